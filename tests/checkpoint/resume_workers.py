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
    it = iter(loader)
    losses = {}
    for step in range(start, steps + 1):
        try:
            x = next(it)
        except StopIteration:
            it = iter(loader)
            x = next(it)
        noise = torch.from_numpy(np.random.normal(size=x.shape).astype("float32")) * 0.01 * random.random()
        y = (x.sum(dim=1, keepdim=True) > 0).float()
        loss = nn.functional.binary_cross_entropy_with_logits(model(x + noise), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
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
