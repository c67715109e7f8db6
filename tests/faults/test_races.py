"""Two jobs racing on one step, and corrupted objects."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout
from cloudckpt.checkpoint.commit import StepCommit
from cloudckpt.errors import CheckpointExists, CorruptCheckpoint, SaveInProgress
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls
from cloudckpt.testing.faultproxy import Rule

from . import checks, oracle


def _state(who: int) -> dict:
    return {"model": {"x": torch.full((256, 256), float(who)), "y": torch.arange(1000, dtype=torch.float32) * who}}


def _race(step: str, tmp_path, *, jobs=(1, 2), **ck_kwargs) -> dict:
    """Start one save per job at the same moment (a barrier); returns job -> the exception
    it raised (any type: the caller says which are allowed) or None when its save returned.
    Every job must have finished within the join deadline."""
    results: dict = {}
    barrier = threading.Barrier(len(jobs))

    def job(i):
        ck = Checkpointer(work_dir=str(tmp_path / f"work{i}"), **ck_kwargs)
        try:
            barrier.wait(60)
            ck.save(step, _state(i), {"who": i})
            results[i] = None
        except BaseException as e:  # noqa: BLE001 - recorded, and judged by the caller
            results[i] = e
        finally:
            ck.close()

    threads = [threading.Thread(target=job, args=(i,), daemon=True) for i in jobs]
    for t in threads:
        t.start()
    _join_all(threads, 120)
    assert sorted(results) == sorted(jobs), f"a job recorded no outcome: {results}"
    return results


def _join_all(threads, timeout: float) -> None:
    """Join every thread by one deadline; a thread still running fails the test (it would
    go on saving into the next round or test). Threads cannot be killed: they are daemons."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"still running {timeout:.0f}s after the race started: {alive}"


def _assert_only_the_manifest_and_marker(step: str) -> None:
    """What is stored under the step is exactly the marker's manifest plus the marker (read
    as plain JSON): no object of a losing job, no lock left behind."""
    listed = set(checks.objects_under(step))  # every file, hidden ones included (the oracle lists them all)
    assert listed == oracle.manifest_paths(step) | {layout.MARKER}, \
        f"the step holds objects its manifest does not list, or a lock: {sorted(listed)}"


def _texts(results: dict) -> list[str]:
    return [f"{type(e).__name__}: {e}" for e in results.values() if e is not None]


def _assert_exactly_one_commit(step: str, results: dict, *, loser_sees=(SaveInProgress, CheckpointExists)) -> int:
    """Exactly one job's save returned; every other job raised one of ``loser_sees``
    (exactly that type, naming the step); the step holds the winner's bytes and
    nothing else: the manifest's objects and the marker, no object of a loser."""
    winners = [i for i, e in results.items() if e is None]
    assert len(winners) == 1, results
    for i, e in results.items():
        if e is not None:
            assert type(e) in loser_sees, f"job {i} raised {type(e).__name__}, expected one of {loser_sees}: {e}"
            assert step in str(e), f"job {i}'s error does not name the step {step}: {e}"
    assert checks.verify_step(step) == [], "the committed step is complete: every object is the winner's"
    _assert_only_the_manifest_and_marker(step)
    sd = _state(0)
    assert Checkpointer().load(step, sd) == {"who": winners[0]}
    assert torch.equal(sd["model"]["x"], _state(winners[0])["model"]["x"])
    assert torch.equal(sd["model"]["y"], _state(winners[0])["model"]["y"])
    return winners[0]


@pytest.fixture(params=["local", "s3", "gcs"])
def race_root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    proxy = request.getfixturevalue(f"{request.param}_proxy")
    proxy.add(Rule("latency", delay=0.005))
    return proxy.bucket + "/run"


def test_two_jobs_racing_on_one_step_exactly_one_commits(race_root, tmp_path, secret_scan):
    for round_ in range(4):
        step = urls.join(race_root, f"step{round_}")
        results = _race(step, tmp_path)
        secret_scan.add(*_texts(results))
        _assert_exactly_one_commit(step, results)


def test_a_lock_taken_after_the_other_job_committed_does_not_overwrite_the_committed_step(proxy, tmp_path, secret_scan):
    """Job 2 checks the step (no marker yet), then its lock request is slow: it lands only after
    job 1 committed and released the lock. Job 2 must see the commit and write nothing into it."""
    step = proxy.bucket + "/run/step3"
    lock_put = ("PUT", "POST") if proxy.flavor == "gcs" else "PUT"
    proxy.add(Rule("latency", method=lock_put, key=r"step3/\.lock", nth=2, delay=4.0))
    results = _race(step, tmp_path)
    secret_scan.add(*_texts(results))
    assert proxy.injected()["latency"] == 1
    # the late job finds the step committed: CheckpointExists, never SaveInProgress (the lock is gone)
    _assert_exactly_one_commit(step, results, loser_sees=(CheckpointExists,))


def test_a_lock_create_whose_answer_was_lost_still_holds_the_lock(proxy, tmp_path, secret_scan):
    """The store created the lock but the answer was reset; the SDK's retry meets the lock
    this save created itself: that is not another save in progress."""
    step = proxy.bucket + "/run/step4"
    lock_put = ("PUT", "POST") if proxy.flavor == "gcs" else "PUT"
    proxy.add(Rule("reset", method=lock_put, key=r"step4/\.lock", nth=1, when="response"))
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    ck.save(step, _state(5), {"who": 5})
    ck.close()
    assert proxy.injected()["reset"] == 1
    assert checks.verify_step(step) == []


