"""Megatron-Bridge's checkpoint manager on cloudckpt (cloudckpt/integrations/megatron_bridge.py),
driven by tests/integrations/megatron_units/bridge_tool.py with Bridge's own call sequence
(its ``create_checkpoint_manager``, the ``train`` loop's save / ``finalize_async_saves``,
``setup``'s load; see the tool's docstring for the three stand-ins: Bridge does not import
here) on real megatron-core and 2 gloo ranks, async saves to SeaweedFS. Each run is a
new process group and a new manager on the shared pool of Megatron ranks
(megatron_pool.py); what a run resumes from is what the bucket holds. What is proved:

- async saves every 2 (non-persistent ``global``) and 3 (persistent) iterations: when the
  loop ends the tracker names 6, the newest persistent iteration; ``most_recent_k=2`` kept
  iterations 3 and 6, and non-persistent ones 4 and 8 (2 deleted), each a committed step;
- right after every ``save`` returns (the save still in flight) the tracker is what it was
  before, and whatever it names is committed: it never names an uncommitted iteration;
- a second job resumes from iteration 8 (the newest committed, non-persistent), with the
  train state and FLOPs saved, trains to 10 and ends bit for bit where a job that ran 10
  iterations without stopping ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cloudckpt.integrations import megatron_folders as mf

from .test_megatron import mcore, mcore_pool, megatron_python  # noqa: F401 - fixtures used by name


def _run(pool, tmp_path: Path, url: str, steps: int, out: Path) -> dict:
    """bridge_tool.py's ``run`` on the pool's 2 ranks (a new process group, a new manager)."""
    mcore(pool, tmp_path, "bridge", url, "--world", "2", "--steps", str(steps), "--out", str(out), timeout=300)
    return json.loads(out.read_text())


def _weights(out: Path) -> list[dict]:
    return [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(2)]


def test_bridge_call_sequence_async_saves_keep_the_tracker_committed_and_resume_bit_exact(mcore_pool,  # noqa: F811
                                                                                          s3_bucket, tmp_path):
    url = f"{s3_bucket}/bridge"
    first = _run(mcore_pool, tmp_path, url, 8, tmp_path / "first.json")
    assert first["loaded"] == [0, 0, 0]
    assert first["tracker"] == 6
    assert first["persistent"] == [3, 6] and first["non_persistent"] == [4, 8]
    assert [(i.iteration, i.kind) for i in mf.find_iterations(url)] == [(3, "cloudckpt"), (6, "cloudckpt")]
    assert [(i.iteration, i.kind) for i in mf.find_iterations(f"{url}/non_persistent")] == [(4, "cloudckpt"),
                                                                                             (8, "cloudckpt")]
    assert sorted(map(int, first["tracker_after_save"])) == [2, 3, 4, 6, 8]
    for step, (before, after, committed) in first["tracker_after_save"].items():
        assert after == before and committed and (after is None or after < int(step)), (step, before, after)

    resumed = _run(mcore_pool, tmp_path, url, 10, tmp_path / "resumed.json")
    assert resumed["loaded"] == [8, 8000, 8]
    straight = _run(mcore_pool, tmp_path, f"{s3_bucket}/straight", 10, tmp_path / "straight.json")
    assert straight["loaded"] == [0, 0, 0] and resumed["non_persistent"] == [8, 10]
    for got, want in zip(_weights(tmp_path / "resumed.json"), _weights(tmp_path / "straight.json"), strict=True):
        for k in ("a", "b", "c"):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
