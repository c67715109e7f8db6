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
unpickled beyond the weights-only train state cloudckpt itself reads. It is a full
copy of the weights, so it lives only as long as it is needed: it is removed when the
first training step begins (the Trainer has read it all by then), at ``on_train_end``,
``close()`` or process exit, whichever comes first. By default it is made in the work
dir as ``hf-resume-{pid}-*``; one left by a killed process is removed by the next
``prepare_resume()`` on that machine.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import random
import re
import shutil
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("cloudckpt.integrations.hf needs transformers: pip install 'cloudckpt[hf]'") from e

from .. import AppState, CheckpointConfig, CheckpointManager
from ..checkpoint import layout
from ..errors import CheckpointError, CorruptCheckpoint
from ..ops.export import export_weights
from ..storage.nofollow import Folder, private_dir, resolve
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


_RESUME_DIR = "hf-resume-"
_RESUME_RE = re.compile(r"hf-resume-([0-9]{1,10})-.*")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def _remove_dead_leftovers(work_dir: str) -> list[str]:
    """Remove ``hf-resume-{pid}-*`` folders of ``work_dir`` whose process is gone (a
    resume folder of a killed job: a full copy of the weights). Never follows a link
    inside ``work_dir``; a folder of a live process (another rank of this machine) stays."""
    gone = []
    try:
        with Folder.open(resolve(work_dir), what=f"work_dir {work_dir}") as f:
            for n in f.names():
                m = _RESUME_RE.fullmatch(n)
                if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
                    f.remove(n)
                    gone.append(n)
    except (OSError, CheckpointError) as e:  # missing, or a link planted there: nothing of ours to remove
        if not isinstance(e, FileNotFoundError):
            log.warning("could not look for resume folders of killed processes in %s: %s", work_dir, e)
    if gone:
        log.info("removed resume folders of processes that are gone from %s: %s", work_dir, gone)
    return gone


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


_PREPARED: set[str] = set()  # resume folders of this process not removed yet


@atexit.register
def _remove_prepared() -> None:
    for path in list(_PREPARED):
        _rmtree(path)


# ---------------------------------------------------------------- the callback
class CloudCheckpointCallback(TrainerCallback):
    """Mirrors every checkpoint the ``Trainer`` saves into ``save_folder`` (local path,
    ``s3://``, ``gs://``) as a committed cloudckpt step, and resumes from the newest one
    (see the module docstring).

    ``save_folder`` and keyword options build a :class:`~cloudckpt.CheckpointConfig`
    (``async_save``, ``max_checkpoints``, ``keep_every``, ``endpoint_url``, …; the
    intervals are the Trainer's ``save_steps``); or pass ``config=``. ``local_dir``:
    where ``prepare_resume`` writes ``checkpoint-N`` (default: a new private folder per
    process in the work dir); the folder is removed once the Trainer has read it. Call
    the same methods on every process of a distributed job.
    """

    def __init__(self, save_folder: str | None = None, *, config: CheckpointConfig | None = None,
                 local_dir: str | None = None, **options: Any):
        self._args = (save_folder, config, options)
        self.local_dir = local_dir
        self._manager: CheckpointManager | None = None
        self._pending: tuple[int, str, str] | None = None  # (step, step url, local folder) to finish in on_train_begin
        self._state: tuple[tuple[int, ...], AppState] | None = None
        self._prepared: str | None = None  # the folder prepare_resume made, removed once read

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
        self.discard_prepared()  # an earlier call's folder
        if self.local_dir:
            folder = os.path.join(self.local_dir, f"checkpoint-{step}")
            made = None if os.path.exists(folder) else folder  # never remove a folder that was there before
            os.makedirs(folder, exist_ok=True)
        else:
            work_dir = mgr.checkpointer.work_dir
            _remove_dead_leftovers(work_dir)
            made = private_dir(work_dir, f"{_RESUME_DIR}{os.getpid()}-")  # 0700, never through a link
            folder = os.path.join(made, f"checkpoint-{step}")
            os.mkdir(folder)
        if made is not None:
            self._prepared = made
            _PREPARED.add(made)
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

    def on_step_begin(self, args, state, control, **kwargs):
        # the Trainer has read the prepared folder (weights, trainer state, RNG) by the first step
        if self._prepared is not None and self._pending is None:
            self.discard_prepared()

    def discard_prepared(self) -> None:
        """Remove the folder ``prepare_resume`` wrote (a full copy of the weights), if any
        is left: done by the callback once the Trainer has read it."""
        path, self._prepared = self._prepared, None
        if path is not None:
            _rmtree(path)
            _PREPARED.discard(path)

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
        self.discard_prepared()
        if self._manager is not None:
            self._manager.wait()

    def close(self) -> None:
        """Wait for in-flight saves and release the manager; remove the folder
        ``prepare_resume`` wrote if it is still there."""
        self.discard_prepared()
        if self._manager is not None:
            mgr, self._manager = self._manager, None
            mgr.close()
