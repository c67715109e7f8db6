"""Training loops for the exact-resume test (importable by spawned ranks)."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

from cloudckpt import CheckpointConfig


class App(Stateful):
    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class _Batches:
    """Endless batches of a (stateful) loader, epoch after epoch."""

    def __init__(self, loader):
        self.loader, self.it = loader, iter(loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


def _train_step(model, optim, x):
    """One step whose result depends on the model, AdamW's state, dropout (torch RNG),
    and noise from NumPy's and Python's RNGs; returns the loss."""
    noise = torch.from_numpy(np.random.normal(size=x.shape).astype("float32")) * 0.01 * random.random()
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    loss = nn.functional.binary_cross_entropy_with_logits(model(x + noise), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss


def train(rank, world_size, folder, work_dir, steps, stop_after=None):
    """Train ``steps`` steps (resuming from ``folder`` if it has a checkpoint), saving every
    2 steps; with ``stop_after`` the job ends right after that step's save (a preemption)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"app": App(model, optim)}
    g = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randn(8, generator=g) for _ in range(40)]
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(rank))
    random.seed(rank)
    np.random.seed(rank)

    mgr = CheckpointConfig(save_folder=folder, work_dir=work_dir, save_interval=2).build()
    mgr.register_data_loader(loader)
    ts = mgr.resume(state)
    start = ts["step"] + 1 if ts else 1
    batches = _Batches(loader)
    losses = {}
    for step in range(start, steps + 1):
        loss = _train_step(model, optim, batches.next())
        val = loss.detach().clone()
        tdist.all_reduce(val)
        losses[step] = val.item()
        mgr.maybe_save(step, state, {"step": step})
        if stop_after == step:
            break
    mgr.close()
    m, _ = get_state_dict(model, optim)
    weights = {k: v.full_tensor() for k, v in m.items()}
    return {"losses": losses, "weights": weights, "resumed": mgr.resumed_step}


def train_logged(rank, world_size, folder, work_dir, steps):
    """``train`` with the manager's warnings captured."""
    import io
    import logging

    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    logging.getLogger("cloudckpt").addHandler(h)
    logging.getLogger("cloudckpt").setLevel(logging.INFO)
    out = train(rank, world_size, folder, work_dir, steps)
    out["log"] = buf.getvalue()
    return out


def _digest(model, optim, sched, loader) -> dict:
    """What a user checks after a resume, on this rank: weights and AdamW state (local
    shards), the LR scheduler, the data loader's position and every RNG."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"w.{n}": local(p) for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for k, v in optim.state.get(p, {}).items():
            out[f"opt.{i}.{k}"] = local(v)
    out["sched"] = sched.state_dict()
    out["loader"] = loader.state_dict()
    out["rng.torch"] = torch.get_rng_state()
    out["rng.numpy"] = np.random.get_state()[1].copy()
    out["rng.python"] = random.getstate()
    return out


def train_resumable(rank, world_size, folder, work_dir, steps, mode, kill_after=None):
    """Train ``steps`` steps, resuming from ``folder``, saving every 2 steps through
    ``AppState``: ``mode="manager"`` (CheckpointManager, exact resume of loader and RNG)
    or ``"helper"`` (Checkpointer directly; loader and RNG in the train state). With
    ``kill_after`` the process SIGKILLs itself right after that step (no close, no
    cleanup: a preemption). Returns ``{"digests": {step: _digest}, "resumed": step}``."""
    import os
    import signal

    from cloudckpt import AppState, Checkpointer
    from cloudckpt.errors import NotACheckpoint
    from cloudckpt.exact_resume import capture_rng_state, restore_rng_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
    if world_size > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    state = AppState(model, optim, sched)
    g = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randn(8, generator=g) for _ in range(40)]
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(rank))
    random.seed(rank)
    np.random.seed(rank)

    if mode == "manager":
        mgr = CheckpointConfig(save_folder=folder, work_dir=work_dir, save_interval=2).build()
        mgr.register_data_loader(loader)
        ts = mgr.resume(state)
    else:
        ck = Checkpointer(work_dir=work_dir)
        try:
            latest = Checkpointer.latest_checkpoint(folder)
        except NotACheckpoint:
            latest = None
        ts = ck.load(latest, state) if latest else None
        if ts:
            loader.load_state_dict(ts["loader"])
            restore_rng_state(ts["rng"])
    resumed = ts["step"] if ts else None
    start = resumed + 1 if ts else 1
    batches = _Batches(loader)
    digests = {}
    for step in range(start, steps + 1):
        _train_step(model, optim, batches.next())
        sched.step()
        if mode == "manager":
            mgr.maybe_save(step, state, {"step": step})
        elif step % 2 == 0:
            ck.save(f"{folder}/step{step}", state,
                    {"step": step, "loader": loader.state_dict(), "rng": capture_rng_state()})
        digests[step] = _digest(model, optim, sched, loader)
        if kill_after == step:
            os.kill(os.getpid(), signal.SIGKILL)
    (mgr if mode == "manager" else ck).close()
    return {"digests": digests, "resumed": resumed}
