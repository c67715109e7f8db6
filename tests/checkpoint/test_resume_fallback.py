"""A newest step that fails its checks: resume() says so loudly, records it on the
manager and in a refusal note beside the run (`cloudckpt list` marks it), and loads the
previous committed step (every rank the same), or stops with strict_resume=True and
advice that works the first time. A refused step above the resumed one is replaced when
the run reaches it; other committed steps above it are decided at resume time: their
saves are skipped (never overwritten) and said at resume, not a crash later; with an
explicit load_step they are a ConfigError at resume."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from cloudckpt import CheckpointConfig, ops
from cloudckpt.checkpoint import refusals
from cloudckpt.errors import ConfigError, CorruptCheckpoint
from cloudckpt.testing.multiprocess import run_ranks

from . import fallback_workers as fw
from .test_checkpointer import _env


def _flip_a_shard_byte(step_dir: str) -> None:
    model = os.path.join(step_dir, "model_and_optim")
    shard = sorted(n for n in os.listdir(model) if n.endswith(".distcp"))[0]
    with open(os.path.join(model, shard), "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 0xFF]))


def _mgr(folder, tmp_path, **kw):
    return CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w"), save_interval=5, **kw).build()


def test_a_corrupt_newest_step_is_logged_recorded_in_the_bucket_and_replaced_when_the_run_reaches_it(tmp_path,
                                                                                                       caplog):
    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [50, 55, 60])
    _flip_a_shard_byte(os.path.join(folder, "step60"))
    committed_before = _files(os.path.join(folder, "step60"))
    mgr = _mgr(folder, tmp_path)
    sd = fw.state(999)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        ts = mgr.resume(sd)
    assert ts["step"] == 55 and mgr.resumed_step == 55 and torch.equal(sd["model"]["w"], fw.state(55)["model"]["w"])
    assert [s.step for s in mgr.skipped_steps] == [60] and "CRC32C" in mgr.skipped_steps[0].reason
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("cloudckpt")]
    assert errors and "step60 fails its checks" in errors[0].getMessage() and "falling back" in errors[0].getMessage()
    assert "strict_resume=True" in errors[0].getMessage()
    assert "above the resumed step 55 failed their checks: step60" in caplog.text  # said at resume
    assert mgr.steps_above_resumed == {60} and mgr.refused_above == {60}
    # recorded beside the run, the step's committed objects untouched; list shows it refused
    note = refusals.read(folder, 60)
    assert note is not None and "CRC32C" in note.reason and note.url.endswith(".cloudckpt/refused/step60.json")
    assert _files(os.path.join(folder, "step60")) == committed_before
    listing = ops.list_steps(folder)
    assert [(r.step, r.refused is not None) for r in listing.rows] == [(50, False), (55, False), (60, True)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert mgr.maybe_save(60, fw.state(61), {"step": 60}) is not None  # replaced, no save_overwrite needed
        assert mgr.maybe_save(65, fw.state(65), {"step": 65}) is not None
    mgr.close()
    assert "replacing" in caplog.text and "step60, which failed its checks at resume" in caplog.text
    assert refusals.read(folder, 60) is None and not ops.list_steps(folder).refused
    mgr2 = _mgr(folder, tmp_path)
    sd = fw.state(1)
    assert mgr2.checkpointer.load(os.path.join(folder, "step60"), sd)["step"] == 60
    assert torch.equal(sd["model"]["w"], fw.state(61)["model"]["w"])  # the new step60
    assert mgr2.resume(fw.state(1))["step"] == 65 and mgr2.skipped_steps == ()
    mgr2.close()


def _files(dir: str) -> dict:
    out = {}
    for root, _, names in os.walk(dir):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), dir)] = f.read()
    return out


def test_strict_resume_stops_at_a_corrupt_newest_step_and_its_advice_works_the_first_time(tmp_path, caplog):
    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [5, 10])
    _flip_a_shard_byte(os.path.join(folder, "step10"))
    mgr = _mgr(folder, tmp_path, strict_resume=True)
    with pytest.raises(CorruptCheckpoint, match="step10 fails its checks.*strict_resume=True") as e:
        mgr.resume(fw.state(1))
    mgr.close()
    assert "resume from the previous committed step with load_step=5" in str(e.value)
    assert refusals.read(folder, 10) is not None  # recorded even though the run stopped
    mgr = _mgr(folder, tmp_path, load_step=10)  # an explicit step never falls back either
    with pytest.raises(CorruptCheckpoint, match="load_step=10 was asked for.*load_step=5"):
        mgr.resume(fw.state(1))
    mgr.close()
    # the advice, followed as written (strict_resume still set): no second error
    mgr = _mgr(folder, tmp_path, strict_resume=True, load_step=5)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert mgr.resume(fw.state(1))["step"] == 5
    assert mgr.refused_above == {10} and "step10" in caplog.text and "recorded earlier" in caplog.text
    assert mgr.maybe_save(10, fw.state(11), {"step": 10}) is not None  # the refused step is replaced
    mgr.close()
    mgr = _mgr(folder, tmp_path, strict_resume=True)
    sd = fw.state(1)
    assert mgr.resume(sd)["step"] == 10 and torch.equal(sd["model"]["w"], fw.state(11)["model"]["w"])
    mgr.close()


def test_a_restored_step_loads_again_and_its_note_is_removed_with_a_log_line(tmp_path, caplog):
    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [5, 10])
    _flip_a_shard_byte(os.path.join(folder, "step10"))
    mgr = _mgr(folder, tmp_path)
    assert mgr.resume(fw.state(1))["step"] == 5
    mgr.close()
    assert refusals.read(folder, 10) is not None
    _flip_a_shard_byte(os.path.join(folder, "step10"))  # the operator restores the object
    mgr = _mgr(folder, tmp_path)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert mgr.resume(fw.state(1))["step"] == 10  # a note never makes resume skip a step
    mgr.close()
    assert "step10 passed its checks; it was recorded as refused" in caplog.text
    assert refusals.read(folder, 10) is None


def test_the_only_committed_step_failing_its_checks_is_an_error_not_a_fresh_start(tmp_path):
    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [5])
    _flip_a_shard_byte(os.path.join(folder, "step5"))
    mgr = _mgr(folder, tmp_path)
    with pytest.raises(CorruptCheckpoint, match="no older committed step"):
        mgr.resume(fw.state(1))
    assert [s.step for s in mgr.skipped_steps] == [5]
    mgr.close()


def test_load_step_below_committed_steps_is_decided_at_resume(tmp_path, caplog):
    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [50, 55, 60])
    mgr = _mgr(folder, tmp_path, load_step=55)
    with pytest.raises(ConfigError, match="load_step=55.*step60.*new save_folder.*save_overwrite=True"):
        mgr.resume(fw.state(1))
    mgr.close()
    mgr = _mgr(folder, tmp_path, load_step=55, save_overwrite=True)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert mgr.resume(fw.state(1))["step"] == 55
    assert "replaced as the run reaches them" in caplog.text
    assert mgr.maybe_save(60, fw.state(61), {"step": 60}) is not None  # replaced, as asked
    mgr.close()


def test_two_ranks_fall_back_together_when_one_ranks_train_state_is_corrupt(s3_bucket, tmp_path):
    import boto3

    folder = s3_bucket + "/fb"
    work = str(tmp_path / "w")
    run_ranks(2, fw.save_steps, folder, work, [5, 10], env=_env())
    bucket = s3_bucket[len("s3://"):]
    c = boto3.client("s3")
    key = "fb/step10/train/rank1.pt"
    body = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-30] ^= 0xFF
    c.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    out = run_ranks(2, fw.resume, folder, work, env=_env())
    for r in range(2):
        assert "error" not in out[r], out[r]
        assert out[r]["ts"] == {"step": 5, "rank": r} and out[r]["equal"]
        assert [s for s, _ in out[r]["skipped"]] == [10] and "rank 1" in out[r]["skipped"][0][1]
    strict = run_ranks(2, fw.resume, folder, work, True, env=_env())
    assert all("CorruptCheckpoint" in strict[r]["error"] for r in range(2)), strict


def test_an_unreadable_marker_of_ours_on_the_newest_step_is_passed_over_loudly_or_stops_with_strict(tmp_path, caplog):
    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [5, 10])
    marker = os.path.join(folder, "step10", ".metadata.json")
    with open(marker, "rb") as f:
        body = f.read()
    with open(marker, "wb") as f:
        f.write(body[: len(body) // 2])  # ours (it starts as ours), but truncated
    mgr = _mgr(folder, tmp_path)
    with caplog.at_level(logging.ERROR, logger="cloudckpt"):
        assert mgr.resume(fw.state(1))["step"] == 5
    assert [s.step for s in mgr.skipped_steps] == [10] \
        and "step10 is committed but its marker is refused" in caplog.text
    assert mgr.steps_above_resumed == {10} and mgr.refused_above == {10}
    mgr.close()
    with open(marker, "rb") as f:
        assert f.read() == body[: len(body) // 2], "the refused step is kept as it was"
    assert refusals.read(folder, 10) is not None
    listing = ops.list_steps(folder, include_uncommitted=True)
    assert [(r.step, r.status, r.refused is not None) for r in listing.rows] == [(5, "committed", False),
                                                                                (10, "unreadable", True)]
    assert "a resume refused it" in listing.warnings[0]
    mgr = _mgr(folder, tmp_path, strict_resume=True)
    with pytest.raises(CorruptCheckpoint, match="step10.*strict_resume=True.*load_step=5"):
        mgr.resume(fw.state(1))
    mgr.close()
    mgr = _mgr(folder, tmp_path, strict_resume=True, load_step=5)  # the advice works the first time
    assert mgr.resume(fw.state(1))["step"] == 5 and mgr.refused_above == {10}
    assert mgr.maybe_save(10, fw.state(10), {"step": 10}) is not None  # replaced: no CheckpointExists
    mgr.close()
    assert refusals.read(folder, 10) is None and [r.step for r in ops.list_steps(folder).committed] == [5, 10]


def test_the_running_jobs_retention_never_counts_a_refused_step_as_a_kept_one(tmp_path):
    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [5, 10])
    _flip_a_shard_byte(os.path.join(folder, "step10"))
    mgr = _mgr(folder, tmp_path, max_checkpoints=1)
    assert mgr.resume(fw.state(1))["step"] == 5 and mgr.refused_above == {10}
    assert mgr.maybe_save(7, fw.state(7), {"step": 7}, force=True) is not None
    mgr.wait()
    mgr.close()
    # step 7 is the one kept step (the refused step 10 is not counted, so 7 is not pruned for it); 10 stays
    assert [r.step for r in ops.list_steps(folder).committed] == [7, 10]
    assert refusals.read(folder, 10) is not None
