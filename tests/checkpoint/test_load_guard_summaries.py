"""The load guard judges keys left behind from what every rank reads, without each
rank's key list travelling to the coordinator: ranks that ask for different keys
(pipeline stages) load without error, a key no rank asks for is still KeysNotLoaded
on every rank, a key asked for with nothing to read (no elements) still counts as
asked, and a local plan carries no per-key list in the usual case."""

from __future__ import annotations

import pickle

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.dcp.load_guard import KeyCheckingPlanner
from cloudckpt.errors import KeysNotLoaded
from cloudckpt.testing.multiprocess import run_ranks


def _full() -> dict:
    return {"model": {f"layer{i}": torch.full((3,), float(i)) for i in range(4)} | {"empty": torch.empty(0)}}


def save_then_load_by_stage(rank, world_size, path, work, leave_out):
    """Rank r asks for the layers of its stage (layer i with i % world_size == r);
    rank 0 also asks for the empty tensor. ``leave_out``: a layer nobody asks for."""
    ck = Checkpointer(work_dir=work)
    ck.save(path, _full())
    mine = {"model": {f"layer{i}": torch.zeros(3) for i in range(4) if i % world_size == rank and i != leave_out}}
    if rank == 0:
        mine["model"]["empty"] = torch.zeros(0)
    try:
        ck.load(path, mine)
    except KeysNotLoaded as e:
        return {"error": str(e)}
    finally:
        ck.close()
    return {"loaded": {k: v.tolist() for k, v in mine["model"].items()}, "not_loaded": ck.last_load_info.not_loaded}


def test_stages_asking_for_different_keys_load_and_a_key_nobody_asks_for_is_refused_on_every_rank(tmp_path):
    ok = run_ranks(2, save_then_load_by_stage, str(tmp_path / "a" / "step1"), str(tmp_path / "w"), None)
    assert ok[0]["loaded"] == {"layer0": [0.0] * 3, "layer2": [2.0] * 3, "empty": []}
    assert ok[1]["loaded"] == {"layer1": [1.0] * 3, "layer3": [3.0] * 3}
    assert ok[0]["not_loaded"] == ok[1]["not_loaded"] == []
    bad = run_ranks(2, save_then_load_by_stage, str(tmp_path / "b" / "step1"), str(tmp_path / "w"), 3)
    for r in bad:
        assert "model.layer3" in r["error"] and "1 key(s)" in r["error"], r


def test_a_local_plan_carries_top_level_keys_and_no_key_list(tmp_path):
    from cloudckpt.ops.export import read_dcp_metadata

    path = str(tmp_path / "run" / "step1")
    big = {"model": {f"w{i}": torch.ones(2) for i in range(2000)} | {"empty": torch.empty(0)}}
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(path, big)
    _, metadata = read_dcp_metadata(path)
    planner = KeyCheckingPlanner(strict=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in big["model"].items()}}
    planner.set_up_planner(target, metadata, is_coordinator=True)
    plan = planner.create_local_plan()
    assert plan.planner_data["top"] == ["model"]
    # only the key with no elements to read travels by name
    assert plan.planner_data["unread"] == ["model.empty"], plan.planner_data["unread"]
    assert len(pickle.dumps(plan.planner_data)) < 200
    (final,) = planner.create_global_plan([plan])
    assert final.planner_data == {"not_loaded": []}


@pytest.mark.parametrize("ask_empty", [True, False])
def test_a_key_with_no_elements_counts_as_asked_only_when_asked(tmp_path, ask_empty):
    path = str(tmp_path / "run" / "step1")
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(path, _full())
        target = {"model": {f"layer{i}": torch.zeros(3) for i in range(4)}}
        if ask_empty:
            target["model"]["empty"] = torch.zeros(0)
            ck.load(path, target)
            assert ck.last_load_info.not_loaded == []
        else:
            with pytest.raises(KeysNotLoaded, match=r"model\.empty"):
                ck.load(path, target)
