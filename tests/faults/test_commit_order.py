"""The commit marker is the last write of a save (after every rank's objects and its
manifest part ``manifest/rank{R}.json``), judged by the server-side order of
requests (the fault proxy's log of answered requests), and faults aimed at the marker
leave either a committed step or none, never a half-committed one; saves send the
``latest`` pointer no request (it is no longer written), so its faults never reach one.
2 ranks, S3 (SeaweedFS) and GCS (fake-gcs-server)."""

from __future__ import annotations

import urllib.parse

import pytest

from cloudckpt import Checkpointer
from cloudckpt.errors import CloudCkptError
from cloudckpt.storage import StorageOptions
from cloudckpt.testing.faultproxy import Rule
from cloudckpt.testing.multiprocess import run_ranks

from . import checks, workers

WRITES = ("PUT", "POST", "PATCH", "DELETE")
MARKER = r"metadata\.json"  # the S3 key or the GCS object name (&name=... / /o/...) of a marker
POINTER = r"(/|%2F|name=)latest(\?|&|$)"


def _writes_of(proxy, step_prefix: str) -> list:
    """Answered write requests for objects under ``step_prefix`` (e.g. ``run/step1/``), in
    the order the store answered them."""
    out = []
    for c in proxy.completed:
        target = urllib.parse.unquote(c.target)
        if c.method in WRITES and step_prefix in target and 200 <= c.status < 300:
            out.append((c, target))
    return sorted(out, key=lambda ct: ct[0].start)


def test_the_marker_put_starts_after_every_other_write_of_the_step_was_answered(proxy, tmp_path, secret_scan):
    folder = proxy.bucket + "/run"
    step = checks.step_dir(folder, 1)
    errors = run_ranks(2, workers.save_plain, step, str(tmp_path / "w"), 1, env=checks.rank_env())
    assert errors == [None, None]
    writes = _writes_of(proxy, "run/step1/")
    markers = [c for c, t in writes
               if t.rstrip("?&").split("?")[0].endswith(".metadata.json") or "name=run/step1/.metadata.json" in t]
    assert len(markers) == 1, f"exactly one marker write: {[t for _, t in writes]}"
    marker = markers[0]
    data = [(c, t) for c, t in writes if c is not marker and c.method != "DELETE" and ".lock" not in t]
    assert len(data) >= 6, f"the shards, .metadata, both train states and parts were written: {[t for _, t in data]}"
    parts = {r for r in (0, 1) for _, t in data if f"manifest/rank{r}.json" in t}
    assert parts == {0, 1}, f"each rank's manifest part is an object of the step, written before the marker: {writes}"
    last_data_end = max(c.end for c, _ in data)
    assert marker.start >= last_data_end, "the marker write started before every other object of the step was stored"
    lock_deletes = [c for c, t in writes if c.method == "DELETE" and ".lock" in t]
    assert lock_deletes and min(c.start for c in lock_deletes) >= marker.end, "the lock is released after the commit"
    assert checks.committed_steps(folder) == [1] and checks.verify_step(step) == []


def test_a_marker_write_that_keeps_failing_commits_nothing_and_the_next_attempt_commits(proxy, tmp_path, secret_scan):
    folder = proxy.bucket + "/run"
    step = checks.step_dir(folder, 1)
    proxy.add(Rule("error500", method={"PUT", "POST"}, key=MARKER))
    so = StorageOptions(max_attempts=2, operation_timeout=3)
    with Checkpointer(work_dir=str(tmp_path / "w"), storage_options=so) as ck:
        with pytest.raises(CloudCkptError) as ei:
            ck.save(step, checks.step_state(1, 0), {"step": 1})
        secret_scan.add(str(ei.value))
        assert proxy.injected()["error500"] >= 1
        assert checks.committed_steps(folder) == [], "no marker: the step is not a checkpoint"
        assert checks.objects_under(step) == [], "the failed attempt's objects and lock were removed"
        proxy.clear()
        ck.save(step, checks.step_state(1, 0), {"step": 1})
    assert checks.committed_steps(folder) == [1] and checks.verify_step(step) == []


