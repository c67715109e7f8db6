"""Training loops for test_worker_rng_resume.py (importable by spawned ranks): a
map-style dataset whose ``__getitem__`` augments with torch, NumPy and Python random
draws, read by a torchdata ``StatefulDataLoader`` with 0, 1 or 2 workers, a model with
dropout, checkpoints to a local folder through ``CheckpointManager`` every 4 steps."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from cloudckpt import AppState, CheckpointConfig

ITEMS, BATCH = 24, 4  # 6 batches per epoch
STEPS, SAVE_EVERY = 14, 4  # saves at 4, 8 (mid epoch 2) and 12 (the end of epoch 2)


class Augmented(Dataset):
    def __init__(self):
        self.items = [torch.randn(8, generator=torch.Generator().manual_seed(i)) for i in range(ITEMS)]

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        noise = torch.randn(8) + float(np.random.rand()) + random.random()
        return self.items[i] + 0.5 * noise


def _key(cfg) -> str:
    return "w{}-p{}-s{}-{}".format(*cfg)


def run(cfg, folder: str, work_dir: str, load_step=None, keep_worker_rng: bool = True) -> dict:
    """Train to STEPS with ``cfg`` = (num_workers, persistent_workers,
    snapshot_every_n_steps, start method of the workers); from scratch (saving) or
    resumed from ``load_step``. (A rank of run_ranks is itself spawned, and so starts
    its loader workers with spawn unless told: fork is the Linux default elsewhere.)"""
    workers, persistent, snapshot, start = cfg
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = AppState(model, optim)
    data = Augmented()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
    loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=workers,
                                persistent_workers=persistent, prefetch_factor=2 if workers else None,
                                snapshot_every_n_steps=snapshot, multiprocessing_context=start if workers else None)
    # a resumed run saves nothing; save_overwrite only lets it resume below the straight run's newer steps
    mgr = CheckpointConfig(save_folder=folder, work_dir=work_dir, save_interval=SAVE_EVERY, async_save=False,
                           save_overwrite=load_step is not None).build()
    mgr.register_data_loader(loader)
    if not keep_worker_rng:  # what a resume did before workers kept their RNG: the test's power
        del loader._get_iterator
    ts = mgr.resume(state, load_step=load_step) if load_step else mgr.resume(state)
    assert (ts["step"] if ts else None) == load_step
    step = ts["step"] + 1 if ts else 1
    losses = {}
    per_epoch = ITEMS // BATCH
    while step <= STEPS:
        sampler.set_epoch((step - 1) // per_epoch)
        for x in loader:
            y = (x.sum(dim=1, keepdim=True) > 0).float()
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses[step] = loss.detach().view(torch.int32).item()  # the float's bits
            if load_step is None:
                mgr.maybe_save(step, state, {"step": step})
            if step == STEPS:
                break
            step += 1
        else:
            continue
        break
    mgr.close()
    return {"losses": losses, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def straight(rank, world_size, root, configs):
    return {_key(c): run(c, f"{root}/{_key(c)}", f"{root}/work-{_key(c)}") for c in configs}


def resumed(rank, world_size, root, configs, load_steps, unkept=()):
    out = {}
    for c in configs:
        for s in load_steps:
            out[_key(c), s] = run(c, f"{root}/{_key(c)}", f"{root}/work-{_key(c)}", load_step=s)
    for c in unkept:
        out[_key(c), "unkept"] = run(c, f"{root}/{_key(c)}", f"{root}/work-{_key(c)}", load_step=load_steps[0],
                                     keep_worker_rng=False)
    return out
