"""Runs lightning_fit.py's training in a child process for the kill-and-resume tests,
recording (into DUMP_DIR, as weights-only torch files) the state where it stalls
(``--stall-at K``: at the start of the batch after step K's checkpoint, once that
checkpoint is committed, it prints STALLED and sleeps until killed), the state when a
resumed fit starts, and the final state.

    python lightning_worker.py ROOT MAX_STEPS DUMP_DIR [--async] [--stall-at K] [--resume last|helper]

``--resume last`` passes ``ckpt_path="last"``; ``--resume helper`` passes
``ckpt_path=last_checkpoint(ROOT/checkpoints)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).parent))
from lightning_fit import fit

from cloudckpt.integrations.lightning import last_checkpoint


def snapshot(trainer) -> dict:
    return {"step": trainer.global_step,
            "model": {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()},
            "optim": trainer.optimizers[0].state_dict()}


def dump(dump_dir: str, name: str, value) -> None:
    tmp = os.path.join(dump_dir, name + ".part")
    torch.save(value, tmp)
    os.replace(tmp, os.path.join(dump_dir, name))


class Probe(Callback):
    def __init__(self, dump_dir: str, stall_at: int | None):
        self.dump_dir, self.stall_at = dump_dir, stall_at

    def on_train_start(self, trainer, pl_module):
        if trainer.global_step:  # restored from a checkpoint
            dump(self.dump_dir, "resumed.pt", snapshot(trainer))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # ModelCheckpoint saved step K at the end of the previous batch (checkpoint callbacks run last)
        if trainer.global_step == self.stall_at:
            io = trainer.strategy.checkpoint_io
            if hasattr(io, "maybe_finalize_save_checkpoint"):
                io.maybe_finalize_save_checkpoint(blocking=True)  # async: commit step K before stalling
            dump(self.dump_dir, "stalled.pt", snapshot(trainer))
            print("STALLED", flush=True)
            while True:  # until SIGKILL
                time.sleep(0.2)

    def on_train_end(self, trainer, pl_module):
        dump(self.dump_dir, "final.pt", snapshot(trainer))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("max_steps", type=int)
    p.add_argument("dump_dir")
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--stall-at", type=int)
    p.add_argument("--resume", choices=["last", "helper"])
    a = p.parse_args()
    seed_everything(0, verbose=False)
    ckpt_path = {"last": "last", "helper": None, None: None}[a.resume]
    if a.resume == "helper":
        ckpt_path = last_checkpoint(f"{a.root}/checkpoints")
        assert ckpt_path is not None, "no committed checkpoint to resume from"
    trainer = fit(a.root, a.max_steps, ckpt_path=ckpt_path, async_save=a.async_save,
                  callbacks=[Probe(a.dump_dir, a.stall_at)])
    print(f"RESUMED_FROM {trainer.ckpt_path}", flush=True)


if __name__ == "__main__":
    main()
