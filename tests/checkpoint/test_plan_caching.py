"""DCP save-plan caching across repeated saves (``_torch_compat.caching_save_planner``).

A repeated save of a state dict with the same structure sends an empty local plan to
rank 0 (DCP reuses the global plan and metadata it cached); a save with another
structure plans again; a save through another group (another world size) in the same
process never reuses the 2-rank plans. Every step loads back bit-exactly."""

from __future__ import annotations

import torch

from cloudckpt.testing.multiprocess import run_ranks

from . import workers


def _with_extra(sd: dict, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd = dict(sd)
    sd["model"] = dict(sd["model"], extra=distribute_tensor(torch.arange(32.0), mesh, [Shard(0)]))
    return sd


def save_repeatedly(rank, world_size, folder, work_dir):
    from torch.distributed.checkpoint import DefaultSavePlanner

    from cloudckpt import Checkpointer
    from cloudckpt.checkpoint.rank_writer import RankWriter

    # DCP's plan cache: the path of a state whose replicated chunks owners decline (DDP, HSDP)
    RankWriter.owners_first_save = False

    usable: list[bool] = []
    original = DefaultSavePlanner.create_local_plan

    def recording(self):
        plan = original(self)
        usable.append(plan.usable)
        return plan

    DefaultSavePlanner.create_local_plan = recording
    ck = Checkpointer(work_dir=work_dir)
    plans = []
    # seeds 0, 1: same structure; 2: an extra tensor; 3, 4: the first structure again
    for step, seed in enumerate([0, 1, 2, 3, 4], start=1):
        sd = workers.sharded_state(world_size, seed)
        if seed == 2:
            sd = _with_extra(sd, world_size)
        usable.clear()
        ck.save(f"{folder}/step{step}", sd, {"rank": rank})
        plans.append(list(usable))
    loaded = {}
    for step, seed in enumerate([0, 1, 2, 3, 4], start=1):
        sd = workers.sharded_state(world_size, zero=True)
        ck.load(f"{folder}/step{step}", sd, allow_partial=seed == 2)
        loaded[step] = workers.gathered(sd)
    ck.close()
    alone = None
    if rank == 0:
        # another world (one process, no group) in the same process: plans of its own
        solo = Checkpointer(work_dir=work_dir, distributed=False)
        usable.clear()
        solo.save(f"{folder}/step9", workers.full_tensors(5))
        alone = list(usable)
        back = {k: torch.zeros_like(v) for k, v in workers.full_tensors(5).items()}
        solo.load(f"{folder}/step9", back)
        solo.close()
        loaded[9] = back
    DefaultSavePlanner.create_local_plan = original
    return {"plans": plans, "alone": alone, "loaded": loaded}


def test_repeated_saves_reuse_the_plan_until_the_structure_changes_and_load_back_bitexactly(tmp_path):
    res = run_ranks(2, save_repeatedly, str(tmp_path / "run"), str(tmp_path / "work"))
    for r in res:
        # one local plan per save: sent (usable) on the first save and whenever the structure changed
        assert r["plans"] == [[True], [False], [True], [True], [False]], r["plans"]
        for step, seed in enumerate([0, 1, 2, 3, 4], start=1):
            want = workers.full_tensors(seed)
            for k, v in want.items():
                assert torch.equal(r["loaded"][step][k], v), (step, k)
    alone = res[0]
    assert alone["alone"] == [True]
    for k, v in workers.full_tensors(5).items():
        assert torch.equal(alone["loaded"][9][k], v), k
