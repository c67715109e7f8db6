"""Hugging Face ``transformers.Trainer`` checkpoints in a bucket, through cloudckpt.

    cb = CloudCheckpointCallback("s3://bucket/run-7")
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.prepare_resume())   # None: start from scratch

Saving (``on_save``, right after the Trainer wrote its local ``checkpoint-N``): the
Trainer's model, optimizer and LR scheduler are saved as a cloudckpt step
``{save_folder}/step{N}`` (DCP, through :class:`~cloudckpt.AppState`), with this
process's train state: the ``TrainerState`` as JSON, the RNG states in the layout of
the Trainer's ``rng_state.pth``, and the model's config as JSON. The marker is
written last, as for every cloudckpt step, so ``cloudckpt list/verify/export`` work
on it and a crash never leaves a half checkpoint that a resume would pick.

Resuming is two halves, because the Trainer reads a local folder before it creates
the optimizer:

1. ``prepare_resume()`` (before ``train``) finds the newest committed step, removes
   the crashed attempt's uncommitted leftovers above it, and writes a local folder
   the Trainer understands: ``trainer_state.json`` (global step, epoch, callbacks),
   ``rng_state.pth``, ``config.json`` and ``model.safetensors`` (exported from the
   step, CRC32C-checked). The Trainer loads these with its own safe loaders
   (safetensors; ``torch.load(weights_only=True)``).
2. ``on_train_begin`` (after the Trainer created the optimizer and scheduler) loads
   the optimizer and scheduler state of the same step into them, in place. It raises
   if the Trainer did not resume from the folder ``prepare_resume`` returned, so a
   resume never goes on with a fresh optimizer silently.

The folder holds no ``optimizer.pt``/``scheduler.pt``: nothing from the bucket is
unpickled beyond the weights-only train state cloudckpt itself reads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import tempfile
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("cloudckpt.integrations.hf needs transformers: pip install 'cloudckpt[hf]'") from e

from .. import AppState, CheckpointConfig, CheckpointManager
from ..checkpoint import layout
from ..errors import CheckpointError, CorruptCheckpoint
from ..export import export_weights
from ._hf import FORMAT, HF_KEY, build_manager, config_json, hf_section, unwrap
from .hf_export import MAX_CONFIG_BYTES, MAX_TRAINER_STATE_BYTES, saved_json

log = logging.getLogger(__name__)


def _rng_state(world_size: int) -> dict[str, Any]:
    """The RNG states, in the layout of the Trainer's ``rng_state.pth``."""
    import numpy as np

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all() if world_size > 1 else torch.cuda.random.get_rng_state()
    return state


def _write_json(path: str, text: Any, what: str, url: str, *, limit: int, non_finite: bool = False) -> None:
    value = saved_json(text, url=url, what=what, limit=limit, non_finite=non_finite)
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)


