"""``AppState``: the model, optimizer and scheduler state of a training job as one
DCP state dict that saves and resumes *everything*, by default.

Why it exists: the obvious ``{"model": model.state_dict(), "optim":
optim.state_dict()}`` silently loses the optimizer on resume. A fresh optimizer's
``state_dict()`` has no per-parameter state (AdamW's moments are created on the
first step), and DCP loads only the keys its target asks for, so the saved moments
are never read. ``AppState`` builds the state with DCP's
``get_model_state_dict``/``get_optimizer_state_dict`` (which create the optimizer's
state before a load, and give FSDP2/DTensor models sharded, resharding-safe state)
and puts it back with ``set_model_state_dict``/``set_optimizer_state_dict``; LR
schedulers and other ``Stateful`` objects are saved and restored through their own
``state_dict``/``load_state_dict``.

It is a ``dict`` of top-level keys, each a DCP ``Stateful`` (``"model"``,
``"optim"``, ``"scheduler"``, then your extra names), so every option keyed on
top-level names works unchanged (``model_only``, ``load_optim_state=False``,
``exclude_from_loading``), and the state is read at save time: build it once and
pass the same object to every save and load.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

MODEL, OPTIM, SCHEDULER = "model", "optim", "scheduler"


def _named(obj: Any, what: str) -> dict[str, Any]:
    """One object, a list of them, or a ``{name: object}`` dict -> ``{name: object}``."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (list, tuple)):
        return {str(i): o for i, o in enumerate(obj)}
    return {"": obj}


class _Models(Stateful):
    def __init__(self, models: dict[str, torch.nn.Module], options: StateDictOptions | None):
        self.models, self.options = models, options

    def state_dict(self) -> dict:
        sds = {n: get_model_state_dict(m, options=self.options) for n, m in self.models.items()}
        return sds[""] if list(sds) == [""] else sds

    def load_state_dict(self, sd: dict) -> None:
        for n, m in self.models.items():
            set_model_state_dict(m, sd if n == "" else sd[n], options=self.options)


class _Optimizers(Stateful):
    def __init__(self, pairs: dict[str, tuple[torch.nn.Module, list]], options: StateDictOptions | None):
        self.pairs, self.options = pairs, options

    def state_dict(self) -> dict:
        sds = {n: get_optimizer_state_dict(m, opts, options=self.options) for n, (m, opts) in self.pairs.items()}
        return sds[""] if list(sds) == [""] else sds

    def load_state_dict(self, sd: dict) -> None:
        for n, (m, opts) in self.pairs.items():
            set_optimizer_state_dict(m, opts, sd if n == "" else sd[n], options=self.options)


class _Each(Stateful):
    """Objects with their own ``state_dict``/``load_state_dict`` (LR schedulers)."""

    def __init__(self, objs: dict[str, Any]):
        self.objs = objs

    def state_dict(self) -> dict:
        return {n or "0": o.state_dict() for n, o in self.objs.items()}

    def load_state_dict(self, sd: dict) -> None:
        for n, o in self.objs.items():
            o.load_state_dict(sd[n or "0"])


class AppState(dict):
    """Model(s), optimizer(s), LR scheduler(s) and extra ``Stateful`` objects as one
    DCP state dict, for ``Checkpointer.save/load`` and ``CheckpointManager.resume/
    maybe_save``::

        state = AppState(model, optimizer, scheduler)
        train_state = manager.resume(state)       # restores all three in place
        ...
        manager.maybe_save(step, state, {"step": step})

    ``model``: a module, or ``{name: module}`` for several (GAN generator and
    discriminator, pipeline stages). ``optimizer``: an optimizer, a list of optimizers
    over the model, or ``{name: optimizer(s)}`` matching the model names.
    ``scheduler``: a scheduler, a list, or ``{name: scheduler}``. ``extra``: more
    ``Stateful`` objects, each saved under its name as a top-level key; their state
    is global (one copy, from rank 0): per-rank state such as data loader positions
    and RNG goes into the train state (the manager's ``register_data_loader`` and
    exact resume do that). ``options``: DCP's ``StateDictOptions`` (e.g.
    ``full_state_dict``, ``cpu_offload``).

    Raises ValueError when optimizers name models that are not given.
    """

    def __init__(self, model: Any, optimizer: Any = None, scheduler: Any = None, *,
                 extra: Mapping[str, Stateful] | None = None, options: StateDictOptions | None = None):
        super().__init__()
        models = _named(model, "model")
        if not models:
            raise ValueError("AppState needs a model")
        optims = _named(optimizer, "optimizer")
        if list(optims) == [""] or (isinstance(optimizer, (list, tuple)) and len(models) == 1):
            optims = {next(iter(models)): optimizer}  # one model: one optimizer or a list of them over it
        unknown = sorted(set(optims) - set(models))
        if unknown:
            raise ValueError(f"AppState: optimizers for models {unknown} that are not given (models: {sorted(models)})")
        self[MODEL] = _Models(models, options)
        if optims:
            pairs = {n: (models[n], list(o) if isinstance(o, (list, tuple)) else [o]) for n, o in optims.items()}
            self[OPTIM] = _Optimizers(pairs, options)
        scheds = _named(scheduler, "scheduler")
        if scheds:
            self[SCHEDULER] = _Each(scheds)
        for name, obj in (extra or {}).items():
            if name in self:
                raise ValueError(f"AppState: extra name {name!r} is taken by the model, optimizer or scheduler")
            if not isinstance(obj, Stateful):
                raise ValueError(f"AppState: extra {name!r} has no state_dict/load_state_dict")
            self[name] = obj

    def __repr__(self) -> str:
        return f"AppState({', '.join(self)})"
