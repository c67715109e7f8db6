"""The load guard: a DCP load planner that checks the plan against the checkpoint
before anything is read (missing keys, keys left behind, shape and dtype), and puts
non-tensor values in place through ``cloudckpt.untrusted`` (never DCP's own pickle
load). Used by ``Checkpointer.load``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._torch_compat import set_element
from ..errors import KeysNotLoaded, MissingKeys, ShapeMismatch
from ..untrusted import load_plain

log = logging.getLogger(__name__)


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _shown(keys: Sequence[str], n: int = 20) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


class KeyCheckingPlanner(DefaultLoadPlanner):
    """Checks the load plan against the checkpoint before anything is read:

    - MissingKeys: keys asked for that the checkpoint lacks (``strict``; keys under
      ``optional_prefixes`` are skipped silently);
    - ShapeMismatch: a tensor asked for with another shape than saved, or another dtype
      (unless ``cast_dtypes``: then it is read as saved and cast into the target, as
      Megatron's own load and stock DCP's do, each such key logged and listed in
      ``self.cast``);
    - KeysNotLoaded: checkpoint keys that no rank asks for, under a top-level key a
      rank asks for or under ``model``/``optim`` (unless ``allow_partial`` or the key
      was skipped on purpose: ``skipped`` top-level keys, or all but ``only``); other
      leftovers: one warning. Judged on the coordinator from every rank's request
      (ranks of a sharded or pipelined load ask for different keys), and handed back
      to every rank: ``self.not_loaded``.

    What travels to the coordinator for this stays small whatever the job's size: the
    keys a rank asks for are the keys its read items name (DCP sends the local plans
    to the coordinator anyway), so a local plan carries only its top-level keys and the
    keys it asks for without reading anything (a shard with no elements on this rank:
    usually none), not the rank's whole key list.
    """

    def __init__(self, *, strict: bool, optional_prefixes: tuple[str, ...] = (), url: str = "", step_url: str = "",
                 allow_partial: bool = False, skipped: Sequence[str] = (), only: str | None = None,
                 cast_dtypes: bool = False):
        super().__init__(allow_partial_load=True)
        self.cast_dtypes = cast_dtypes
        self.cast: list[str] = []  # keys of this rank's target read as saved and cast to the target's dtype
        self.url = url
        self.step_url = step_url
        self.strict = strict
        self.optional_prefixes = optional_prefixes
        self.allow_partial = allow_partial
        self.skipped = set(skipped)
        self.only = only  # model_only: every other top-level key is skipped on purpose
        self.missing: list[str] = []
        self.not_loaded: list[str] = []
        self._judged = False  # leftovers judged from every rank's flags (dcp/planned_load.py)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        have = metadata.state_dict_metadata if metadata is not None else {}
        missing = [k for k in self.state_dict if k not in have]
        self.missing = [k for k in missing if not k.startswith(self.optional_prefixes)]
        if self.missing and self.strict:
            raise MissingKeys(
                f"{self.step_url}: {len(self.missing)} key(s) asked for are not in the checkpoint: "
                f"{_shown(self.missing)}; pass strict=False to load what exists"
            )
        self._check_shapes(have)
        self._top = sorted(state_dict)

    def create_local_plan(self):
        plan = super().create_local_plan()
        have = self.metadata.state_dict_metadata if self.metadata is not None else {}
        reads = {ri.dest_index.fqn for ri in plan.items}
        unread = sorted(k for k in self.state_dict if k in have and k not in reads)
        return dataclasses.replace(plan, planner_data={"unread": unread, "top": self._top})

    def asked_keys(self) -> set[str]:
        """The checkpoint's keys this rank asks for (whether or not it reads any byte of them)."""
        have = self.metadata.state_dict_metadata if self.metadata is not None else {}
        return {k for k in self.state_dict if k in have}

    def judge_leftovers(self, asked: set[str], top: set[str], *, warn: bool = True) -> None:
        """The leftover check from the keys some rank asks for (``asked``) and the
        top-level keys some rank's target has (``top``), the same on every rank: raises
        KeysNotLoaded, or sets ``not_loaded`` (the warning for the rest only if ``warn``)."""
        have = self.metadata.state_dict_metadata if self.metadata is not None else {}
        self.not_loaded = self._check_leftovers(have, asked, top, warn=warn)
        self._judged = True

    def create_global_plan(self, global_plan):
        if self._judged:
            return super().create_global_plan(global_plan)

        asked: set[str] = set()
        top: set[str] = set()
        for p in global_plan:
            data = p.planner_data or {}
            asked.update(ri.dest_index.fqn for ri in p.items)
            asked.update(data.get("unread", ()))
            top.update(data.get("top", ()))
        have = self.metadata.state_dict_metadata if self.metadata is not None else {}
        not_loaded = self._check_leftovers(have, asked, top)
        return [dataclasses.replace(p, planner_data={"not_loaded": not_loaded})
                for p in super().create_global_plan(global_plan)]

    def finish_plan(self, new_plan):
        if not self._judged:
            self.not_loaded = list((new_plan.planner_data or {}).get("not_loaded", ()))
        return super().finish_plan(new_plan)

    def _check_shapes(self, have) -> None:
        cast = []
        for k, v in self.state_dict.items():
            md = have.get(k)
            if not isinstance(v, torch.Tensor) or not isinstance(md, TensorStorageMetadata):
                continue
            same_shape = tuple(v.size()) == tuple(md.size)
            if same_shape and v.dtype == md.properties.dtype:
                continue
            if same_shape and self.cast_dtypes:
                cast.append(f"{k} ({_dtype(md.properties.dtype)} -> {_dtype(v.dtype)})")
                continue
            raise ShapeMismatch(
                f"{self.step_url}: {k!r} was saved as {_dtype(md.properties.dtype)} {list(md.size)}, the target is "
                f"{_dtype(v.dtype)} {list(v.size())}; build the model with the configuration the checkpoint was "
                "saved with, or leave its top-level key out (exclude_from_loading=[...])"
            )
        self.cast = cast
        if cast:
            log.warning("%s: %d tensor(s) saved with another dtype are cast into the target's: %s", self.step_url,
                        len(cast), _shown(cast))

    def _check_leftovers(self, have, asked: set[str], top: set[str], *, warn: bool = True) -> list[str]:
        not_loaded = sorted(k for k in have if k not in asked and k.split(".", 1)[0] not in self.skipped
                            and (self.only is None or k.split(".", 1)[0] == self.only))
        guarded = top | {"model", "optim"}
        dropped = [k for k in not_loaded if k.split(".", 1)[0] in guarded]
        if dropped and not self.allow_partial:
            raise KeysNotLoaded(
                f"{self.step_url}: {len(dropped)} key(s) of the checkpoint would not be loaded because the target does "
                f"not ask for them: {_shown(dropped)}. A fresh optimizer's state_dict() has no per-parameter state: "
                "pass cloudckpt.AppState(model, optimizer, scheduler) as the state, or pass allow_partial=True "
                "(or model_only=True) if you mean to leave them behind"
            )
        rest = [k for k in not_loaded if k not in dropped]
        if rest and warn:
            log.warning("%s: %d key(s) of the checkpoint are not loaded (the target does not ask for them): %s",
                        self.step_url, len(rest), _shown(rest))
        return not_loaded


    def load_bytes(self, read_item, value) -> None:
        # Stock DCP unpickles non-tensor values with weights_only=False: a checkpoint
        # from a bucket could run code. Only plain data is accepted (untrusted.plain).

        fqn = read_item.dest_index.fqn
        obj = load_plain(value, url=self.url, what=f"value of {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
