"""Workers of test_repeated_save_finish.py: saves on real gloo ranks, recording on rank 0
what each save's DCP finish received from every rank (the write results whole, or only
their digest)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from cloudckpt import Checkpointer
from cloudckpt.dcp import writer as dcp_writer


def state(world_size: int, step: int, extra: bool = False) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(step)
    sd = {"model": {f"w{i}": distribute_tensor(torch.randn(4 * world_size, 6, generator=g), mesh, [Shard(0)])
                    for i in range(5)},
          "optim": {"step": torch.tensor(step), "bias": torch.randn(7, generator=g)}}
    if extra:
        sd["model"]["new"] = distribute_tensor(torch.randn(2 * world_size, 3, generator=g), mesh, [Shard(0)])
    return sd


def full(sd: dict) -> dict:
    """The whole value of every tensor (DTensors gathered)."""
    out = {}
    for top, d in sd.items():
        for k, v in d.items():
            out[f"{top}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def saves(rank, world_size, root, work_dir, fail_step=None, keep_bytes=None):
    """Save steps 1..5 (step 5 with an extra tensor); ``fail_step``: rank 1's DCP write
    fails in that step's save; ``keep_bytes``: the writer's KEEP_METADATA_BYTES (0: every
    .metadata is kept and linked). Returns, per save, what rank 0's finish got from each
    rank (True: the digest only), whether the save committed, and what work_dir held
    after it."""
    import os

    from cloudckpt.checkpoint.rank_writer import RankWriter

    # DCP's plan cache and rank 0's finish: the path of a state whose replicated chunks owners decline
    RankWriter.owners_first_save = False
    if keep_bytes is not None:
        dcp_writer.KEEP_METADATA_BYTES = keep_bytes
    seen: list = []
    real_finish = dcp_writer.UploadingWriter.finish
    real_write = dcp_writer.write_files

    def finish(self, metadata, results):
        seen.append([r.results is None for r in results])
        return real_finish(self, metadata, results)

    dcp_writer.UploadingWriter.finish = finish
    out = []
    with Checkpointer(work_dir=work_dir) as ck:
        for step in range(1, 6):
            if step == fail_step and rank == 1:
                def write_files(*a, **kw):
                    raise OSError("injected: the disk is full")
                dcp_writer.write_files = write_files
            before = len(seen)
            try:
                ck.save(f"{root}/step{step}", state(world_size, step, extra=step == 5))
                ok = True
            except Exception:  # noqa: BLE001 - the injected failure, on every rank
                ok = False
            finally:
                dcp_writer.write_files = real_write
            out.append({"step": step, "ok": ok, "digest_only": seen[before] if len(seen) > before else None,
                        "work_dir": sorted(os.listdir(work_dir))})
    return out


def state_single(step: int, extra: bool = False, world_size: int = 2) -> dict:
    """``state`` as one process sees it whole (the same generator draws)."""
    g = torch.Generator().manual_seed(step)
    sd = {"model": {f"w{i}": torch.randn(4 * world_size, 6, generator=g) for i in range(5)},
          "optim": {"step": torch.tensor(step), "bias": torch.randn(7, generator=g)}}
    if extra:
        sd["model"]["new"] = torch.randn(2 * world_size, 3, generator=g)
    return sd