# ---------------------------------------------------------------- the callback
class CloudCheckpointCallback(TrainerCallback):
    """Mirrors every checkpoint the ``Trainer`` saves into ``save_folder`` (local path,
    ``s3://``, ``gs://``) as a committed cloudckpt step, and resumes from the newest one
    (see the module docstring).

    ``save_folder`` and keyword options build a :class:`~cloudckpt.CheckpointConfig`
    (``async_save``, ``max_checkpoints``, ``keep_every``, ``endpoint_url``, …; the
    intervals are the Trainer's ``save_steps``); or pass ``config=``. ``local_dir``:
    where ``prepare_resume`` writes ``checkpoint-N`` (default: a new temporary folder
    per process). Call the same methods on every process of a distributed job.
    """

    def __init__(self, save_folder: str | None = None, *, config: CheckpointConfig | None = None,
                 local_dir: str | None = None, **options: Any):
        self._args = (save_folder, config, options)
        self.local_dir = local_dir
        self._manager: CheckpointManager | None = None
        self._pending: tuple[int, str, str] | None = None  # (step, step url, local folder) to finish in on_train_begin
        self._state: tuple[tuple[int, ...], AppState] | None = None

    @property
    def manager(self) -> CheckpointManager:
        """The :class:`~cloudckpt.CheckpointManager` (built on first use)."""
        if self._manager is None:
            self._manager = build_manager(*self._args)
        return self._manager

    def _app_state(self, model: Any, optimizer: Any, scheduler: Any) -> AppState:
        objs = (model, unwrap(optimizer), unwrap(scheduler))
        key = tuple(id(o) for o in objs)
        if self._state is None or self._state[0] != key:  # a new train() may bring new objects
            self._state = (key, AppState(*objs))
        return self._state[1]

    # ------------------------------------------------------------ resume
    def prepare_resume(self) -> str | None:
        """Find the newest committed step of ``save_folder`` and write the local folder
        to pass as ``trainer.train(resume_from_checkpoint=…)``; None when the folder has
        no committed step (start from scratch). Collective (every process calls it).

        Raises IncompatibleCheckpoint (the step was not written by this callback),
        CorruptCheckpoint/UnsafeCheckpoint (bad bytes), storage errors."""
        mgr = self.manager
        step_url = mgr.step_to_resume()
        if step_url is None:
            self._pending = None
            return None
        train_state = mgr.checkpointer.read_train_state(step_url)  # this rank's; the weights come below
        step = mgr.resumed_step = layout.parse_step_dir(step_url)
        hf = hf_section(train_state, step_url)
        base = self.local_dir or tempfile.mkdtemp(prefix="cloudckpt-hf-")
        folder = os.path.join(base, f"checkpoint-{step}")
        os.makedirs(folder, exist_ok=True)
        _write_json(os.path.join(folder, "trainer_state.json"), hf.get("trainer_state"), "TrainerState", step_url,
                    limit=MAX_TRAINER_STATE_BYTES, non_finite=True)  # the Trainer logs a NaN loss as NaN
        if hf.get("config") is not None:
            _write_json(os.path.join(folder, "config.json"), hf["config"], "model config", step_url,
                        limit=MAX_CONFIG_BYTES)
        rng, rank, world = hf.get("rng"), hf.get("process_index", 0), hf.get("world_size", 1)
        if type(rank) is not int or type(world) is not int or not 0 <= rank < max(world, 1) <= 1 << 24:
            # names a file below: only a number, never a path
            raise CorruptCheckpoint(f"{step_url}: the saved process_index/world_size are not a rank below a world "
                                    "size; the step was not written by this callback")
        if isinstance(rng, dict):  # plain data, read weights-only; the Trainer reads it back weights-only
            torch.save(rng, os.path.join(folder, "rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"))
        export_weights(step_url, os.path.join(folder, "model.safetensors"), overwrite=True,
                       storage_options=mgr.checkpointer.storage_options, work_dir=mgr.checkpointer.work_dir)
        self._pending = (step, step_url, folder)
        log.info("prepared %s from %s: pass it as resume_from_checkpoint", folder, step_url)
        return folder

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self._pending is None:
            return
        step, step_url, folder = self._pending
        if state.global_step != step:
            raise CheckpointError(
                f"CloudCheckpointCallback.prepare_resume() prepared {folder} (step {step} of {step_url}), but the "
                f"Trainer starts at global step {state.global_step}: pass that folder as "
                "trainer.train(resume_from_checkpoint=…), or the optimizer and scheduler would start fresh")
        # the weights came from model.safetensors of the same step; optimizer and scheduler now
        self.manager.checkpointer.load(step_url, self._app_state(model, optimizer, lr_scheduler),
                                       exclude_from_loading=["model"], load_trainer_state=False)
        self._pending = None
        log.info("restored optimizer and LR scheduler from %s", step_url)

    # ------------------------------------------------------------ save
    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if model is None or optimizer is None:
            raise CheckpointError("CloudCheckpointCallback.on_save got no model or optimizer from the Trainer")
        section = {
            "format": FORMAT,
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
            "rng": _rng_state(args.world_size),
            "config": config_json(model),
            "process_index": args.process_index,
            "world_size": args.world_size,
        }
        self.manager.save(state.global_step, self._app_state(model, optimizer, lr_scheduler), {HF_KEY: section})

    def on_train_end(self, args, state, control, **kwargs):
        """Every save is committed (async saves waited for) when ``train`` returns."""
        if self._manager is not None:
            self._manager.wait()

    def close(self) -> None:
        """Wait for in-flight saves and release the manager."""
        if self._manager is not None:
            mgr, self._manager = self._manager, None
            mgr.close()
