"""Drives the real torchtitan (0.3.0, .venv-titan) for tests/integrations/test_torchtitan.py.

Runs with the python of .venv-titan (scripts/setup_torchtitan_venv.sh) and cloudckpt
from the source tree (PYTHONPATH). torchtitan's Trainer needs CUDA and a tokenizer, so
this loop stands in for ``Trainer.train()`` and calls the checkpoint manager exactly as
it does: ``config.checkpoint.build(...)`` with the Trainer's arguments, ``load(step=
config.checkpoint.load_step)`` before the loop, ``save(step, last_step=...)`` after each
step, ``close()`` at the end. Model parts, optimizers (torchtitan's OptimizersContainer,
AdamW), LR schedulers (its LRSchedulersContainer, warmup) are torchtitan's own.

    train FOLDER --steps N --interval I --out DIR [--async] [--slow-after K] [--exclude KEY ...]
        writes DIR/saved-{step}.pt (the state handed to each save), DIR/resumed.pt (the
        state right after load, when a step was loaded) and DIR/final.pt; prints
        "COMMITTED {step}" once a save is committed.
    import SRC FOLDER      import_torchtitan_step(SRC, FOLDER); prints "IMPORTED {step url}"
    titan-save DIR         torchtitan's own CheckpointManager (local, synchronous) saves step-2
        of the same loop under DIR; writes DIR/saved-2.pt
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful


class TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build(steps: int):
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = default_adamw(lr=1e-2)
    cfg.implementation = "for-loop"
    opt = cfg.build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=steps)
    return model, opt, sched, TrainState()


def snapshot(model, opt, sched, ts) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict(),
            "lr_scheduler": sched.state_dict(), "train_state": ts.state_dict()}


def train_step(model, opt, sched, ts) -> None:
    g = torch.Generator().manual_seed(1000 + ts.step)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    ts.ntokens_seen += 32


def cmd_train(a) -> None:
    from cloudckpt.integrations.torchtitan import CloudCheckpointManager

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, opt, sched, ts = build(a.steps)
    config = CloudCheckpointManager.Config(enable=True, folder=a.folder, interval=a.interval, keep_latest_k=0,
                                           last_save_model_only=False, async_mode="async" if a.async_ else "disabled",
                                           exclude_from_loading=a.exclude, work_dir=str(out / "work"))
    ckpt = config.build(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                        states={"train_state": ts}, sd_adapter=None, base_folder=str(out))
    if ckpt.load(step=config.load_step):
        torch.save(snapshot(model, opt, sched, ts), out / "resumed.pt")
        print("RESUMED", ts.step, flush=True)
    while ts.step < a.steps:
        ts.step += 1
        train_step(model, opt, sched, ts)
        state = snapshot(model, opt, sched, ts)
        if ckpt.save(ts.step, last_step=ts.step == a.steps):
            torch.save(state, out / f"saved-{ts.step}.pt")
            ckpt.maybe_wait_for_saving()
            print("COMMITTED", ts.step, flush=True)
        if a.slow_after is not None and ts.step >= a.slow_after:
            time.sleep(1.0)  # room for the test's SIGKILL while training goes on
    ckpt.close()
    torch.save(snapshot(model, opt, sched, ts), out / "final.pt")
    print("DONE", ts.step, flush=True)


def cmd_titan_save(a) -> None:
    """torchtitan's own CheckpointManager writes step-2 (no process group: world of one)."""
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{a.port}")
    out = Path(a.out)
    model, opt, sched, ts = build(4)
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=2, keep_latest_k=0)
    ckpt = config.build(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                        states={"train_state": ts}, sd_adapter=None, base_folder=str(out))
    for _ in range(2):
        ts.step += 1
        train_step(model, opt, sched, ts)
        ckpt.save(ts.step)
    torch.save(snapshot(model, opt, sched, ts), out / "saved-2.pt")
    ckpt.close()
    dist.destroy_process_group()
    print("TITAN-SAVED", out / "checkpoint" / "step-2", flush=True)


def cmd_import(a) -> None:
    from cloudckpt.integrations.torchtitan import import_torchtitan_step

    print("IMPORTED", import_torchtitan_step(a.src, a.folder), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("folder")
    t.add_argument("--steps", type=int, default=6)
    t.add_argument("--interval", type=int, default=2)
    t.add_argument("--out", required=True)
    t.add_argument("--async", dest="async_", action="store_true")
    t.add_argument("--slow-after", type=int)
    t.add_argument("--exclude", nargs="*", default=[])
    t = sub.add_parser("titan-save")
    t.add_argument("out")
    t.add_argument("--port", type=int, required=True)
    t = sub.add_parser("import")
    t.add_argument("src")
    t.add_argument("folder")
    a = ap.parse_args()
    {"train": cmd_train, "titan-save": cmd_titan_save, "import": cmd_import}[a.cmd](a)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
