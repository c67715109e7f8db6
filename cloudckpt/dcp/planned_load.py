"""DCP's load with the planning done on each rank, and only flat collectives.

Stock ``dcp.load`` gathers every rank's load plan (every item it reads) to the
coordinator and scatters it back: at 4,096 ranks that is millions of read items into
one process, for a global step that changes nothing (DCP's default global load plan is
the identity). Here each rank plans against the metadata it was given (with the DCP
index, only the chunks it reads: dcp/index.py), and what crosses ranks does not grow
with their number:

1. PLAN (every rank): ``metadata(state_dict)`` gives the DCP ``Metadata`` to plan
   against; the planner checks it (missing keys, shapes: load_guard.py) and makes the
   local plan; the reader checks the plan against the manifest (``check_plan``).
   AGREE: one all_reduce of a flag; if any rank failed, every rank raises the lowest
   failing rank's error.
2. LEFTOVERS: one all_reduce of a bit per key of the checkpoint (asked for by some
   rank?) and per top-level key; every rank then judges the keys no rank loads the
   same way (KeysNotLoaded on every rank, or the list of keys not loaded).
3. ``before_read`` (the node-local tier's collective fetch from peers) with the
   ranges this rank reads from storage (with the read-once exchange: its share, the
   exchange's census made first), then READ: every rank reads its items; AGREE
   again, so a rank's read error reaches all.

The order of the public planner and reader calls is DCP's own
(``state_dict_loader._load_state_dict``, torch 2.13): reset, set_up_planner,
set_up_storage_reader, create_local_plan, prepare_local_plan, create_global_plan,
prepare_global_plan, finish_plan, read_data. ``Stateful`` values are handled as
``dcp.load`` does (``state_dict()`` before, ``load_state_dict`` after).
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful


def load(state_dict: dict, *, reader: Any, planner: Any, coord: Any,
         metadata: Callable[[dict], Metadata], before_read: Callable | None = None,
         prepare: Callable[[dict], Callable[[], None]] | None = None) -> None:
    """Load ``state_dict`` in place (see the module docstring). ``reader``: a
    StreamingReader; ``planner``: a KeyCheckingPlanner; ``coord``: the checkpointer's
    ``dist.Coordinator``; ``metadata(flat state dict)``: the Metadata this rank plans
    against. ``prepare(flat state dict)`` (optional; given on every rank or none): run
    on every rank first (a failure on one fails all), returning a collective step every
    rank then runs before ``metadata`` (the checkpointer fetches the manifest part
    references this rank's plan reads there)."""
    reader.reset()
    keys = sorted(state_dict)
    sd = {k: (state_dict[k].state_dict() if isinstance(state_dict[k], Stateful) else state_dict[k]) for k in keys}
    if prepare is not None:
        coord.agree("load prepare", lambda: prepare(sd))()

    def plan():
        md = metadata(sd)
        planner.set_up_planner(sd, md, coord.is_coordinator)
        reader.set_up_storage_reader(md, coord.is_coordinator)
        local = planner.create_local_plan()
        ranges = reader.check_plan(local)
        return md, local, ranges

    md, local, ranges = coord.agree("load plan", plan)

    # keys no rank asks for: one bit per key of the checkpoint and per top-level key
    ckpt_keys = sorted(md.state_dict_metadata)
    tops = sorted({k.split(".", 1)[0] for k in ckpt_keys})  # the same list on every rank
    asked = planner.asked_keys()
    mine_top = set(keys)
    flags = coord.any_rank([k in asked for k in ckpt_keys] + [t in mine_top for t in tops])
    asked_all = {k for k, f in zip(ckpt_keys, flags[:len(ckpt_keys)], strict=True) if f}
    top_all = {t for t, f in zip(tops, flags[len(ckpt_keys):], strict=True) if f}
    planner.judge_leftovers(asked_all, top_all, warn=coord.is_coordinator)

    (local,) = planner.create_global_plan([local])
    (local,) = reader.prepare_global_plan([local])
    if before_read is not None:
        ex = getattr(reader, "exchange", None)  # read-once: this rank reads its share (the census, made now)
        before_read(ex.plan_ahead(ranges, reader) if ex is not None else ranges)

    def read():
        final = planner.finish_plan(local)
        reader.read_data(final, planner).wait()

    coord.agree("load read", read)
    for k in keys:
        if isinstance(state_dict[k], Stateful):
            state_dict[k].load_state_dict(sd[k])
        else:
            state_dict[k] = sd[k]
