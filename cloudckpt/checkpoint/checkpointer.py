"""The Checkpointer: save and load with the marker-last commit protocol.

Save, on every rank (collective steps in CAPITALS):

1. PREPARE — rank 0 checks the step (committed? ``save_overwrite``? another save
   holding the lock?) and takes the step's lock with a conditional create; every
   rank creates its private (0700) work dir. Any failure reaches every rank.
2. WRITE — DCP writes this rank's shards into its work dir (DCP's own collectives
   plan the save and write ``.metadata`` on the coordinator); each file is handed
   to the transfer engine the moment it is closed, so writing and uploading
   overlap. The rank's train state is written and uploaded too.
3. UPLOAD — the rank waits for its uploads (CRC32C computed on the way), then
   uploads its manifest part (``manifest/rank{R}.json``: its files, sizes, CRC32Cs).
4. AGREE — every rank's outcome (its part's path, size and CRC32C, or its error)
   goes to rank 0 (a gather: no rank receives another's manifest). If any rank
   failed, every rank raises one SaveFailed naming each rank's error, no marker is
   written, and rank 0 removes what the attempt uploaded.
5. COMMIT — only now rank 0 writes ``.metadata.json`` (the step header and the
   parts with their sizes and CRC32Cs) with a conditional create.
   It runs last because a reader treats "marker exists" as "every object of the
   step is uploaded"; writing it any earlier would let a reader (a resuming job)
   load a step whose shards are still in flight.
6. The work dir is removed on every path (try/finally).

The storage requests of steps 1, 3 (the part), 5 and of a failed attempt's cleanup are
``commit.StepCommit``'s; this module writes the files and runs the collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import dist
from .._torch_compat import caching_save_planner
from ..collector import collector_paused
from ..config import CheckpointerOptions
from ..dcp import StreamingReader, UploadingWriter, planned_load
from ..dcp import index as dcp_index
from ..dcp.load_guard import KeyCheckingPlanner as _KeyCheckingPlanner
from ..errors import (
    CloudCkptError,
    CorruptCheckpoint,
    SaveFailed,
)
from ..storage import Location, StorageOptions, Where, resolve_step_dir
from ..storage import url as urls
from ..storage.nofollow import private_dir
from ..transfer import TransferEngine
from ..untrusted import MAX_TRAIN_STATE_BYTES, load_plain, read_checked
from . import discovery, layout, step_files
from .async_save import AsyncSaver
from .commit import StepCommit
from .marker import Marker, ObjectEntry, PartRef, split_by_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Report:
    """What a rank tells the coordinator at AGREE: its part's reference (None when it
    wrote nothing) and the step's own files it wrote (rank 0: DCP's ``.metadata``)."""

    part: PartRef | None
    shared: tuple


def _shard_manifest(manifest: "discovery.StepManifest", rels) -> tuple[dict, dict]:
    """``(checksums, sizes)`` of the files ``rels`` under ``model_and_optim/`` a rank's
    load plan reads, from the parts that list them (read and checked on first use)."""
    prefix = layout.MODEL_DIR + "/"
    entries = manifest.entries(prefix + r for r in rels)
    sums = {}
    for path, o in entries.items():
        d = sums[path[len(prefix):]] = {(c[0], c[1]): c[2] for c in o.chunks}
        if o.crc32c:
            d[(0, o.size)] = o.crc32c
    return sums, {path[len(prefix):]: o.size for path, o in entries.items()}


@dataclass
class _Selected:
    """What a rank's load plan reads of a step with the DCP index (``_index_select``)."""

    header: Any  # dcp_index.Header
    wanted: dict
    needs: dict
    owners: set  # the ranks whose index parts hold the chunks selected
    writers: set  # the ranks whose manifest parts this rank's load reads (index parts, items' CRC32Cs, train state)


def _parse_header(step: Location, marker: Marker, header: "bytes | dcp_index.Header") -> "dcp_index.Header":
    """The step's DCP index header, checked (``header``: its bytes, or a header parsed already)."""
    if isinstance(header, dcp_index.Header):
        return header
    return step_files.parse_index_header(step, marker, header)


def _index_select(step: Location, marker: Marker, header_bytes: "bytes | dcp_index.Header", flat_sd: dict, *,
                  train_state_rank: int):
    """This rank's selection from the step's DCP index: the chunks its shards overlap
    and the ranks whose manifest parts its load reads. Not collective."""
    from .._torch_compat import flatten_for_load

    header = _parse_header(step, marker, header_bytes)
    wanted = dcp_index.wanted_boxes(flatten_for_load(flat_sd))
    needs, owners = dcp_index.select(header, wanted)
    writers = owners | dcp_index.writers_read(header, needs, wanted) | {train_state_rank}
    return _Selected(header, wanted, needs, owners, writers)


def _index_metadata(step: Location, manifest: "discovery.StepManifest", sel: _Selected, *, verify: bool,
                    pace: Callable[[str], Any] | None = None):
    """The DCP ``Metadata`` this rank plans its load against, from the step's DCP index:
    only the chunks its shards overlap, from the index parts of the ranks that wrote
    them (read concurrently, each checked against its manifest part)."""
    from concurrent.futures import ThreadPoolExecutor

    rels = {r: layout.index_part_name(r) for r in sorted(sel.owners)}
    entries = manifest.entries(rels.values())

    def read(rank: int) -> dict:
        rel = rels[rank]
        url = step.join(rel).url
        if rel not in entries:
            raise CorruptCheckpoint(f"{url}: the DCP index places chunks on rank {rank}, whose manifest lists no index "
                                    "part; the step is damaged: load an older step")
        if pace is not None:
            pace(url)
        data = read_checked(step.store, url, entries[rel], limit=dcp_index.MAX_INDEX_BYTES, what="DCP index part",
                            verify=verify)
        return dcp_index.parse_part(data, url=url, rank=rank)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(rels)))) as pool:
        parts = dict(zip(rels, pool.map(read, rels), strict=True))
    return dcp_index.build_metadata(sel.header, sel.needs, parts, sel.wanted)


