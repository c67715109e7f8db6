"""The commit protocol of one save of one step, torch-free.

A save makes a step visible to readers only when every object of it is stored: the
marker ``.metadata.json`` is written last, by the coordinator, with a conditional
create. This module holds every storage request of that protocol; the checkpointer
writes the files and runs the collectives (``cloudckpt/dist.py``) between the calls.

Call order (``C``: the coordinator, rank 0, alone; ``R``: every rank)::

    c = StepCommit(step_ref, save_id=..., world_size=W, ...)   # R  (step_ref: a StepRef)
    c.prepare()              # C  check the step, take its lock (conditional create);
                             #    returns the save id every rank adopts
    ... each rank writes and uploads its objects ...                       # R
    ref = c.publish_part(rank, entries)   # R  upload this rank's manifest part
    ... "agree": every rank's outcome and ``ref`` travel to the coordinator ...
    marker = c.marker(parts, objects, ephemeral=...)   # C  the header listing the parts
    c.commit(marker)         # C  the marker (conditional create), then release the lock
    c.abort()                # C  on any failure after prepare(): remove what this
                             #    attempt uploaded, if it still holds the lock

``prepare`` raises before anything is written if the step is committed (unless
``save_overwrite``) or another save holds a fresh lock. ``commit`` raises
CheckpointExists if another save committed the step meanwhile; a marker that exists
with this save's id is this save's own create whose answer was lost: success.

Each rank's part (``manifest/rank{R}.json``) is uploaded before the agree step, so the
coordinator receives one small reference per rank (path, size, CRC32C), never another
rank's manifest; the marker lists the parts with their size and CRC32C, and a reader
checks a part against it before trusting it (``marker.py``).

The lock body is a small JSON object (``LockBody``); a lock that is not one (another
tool's, damaged, planted: deep, non-finite or oversized JSON) is judged abandoned
(stale) and taken over with a compare-and-swap, never parsed without a ceiling.
Every call here runs on storage only, so ``cloudckpt.testing.conformance`` drives
the protocol on every backend without spawning ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import (
    AlreadyExists,
    CheckpointExists,
    CloudCkptError,
    CorruptCheckpoint,
    NotFound,
    PreconditionFailed,
    SaveFailed,
    SaveInProgress,
)
from ..untrusted import MAX_MARKER_BYTES, loads_json, read_capped
from . import layout
from .entries import ObjectEntry
from .marker import FORMAT_VERSION, REPLACED_FORMAT_VERSION, Marker
from .parts import ManifestPart, PartRef
from .step import StepRef

log = logging.getLogger(__name__)

MAX_LOCK_BYTES = 64 * 1024  # ours is under 200 bytes


@dataclass(frozen=True)
class LockBody:
    """What a step's ``.lock`` holds: which save took it, where, and when."""

    save_id: str
    host: str = ""
    pid: int = 0
    created_unix: float = 0.0
    world_size: int = 0

    @classmethod
    def new(cls, save_id: str, world_size: int) -> "LockBody":
        return cls(save_id, socket.gethostname(), os.getpid(), time.time(), world_size)

    def to_bytes(self) -> bytes:
        import json

        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, url: str) -> "LockBody":
        """Parse a lock body (at most MAX_LOCK_BYTES, bounded JSON). Raises CorruptCheckpoint
        when it is not one of ours."""
        d = loads_json(data, url=url, what="save lock", limit=MAX_LOCK_BYTES)
        if type(d) is not dict:
            raise CorruptCheckpoint(f"{url}: the save lock is not a JSON object")
        save_id, created = d.get("save_id"), d.get("created_unix")
        if type(save_id) is not str or not 0 < len(save_id) <= 128:
            raise CorruptCheckpoint(f"{url}: the save lock has no save_id")
        if type(created) not in (int, float) or not math.isfinite(created):
            raise CorruptCheckpoint(f"{url}: the save lock has no creation time")
        host, pid, ws = d.get("host", ""), d.get("pid", 0), d.get("world_size", 0)
        return cls(save_id, host[:256] if type(host) is str else "", pid if type(pid) is int else 0,
                   float(created), ws if type(ws) is int else 0)

    @classmethod
    def read(cls, store: Any, url: str) -> "LockBody | None":
        """The lock at ``url``, or None when it cannot be read as ours (then it is judged
        stale). Raises NotFound (no lock), storage errors."""
        try:
            return cls.from_bytes(read_capped(store, url, limit=MAX_LOCK_BYTES, what="save lock"), url=url)
        except CorruptCheckpoint as e:  # UnsafeCheckpoint (oversized) included
            log.warning("the save lock %s is not readable as cloudckpt's (%s); it is treated as abandoned", url, e)
            return None