def _plant_stale_lock(step: str) -> None:
    body = {"save_id": "dead-job", "host": "gone", "pid": 1, "created_unix": time.time() - 3600, "world_size": 1}
    open_store(step).put_bytes(urls.join(step, layout.LOCK), json.dumps(body).encode())
    open_store(step).put_bytes(urls.join(step, "model_and_optim", "__0_0.distcp"), b"left over by the dead job")


def test_a_slow_second_taker_of_a_stale_lock_does_not_destroy_the_first_takers_commit(tmp_path, secret_scan,
                                                                                      monkeypatch):
    """Job A and job B both find the stale lock of a crashed save; B is slow between judging it
    stale and clearing it. A's committed step must survive B."""
    step = str(tmp_path / "ckpt" / "step1")
    _plant_stale_lock(step)
    a = Checkpointer(work_dir=str(tmp_path / "wa"), stale_lock_seconds=60)
    b = Checkpointer(work_dir=str(tmp_path / "wb"), stale_lock_seconds=60)
    judged = threading.Event()
    a_done = threading.Event()
    real_age = StepCommit._age

    def slow_age(self, data):
        age = real_age(self, data)  # stale: an hour old
        if threading.current_thread() is tb:  # only B judges slowly
            judged.set()
            a_done.wait(60)  # B stalls (GC pause, slow network) while A takes over and commits
        return age

    monkeypatch.setattr(StepCommit, "_age", slow_age)
    outcome: dict = {}

    def run_b():
        try:
            b.save(step, _state(2), {"who": 2})
            outcome["b"] = None
        except BaseException as e:  # noqa: BLE001 - judged below
            outcome["b"] = e
        finally:
            b.close()

    tb = threading.Thread(target=run_b, daemon=True)
    tb.start()
    assert judged.wait(60)
    try:
        a.save(step, _state(1), {"who": 1})  # A takes over the stale lock and commits
    finally:
        a_done.set()
        a.close()
    _join_all([tb], 60)
    e = outcome["b"]
    secret_scan.add(f"{e}")
    # B wakes up after A's commit: its compare-and-swap of the lock it judged stale fails (A
    # replaced that lock, then released it), so B raises SaveInProgress and deletes nothing
    assert type(e) is SaveInProgress and "took its lock over first" in str(e), f"B: {type(e).__name__}: {e}"
    assert step in str(e)
    sd = _state(0)
    assert Checkpointer().load(step, sd) == {"who": 1}, "A's save returned: its step must still be there"
    assert torch.equal(sd["model"]["x"], _state(1)["model"]["x"])
    assert checks.verify_step(step) == []
    _assert_only_the_manifest_and_marker(step)  # the dead job's leftover was replaced, B added nothing


# ------------------------------------------------------------------ corrupted objects
def _saved(root: str, tmp_path) -> tuple[str, object]:
    step = urls.join(root, "step1")
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, checks.step_state(1, 0), {"step": 1, "rank": 0})
    return step, discovery.read_marker(step)


def _flip(url: str, offset: int) -> None:
    store = open_store(url)
    data = bytearray(store.get_bytes(url))
    data[offset] ^= 0x5A
    store.put_bytes(url, bytes(data))


def _truncate(url: str, keep: int) -> None:
    store = open_store(url)
    store.put_bytes(url, store.get_bytes(url)[:keep])


CORRUPTIONS = {
    "distcp_byte_flipped": (lambda m: next(o for o in m.objects if o.path.endswith(".distcp")),
                            lambda url, o: _flip(url, o.chunks[0][0] + o.chunks[0][1] // 2)),
    "distcp_truncated": (lambda m: next(o for o in m.objects if o.path.endswith(".distcp")),
                         lambda url, o: _truncate(url, o.size // 3)),
    "train_state_byte_flipped": (lambda m: m.object("train/rank0.pt"), lambda url, o: _flip(url, o.size // 2)),
    "train_state_truncated": (lambda m: m.object("train/rank0.pt"), lambda url, o: _truncate(url, 10)),
    "dcp_metadata_truncated": (lambda m: m.object("model_and_optim/.metadata"), lambda url, o: _truncate(url, 7)),
    "dcp_index_truncated": (lambda m: m.object("index/header.json"), lambda url, o: _truncate(url, 7)),
}
# what a load of a step with the DCP index never reads (it plans from the index): it loads; verify names it
NOT_READ_BY_LOAD = {"dcp_metadata_truncated"}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
@pytest.mark.parametrize("backend", ["local", "s3", "gcs"])
def test_corrupted_object_is_named_by_load_and_by_verify(backend, damage, request, tmp_path, secret_scan):
    root = {"local": lambda: str(tmp_path / "ckpt"), "s3": lambda: request.getfixturevalue("s3_bucket") + "/run",
            "gcs": lambda: request.getfixturevalue("gcs_bucket") + "/run"}[backend]()
    step, marker = _saved(root, tmp_path)
    pick, hurt = CORRUPTIONS[damage]
    entry = pick(marker)
    url = urls.join(step, entry.path)
    hurt(url, entry)
    if damage in NOT_READ_BY_LOAD:
        state = checks.zero_state(1)
        Checkpointer().load(step, state)
        assert checks.bitexact(state, 1, 1)
    else:
        with pytest.raises(CorruptCheckpoint) as ei:
            Checkpointer().load(step, checks.zero_state(1))
        secret_scan.add(str(ei.value))
        assert url in str(ei.value), f"load names the damaged object: {ei.value}"
    problems = checks.verify_step(step)
    assert len(problems) == 1 and problems[0].startswith(url + ":"), problems
    _library_verify_names(step, url)


def _library_verify_names(step: str, url: str) -> None:
    """The library's own verify (`cloudckpt verify`) names the object too."""
    rc, out = checks.library_verify(step)
    assert rc != 0 and url in out, out
