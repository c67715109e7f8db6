"""A load, top to bottom: :func:`load` reads a committed step into a state dict.

Call order (``R``: every rank; ``C``: the coordinator, rank 0; collective steps in
CAPITALS, each carrying every rank's error to every rank: ``dist.Coordinator``)::

    step.connect_in_background()                       R  (not C) the store's client
    READ MARKER   read_shared(step)                    C  the marker and the DCP index
                                                          header (or, a step without the
                                                          index, .metadata), checked, sent
                                                          to R with part references withheld
    committed = CommittedStep.of_shared(...)           R  (open_step: both lines)
    ... load_with: build(committed.shapes()) ...       R
    sd = planned_load.unwrap(target)                   R  Stateful -> state_dict()
    [a step with the DCP index:]
    LOAD PREPARE  committed.select(sd)                 R  the chunks this rank's shards
                                                          overlap, the ranks it reads
    PART REFS     committed.with_part_refs(writers)    R  the references it reads, from C
    LOAD PLAN     committed.plan_metadata(selection)   R  Metadata from those index parts
                  (else committed.metadata())             (or the whole .metadata)
                  planned_load.plan(sd, metadata)         DCP's local plan, checked
    LEFTOVERS     planned_load.judge_leftovers         R  keys no rank loads: one bit each
                  planned_load.global_plan             R  DCP's identity global step
                  before_read(ranges)                  R  (optional, may be collective)
    LOAD READ     planned_load.read                    R  stream items into place (the
                                                          read-once exchange shares items
                                                          several ranks need)
                  planned_load.put_back(state_dict)    R
                  committed.train_state(rank)          R  this rank's (rank 0's when the
                                                          world size changed)

Nothing a rank receives or holds grows with the saved job's ranks: the marker comes
with its part references withheld, a rank reads the index parts and manifest parts of
the ranks whose chunks it loads, and the collectives carry a flag, a bit per key, or a
few integers per part reference asked.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..dcp import StreamingReader, planned_load
from ..dcp.load_guard import KeyCheckingPlanner
from ..dcp.reader import ShardSource
from ..errors import PeerLost
from ..options import CheckpointerOptions
from ..storage.nofollow import private_dir
from ..transfer import TransferEngine
from .committed import CommittedStep, Shared, read_shared
from .rank_writer import quiet_dcp
from .step import StepRef


@dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """What to load (``Checkpointer.load``'s arguments, checked there)."""

    load_optim_state: bool | None = None
    load_trainer_state: bool | None = None
    strict: bool = True
    pre_download: bool | None = None
    exclude_from_loading: Sequence[str] = ()
    allow_partial: bool = False
    only: str | None = None  # model_only: the one top-level key loaded
    before_read: Callable[[dict[str, list[tuple[int, int]]]], None] | None = None
    cast_dtypes: bool = False  # a tensor saved with another dtype is cast into the target (Megatron's load)

    def target(self, state_dict: dict) -> tuple[dict, set[str], tuple[str, ...]]:
        """``(the top-level entries loaded, the keys skipped, the optional key prefixes)``."""
        skipped = set(self.exclude_from_loading)
        if self.load_optim_state is False:
            skipped.add("optim")
        loaded = {k: v for k, v in state_dict.items() if k not in skipped}
        return loaded, skipped, ("optim.",) if self.load_optim_state is None else ()


@dataclass(frozen=True)
class LoadInfo:
    """What the last :meth:`~cloudckpt.checkpoint.checkpointer.Checkpointer.load` (or ``load_with``) of this rank did:
    ``Checkpointer.last_load_info`` (None before the first load).

    Attributes:
        dir: the step folder loaded (its URL).
        step: its step number.
        saved_world_size: the number of ranks that saved it.
        bytes_read: bytes this rank read from the store for the model and optimizer (its
            own reads; what peers sent it through the read-once exchange is not counted).
        direct_items: items this rank put in place straight from the bytes read, without
            DCP's copy (``dcp/items.py``).
        not_loaded: checkpoint keys the target did not ask for, left in the checkpoint
            (``allow_partial``, ``strict=False``, excluded or skipped keys).
        writer: the tool that wrote the step (``"cloudckpt"``, or another such as
            ``"olmo-core"`` for a step adopted as it was).
        verified: the step has a manifest (sizes and CRC32Cs); False for a step another
            tool wrote, whose sizes come from a listing.
        parts_read: manifest parts (``manifest/rank{R}.json``) this rank read to plan.
        cast: this rank's target keys saved with another dtype, read as saved and cast
            (``"key (saved -> target)"``; only where the load casts: Megatron's).
    """

    dir: str
    step: int
    saved_world_size: int
    bytes_read: int
    direct_items: int
    not_loaded: list
    writer: str
    verified: bool
    parts_read: int
    cast: tuple = ()


def read_marker(coord: Any, step: StepRef, *, verify: bool) -> Shared:
    """READ MARKER: the coordinator reads what every rank plans against, once, and hands
    it on with the part references withheld; it keeps its own whole. Collective."""
    if not coord.is_coordinator:
        step.connect_in_background()
    mine: list[Shared] = []

    def read() -> Shared:
        mine.append(read_shared(step, verify=verify))
        return mine[0].for_peers()

    try:
        shared = coord.on_coordinator("read marker", read)
    except PeerLost as e:
        e.at(step.url)  # the step folder, in the message
        raise
    return mine[0] if mine else shared


def open_step(coord: Any, engine: TransferEngine, options: CheckpointerOptions, step: StepRef) -> CommittedStep:
    """READ MARKER, then this rank's reader of the step. Collective."""
    shared = read_marker(coord, step, verify=options.verify_checksums)
    return CommittedStep.of_shared(step, shared, verify=options.verify_checksums, pace=engine.pace)


def load(coord: Any, engine: TransferEngine, options: CheckpointerOptions, committed: CommittedStep,
         state_dict: dict, req: LoadRequest) -> tuple[Any, LoadInfo]:
    """Load the committed step (``open_step``'s) into ``state_dict`` (see the module
    docstring for the order). Collective. Returns ``(this rank's train state or None,
    LoadInfo)``; raises what ``Checkpointer.load`` documents."""
    step, marker = committed.step, committed.marker
    target, skipped, optional = req.target(state_dict)
    planner = KeyCheckingPlanner(strict=req.strict, optional_prefixes=optional, url=step.model.url, step_url=step.url,
                                 allow_partial=req.allow_partial, skipped=skipped, only=req.only,
                                 cast_dtypes=req.cast_dtypes)
    pre = options.pre_download if req.pre_download is None else req.pre_download
    local = private_dir(options.work_dir, f"load-rank{coord.rank}-") if pre else None  # 0700, never through a link
    try:
        store = step.model.store
        reader = StreamingReader(ShardSource(
            step.model.url, engine.submit_stream, streamed=store.streams_ranges, checksums=committed.item_checksums(),
            verify=options.verify_checksums, manifest=committed.shard_manifest if marker.parts else None),
            local_dir=local, exchange=coord if options.load_exchange else None)  # read-once: collective
        sd = planned_load.unwrap(target)
        selection = None
        if committed.header_bytes() is not None:  # the same on every rank: handed over by READ MARKER
            ts_rank = coord.rank if coord.world_size == marker.world_size else 0
            selection = coord.agree("load prepare", lambda: committed.select(sd, train_state_rank=ts_rank))
            committed.with_part_refs(coord, selection.writers)
        with quiet_dcp():
            md, local_plan, ranges = coord.agree("load plan", lambda: planned_load.plan(
                sd, committed.plan_metadata(selection) if selection else committed.metadata(),
                reader, planner, is_coordinator=coord.is_coordinator))
            planned_load.judge_leftovers(coord, planner, md, sorted(target))
            local_plan = planned_load.global_plan(local_plan, planner, reader)
            if req.before_read is not None:  # read-once: this rank reads its share (the census, made now)
                req.before_read(reader.exchange.plan_ahead(ranges, reader) if reader.exchange else ranges)
            coord.agree("load read", lambda: planned_load.read(local_plan, reader, planner))
        planned_load.put_back(state_dict, sd)
    except PeerLost as e:
        e.at(step.url)  # the step folder, in the message
        raise
    finally:
        if local:
            shutil.rmtree(local, ignore_errors=True)
    info = LoadInfo(dir=step.url, step=marker.step, saved_world_size=marker.world_size, bytes_read=reader.bytes_read,
                    direct_items=reader.direct_items, not_loaded=planner.not_loaded, writer=marker.writer,
                    verified=marker.verified, parts_read=committed.manifest.parts_read, cast=tuple(planner.cast))
    if req.load_trainer_state is False:
        return None, info
    return committed.train_state(coord.rank, world_size=coord.world_size,
                                 required=bool(req.load_trainer_state)), info


__all__ = ["LoadInfo", "LoadRequest", "load", "open_step", "read_marker"]
