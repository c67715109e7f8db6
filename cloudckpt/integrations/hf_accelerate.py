"""Hugging Face Accelerate: ``save_state``/``load_state`` to a bucket, through cloudckpt.

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ckpt = AcceleratorCheckpointer(accelerator, "s3://bucket/run-7", model=model,
                                   optimizer=optimizer, scheduler=scheduler)
    train_state = ckpt.load_state()            # newest committed step restored in place; None: fresh
    start = train_state["step"] if train_state else 0
    for step in range(start + 1, num_steps + 1):
        ...
        if step % 100 == 0:
            ckpt.save_state(step, {"step": step})
    ckpt.close()

Why not ``accelerator.save_state(dir)`` on a copy of the bucket: Accelerate writes a
folder of pickles and loads custom objects with ``torch.load(weights_only=False)``,
which would let a checkpoint from a bucket run code. Here the prepared model,
optimizer and scheduler are saved as one DCP state (:class:`~cloudckpt.AppState`,
which unwraps DDP/FSDP models and creates the optimizer's state before loading), the
train state and each process's RNG states (Python, NumPy, torch, CUDA) go in the
per-rank train state, and the step is committed with the marker written last. Every
read is weights-only.
"""

from __future__ import annotations

from typing import Any

from .. import AppState, CheckpointConfig, CheckpointManager
from ._hf import FORMAT, HF_KEY, build_manager, config_json, unwrap

USER_KEY = "train_state"


class AcceleratorCheckpointer:
    """Saves and restores an Accelerate training job in ``save_folder`` (local path,
    ``s3://``, ``gs://``).

    ``model``/``optimizer``/``scheduler``: what ``accelerator.prepare`` returned (one
    each, or lists / ``{name: …}`` dicts as :class:`~cloudckpt.AppState` takes). Keyword
    options build a :class:`~cloudckpt.CheckpointConfig` (``async_save``,
    ``save_interval`` for :meth:`maybe_save_state`, ``max_checkpoints``, …); or pass
    ``config=``. Data loader position: resume with ``accelerator.skip_first_batches``, or
    register a stateful loader with ``ckpt.manager.register_data_loader``. Create it and
    call its methods on every process.
    """

    def __init__(self, accelerator: Any, save_folder: str | None = None, *, model: Any, optimizer: Any = None,
                 scheduler: Any = None, config: CheckpointConfig | None = None, **options: Any):
        self.accelerator = accelerator
        self.manager: CheckpointManager = build_manager(save_folder, config, options)
        self.state = AppState(model, _each(optimizer), _each(scheduler))
        models = (list(model.values()) if isinstance(model, dict)
                  else list(model) if isinstance(model, (list, tuple)) else [model])
        self._config = config_json(accelerator.unwrap_model(models[0])) if len(models) == 1 else None

    def load_state(self, **load_options: Any) -> Any:
        """Restore the newest committed step (model, optimizer, scheduler, this process's
        RNG states) in place and return the train state passed to ``save_state``; None
        when the folder has no committed step. ``load_options`` go to
        ``Checkpointer.load``. Raises what ``CheckpointManager.resume`` raises."""
        train_state = self.manager.resume(self.state, **load_options)
        if isinstance(train_state, dict) and HF_KEY in train_state:
            return train_state.get(USER_KEY)
        return train_state

    def save_state(self, step: int, train_state: Any = None, *, ephemeral: bool = False) -> Any:
        """Save and commit ``{save_folder}/step{step}`` (in the background with
        ``async_save=True``; the returned Future, or the Marker)."""
        return self.manager.save(step, self.state, self._train_state(train_state), ephemeral=ephemeral)

    def maybe_save_state(self, step: int, train_state: Any = None, *, force: bool = False) -> Any:
        """Save if ``step`` is due by ``save_interval``/``ephemeral_save_interval`` (or ``force``)."""
        return self.manager.maybe_save(step, self.state, self._train_state(train_state), force=force)

    def _train_state(self, train_state: Any) -> dict:
        return {USER_KEY: train_state, HF_KEY: {"format": FORMAT, "config": self._config,
                                                 "process_index": self.accelerator.process_index,
                                                 "world_size": self.accelerator.num_processes}}

    def wait(self) -> None:
        """Wait for in-flight async saves to commit; raise the first failure."""
        self.manager.wait()

    def close(self) -> None:
        """Wait for in-flight saves, then release the manager."""
        self.manager.close()

    def __enter__(self) -> "AcceleratorCheckpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _each(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: unwrap(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [unwrap(v) for v in obj]
    return unwrap(obj)
