"""Runs examples/hf_trainer.py or examples/hf_accelerate.py in a child process for the
kill-and-resume tests, recording (into DUMP_DIR, as weights-only torch files) the state
at the save where it stalls (``--stall-at K``: after step K is committed it prints
STALLED and sleeps until killed), the state right after a resume, the RNG at the first
resumed step, and the final state.

    python tests/integrations/hf_workers.py {trainer|accelerate} SAVE_FOLDER MAX_STEPS DUMP_DIR [--stall-at K]
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rng() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))}


def snapshot(step: int, model, optimizer, scheduler) -> dict:
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    scheduler = getattr(scheduler, "scheduler", scheduler)
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    return {"step": step, "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": optimizer.state_dict(), "sched": sched, "rng": rng()}


def dump(dump_dir: str, name: str, value) -> None:
    tmp = os.path.join(dump_dir, name + ".part")
    torch.save(value, tmp)
    os.replace(tmp, os.path.join(dump_dir, name))


def stall(dump_dir: str, state: dict) -> None:
    dump(dump_dir, "stalled.pt", state)
    print("STALLED", flush=True)
    while True:  # until SIGKILL
        time.sleep(0.2)


def run_trainer(folder: str, max_steps: int, dump_dir: str, stall_at: int | None) -> None:
    from transformers import TrainerCallback

    class Probe(TrainerCallback):  # after the cloud callback in the list: runs after its on_save/on_train_begin
        first = True

        def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
            if state.global_step:
                dump(dump_dir, "resumed.pt", snapshot(state.global_step, model, optimizer, lr_scheduler))

        def on_step_begin(self, args, state, control, **kw):
            if self.first and state.global_step:  # the Trainer restored the RNG before the first resumed step
                dump(dump_dir, "first_step_rng.pt", rng())
            self.first = False

        def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
            if state.global_step == stall_at:
                stall(dump_dir, snapshot(state.global_step, model, optimizer, lr_scheduler))

        def on_train_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
            dump(dump_dir, "final.pt", snapshot(state.global_step, model, optimizer, lr_scheduler))

    load_example("hf_trainer").main(folder, max_steps=max_steps, callbacks=[Probe()])


def run_accelerate(folder: str, max_steps: int, dump_dir: str, stall_at: int | None) -> None:
    def after_save(step, *objs):
        if step == stall_at:
            stall(dump_dir, snapshot(step, *objs))

    def after_resume(step, *objs):
        state = snapshot(step, *objs)  # the RNG is restored by load_state, before the first resumed step
        dump(dump_dir, "resumed.pt", state)
        dump(dump_dir, "first_step_rng.pt", state["rng"])

    objs = load_example("hf_accelerate").train(folder, max_steps, after_save=after_save, after_resume=after_resume)
    dump(dump_dir, "final.pt", snapshot(max_steps, *objs))


if __name__ == "__main__":
    kind, folder, max_steps, dump_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    stall_at = int(sys.argv[sys.argv.index("--stall-at") + 1]) if "--stall-at" in sys.argv else None
    {"trainer": run_trainer, "accelerate": run_accelerate}[kind](folder, max_steps, dump_dir, stall_at)
