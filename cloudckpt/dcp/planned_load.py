"""DCP's load with the planning done on each rank: the steps of DCP's own
``state_dict_loader._load_state_dict`` (torch 2.13), without its gather of every
rank's plan.

Stock ``dcp.load`` gathers every rank's load plan (every item it reads) to the
coordinator and scatters it back: at 4,096 ranks that is millions of read items into
one process, for a global step that changes nothing (DCP's default global load plan is
the identity). Here each rank plans against the metadata it was given (with the DCP
index, only the chunks it reads), and what crosses ranks does not grow with their
number. The caller (``checkpoint/loading.py``) runs these in order, each on every
rank, the collectives between them named there::

    sd = unwrap(state_dict)                 Stateful values -> their state_dict()
    md, local, ranges = plan(sd, md, ...)   reset, set_up_planner, set_up_storage_reader,
                                            create_local_plan, the reader's check_plan
                                            (AGREE "load plan")
    judge_leftovers(coord, planner, md, keys)   one all_reduce of a bit per key
    local = global_plan(local, ...)         create_global_plan, prepare_global_plan
    read(local, reader, planner)            finish_plan, read_data (AGREE "load read")
    put_back(state_dict, sd)                load_state_dict / state_dict[key] = value
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful


def unwrap(state_dict: dict) -> dict:
    """The state dict DCP plans with: each ``Stateful`` value's ``state_dict()`` (as
    ``dcp.load`` does), other values as they are."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def plan(sd: dict, metadata: Metadata, reader: Any, planner: Any, *, is_coordinator: bool):
    """This rank's local plan against ``metadata``: the planner checks it (missing keys,
    shapes: load_guard.py) and the reader checks the plan against the manifest.
    Returns ``(metadata, local plan, {file: [(offset, length), ...]})``. Not collective."""
    reader.reset()
    planner.set_up_planner(sd, metadata, is_coordinator)
    reader.set_up_storage_reader(metadata, is_coordinator)
    local = planner.create_local_plan()
    return metadata, local, reader.check_plan(local)


def judge_leftovers(coord: Any, planner: Any, metadata: Metadata, keys: list[str]) -> None:
    """Collective: one all_reduce of a bit per key of the checkpoint (asked for by some
    rank?) and per top-level key; every rank then judges the keys no rank loads the same
    way (KeysNotLoaded on every rank, or the list of keys not loaded)."""
    ckpt_keys = sorted(metadata.state_dict_metadata)
    tops = sorted({k.split(".", 1)[0] for k in ckpt_keys})  # the same list on every rank
    asked, mine = planner.asked_keys(), set(keys)
    flags = coord.any_rank([k in asked for k in ckpt_keys] + [t in mine for t in tops])
    asked_all = {k for k, f in zip(ckpt_keys, flags[:len(ckpt_keys)], strict=True) if f}
    top_all = {t for t, f in zip(tops, flags[len(ckpt_keys):], strict=True) if f}
    planner.judge_leftovers(asked_all, top_all, warn=coord.is_coordinator)


def global_plan(local: Any, planner: Any, reader: Any) -> Any:
    """DCP's global step, run on this rank's plan alone (the identity for DCP's planners)."""
    (local,) = planner.create_global_plan([local])
    (local,) = reader.prepare_global_plan([local])
    return local


def read(local: Any, reader: Any, planner: Any) -> None:
    """Read every item of this rank's plan and put it in place."""
    final = planner.finish_plan(local)
    reader.read_data(final, planner).wait()


def put_back(state_dict: dict, sd: dict) -> None:
    """Hand the loaded values back as ``dcp.load`` does: ``load_state_dict`` for a
    ``Stateful``, ``state_dict[key] = value`` for every other top-level value (tensors
    were filled in place), key by key in sorted order as ``dcp.load`` does."""
    for k in sorted(sd):
        if isinstance(state_dict[k], Stateful):
            state_dict[k].load_state_dict(sd[k])
        else:
            state_dict[k] = sd[k]