def test_a_marker_write_whose_answer_is_lost_commits_exactly_once(proxy, tmp_path, secret_scan):
    """The store applied the marker's conditional create but the answer was lost: the
    SDK's retry meets the marker; the save recognises its own and succeeds."""
    folder = proxy.bucket + "/run"
    step = checks.step_dir(folder, 1)
    proxy.add(Rule("reset", method={"PUT", "POST"}, key=MARKER, when="response", times=1))
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(step, checks.step_state(1, 0), {"step": 1})
    assert proxy.injected()["reset"] == 1
    assert checks.committed_steps(folder) == [1] and checks.verify_step(step) == []


@pytest.mark.parametrize("fault", ["error500", "reset"])
def test_saves_send_the_latest_pointer_no_request_so_its_faults_never_touch_a_commit(proxy, fault, tmp_path,
                                                                                   secret_scan):
    """Every request for ``latest`` fails: steps 1 and 2 commit and discovery finds step 2,
    and no request for the pointer reached the proxy (saves no longer read or write it)."""
    folder = proxy.bucket + "/run"
    proxy.add(Rule(fault, key=POINTER))
    with Checkpointer(work_dir=str(tmp_path / "w"),
                      storage_options=StorageOptions(max_attempts=2, operation_timeout=3)) as ck:
        ck.save(checks.step_dir(folder, 1), checks.step_state(1, 0), {"step": 1})
        assert Checkpointer.latest_checkpoint(folder) == checks.step_dir(folder, 1)
        ck.save(checks.step_dir(folder, 2), checks.step_state(2, 0), {"step": 2})
    assert proxy.injected()[fault] == 0, "a request for the pointer was sent"
    assert checks.committed_steps(folder) == [1, 2]
    assert Checkpointer.latest_checkpoint(folder) == checks.step_dir(folder, 2)


def test_prune_deletes_a_steps_marker_before_any_other_object_of_it(s3_proxy, tmp_path, secret_scan):
    """The manager keeps one checkpoint: after step 2 commits, step 1 is pruned. By
    server-side order, step 1's marker DELETE is answered before any other delete of
    step 1 starts (a reader never sees a marker over a partly deleted step)."""
    import torch

    from cloudckpt import CheckpointConfig

    folder = s3_proxy.bucket + "/run"
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w"), save_interval=1, max_checkpoints=1,
                           exact_resume=False).build()
    mgr.maybe_save(1, {"model": {"w": torch.ones(64)}}, {"step": 1})
    s3_proxy.reset_counters()
    mgr.maybe_save(2, {"model": {"w": torch.full((64,), 2.0)}}, {"step": 2})
    mgr.close()
    done = sorted(s3_proxy.completed, key=lambda c: c.start)
    targets = [(c, urllib.parse.unquote(c.target)) for c in done]
    step2_marker = next(c for c, t in targets if c.method == "PUT" and "run/step2/.metadata.json" in t)
    marker_delete = [c for c, t in targets if c.method == "DELETE" and "run/step1/.metadata.json" in t]
    assert len(marker_delete) == 1, [t for _, t in targets]
    other_deletes = [c for c, t in targets if c.start > step2_marker.end and c is not marker_delete[0] and (
        (c.method == "DELETE" and "run/step1/" in t) or (c.method == "POST" and "delete" in t))]
    assert other_deletes, "step 1's objects were deleted after its marker"
    assert marker_delete[0].start > step2_marker.end, "step 1 is pruned only after step 2 committed"
    assert all(c.start >= marker_delete[0].end for c in other_deletes), "an object was deleted before the marker"
    assert checks.committed_steps(folder) == [2] and checks.objects_under(checks.step_dir(folder, 1)) == []
