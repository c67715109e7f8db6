"""Ranks for the resume-fallback tests (importable by spawned ranks)."""

from __future__ import annotations

import logging

import torch

from cloudckpt import CheckpointConfig


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(64, 16), "b": torch.randn(16)}}


def save_steps(rank, world_size, folder, work, steps):
    mgr = CheckpointConfig(save_folder=folder, work_dir=work, save_interval=5).build()
    for s in steps:
        mgr.maybe_save(s, state(s), {"step": s, "rank": rank})
    mgr.close()


def resume(rank, world_size, folder, work, strict=False):
    buf = []
    h = logging.Handler()
    h.emit = lambda r: buf.append(r.getMessage())
    logging.getLogger("cloudckpt").addHandler(h)
    mgr = CheckpointConfig(save_folder=folder, work_dir=work, save_interval=5, strict_resume=strict).build()
    sd = state(999)
    try:
        ts = mgr.resume(sd)
    except Exception as e:  # noqa: BLE001 - reported to the test
        mgr.close()
        return {"error": f"{type(e).__name__}: {e}"}
    mgr.close()
    return {"ts": ts, "equal": torch.equal(sd["model"]["w"], state(ts["step"])["model"]["w"]),
            "skipped": [(s.step, s.reason) for s in mgr.skipped_steps], "log": buf}
