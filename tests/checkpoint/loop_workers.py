"""The usual training-loop shape, for the exact-resume tests (importable by spawned ranks):
``resume()``, then per epoch ``sampler.set_epoch(e)`` and ``for batch in loader``, with
a loader that draws its seeds from the global torch RNG (no ``generator=``) and dropout."""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from cloudckpt import AppState, CheckpointConfig

BATCHES_PER_EPOCH = 5


def train(rank, world_size, folder, work_dir, steps, stop_after=None, async_save=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = AppState(model, optim)
    data = [torch.randn(8, generator=torch.Generator().manual_seed(i)) for i in range(40)]
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler)  # 20 items per rank: 5 batches per epoch

    mgr = CheckpointConfig(save_folder=folder, work_dir=work_dir, save_interval=2, async_save=async_save).build()
    mgr.register_data_loader(loader)
    ts = mgr.resume(state)
    step = ts["step"] + 1 if ts else 1
    losses = {}
    while step <= steps:
        sampler.set_epoch((step - 1) // BATCHES_PER_EPOCH)
        for x in loader:
            y = (x.sum(dim=1, keepdim=True) > 0).float()
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            optim.zero_grad()
            loss.backward()
            for p in model.parameters():  # DDP-style: the ranks train one model
                tdist.all_reduce(p.grad)
            optim.step()
            val = loss.detach().clone()
            tdist.all_reduce(val)
            losses[step] = val.item()
            mgr.maybe_save(step, state, {"step": step})
            if step == stop_after or step == steps:
                mgr.close()
                return {"losses": losses, "weights": {k: v.clone() for k, v in model.state_dict().items()},
                        "resumed": mgr.resumed_step, "rng": torch.get_rng_state()}
            step += 1
    raise AssertionError("unreachable")
