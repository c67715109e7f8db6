"""A save, top to bottom: :func:`save` runs the marker-last commit protocol around
one rank's writing and uploading.

Call order (``R``: every rank; ``C``: the coordinator, rank 0; collective steps in
CAPITALS, each carrying every rank's error to every rank: ``dist.Coordinator``)::

    attempt = StepCommit(step, save_id, ...)            R  the same attempt everywhere
    step.connect_in_background()                        R  (not C) the store's client
    PREPARE   attempt.prepare()                         C  committed? locked? take the lock;
                                                           the plan (save id, where the
                                                           objects go) or the error reach R
    WORK DIR  private_dir(work_dir)                     R  0700, never through a link
    produce(step, work)                                 R  write + upload this rank's files
                                                           (RankWriter.write: DCP's own
                                                           collectives plan the save and
                                                           write .metadata on C; a job's
                                                           first save: planned by owners,
                                                           .metadata assembled in the store
                                                           from every rank's fragment; after
                                                           a load or such a save, planned
                                                           from that step: structure.py)
    AGREE     attempt.publish_part(rank, own)           R  its manifest part, then its
                                                           reference (or error) to C
              attempt.marker(parts, shared)             C  the marker, listing the parts
    [commit=False: return PendingCommit(attempt, marker): its commit() runs COMMIT later]
    COMMIT    attempt.commit(marker)                    C  the marker, conditional create,
                                                           written LAST; the lock released
              outcome.committed(step, marker)           R  a save planned by owners: the
                                                           writer keeps the step's structure
                                                           for its next saves (no collective)
    on any failure after PREPARE: attempt.abort()       C  remove what the attempt uploaded
    finally: the work dir removed                       R

The marker runs last because a reader treats "marker exists" as "every object of the
step is uploaded": writing it any earlier would let a resuming job load a step whose
shards are still in flight. Every storage request of PREPARE, AGREE (the part) and
COMMIT is ``commit.StepCommit``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import PeerLost, SaveFailed
from ..options import CheckpointerOptions
from ..storage.nofollow import private_dir
from ..transfer import TransferEngine
from .commit import StepCommit
from .marker import Marker
from .parts import PartRef, split_by_rank
from .rank_writer import RankResult
from .step import StepRef

log = logging.getLogger(__name__)

Produce = Callable[[StepRef, "str | None"], RankResult]
"""``produce(step, work_dir)``: write and upload this rank's objects of the step
(``work_dir`` None when the save needs none); returns the rank's result."""


@dataclass(frozen=True)
class SaveStats:
    """What the last committed :meth:`~cloudckpt.checkpoint.checkpointer.Checkpointer.save`
    did: ``Checkpointer.last_save_stats`` (None before the first; a failed save leaves the
    previous one).

    Attributes:
        step: the step number committed.
        seconds: from PREPARE to the marker written.
        bytes: bytes the step holds (every object, the marker's ``total_bytes``).
        objects: objects the step holds.
        retries: engine-level re-attempts of transfers so far (over the engine's life).
        sdk_retries: requests the SDK retried so far.
        throttled: throttle signals seen so far (503 SlowDown, 429).
        stalls: attempts the stall watchdog failed so far.
    """

    step: int
    seconds: float
    bytes: int
    objects: int
    retries: int
    sdk_retries: int
    throttled: int
    stalls: int


@dataclass(frozen=True)
class _Report:
    """What a rank tells the coordinator at AGREE: its part's reference (None when it
    wrote nothing) and the step's own files it wrote (rank 0: DCP's ``.metadata``)."""

    part: PartRef | None
    shared: tuple


