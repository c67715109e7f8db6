"""A small real training loop that checkpoints through cloudckpt.

A tiny transformer on synthetic data, parameters sharded with FSDP2 (DTensor) on
CPU over gloo, AdamW. Run with::

    torchrun --nproc_per_node 2 examples/train.py --config examples/demo.yaml

The checkpoint section of the YAML is a CheckpointConfig; CLOUDCKPT_* env vars
override it. Restart the same command after a kill: it resumes from the newest
committed step in the bucket.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml

from cloudckpt import AppState, CheckpointConfig


class TinyTransformer(nn.Module):
    def __init__(self, vocab=64, dim=64, heads=4, layers=2, seq=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 2, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.head(self.blocks(self.emb(x) + self.pos))


def batch(step: int, rank: int, bs: int, seq: int = 16, vocab: int = 64):
    """Deterministic synthetic data: the task is to predict the next token of x -> (x * 3 + 1) % vocab."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randint(0, vocab, (bs, seq), generator=g)
    return x, (x * 3 + 1) % vocab


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--step-delay", type=float, default=0.0,
                    help="seconds to sleep per step (makes the demo killable mid-run)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s rank" + os.environ.get("RANK", "0") + " %(name)s: %(message)s")
    logging.getLogger("botocore").setLevel(logging.WARNING)

    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    train_cfg = cfg.get("train", {})
    steps = args.steps or int(train_cfg.get("steps", 40))

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    from torch.distributed.fsdp import fully_shard

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for blk in model.blocks.layers:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=float(train_cfg.get("lr", 3e-3)))
    state = AppState(model, optim)  # sharded (DTensor) model and AdamW state, restored in place by resume

    mgr = CheckpointConfig.from_dict(cfg["checkpoint"]).build()
    train_state = mgr.resume(state)
    start = 1
    if train_state is not None:
        start = int(train_state["step"]) + 1
        if rank == 0:
            print(f"RESUMED from step {train_state['step']} (loss then {train_state['loss']:.4f})", flush=True)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(start, steps + 1):
        x, y = batch(step, rank, int(train_cfg.get("batch_size", 32)))
        loss = loss_fn(model(x).reshape(-1, 64), y.reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        val = loss.detach().clone()
        dist.all_reduce(val)
        val = val.item() / world
        if rank == 0:
            print(f"step {step:4d} loss {val:.4f}", flush=True)
        mgr.maybe_save(step, state, {"step": step, "loss": val})
        if args.step_delay:
            time.sleep(args.step_delay)
    mgr.close()
    if rank == 0:
        print(f"DONE at step {steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