@dataclass(frozen=True)
class LoadInfo:
    """What the last :meth:`Checkpointer.load` (or ``load_with``) of this rank did:
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


@dataclass(frozen=True)
class SaveStats:
    """What the last committed :meth:`Checkpointer.save` did: ``Checkpointer.last_save_stats``
    (None before the first; a failed save leaves the previous one).

    Attributes:
        step: the step number committed.
        seconds: from PREPARE to the marker written.
        bytes: bytes the step holds (every object, the marker's ``total_bytes``).
        objects: objects the step holds.
        retries: engine-level re-attempts of transfers so far (the engine's counter,
            over the Checkpointer's life).
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


@dataclass
class _RankOutcome:
    objects: list  # [ObjectEntry]
    bytes: int
    seconds: float


class Checkpointer:
    """Save and load checkpoints to a local folder, ``s3://`` or ``gs://``.

    Create it on every rank at the same point, with the same settings (it creates a
    dedicated gloo group when torch.distributed is initialised). ``dir`` arguments are
    step folders: ``{save_folder}/step{N}``.

    Args:
        options: every setting in one :class:`~cloudckpt.config.CheckpointerOptions`
            (None: the defaults).
        progress: called with the number of bytes moved since the last call, from the
            transfer threads (a progress bar).
        distributed: False: this process acts alone even when torch.distributed is
            initialised (no collectives; every process saves or loads by itself).
        **settings: fields of :class:`~cloudckpt.config.CheckpointerOptions` by name,
            each replacing the one in ``options``: ``Checkpointer(work_dir="/scratch")``.

    Raises:
        ConfigError: a setting not allowed (naming it, the value and what is allowed).
        TypeError: a keyword argument that is not a setting.

    Attributes:
        options: the settings (a ``CheckpointerOptions``).
        last_load_info: a :class:`LoadInfo` of this rank's last load (None before one).
        last_save_stats: a :class:`SaveStats` of the last committed save (None before one).
        coord: the coordinator of the checkpointer's collectives (rank, world size).
        engine: the transfer engine (``engine.stats()``: its counters).
    """

    def __init__(self, options: CheckpointerOptions | None = None, *, progress: Any = None, distributed: bool = True,
                 **settings: Any):
        if options is not None and not isinstance(options, CheckpointerOptions):
            raise TypeError(f"Checkpointer(options=...) takes a CheckpointerOptions, got {type(options).__name__}")
        if settings:
            known = {f.name for f in dataclasses.fields(CheckpointerOptions)}
            unknown = sorted(set(settings) - known)
            if unknown:
                raise TypeError(f"Checkpointer() got unknown setting(s) {unknown}; the settings are "
                                f"{', '.join(sorted(known))} (CheckpointerOptions), progress and distributed")
            options = dataclasses.replace(options or CheckpointerOptions(), **settings)
        self.options: CheckpointerOptions = options or CheckpointerOptions()
        self.coord = dist.Coordinator(timeout=self.options.collective_timeout, local=not distributed)
        self.engine = TransferEngine(self.options.transfer, storage_options=self.options.storage_options,
                                     progress=progress, world_size=self.coord.world_size)
        self.last_save_stats: SaveStats | None = None
        self.last_load_info: LoadInfo | None = None
        self._index_cache: dict = {}  # the DCP index's layouts, kept across saves (dcp/index.header_bytes)
        self._metadata_cache: str | None = None  # rank 0: its last DCP .metadata, for a repeated save (dcp/writer.py)
        # rank 0: (URL, CRC32C, local file identity) of the last DCP .metadata it sent
        self._metadata_sent: tuple[str, str, tuple] | None = None
        self._async = AsyncSaver(self._save_now, max_in_flight=self.options.max_in_flight)

    @property
    def work_dir(self) -> str:
        """``options.work_dir``: the local scratch folder."""
        return self.options.work_dir

    @property
    def storage_options(self) -> StorageOptions:
        """``options.storage_options``: how the stores are reached."""
        return self.options.storage_options

    # ================================================================ save
    def save_async(self, dir: str, state_dict: dict, train_state: Any = None, *, ephemeral: bool = False,
                   step: int | None = None, commit: bool = True) -> Future:
        """Stage ``state_dict`` and ``train_state`` in host memory, then save in the
        background; returns a Future of the Marker. Collective (call on every rank).
        Waits while ``max_in_flight`` saves are in flight; raises here the error of
        an earlier async save that failed and was not reported yet.

        ``commit=False``: the Future holds a :class:`PendingCommit` once everything is
        uploaded and agreed; the caller commits it (``.commit()``), in its own order,
        and gets the save's error from the Future (it is not raised again later)."""
        return self._async.submit(dir, state_dict, train_state, ephemeral, step, commit=commit)

    def _run_async(self, fn: Callable[[dict, Any], Any], state_dict: dict, train_state: Any = None) -> Future:
        """Like :meth:`save_async` for another collective writer (the node-local tier):
        stage ``state_dict`` and ``train_state`` in host memory, then run ``fn(staged,
        train_state)`` in order with the other async saves."""
        return self._async.submit_call(fn, state_dict, train_state)

    def in_flight(self) -> list[Future]:
        """The Futures of async saves staged or running, oldest first."""
        return self._async.in_flight()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for in-flight async saves; raise the first failure not reported yet."""
        self._async.wait(timeout)

    def save(self, dir: str, state_dict: dict, train_state: Any = None, *, ephemeral: bool = False,
             step: int | None = None, commit: bool = True) -> "Marker | PendingCommit":
        """Save ``state_dict`` (DCP) and this rank's ``train_state`` to the step folder
        ``dir`` and commit it, after any in-flight async saves finish. Collective: call
        on every rank. ``last_save_stats`` (a :class:`SaveStats`) tells what it did.

        Args:
            dir: the step folder, ``{save_folder}/step{N}``.
            state_dict: the model/optimizer state (tensors, DTensors, plain values).
            train_state: this rank's picklable extras (plain data), loaded back by ``load``.
            ephemeral: mark the step ephemeral (retention keeps fewer of them).
            step: the step number, for a ``dir`` not named ``step{N}`` (integrations with
                their own naming).
            commit: False stops once everything is uploaded and agreed and returns a
                :class:`PendingCommit`: nothing is visible to readers until its
                ``commit()`` writes the marker.

        Returns:
            The marker as written (every rank gets rank 0's), or a PendingCommit.

        Raises:
            CheckpointExists: the step is committed and ``save_overwrite`` is off.
            SaveInProgress: another save holds the step's lock.
            SaveFailed: a rank failed; nothing was committed (the message names each
                rank's error).
            NotACheckpoint: ``dir`` is not named ``step{N}`` and no ``step`` is given.
            StorageError: the store's errors.
        """
        self._async.wait()
        with collector_paused():  # blocking: training waits anyway (async saves do not pause it)
            return self._save_now(dir, state_dict, train_state, ephemeral=ephemeral, step=step, commit=commit)

    def _save_now(self, dir: str, state_dict: dict, train_state: Any = None, *, ephemeral: bool = False,
                  step: int | None = None, commit: bool = True) -> "Marker | PendingCommit":
        """:meth:`save` without waiting for async saves (the async saver's thread runs it).
        The marker returned names the ranks' manifest parts by reference
        (``discovery.read_marker`` gives every object). ``commit=False`` stops after
        AGREE: the step's lock stays held until ``PendingCommit.commit()`` writes the
        marker (or ``abort()`` removes the upload); the Lightning async plugin's finalize
        commits from another thread that way."""
        return self._protocol(dir, step, ephemeral, commit,
                              lambda dir, work: self._write_and_upload(dir, work, state_dict, train_state))

    def _persist_files(self, dir: str, files: Sequence[tuple[str, ObjectEntry]], *, ephemeral: bool = False,
                       step: int | None = None) -> Marker:
        """Commit the step folder ``dir`` from files already written: every rank passes
        its own ``(local path, ObjectEntry)`` pairs (a part of a local step, with the
        sizes and CRC32Cs taken when it was written); they are uploaded as they are (no
        second serialization) and committed with the usual protocol (lock, AGREE,
        marker last). Collective. Raises as :meth:`save`."""
        return self._protocol(dir, step, ephemeral, True, lambda dir, work: self._upload_files(dir, files),
                              needs_work=False)

    def _write_local(self, folder: str, state_dict: dict, train_state: Any = None) -> list[ObjectEntry]:
        """Write this rank's part of a step into the (new or empty) local folder ``folder`` (DCP
        shards under ``model_and_optim/``, rank 0 also its ``.metadata``; the train state
        under ``train/``) and keep it there: nothing is uploaded. Collective. Returns this
        rank's entries (size and CRC32C of every file and DCP item). Raises SaveFailed on
        every rank if any rank failed (the caller removes the folders)."""
        os.makedirs(folder, exist_ok=True)
        outcome = self._write_and_upload(None, folder, state_dict, train_state)
        self.coord.to_coordinator("agree", lambda: outcome.result() and None, error=SaveFailed.from_failures)
        return list(outcome.result().objects)

    def _protocol(self, dir: str, step: int | None, ephemeral: bool, commit: bool, produce, *,
                  needs_work: bool = True) -> "Marker | PendingCommit":
        """The commit protocol (``commit.StepCommit``) around ``produce(dir, work_dir)``,
        which writes and uploads this rank's objects and returns their outcome:
        PREPARE, AGREE, COMMIT (marker last); ABORT on any failure after PREPARE."""
        step = layout.parse_step_dir(dir) if step is None else int(step)
        dir = resolve_step_dir(dir)  # the user's own links above the step: followed once, here
        # every rank builds the same attempt: the coordinator's save id travels with PREPARE
        attempt = StepCommit(self._at(dir), step=step, save_id=uuid.uuid4().hex, world_size=self.coord.world_size,
                             save_overwrite=self.options.save_overwrite,
                             stale_lock_seconds=self.options.stale_lock_seconds)
        t0 = time.monotonic()
        work = None
        try:
            def prepare() -> str:
                attempt.prepare()
                return attempt.save_id

            def make_work_dir():
                nonlocal work
                work = private_dir(self.work_dir, f"step{step}-rank{self.coord.rank}-")  # 0700, never through a link

            self._connect_in_background(dir)
            attempt.save_id = self.coord.on_coordinator("prepare", prepare)
            if needs_work:
                self.coord.all_ranks("work dir", make_work_dir, error=SaveFailed.from_failures)
            outcome = produce(dir, work)
            rank = self.coord.rank

            def report() -> _Report:
                res = outcome.result()  # this rank's error, if any
                try:
                    own, shared = split_by_rank(res.objects, rank)
                except ValueError as e:
                    raise SaveFailed(f"{dir}: {e}") from None
                if shared and not self.coord.is_coordinator:
                    raise SaveFailed(f"{dir}: rank {rank} wrote {shared[0].path!r}; only rank 0 writes the step's "
                                     "own files")
                if own:  # every rank publishes its part at once: paced like its data
                    self.engine.pace(urls.join(dir, layout.part_name(rank)), "write")
                return _Report(attempt.publish_part(rank, own) if own else None, tuple(shared))

            reports = self.coord.to_coordinator("agree", report, error=SaveFailed.from_failures)
            marker = None  # the coordinator's, until COMMIT hands it to every rank
            if reports is not None:
                marker = attempt.marker([r.part for r in reports if r.part is not None],
                                        [o for r in reports for o in r.shared], ephemeral=ephemeral,
                                        torch_version=torch.__version__)
            if not commit:
                pending = PendingCommit(self, attempt, marker)
                attempt = None  # the PendingCommit owns the lock (and the cleanup) from here
                return pending
            marker = self.coord.on_coordinator("commit", lambda: attempt.commit(marker))
            stats = self.engine.stats()
            self.last_save_stats = SaveStats(
                step=step, seconds=time.monotonic() - t0, bytes=marker.total_bytes, objects=marker.object_count,
                retries=stats.retries, sdk_retries=stats.sdk_retries, throttled=stats.throttled, stalls=stats.stalls)
            log.info("committed %s (%d objects, %.1f MB) in %.2fs", dir, marker.object_count, marker.total_bytes / 1e6,
                     self.last_save_stats.seconds)
            return marker
        except BaseException:
            if attempt is not None and attempt.locked:
                attempt.abort()
            raise
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)

    def _write_and_upload(self, dir: str | None, work: str, state_dict: dict, train_state: Any):
        """Write this rank's files and upload them (``dir`` None: keep them in ``work``,
        with their CRC32Cs); returns a callable outcome (raises this rank's error when
        called) so the AGREE step sees it."""
        t0 = time.monotonic()
        uploads: list = []  # (rel, local_path, checksums or None, future)

        def on_file(path: str, sums=None, same_as_last: bool = False) -> None:
            rel = os.path.relpath(path, work).replace(os.sep, "/")
            if dir is None:
                uploads.append((rel, path, sums, _kept(path, sums.crc32c if sums is not None else None)))
                return
            crc = sums.crc32c if sums is not None and self.engine.config.checksum else None
            fut = self._send(path, urls.join(dir, rel), rel, crc, sums.crc32c if sums is not None else None,
                             same_as_last=same_as_last)
            uploads.append((rel, path, sums, fut))

        writer = UploadingWriter(os.path.join(work, layout.MODEL_DIR), on_file, thread_count=self.options.thread_count,
                                 index_cache=self._index_cache, cache_dir=self._metadata_cache_dir)
        error: BaseException | None = None
        try:
            with _quiet_dcp():
                planner = caching_save_planner(f"{self.coord.world_size}:{self.coord.rank}")
                try:
                    dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=self.coord.group,
                             no_dist=self.coord.local)
                except BaseException:
                    writer.abandoned()
                    raise
                writer.completed()
            index_part = writer.write_index_part(self.coord.rank)
            if index_part is not None:
                on_file(index_part)
            if train_state is not None:
                path = os.path.join(work, layout.train_state_name(self.coord.rank))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(train_state, path)
                on_file(path)
        except BaseException as e:  # noqa: BLE001 - carried to every rank by AGREE
            error = _unwrap_dcp(e)
        entries = []
        try:
            results = TransferEngine.wait_all([f for *_, f in uploads])
            items = writer.manifest() if error is None else {}  # {shard file: ((offset, length, crc32c), ...)}
            for (rel, _path, _sums, _), res in zip(uploads, results, strict=True):
                in_model = rel.startswith(layout.MODEL_DIR + "/")
                chunks = items.get(rel[len(layout.MODEL_DIR) + 1:], ()) if in_model else ()
                entries.append(ObjectEntry(rel, res.size, res.crc32c, chunks))
        except BaseException as e:  # noqa: BLE001 - carried to every rank by AGREE
            for *_, f in uploads:
                f.cancel()
            # the uploads already running end first (each within the engine's time limits): the failed
            # attempt's cleanup then sees every object, and none lands after it
            wait([f for *_, f in uploads])
            error = error or e
        return _RankResult(entries, t0, error)

    def _upload_files(self, dir: str, files: Sequence[tuple[str, ObjectEntry]]):
        """Upload files written earlier, each checked against its entry's CRC32C."""
        t0 = time.monotonic()
        futures = [self._send(path, urls.join(dir, e.path), e.path, e.crc32c, e.crc32c) for path, e in files]
        error: BaseException | None = None
        try:
            for (path, e), res in zip(files, TransferEngine.wait_all(futures), strict=True):
                if res.size != e.size:
                    raise CorruptCheckpoint(f"{path}: {res.size} bytes uploaded, {e.size} were written; the local "
                                            "file changed since it was written")
        except BaseException as exc:  # noqa: BLE001 - carried to every rank by AGREE
            for f in futures:
                f.cancel()
            error = exc
        return _RankResult([e for _, e in files] if error is None else [], t0, error)

    # ================================================================ load
    def load(
        self,
        dir: str,
        state_dict: dict,
        *,
        load_optim_state: bool | None = None,
        load_trainer_state: bool | None = None,
        strict: bool = True,
        pre_download: bool | None = None,
        exclude_from_loading: Sequence[str] = (),
        model_only: bool = False,
        allow_partial: bool = False,
        before_read: Callable[[dict[str, list[tuple[int, int]]]], None] | None = None,
    ) -> Any:
        """Load the committed step ``dir`` into ``state_dict`` in place (resharding
        as needed) and return this rank's train state. Collective: call on every rank.

        Nothing is left behind silently: checkpoint keys the target does not ask for
        under ``model``, ``optim`` or a top-level key the target has raise
        KeysNotLoaded (use ``AppState``, or ``allow_partial``); other leftovers are
        logged. ``last_load_info`` (a :class:`LoadInfo`) tells what the load did,
        ``last_load_info.not_loaded`` the keys not loaded.

        Args:
            dir: the step folder, ``{save_folder}/step{N}`` (a URL or a local path).
            state_dict: what to load into: tensors (DTensors, sharded or not) are filled
                in place, other top-level values replaced.
            load_optim_state: False skips the top-level ``optim`` key; None loads it if
                the checkpoint has it; True requires it.
            load_trainer_state: False skips the train state (returns None); None loads it
                if present; True requires it (CorruptCheckpoint if missing).
            strict: False loads what exists instead of raising MissingKeys for keys of
                ``state_dict`` the checkpoint lacks.
            pre_download: download this rank's items to ``work_dir`` first instead of
                streaming them (None: ``options.pre_download``).
            exclude_from_loading: top-level keys of ``state_dict`` not loaded; they keep
                their current values (torchtitan's option).
            model_only: load only the top-level ``model`` key and no train state
                (returns None): a fresh run from a seed checkpoint.
            allow_partial: load what ``state_dict`` asks for and leave the checkpoint's
                other keys, instead of raising KeysNotLoaded.
            before_read: (advanced) called on every rank once the load is planned and
                before any shard is read, with ``{path under model_and_optim/: [(offset,
                length), ...]}``, the items this rank reads from storage itself: with
                ``load_exchange``, its share of the items several ranks need (peers send
                it the rest). The node-local tier fetches them from peer nodes there.

        Returns:
            This rank's train state (rank 0's when the world size changed), or None when
            not loaded or the step has none.

        Raises:
            ValueError: an excluded key is not in ``state_dict``; ``model_only`` without
                a ``model`` key or with ``load_trainer_state=True``.
            NotACheckpoint: ``dir`` holds no committed step.
            IncompatibleCheckpoint: a marker format this version cannot read.
            CorruptCheckpoint: a size or CRC32C that does not match the manifest, naming
                the object; a required train state missing.
            UnsafeCheckpoint: a checkpoint that tries to run code or escape its folder.
            MissingKeys: keys of ``state_dict`` not in the checkpoint (``strict``).
            KeysNotLoaded: checkpoint keys the target did not ask for (``allow_partial``).
            ShapeMismatch: a tensor of another shape or dtype than saved.
            ExchangeFailed: a peer failed during the read-once exchange (``load_exchange``).
            StorageError: the store's errors (NotFound, AccessDenied, Timeout...).
        """
        unknown = [k for k in exclude_from_loading if k not in state_dict]
        if unknown:
            raise ValueError(f"exclude_from_loading names keys that are not in the state dict: {unknown} "
                             f"(top-level keys are: {sorted(state_dict)})")
        if model_only:
            if "model" not in state_dict:
                raise ValueError(f"model_only=True needs a top-level 'model' key (got: {sorted(state_dict)})")
            if load_trainer_state:
                raise ValueError("model_only=True loads no train state: do not pass load_trainer_state=True")
            exclude_from_loading = [k for k in state_dict if k != "model"]
            load_trainer_state = False
        self._async.wait()
        dir = resolve_step_dir(dir)  # the user's own links above the step: followed once, here
        with collector_paused():
            return self._load_now(dir, state_dict, load_optim_state=load_optim_state,
                                  load_trainer_state=load_trainer_state,
                                  strict=strict, pre_download=pre_download, exclude_from_loading=exclude_from_loading,
                                  allow_partial=allow_partial, only="model" if model_only else None,
                                  before_read=before_read)

    def load_with(self, dir: str, build: Callable[[Any], dict], **load_kwargs: Any) -> tuple[dict, Any]:
        """Load a step whose shapes the caller does not know: into the state dict
        ``build(metadata)`` makes from a DCP ``Metadata`` of the step, e.g. empty tensors
        of every saved shape. Collective. The Lightning and OLMo-core integrations load
        this way.

        For a step with the DCP index (every step this library writes), ``metadata`` is
        built from the index header, which every rank already gets for its load: every
        key, each tensor's dtype and size, but no chunks and no storage (those grow with
        the job's ranks; the load plans from the index as :meth:`load` does). A step
        without the index (written by another tool) gives its whole ``.metadata``.

        Args:
            dir: the step folder.
            build: called with that ``torch.distributed.checkpoint.Metadata``; returns
                the state dict to load into.
            **load_kwargs: as for :meth:`load` (``load_trainer_state``, ``strict``...).

        Returns:
            ``(state_dict, train_state)``; raises what :meth:`load` raises.
        """
        self._async.wait()
        dir = resolve_step_dir(dir)
        self._connect_in_background(dir)
        read = self._shared_read(dir)
        marker, header, metadata = read
        if header is not None:
            header = _parse_header(self._at(dir), marker, header)
            dcp_index.check_tensor_bytes(header, marker.total_bytes)  # build allocates what the header says
            shapes = dcp_index.build_metadata(header, {}, {}, {})  # keys, dtypes, sizes: no chunks, no storage
            read = (marker, header, None)
        else:
            shapes = step_files.parse_metadata(self._at(dir), marker, metadata)  # parts' sizes: checked per rank
        state_dict = build(shapes)
        opts = dict(load_optim_state=None, load_trainer_state=None, strict=True, pre_download=None,
                    exclude_from_loading=(), allow_partial=False)
        opts.update(load_kwargs)
        with collector_paused():
            train_state = self._load_now(dir, state_dict, read=read, **opts)
        return state_dict, train_state

    def _load_now(self, dir: str, state_dict: dict, *, load_optim_state: bool | None, load_trainer_state: bool | None,
                  strict: bool, pre_download: bool | None, exclude_from_loading: Sequence[str],
                  allow_partial: bool = False, only: str | None = None,
                  read: tuple[Marker, Any, bytes | None] | None = None,  # (marker, index header, .metadata)
                  before_read: Callable[[dict[str, list[tuple[int, int]]]], None] | None = None) -> Any:
        if read is None:
            self._connect_in_background(dir)
            read = self._shared_read(dir)
        marker, index_header, metadata = read
        sd = {k: v for k, v in state_dict.items() if k not in exclude_from_loading}
        skipped = set(exclude_from_loading)
        if load_optim_state is False:
            sd.pop("optim", None)
            skipped.add("optim")
        optional = ("optim.",) if load_optim_state is None else ()
        manifest = discovery.StepManifest(self._at(dir), marker, pace=self.engine.pace)  # parts: paced like data
        checksums = step_files.item_checksums(marker)  # format 2: the parts the plan needs add theirs
        pre = self.options.pre_download if pre_download is None else pre_download
        local = None
        try:
            if pre:
                local = private_dir(self.work_dir, f"load-rank{self.coord.rank}-")  # 0700, never through a link
            model_url = urls.join(dir, layout.MODEL_DIR)
            store = self._at(model_url).store
            reader = StreamingReader(
                model_url,
                self.engine.submit_stream,
                get_bytes=store.get_bytes,
                checksums=checksums,
                verify=self.options.verify_checksums,
                local_dir=local,
                metadata_bytes=metadata,
                streamed=store.streams_ranges,
                files=marker.sizes_under(layout.MODEL_DIR),  # every item of .metadata must lie in one
                manifest=(lambda rels: _shard_manifest(manifest, rels)) if marker.parts else None,
                # read-once: items several ranks need are read by one (dcp/exchange.py); collective
                exchange=self.coord if self.options.load_exchange else None,
            )
            planner = _KeyCheckingPlanner(strict=strict, optional_prefixes=optional, url=model_url, step_url=dir,
                                          allow_partial=allow_partial, skipped=skipped, only=only)

            selected: list[_Selected] = []

            def prepare(flat_sd: dict):
                ts_rank = self.coord.rank if self.coord.world_size == marker.world_size else 0
                selected.append(_index_select(self._at(dir), marker, index_header, flat_sd, train_state_rank=ts_rank))
                return lambda: self._fetch_part_refs(marker, selected[0].writers)

            def metadata_for(flat_sd: dict):
                if index_header is None:  # a step without the DCP index (foreign, or older): its whole .metadata
                    return reader.read_metadata()
                return _index_metadata(self._at(dir), manifest, selected[0], verify=self.options.verify_checksums,
                                       pace=self.engine.pace)

            with _quiet_dcp():
                planned_load.load(sd, reader=reader, planner=planner, coord=self.coord, metadata=metadata_for,
                                  before_read=before_read, prepare=prepare if index_header is not None else None)
            state_dict.update(sd)  # top-level non-tensor values are replaced, not filled in place
        finally:
            if local:
                shutil.rmtree(local, ignore_errors=True)
        self.last_load_info = LoadInfo(dir=dir, step=marker.step, saved_world_size=marker.world_size,
                                       bytes_read=reader.bytes_read, direct_items=reader.direct_items,
                                       not_loaded=planner.not_loaded, writer=marker.writer, verified=marker.verified,
                                       parts_read=manifest.parts_read)
        if load_trainer_state is False:
            return None
        return self._load_train_state(dir, manifest, required=bool(load_trainer_state))

    def read_train_state(self, dir: str) -> Any:
        """This rank's train state of the committed step ``dir`` (what ``load`` returns),
        without loading the model or optimizer; None if the step has none. Not
        collective (the Hugging Face integrations read it before loading the weights
        their own way).

        Raises:
            NotACheckpoint: ``dir`` holds no committed step.
            CorruptCheckpoint: the train state does not match its size or CRC32C.
            UnsafeCheckpoint: the train state would run code when unpickled.
        """
        dir = resolve_step_dir(dir)
        marker = discovery.read_header(self._at(dir))
        return self._load_train_state(dir, discovery.StepManifest(self._at(dir), marker), required=False)

    def _connect_in_background(self, dir: str) -> None:
        """On ranks other than rank 0, build the store's client while rank 0 reads the
        marker or takes the step's lock: they would wait anyway, and building boto3's
        client costs ~0.15-0.3 s of CPU (and, with the objects it leaves, a full GC of
        the process) that otherwise lands inside the load. A failure here is left to the
        first real request, which raises it with its URL."""
        if self.coord.is_coordinator:
            return

        def connect() -> None:
            with contextlib.suppress(Exception):
                self._at(dir).store.connect()

        threading.Thread(target=connect, name="cloudckpt-connect", daemon=True).start()

    def _shared_read(self, dir: str) -> tuple[Marker, bytes | None, bytes | None]:
        """Rank 0 reads the marker and what every rank plans against
        (``_read_marker_and_metadata``) and hands it to every rank; for a step with the
        DCP index, with the marker's part references withheld: each rank then fetches
        the ones its plan reads (``_fetch_part_refs``), so what a rank receives does not
        grow with the job's ranks. Rank 0 keeps them all."""
        mine: list = []

        def read():
            mine.append(self._read_marker_and_metadata(dir))
            marker, header, metadata = mine[0]
            return (marker.withholding_parts(), header, metadata) if header is not None and marker.parts else mine[0]

        shared = self.coord.on_coordinator("read marker", read)
        return mine[0] if mine else shared

    def _fetch_part_refs(self, marker: Marker, ranks: set[int]) -> None:
        """Collective: each rank's withheld marker gets the part references of ``ranks``
        from rank 0 (one gather and one scatter of a few integers per reference)."""
        from .marker import WithheldParts, decode_refs, encode_refs

        withheld = isinstance(marker.parts, WithheldParts)
        got = self.coord.ask_coordinator("part refs", sorted(ranks) if withheld else [],
                                         lambda asked: [encode_refs(marker, rs) for rs in asked])
        if withheld:
            marker.parts.add(decode_refs(got))

    def _read_marker_and_metadata(self, dir: str) -> tuple[Marker, bytes | None, bytes | None]:
        """Rank 0 reads the marker and what every rank plans its load against, once for
        every rank: ``(marker, the DCP index's header, None)`` for a step that has the
        index (dcp/index.py), else ``(marker, None, DCP's .metadata)`` (DCP would have
        each rank GET ``.metadata``, whose size grows with ranks x tensors). ``.metadata``
        is None if it is not in the manifest: each rank's reader then reports it. The
        bytes are checked against the manifest before they travel."""
        step = self._at(dir)
        marker = discovery.read_header(step)  # format 2: the ranks' parts are read by the ranks that need them
        if not marker.verified:
            # a foreign step: sizes from one listing bound every read; no CRC32C to check
            log.warning("loading %s, written by %s without a manifest: sizes are checked, checksums cannot be "
                        "(run `cloudckpt adopt %s --yes` to record them)", dir, marker.writer, dir)
        # the index of our own steps only: a step another tool wrote (sizes from a listing) plans from .metadata
        entry = None if not marker.verified else marker.object(layout.INDEX_HEADER)
        if entry is not None:
            url = step.join(layout.INDEX_HEADER).url
            return marker, read_checked(step.store, url, entry, limit=dcp_index.MAX_INDEX_BYTES, what="DCP index",
                                        verify=self.options.verify_checksums), None
        return marker, None, step_files.metadata_bytes(step, marker, verify=self.options.verify_checksums)

    def _load_train_state(self, dir: str, manifest: "discovery.StepManifest", *, required: bool) -> Any:
        marker = manifest.marker
        rank, ws = self.coord.rank, self.coord.world_size
        rel = layout.train_state_name(rank)
        if ws != marker.world_size:
            rel = layout.train_state_name(0)
            log.warning("world size changed (%d saved, %d now): rank %d loads the train state of rank 0 (%s)",
                        marker.world_size, ws, rank, urls.join(dir, rel))
        entry = manifest.entry(rel)
        if entry is None:
            if required:
                raise CorruptCheckpoint(f"{urls.join(dir, rel)}: the train state file is not in this checkpoint; "
                                        "save a "
                                        "train state or pass load_trainer_state=None")
            return None
        url = urls.join(dir, rel)
        self.engine.pace(url)  # every rank reads its train state at once: paced like its data
        data = read_checked(self._at(dir).store, url, entry, limit=MAX_TRAIN_STATE_BYTES, what="train state",
                            verify=self.options.verify_checksums)
        return load_plain(data, url=url, what="train state")

    # ================================================================ discovery
    # Public entry points: a URL or path with optional StorageOptions (or a Location).
    @staticmethod
    def find_checkpoints(folder: Where, ephemeral: bool | None = None, *,
                         storage_options: StorageOptions | None = None) -> Iterator[tuple[int, str]]:
        return discovery.find_checkpoints(Location.of(folder, storage_options), ephemeral)

    @staticmethod
    def latest_checkpoint(folder: Where, *, storage_options: StorageOptions | None = None) -> str:
        return discovery.latest_checkpoint(Location.of(folder, storage_options))

    @staticmethod
    def dir_is_checkpoint(dir: Where, *, storage_options: StorageOptions | None = None) -> bool:
        return discovery.dir_is_checkpoint(Location.of(dir, storage_options))

    @staticmethod
    def contains_checkpoint(folder: Where, *, storage_options: StorageOptions | None = None) -> bool:
        return discovery.contains_checkpoint(Location.of(folder, storage_options))

    def _at(self, url: str) -> Location:
        """``url`` with this checkpointer's storage options."""
        return Location.of(url, self.storage_options)

    def _metadata_cache_dir(self) -> str:
        """Rank 0's folder for the last DCP ``.metadata`` it wrote (made at first use, in
        ``work_dir``, 0700; removed by :meth:`close`)."""
        if self._metadata_cache is None:
            self._metadata_cache = private_dir(self.work_dir, "dcp-metadata-")
        return self._metadata_cache

    def _send(self, path: str, url: str, rel: str, crc: str | None, own_crc: str | None, *,
              same_as_last: bool = False):
        """Upload the step file ``path`` to ``url`` (``crc``: its CRC32C, checked by the
        transfer; ``own_crc``: its CRC32C whatever the checksum setting). DCP's
        ``.metadata`` with the bytes of the last one this rank sent (the writer says so,
        ``same_as_last``, or it is the same file on disk: a local step's link to it) is
        copied server-side from where that one went (``TransferEngine.submit_copy_or_upload``):
        rank 0 of a large job does not send the same ~GB at every save."""
        if rel != layout.DCP_METADATA or own_crc is None:
            return self.engine.submit_upload(path, url, crc32c=crc)
        ident = _file_identity(path)
        sent = self._metadata_sent
        if sent is not None and sent[1] == own_crc and (same_as_last or sent[2] == ident):
            fut = self.engine.submit_copy_or_upload(sent[0], path, url, crc32c=crc)
        else:
            fut = self.engine.submit_upload(path, url, crc32c=crc)
        fut.add_done_callback(lambda f: self._metadata_put(url, own_crc, ident, f))
        return fut

    def _metadata_put(self, url: str, crc32c: str, ident: tuple, fut) -> None:
        """A ``.metadata`` upload (or copy) ended: remember where its bytes are, so that a
        repeated save whose ``.metadata`` has the same bytes copies it server-side. A step
        aborted later loses it: the next copy finds it gone and uploads (engine)."""
        if not fut.cancelled() and fut.exception() is None:
            self._metadata_sent = (url, crc32c, ident)

    def close(self) -> None:
        """Wait for in-flight async saves (raising an unreported failure), then release resources."""
        try:
            self._async.close()
        finally:
            self.engine.close()
            if self._metadata_cache is not None:
                shutil.rmtree(self._metadata_cache, ignore_errors=True)
                self._metadata_cache = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _file_identity(path: str) -> tuple:
    """What makes two names one file whose bytes did not change: a hard link of it (the
    writer links a reused ``.metadata``, never writes one in place)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class PendingCommit:
    """A save that is uploaded and agreed on but not committed: ``save(..., commit=False)``.
    ``marker`` is the marker to be written on rank 0 (None on other ranks until
    ``commit()`` returns it).

    Until ``commit()`` or ``abort()`` runs, the step is invisible to readers (no
    marker) and its lock is held (another save of the step raises SaveInProgress
    until the lock is ``stale_lock_seconds`` old). Both are collective like save:
    call them on every rank of the checkpointer, once.
    """

    def __init__(self, checkpointer: "Checkpointer", attempt: StepCommit, marker: Marker):
        self._ckpt = checkpointer
        self._attempt = attempt
        self.dir = attempt.dir
        self.marker = marker

    def commit(self) -> Marker:
        """Write the marker (conditional create, stamped with the commit time) and
        release the lock. On failure nothing is committed and the upload is removed
        (best effort), as a failed ``save`` does. Raises CheckpointExists if another
        save committed the step meanwhile, storage errors."""
        import dataclasses

        def commit() -> Marker:
            return self._attempt.commit(dataclasses.replace(self.marker, created_unix=time.time()))

        try:
            self.marker = self._ckpt.coord.on_coordinator("commit", commit)
        except BaseException:
            self.abort()
            raise
        return self.marker

    def abort(self) -> None:
        """Best effort: remove what the save uploaded, unless it got committed."""
        if self._ckpt.coord.is_coordinator:
            self._attempt.abort()


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns that it runs without torch.distributed in single-process jobs; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class _RankResult:
    """A rank's outcome for AGREE: ``result()`` returns it or raises the rank's error."""

    def __init__(self, entries: list, t0: float, error: BaseException | None):
        self._value = _RankOutcome(entries, sum(e.size for e in entries), time.monotonic() - t0)
        self._error = error

    def result(self) -> _RankOutcome:
        if self._error is not None:
            raise self._error
        return self._value


def _kept(path: str, crc: str | None) -> Future:
    """A finished 'transfer' of a file kept where it was written (local steps)."""
    from ..transfer import TransferResult, crc32c_file

    if crc is None:
        crc = crc32c_file(path)
    fut: Future = Future()
    fut.set_result(TransferResult(url=path, local_path=path, size=os.path.getsize(path), crc32c=crc, attempts=0,
                                  seconds=0.0))
    return fut


def _unwrap_dcp(e: BaseException) -> BaseException:
    """DCP wraps per-rank errors in CheckpointException (a BaseException carrying
    ``{rank: (exception, traceback)}``); surface the first underlying error."""
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and isinstance(failures, dict) and failures:
        inner = [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())]
        typed = [x for x in inner if isinstance(x, CloudCkptError)]
        return typed[0] if typed else inner[0]
    return e
