"""Drives ``cloudckpt.integrations.megatron_bridge.CloudCheckpointManager`` with Megatron-Bridge's
call sequence, on real megatron-core (0.19.2, .venv-megatron) and real gloo ranks, for
tests/integrations/test_megatron_bridge.py.

Megatron-Bridge itself does not import here (it needs transformers >= 5.8 and the rest of
its 8 GB of dependencies), so three of its parts are stand-ins, written from its source
(r0.6.0, ``src/megatron/bridge/training``) and nothing else:

- ``create_checkpoint_manager`` (checkpointing.py): the class named by
  ``custom_manager_class`` imported and built with the checkpoint config, then checked
  against the ``CheckpointManager`` protocol (``runtime_checkable``, its four methods);
- the loop of ``train`` (train.py): ``finalize_async_saves(state, blocking=False)`` at the
  top of every iteration, ``save(CheckpointSaveContext(...), callback_manager)`` after the
  step at the save intervals (``non_persistent_ckpt=True`` at the non-persistent ones),
  ``finalize_async_saves(state, blocking=True, terminate=True)`` at the end; ``setup``
  (setup.py): ``load(CheckpointLoadContext(...))`` once before training;
- the state: the manager's ``state_dict``/``restore`` (Bridge's ``generate_state_dict`` and
  restore) are replaced by a Megatron-core sharded state dict of two tensors split over
  the ranks and a replicated one, and ``TrainState`` by a class with the same
  ``state_dict``/``load_state_dict`` of tensors.

    run URL --world W --steps N --out F    train N steps from whatever is committed, saving as
        configured below; F gets, from rank 0, what was seen (JSON)
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from cloudckpt.integrations import megatron_bridge as mb
from cloudckpt.integrations import megatron_folders as mf

SAVE_INTERVAL, NON_PERSISTENT_INTERVAL, MOST_RECENT_K = 3, 2, 2


@runtime_checkable
class CheckpointManager(Protocol):  # Bridge's protocol (checkpointing.py), the methods it checks
    def __init__(self, checkpoint_config) -> None: ...
    def save(self, ctx, callback_manager) -> None: ...
    def load(self, ctx) -> tuple[int, int]: ...
    def finalize_async_saves(self, state, blocking: bool = False, terminate: bool = False) -> None: ...


@dataclass(kw_only=True)
class _Context:  # the fields Bridge's CheckpointSaveContext and CheckpointLoadContext share
    state: object
    model: list
    optimizer: object
    opt_param_scheduler: object
    pg_collection: object = None
    module_name: str | None = None


@dataclass(kw_only=True)
class CheckpointSaveContext(_Context):
    num_floating_point_operations_so_far: int
    train_data_iterator: object = None
    non_persistent_ckpt: bool = False


@dataclass(kw_only=True)
class CheckpointLoadContext(_Context):
    strict: bool = True
    skip_load_to_model_and_opt: bool = False


@dataclass
class TrainState:  # the part of Bridge's TrainState a resume needs, saved as Bridge saves it (tensors)
    step: int = 0
    consumed_train_samples: int = 0
    floating_point_operations_so_far: int = 0
    extra: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step, dtype=torch.int32),
                "consumed_train_samples": torch.tensor(self.consumed_train_samples, dtype=torch.int32),
                "floating_point_operations_so_far": torch.tensor(self.floating_point_operations_so_far,
                                                                 dtype=torch.float64)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"].item())
        self.consumed_train_samples = int(sd["consumed_train_samples"].item())
        self.floating_point_operations_so_far = int(sd["floating_point_operations_so_far"].item())


class Model:
    """Two tensors split in rows over the ranks and one replicated; a step changes them all."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.a = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)[rank * 8 // world:(rank + 1) * 8 // world]
        self.b = torch.zeros(6, dtype=torch.float64)
        self.c = torch.ones(world * 2, 3, dtype=torch.bfloat16)[rank * 2:(rank + 1) * 2]

    def step(self, n: int) -> None:
        self.a = self.a * 1.5 + n
        self.b = self.b + torch.linspace(0, 1, 6, dtype=torch.float64) / n
        self.c = (self.c * 0.75 + 0.125).to(torch.bfloat16)

    def sharded_state_dict(self, *, fill: bool = True) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        def val(t):
            return t.clone() if fill else torch.zeros_like(t)

        return {"a": ShardedTensor.from_rank_offsets("model.a", val(self.a), (0, self.rank, self.world)),
                "b": ShardedTensor.from_rank_offsets("model.b", val(self.b), replica_id=self.rank),
                "c": ShardedTensor.from_rank_offsets("model.c", val(self.c), (0, self.rank, self.world))}


