"""A step that a resume refused, as the operator meets it in the CLI: `list` marks it
REFUSED with the reason, `verify` reports the refusal, `prune` neither counts nor deletes
it, `rm` removes it with its note, `gc` removes notes that no longer describe their step.
The refusal comes from a real run (a manager's resume of a step with a damaged shard)."""

from __future__ import annotations

import os

import pytest

from cloudckpt import CheckpointConfig
from cloudckpt.checkpoint import refusals
from tests.checkpoint import fallback_workers as fw
from tests.checkpoint.test_resume_fallback import _flip_a_shard_byte as _flip

from .helpers import cli


@pytest.fixture
def refused_run(tmp_path):
    """Steps 5, 10 and 15 saved, step 15 damaged, a resume that fell back to step 10."""
    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [5, 10, 15])
    _flip(os.path.join(folder, "step15"))
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w"), save_interval=5).build()
    assert mgr.resume(fw.state(1))["step"] == 10
    mgr.close()
    return folder


def test_list_marks_the_refused_step_with_its_reason(refused_run):
    r = cli("list", refused_run)
    assert r.code == 0, r.err
    row = next(ln for ln in r.out.splitlines() if ln.split()[:1] == ["15"])
    assert "REFUSED (persistent)" in row
    assert "3 committed (3 persistent, 0 ephemeral)" in r.out and "1 of them REFUSED by a resume" in r.out
    assert "REFUSED step15: a resume found it failing its checks at" in r.out and "CRC32C mismatch" in r.out
    rows = {x["step"]: x for x in cli("list", refused_run, "--json").lines()}
    assert rows[10]["refused"] is None and "CRC32C" in rows[15]["refused"]["reason"]


def test_verify_reports_the_refusal_beside_what_it_finds(refused_run):
    r = cli("verify", os.path.join(refused_run, "step15"))
    assert r.code == 1 and "FAILED" in r.out and "REFUSED: a resume found" in r.out
    ok = cli("verify", os.path.join(refused_run, "step10"))
    assert ok.code == 0 and "REFUSED" not in ok.out


def test_prune_leaves_the_refused_step_out_and_rm_removes_it_with_its_note(refused_run):
    r = cli("prune", refused_run, "--keep-last", "1", "--yes")
    assert r.code == 0, r.err
    assert "not counted, not pruned: 1 step(s) a resume refused (15)" in r.out
    assert os.path.exists(os.path.join(refused_run, "step15", ".metadata.json"))
    assert not os.path.exists(os.path.join(refused_run, "step5"))  # step 10 is the newest usable one: kept
    assert os.path.exists(os.path.join(refused_run, "step10", ".metadata.json"))
    assert cli("rm", os.path.join(refused_run, "step15"), "--yes").code == 0
    assert refusals.read(refused_run, 15) is None and refusals.listed_steps(refused_run) == []


def test_gc_removes_a_note_that_no_longer_describes_its_step(refused_run):
    marker = os.path.join(refused_run, "step15", ".metadata.json")
    with open(marker, "rb") as f:
        body = f.read()
    with open(marker, "wb") as f:  # the step rewritten by someone else since the refusal
        f.write(body + b"\n")
    assert "REFUSED" not in cli("list", refused_run).out  # the note no longer describes the step
    dry = cli("gc", refused_run)
    assert dry.code == 0 and "would remove refusal note" in dry.out and refusals.listed_steps(refused_run) == [15]
    assert cli("gc", refused_run, "--yes").code == 0 and refusals.listed_steps(refused_run) == []