@dataclass(frozen=True)
class Plan:
    """What PREPARE decides for every rank: the save id, and the folder under the step
    that receives this attempt's objects ("" or, replacing a committed step,
    ``.replace/{save id}``)."""

    save_id: str
    root: str = ""


class StepCommit:
    """The storage side of one save attempt of the step folder ``step_dir``.

    Build it on every rank with the same ``save_id`` (the coordinator chooses it);
    ``prepare``, ``commit``, ``abort`` run on the coordinator only, ``publish_part``
    on every rank. See the module docstring for the order.
    """

    def __init__(self, step: StepRef, *, save_id: str, world_size: int, save_overwrite: bool = False,
                 stale_lock_seconds: float = 600.0):
        if step.number is None:
            raise ValueError(f"{step}: a save needs the step's number (a folder named step{{N}}, or step=N)")
        self.ref = step
        self.dir = step.url
        self.step = step.number
        self.save_id = save_id
        self.world_size = world_size
        self.save_overwrite = save_overwrite
        self.stale_lock_seconds = stale_lock_seconds
        self.locked = False  # this object took the lock (coordinator)
        self.replaces: str | None = None  # coordinator, replacing a committed step: its marker's version

    def adopt(self, plan: "Plan") -> None:
        """Every rank: take the coordinator's plan from PREPARE (its save id, and where this
        attempt's objects go: the step folder, or a replaced step's root)."""
        self.save_id = plan.save_id
        self.ref = self.ref.with_root(plan.root)

    @property
    def store(self):
        return self.ref.store

    @property
    def marker_url(self) -> str:
        return self.ref.marker_url

    @property
    def lock_url(self) -> str:
        return self.ref.lock_url

    # ------------------------------------------------------------ coordinator: prepare
    def prepare(self) -> "Plan":
        """Check the step and take its lock; returns the plan every rank adopts
        (:meth:`adopt`): the coordinator's save id, and where the attempt's objects go.
        Replacing a committed step (``save_overwrite``) on a store with
        ``conditional_replace``, they go under a root of their own (``.replace/{save
        id}``) and the old step stays committed until :meth:`commit` swaps the marker;
        on another store the old marker is deleted first, then the old objects. Raises
        CheckpointExists (committed and no ``save_overwrite``), SaveInProgress (another
        save holds a fresh lock, or took a stale one over first, or the store cannot take
        a stale lock over: its ``conditional_replace`` is False), CorruptCheckpoint (an
        oversized lock: not ours), storage errors (BucketNotFound included)."""
        store, dir, marker, lock = self.store, self.dir, self.marker_url, self.lock_url
        store.check_bucket(dir)  # a clear BucketNotFound; some S3-compatible stores would create it on PUT
        keep_root = None  # replacing: the committed step's root, kept by a stale lock's takeover
        if store.exists(marker):
            if not self.save_overwrite:
                raise CheckpointExists(f"{dir} is already a committed checkpoint; "
                                       "pass save_overwrite=True to replace it")
            if store.conditional_replace:
                keep_root = self._begin_replace()
            else:
                log.warning("save_overwrite: replacing committed checkpoint %s (marker deleted first: %s cannot "
                            "replace it in one step)", dir, type(store).__name__)
                store.delete(marker)
                store.delete_prefix(dir)
        plan = Plan(self.save_id, "" if keep_root is None else f"{layout.REPLACE_DIR}/{self.save_id}")
        body = LockBody.new(self.save_id, self.world_size).to_bytes()
        try:
            store.put_bytes(lock, body, if_absent=True)
            self._check_not_committed_under_lock()
            self.locked = True
            return plan
        except AlreadyExists:
            if self._lock_owner() == self.save_id:
                # our create landed but its answer was lost; the SDK's retry met our own lock
                self._check_not_committed_under_lock()
                self.locked = True
                return plan
        try:
            if store.stat(lock).size > MAX_LOCK_BYTES:
                raise CorruptCheckpoint(f"{lock} is {store.stat(lock).size} bytes: not a cloudckpt save lock (ours are "
                                        f"under {MAX_LOCK_BYTES} bytes); delete it to save {dir}")
            if store.conditional_replace:
                data, version = store.get_bytes_versioned(lock)  # the exact lock we judge below
            else:
                data, version = read_capped(store, lock, limit=MAX_LOCK_BYTES, what="save lock"), None
        except NotFound:
            data, version = None, None  # released meanwhile: compete for it again below
        age = self._age(data)
        if not self.save_overwrite and age is not None and age < self.stale_lock_seconds:
            raise SaveInProgress(
                f"another save of {dir} is in progress (its lock is {age:.0f}s old); "
                "if that job is dead, wait until the "
                f"lock is {self.stale_lock_seconds:.0f}s old, delete {lock}, or pass save_overwrite=True"
            )
        if data is not None and not store.conditional_replace:
            # Without a compare-and-swap two jobs that judged the lock stale could both take
            # it (each deleting what the other writes): refuse instead of guessing.
            raise SaveInProgress(
                f"{lock} holds a save lock ({'of unknown age' if age is None else f'{age:.0f}s old'}) and "
                f"{type(store).__name__} cannot replace an object conditionally (its conditional_replace is "
                f"False), so the lock is not taken over; if no other save of {dir} runs, delete {lock} and save again"
            )
        log.warning("taking over %s: clearing an abandoned save (lock %s old)", dir,
                    "of unknown age" if age is None else f"{age:.0f}s")
        # Take the lock over with a compare-and-swap of the very lock judged stale: of two
        # jobs that judged it stale, only one wins; the other (which may have been slow
        # long enough for the winner to commit) gets SaveInProgress and deletes nothing.
        try:
            if version is None:
                store.put_bytes(lock, body, if_absent=True)
            else:
                store.put_bytes_if_match(lock, body, version)
        except (AlreadyExists, PreconditionFailed):
            raise SaveInProgress(f"another save of {dir} took its lock over first; retry later") from None
        self._check_not_committed_under_lock()
        self.locked = True
        # clear the abandoned save's objects, keeping the lock we now hold (and, replacing, the committed step)
        if keep_root is None:
            store.delete_many(o.url for o in store.walk(self.ref.prefix) if o.url != lock)
        else:
            kept = self.ref.with_root(keep_root).objects_prefix if keep_root else None
            store.delete_many(o.url for o in store.walk(self.ref.with_root(layout.REPLACE_DIR).objects_prefix)
                              if kept is None or not o.url.startswith(kept))
        return plan

    def _begin_replace(self) -> str:
        """Replacing the committed step: note its marker's version (the commit swaps the
        marker only if it is still this one) and return its root ("" for a step whose
        objects are in the step folder itself), whose objects a stale lock's takeover keeps."""
        data, self.replaces = self.store.get_bytes_versioned(self.marker_url, limit=MAX_MARKER_BYTES)
        try:
            root = Marker.from_bytes(data, url=self.marker_url).root
        except CloudCkptError:
            root = ""  # not a marker we read: nothing under .replace/ is kept for it
        log.warning("save_overwrite: replacing committed checkpoint %s; it stays committed until the new marker "
                    "replaces its marker", self.dir)
        return root

    def _committed_save_id(self, limit: int) -> str | None:
        """The save id of the step's marker as it is now (None: none, or not readable)."""
        try:
            data = read_capped(self.store, self.marker_url, limit=max(limit, MAX_LOCK_BYTES), what="commit marker")
            return Marker.from_bytes(data, url=self.marker_url).save_id
        except CloudCkptError:
            return None

    def _clear_replaced(self) -> None:
        """After the marker was swapped: remove what is not the new step's (the old step's
        objects, in the step folder or under its root), keeping the marker and the lock.
        Best effort: an object left behind is not listed by any marker (logged)."""
        store, keep = self.store, self.ref.objects_prefix
        try:
            store.delete_many(o.url for o in store.walk(self.ref.prefix)
                              if not o.url.startswith(keep) and o.url not in (self.marker_url, self.lock_url))
        except CloudCkptError as e:
            log.warning("replaced %s but could not remove all of the old step's objects (%s); they are listed by no "
                        "marker", self.dir, e)

    def _age(self, data: bytes | None) -> float | None:
        """Seconds since the lock ``data`` was taken: 0 when it is gone (released between
        our create and read: treat as fresh), None when it is not ours (stale)."""
        if data is None:
            return 0.0
        try:
            return time.time() - LockBody.from_bytes(data, url=self.lock_url).created_unix
        except CorruptCheckpoint as e:
            log.warning("the save lock %s is not readable as cloudckpt's (%s)", self.lock_url, e)
            return None

    def _lock_owner(self) -> str | None:
        """The save_id in the lock, or None when it cannot be read."""
        try:
            body = LockBody.read(self.store, self.lock_url)
        except CloudCkptError:
            return None
        return None if body is None else body.save_id

    def _check_not_committed_under_lock(self) -> None:
        """Look at the marker again now that we hold the lock. The check before taking it
        is not enough: a slow lock request can land after another save of the step
        committed and released the lock, and writing on would overwrite that committed
        step's objects. A committer writes its marker before releasing the lock, so the
        marker is visible here in that case."""
        if self.save_overwrite or not self.store.exists(self.marker_url):
            return
        try:
            self.store.delete(self.lock_url)
        except CloudCkptError as e:
            log.warning("could not release the lock %s (%s); it is harmless", self.lock_url, e)
        raise CheckpointExists(f"{self.dir} was committed by another save while this one was starting; "
                               "pass save_overwrite=True to replace it")

    # ------------------------------------------------------------ every rank: parts
    def publish_part(self, rank: int, entries: Sequence[ObjectEntry]) -> PartRef:
        """Upload rank ``rank``'s manifest part (its objects: sizes, CRC32Cs, item CRCs)
        and return its reference for the marker. A part this library's reader would
        refuse (a name outside the rank's files, a bad entry) raises SaveFailed before
        anything is uploaded: a save never commits what a load cannot read."""
        _check_readable(entries, self.dir)
        part = ManifestPart(step=self.step, rank=rank, save_id=self.save_id, objects=tuple(entries))
        data = part.to_bytes()
        ref = PartRef.of(rank, data, part)
        url = self.ref.part_url(rank)
        try:
            ManifestPart.from_bytes(data, url=url, ref=ref, step=self.step, save_id=self.save_id)
        except CorruptCheckpoint as e:
            raise SaveFailed(f"rank {rank}'s manifest part of {self.dir} would not be readable: {e}") from None
        self.store.put_bytes(url, data)
        return ref

    # ------------------------------------------------------------ coordinator: commit
    def marker(self, parts: Sequence[PartRef], objects: Sequence[ObjectEntry], *, ephemeral: bool,
               torch_version: str = "") -> Marker:
        """The marker of this save: the step header, the step's own ``objects`` (DCP's
        ``.metadata``) and the ranks' ``parts`` (written as columns: format 3)."""
        root = self.ref.root
        return Marker(step=self.step, ephemeral=ephemeral, world_size=self.world_size,
                      objects=tuple(sorted(objects, key=lambda o: o.path)),
                      parts=tuple(sorted(parts, key=lambda p: p.rank)), torch_version=torch_version,
                      save_id=self.save_id, format_version=REPLACED_FORMAT_VERSION if root else FORMAT_VERSION,
                      root=root)

    def commit(self, marker: Marker) -> Marker:
        """Write the marker last (conditional create) and release the lock: 2 requests (no
        ``latest`` pointer: ``pointer.py`` says why). Replacing a committed step, the
        marker replaces the old one only if it is still the one ``prepare`` saw (one
        conditional request: a reader sees the old step or the new one), then the old
        step's objects are removed (best effort, still under the lock). Raises SaveFailed
        (a marker this library could not read back), CheckpointExists (another save
        committed or replaced the step meanwhile), storage errors."""
        store, url = self.store, self.marker_url
        _check_readable(marker.objects, self.dir, step_bytes=marker.total_bytes)
        data = marker.to_bytes()
        try:
            Marker.from_bytes(data, url=url)  # what readers will parse: checked before it is written
        except CorruptCheckpoint as e:
            raise SaveFailed(f"the marker of {self.dir} would not be readable: {e}") from None
        try:
            if self.replaces is None:
                store.put_bytes(url, data, if_absent=True)
            else:
                store.put_bytes_if_match(url, data, self.replaces)
        except (AlreadyExists, PreconditionFailed):
            # A lost response can make our own retried create look like a conflict.
            if self._committed_save_id(len(data)) != marker.save_id:
                raise CheckpointExists(f"{self.dir} was committed by another save while this one ran; "
                                       "this save was not committed") from None
        if self.replaces is not None:
            self._clear_replaced()
        self.locked = False
        try:
            store.delete(self.lock_url)
        except CloudCkptError as e:
            log.warning("committed %s but could not remove its lock (%s); it is harmless", self.dir, e)
        return marker

    # ------------------------------------------------------------ coordinator: abort
    def abort(self) -> None:
        """Best effort: remove what this attempt uploaded, if it still holds the lock
        and nothing committed the step (the error may have come after the commit).
        Replacing a committed step, only this attempt's root is removed (the old step
        stays committed) and the lock released."""
        store = self.store
        try:
            if self.replaces is not None:
                if self._committed_save_id(MAX_MARKER_BYTES) == self.save_id or self._lock_owner() != self.save_id:
                    return  # committed after all, or not ours to clean
                store.delete_prefix(self.ref.objects_prefix)
                store.delete(self.lock_url)
            else:
                if store.exists(self.marker_url):
                    return  # committed after all: keep it
                if self._lock_owner() != self.save_id:
                    return
                store.delete_prefix(self.dir)
        except CloudCkptError as e:
            log.warning("could not clean up the failed save at %s (%s); `cloudckpt gc` will remove it", self.dir, e)
        self.locked = False


def _check_readable(entries: Sequence[ObjectEntry], dir: str, *, step_bytes: int = 0) -> None:
    """Refuse (SaveFailed), before the marker, an object a reader would refuse for its
    size: DCP's ``.metadata`` over ``metadata_limit`` of the step's other files
    (``step_bytes``: every object of the step, the metadata included), a train state
    over MAX_TRAIN_STATE_BYTES (a save never commits what a load cannot read)."""
    from ..untrusted import MAX_TRAIN_STATE_BYTES
    from ..untrusted.limits import metadata_limit

    for e in entries:
        limit = (metadata_limit(step_bytes - e.size) if e.path == layout.DCP_METADATA else
                 MAX_TRAIN_STATE_BYTES if layout.rank_of_train_state(e.path) is not None else None)
        if limit is not None and e.size > limit:
            raise SaveFailed(f"{dir}: {e.path} is {e.size} bytes, over the {limit}-byte ceiling a load reads; nothing "
                             "was committed (save less per rank, or split the train state)")


__all__ = ["LockBody", "MAX_LOCK_BYTES", "Plan", "StepCommit"]