class TestManager(mb.CloudCheckpointManager):
    """The manager with its two Bridge-built parts replaced (module docstring)."""

    def state_dict(self, ctx, *, loading: bool) -> dict:
        return {"model": ctx.model[0].sharded_state_dict(fill=not loading), "iteration": ctx.state.train_state.step}

    def restore(self, ctx, state: dict) -> None:
        m = ctx.model[0]
        m.a, m.b, m.c = state["model"]["a"], state["model"]["b"], state["model"]["c"]
        ctx.state.train_state.load_state_dict(state[mb.TRAIN_STATE_KEY])


def create_checkpoint_manager(cfg):  # Bridge's factory (checkpointing.py), without its target allowlist
    import importlib

    module_path, class_name = cfg.custom_manager_class.rsplit(".", 1)
    manager = getattr(importlib.import_module(module_path), class_name)(cfg)
    if not isinstance(manager, CheckpointManager):
        raise TypeError(f"{cfg.custom_manager_class} does not implement the CheckpointManager protocol")
    return manager


def run(a, rank: int, world: int) -> None:
    cfg = SimpleNamespace(save=a.url, load=a.url, non_persistent_ckpt_type="global",
                          non_persistent_global_ckpt_dir=None, most_recent_k=MOST_RECENT_K, async_save=True,
                          ckpt_format="torch_dist",
                          custom_manager_class="bridge_tool.TestManager")
    state = SimpleNamespace(train_state=TrainState(), cfg=cfg)
    model = Model(rank, world)
    manager = create_checkpoint_manager(cfg)
    seen: dict = {"loaded": None, "tracker_after_save": {}}
    ctx = CheckpointLoadContext(state=state, model=[model], optimizer=None, opt_param_scheduler=None)
    it, flops = manager.load(ctx)
    seen["loaded"] = [it, flops, state.train_state.step]
    while state.train_state.step < a.steps:
        manager.finalize_async_saves(state=state, blocking=False)
        step = state.train_state.step + 1
        model.step(step)
        state.train_state.step = step
        state.train_state.consumed_train_samples += 4
        state.train_state.floating_point_operations_so_far += 1000
        persistent = step % SAVE_INTERVAL == 0
        if persistent or step % NON_PERSISTENT_INTERVAL == 0:
            before = mf.read_tracker(a.url)
            manager.save(CheckpointSaveContext(state=state, model=[model], optimizer=None, opt_param_scheduler=None,
                                               num_floating_point_operations_so_far=1000 * step,
                                               non_persistent_ckpt=not persistent), None)
            # the save is in flight: the tracker still names what was committed and finalized before
            after = mf.read_tracker(a.url)
            committed = [i.iteration for i in mf.find_iterations(a.url)]
            seen["tracker_after_save"][step] = [before, after, after is None or after in committed]
    manager.finalize_async_saves(state=state, blocking=True, terminate=True)
    dist.barrier()
    if rank == 0:
        seen["tracker"] = mf.read_tracker(a.url)
        seen["persistent"] = [i.iteration for i in mf.find_iterations(a.url)]
        seen["non_persistent"] = [i.iteration for i in mf.find_iterations(f"{a.url}/non_persistent")]
    torch.save({"a": model.a, "b": model.b, "c": model.c}, f"{a.out}.rank{rank}.pt")
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(seen, f)


def _rank(rank: int, a) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=a.world, init_method=f"tcp://127.0.0.1:{a.port}")
    run(a, rank, a.world)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["run"])
    ap.add_argument("url")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(a,), nprocs=a.world, start_method="spawn")


if __name__ == "__main__":
    main()