def save(coord: Any, engine: TransferEngine, options: CheckpointerOptions, step: StepRef, produce: Produce, *,
         ephemeral: bool, commit: bool = True, needs_work: bool = True) -> "tuple[Marker, SaveStats] | PendingCommit":
    """Run the commit protocol (the module docstring) around ``produce``. Collective.
    Returns the committed marker (every rank gets the coordinator's) and the save's
    stats, or with ``commit=False`` a :class:`PendingCommit`. Raises CheckpointExists,
    SaveInProgress, SaveFailed (naming each failed rank), storage errors."""
    attempt: StepCommit | None = StepCommit(step, save_id=uuid.uuid4().hex, world_size=coord.world_size,
                                            save_overwrite=options.save_overwrite,
                                            stale_lock_seconds=options.stale_lock_seconds)
    t0, work = time.monotonic(), []  # this rank's work dir, once made
    try:
        if not coord.is_coordinator:
            step.connect_in_background()
        attempt.adopt(coord.on_coordinator("prepare", attempt.prepare))  # the save id; where the objects go
        if needs_work:  # 0700, never through a link; a gather: no rank receives the others' outcomes
            coord.gather_some("work dir", lambda: work.append(private_dir(
                options.work_dir, f"step{step.number}-rank{coord.rank}-")), error=SaveFailed.from_failures)
        outcome = produce(attempt.ref, work[0] if work else None)
        reports = coord.to_coordinator("agree", lambda: _report(coord, engine, attempt, attempt.ref, outcome),
                                       error=SaveFailed.from_failures)
        marker = None if reports is None else attempt.marker(  # the coordinator's, until COMMIT hands it on
            [r.part for r in reports if r.part is not None], [o for r in reports for o in r.shared],
            ephemeral=ephemeral, torch_version=torch.__version__)
        if not commit:  # it owns the lock from here
            pending, attempt = PendingCommit(coord, attempt, marker, lambda m: outcome.committed(step, m)), None
            return pending
        marker = coord.on_coordinator("commit", lambda: attempt.commit(marker))
        outcome.committed(step, marker)  # R: the writer may keep the step's structure for its next saves
        stats = _stats(engine, step.number, time.monotonic() - t0, marker)
        log.info("committed %s (%d objects, %.1f MB) in %.2fs", step, marker.object_count, marker.total_bytes / 1e6,
                 stats.seconds)
        return marker, stats
    except BaseException as e:
        if isinstance(e, PeerLost):
            e.at(step.url)  # the step folder, in the message
        if attempt is not None and attempt.locked:
            attempt.abort()
        raise
    finally:
        for w in work:
            shutil.rmtree(w, ignore_errors=True)


def write_local(coord: Any, produce: Callable[[], RankResult]) -> list:
    """A local step: every rank writes its part and keeps it (``produce``), then all
    agree. Collective. Returns this rank's entries; raises SaveFailed on every rank if
    any rank failed (the caller removes the folders)."""
    outcome = produce()
    coord.gather_some("agree", lambda: outcome.result() and None, error=SaveFailed.from_failures)
    return list(outcome.result().objects)


def _report(coord: Any, engine: TransferEngine, attempt: StepCommit, step: StepRef, outcome: RankResult) -> _Report:
    """This rank's AGREE: its result (or its error), its part published."""
    rank = coord.rank
    res = outcome.result()  # this rank's error, if any
    try:
        own, shared = split_by_rank(res.objects, rank)
    except ValueError as e:
        raise SaveFailed(f"{step}: {e}") from None
    if shared and not coord.is_coordinator:
        raise SaveFailed(f"{step}: rank {rank} wrote {shared[0].path!r}; only rank 0 writes the step's own files")
    if own:  # every rank publishes its part at once: paced like its data
        engine.pace(step.part_url(rank), "write")
    return _Report(attempt.publish_part(rank, own) if own else None, tuple(shared))


def _stats(engine: TransferEngine, number: int, seconds: float, marker: Marker) -> SaveStats:
    s = engine.stats()
    return SaveStats(step=number, seconds=seconds, bytes=marker.total_bytes, objects=marker.object_count,
                     retries=s.retries, sdk_retries=s.sdk_retries, throttled=s.throttled, stalls=s.stalls)


class PendingCommit:
    """A save that is uploaded and agreed on but not committed: ``save(..., commit=False)``.
    ``marker`` is the marker to be written on rank 0 (None on other ranks until
    ``commit()`` returns it).

    Until ``commit()`` or ``abort()`` runs, the step is invisible to readers (no
    marker) and its lock is held (another save of the step raises SaveInProgress
    until the lock is ``stale_lock_seconds`` old). Both are collective like save:
    call them on every rank of the checkpointer, once.
    """

    def __init__(self, coord: Any, attempt: StepCommit, marker: Marker | None,
                 committed: Callable[[Marker], None] | None = None):
        self._coord = coord
        self._attempt = attempt
        self._committed = committed  # every rank, once committed: the writer's RankResult.committed
        self.dir = attempt.dir
        self.marker = marker

    def commit(self) -> Marker:
        """Write the marker (conditional create, stamped with the commit time) and
        release the lock. On failure nothing is committed and the upload is removed
        (best effort), as a failed ``save`` does. Raises CheckpointExists if another
        save committed the step meanwhile, storage errors."""
        def commit() -> Marker:
            return self._attempt.commit(dataclasses.replace(self.marker, created_unix=time.time()))

        try:
            self.marker = self._coord.on_coordinator("commit", commit)
        except BaseException:
            self.abort()
            raise
        if self._committed is not None:
            self._committed(self.marker)
        return self.marker

    def abort(self) -> None:
        """Best effort: remove what the save uploaded, unless it got committed."""
        if self._coord.is_coordinator:
            self._attempt.abort()


__all__ = ["PendingCommit", "SaveStats", "save", "write_local"]
