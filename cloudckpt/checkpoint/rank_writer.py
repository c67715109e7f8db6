"""One rank's side of a save: write its files, hand each to the transfer engine the
moment it is closed, and report what it made.

``RankWriter.write`` runs DCP's save into the rank's work dir (DCP's own collectives
plan the save and write ``.metadata`` on the coordinator; ``dcp/writer.py``), then
the rank's DCP index part and its train state; ``RankWriter.upload`` sends files a
local step wrote earlier. Both return a :class:`RankResult`: the rank's entries (size,
CRC32C, item CRC32Cs of every object) or its error, for the save's AGREE step.

The writer keeps what a repeated save reuses, across saves: the DCP index's layouts,
rank 0's last ``.metadata`` (64 MiB or more, in a private folder of ``work_dir``),
and where rank 0 sent it, so that a repeated save copies an unchanged ``.metadata``
inside the store instead of sending it again (``TransferEngine.submit_copy_or_upload``).

After a load (``loaded``), the writer keeps the loaded step's structure
(checkpoint/structure.py): the saves that follow are planned from it while the state
keeps it (``_torch_compat.ResumedSavePlanner``: DCP's plan step carries a tag a rank, no
plan), and rank 0 copies the loaded ``.metadata`` inside the store when every rank's
write results are where the loaded step had them. A rank whose state changed makes
every rank's save, and those after it, plan as a first save does.

A job's first save (and the save that falls back from a loaded structure) on more than
one rank, to a store that assembles objects, is planned by owners
(``dcp/owners.py``): no rank gathers every rank's plan or write results. After DCP's
save, every rank (in this order, each step collective, each carrying every rank's error
to every rank): makes its ``.metadata`` fragment; ``assemble_store.assemble_in_store``
joins ``.metadata`` in the store from every rank's fragment (rank 0 begins and
completes it; its size and CRC32C go into rank 0's entries, as an uploaded
``.metadata``'s do); ``owners.index_header`` gives rank 0 the DCP index header from the
owners' records, which it writes and uploads. A state holding a chunk on several
ranks larger than ``MIN_PIECE_BYTES`` (DDP's, HSDP's tensors) is planned from every
rank's plan instead (``owners.SharedItemsTooLarge``, found by its owner before anything
is written): its holders then write it in pieces balanced by bytes
(``_torch_compat.balanced_dedup``); smaller replicated chunks go to a holder picked by a
hash of the key, values and chunks of at most ``SMALL_SHARED_BYTES`` to the lowest
holder, as ``balanced_dedup`` does. Once the step is committed
(``RankResult.committed``), each rank keeps what it planned and wrote
(:class:`SavedStructure`; rank 0 also the header and where ``.metadata`` is) and the
saves after it are planned from that, as after a load of the step: no plan gathered,
its ``.metadata`` copied in the store while the write results stay where they were.
Saves that cannot be planned by owners (one process, a caller's planner, a store that
cannot assemble objects) plan with DCP's plan cache (``caching_save_planner``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import CancelledError, Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from .._torch_compat import (
    MIN_PIECE_BYTES,
    SMALL_SHARED_BYTES,
    ResumedSavePlanner,
    ResumeMismatch,
    caching_save_planner,
)
from ..dcp import UploadingWriter
from ..dcp.assemble import TRAILER, header
from ..dcp.assemble_store import assemble_in_store
from ..dcp.owners import OwnersSavePlanner, SharedItemsTooLarge, fragment_of, index_header
from ..errors import CloudCkptError, CorruptCheckpoint, NotFound, PreconditionFailed
from ..options import CheckpointerOptions
from ..storage.nofollow import private_dir
from ..transfer import TransferEngine, TransferResult, crc32c_file
from . import layout
from .entries import ObjectEntry
from .step import StepRef
from .structure import LoadedStructure, SavedStructure

log = logging.getLogger(__name__)


@dataclass
class RankOutcome:
    """What one rank made: its objects' entries, their bytes, the seconds it took."""

    objects: list  # [ObjectEntry]
    bytes: int
    seconds: float


class RankResult:
    """A rank's outcome for AGREE: ``result()`` returns it or raises the rank's error.
    ``committed(step, marker)``: the save calls it on every rank once the step is
    committed (no collective; never raises)."""

    def __init__(self, entries: list, t0: float, error: BaseException | None,
                 on_commit: Callable[[StepRef, Any], None] | None = None):
        self._value = RankOutcome(entries, sum(e.size for e in entries), time.monotonic() - t0)
        self._error = error
        self._on_commit = on_commit if error is None else None

    def result(self) -> RankOutcome:
        if self._error is not None:
            raise self._error
        return self._value

    def committed(self, step: StepRef, marker: Any) -> None:
        if self._on_commit is not None:
            self._on_commit(step, marker)


class RankWriter:
    """Writes and uploads one rank's files of each save (see the module docstring)."""

    def __init__(self, coord: Any, engine: TransferEngine, options: CheckpointerOptions):
        self.coord, self.engine, self.options = coord, engine, options
        self._index_cache: dict = {}  # the DCP index's layouts, kept across saves (dcp/index.header_bytes)
        self._metadata_dir: str | None = None  # rank 0: its last DCP .metadata, for a repeated save (dcp/writer.py)
        # rank 0: (URL, CRC32C, file identity, the object's version as written) of the .metadata last sent
        self._metadata_sent: tuple[str, str, tuple, str] | None = None
        self._loaded: LoadedStructure | None = None  # the step this job loaded, while its structure holds
        self._planned = False  # a save planned with DCP's plan cache completed: the next ones plan with it

    #: A job's first save planned by owners (the module docstring); False: every rank's plan gathered on rank 0.
    owners_first_save = True
    #: The saves after one planned by owners are planned from its structure (False: by owners again).
    keep_saved_structure = True

    def loaded(self, committed: Any) -> None:
        """After a load of ``committed`` (a CommittedStep) on this rank: the saves that
        follow are planned from its structure while the state keeps it (module
        docstring of checkpoint/structure.py); a step of another world size, or without
        the DCP index, is not used."""
        try:
            self._loaded = LoadedStructure.of(committed, self.coord.rank, self.coord.world_size)
        except Exception as e:  # noqa: BLE001 - the load succeeded; its saves plan as a first save does
            log.warning("%s: its structure is not kept for the next saves (%s: %s); they plan every rank's items",
                        committed.step, type(e).__name__, e)
            self._loaded = None

    def write(self, step: StepRef | None, work: str, state_dict: dict, train_state: Any, *,
              planner: Any = None, flavour: type | None = None) -> RankResult:
        """Write this rank's files into ``work`` and upload each to ``step`` as it is
        closed (``step`` None: keep them in ``work``, with their CRC32Cs: a local step).
        ``planner``: DCP's save planner (None: ours). ``flavour``: with ``planner`` None, a
        mixin class put before each of our planners this save uses (owners', the kept
        structure's, the plan cache's), its methods first (the Megatron integration's:
        byte values written as they are, keys not flattened). Collective (DCP's save).
        Never raises: the error is in the result."""
        t0 = time.monotonic()
        uploads: list = []  # (rel, future)
        on_commit = None  # a save planned by owners: keep the step's structure once it is committed

        def on_file(path: str, sums=None, same_as_last: bool = False, copy_of: LoadedStructure | None = None) -> None:
            rel = os.path.relpath(path, work).replace(os.sep, "/")
            own = sums.crc32c if sums is not None else None
            if copy_of is not None:  # the loaded step's .metadata, byte for byte: copied in the store
                uploads.append((rel, self._copy_loaded(copy_of, step.url_of(rel))))
            elif step is None:
                uploads.append((rel, _kept(path, own)))
            else:
                crc = own if self.engine.config.checksum else None
                uploads.append((rel, self._send(path, step, rel, crc, own, same_as_last=same_as_last)))

        writer: UploadingWriter | None = None
        error: BaseException | None = None
        try:
            self._agree_on_kept(step, planner)
            owned = _flavoured(self._owners_planner(step, planner), flavour)
            loaded = self._loaded if owned is None and planner is None and step is not None else None
            writer = self._writer(work, on_file, loaded, owned is not None)
            with quiet_dcp():
                chosen = owned or (planner if loaded is None else
                                   _flavoured(ResumedSavePlanner(loaded.final_plan, self.coord), flavour))
                while True:
                    try:
                        self._dcp_save(writer, state_dict, chosen, flavour)
                        break
                    except BaseException as e:
                        why = _unwrap_dcp(e)
                        # every rank got it, nothing was written yet. ResumeMismatch: every rank saves as a
                        # first save, now and from now on. SharedItemsTooLarge: from every rank's plan, the
                        # replicated items balanced over their holders (the plan cached for later saves)
                        if isinstance(why, ResumeMismatch) and isinstance(chosen, ResumedSavePlanner):
                            self._loaded = None
                            owned = _flavoured(self._owners_planner(step, planner), flavour)
                        elif isinstance(why, SharedItemsTooLarge) and chosen is owned is not None:
                            owned = None
                        else:
                            raise
                        log.info("%s: %s; planning this save %s", step, why,
                                 "by owners" if owned is not None else "from every rank's plan")
                        chosen = owned or planner
                        writer = self._writer(work, on_file, None, owned is not None)
            if isinstance(chosen, ResumedSavePlanner):  # every rank: .metadata and the header placed by rank 0
                writer.finish_kept(self.coord)
            if owned is not None:
                header_bytes = self._assemble(step, writer, owned, uploads)
                on_commit = lambda ref, marker: self._keep_saved(ref, marker, owned, writer.results,  # noqa: E731
                                                                 header_bytes)
            index_part = writer.write_index_part(self.coord.rank)
            if index_part is not None:
                on_file(index_part)
            if train_state is not None:
                path = os.path.join(work, layout.train_state_name(self.coord.rank))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(train_state, path)
                on_file(path)
        except BaseException as e:  # noqa: BLE001 - carried to every rank by AGREE
            # a peer gone in DCP's collectives: PeerLost naming them, not gloo's RuntimeError
            error = self.coord.lost_in_dcp(e, where=step.url if step is not None else None) or _unwrap_dcp(e)
        futures = [f for _, f in uploads]
        entries = []
        try:
            results = TransferEngine.wait_all(futures)
            # {shard file: ((offset, length, crc32c), ...)}
            items = writer.manifest() if error is None and writer is not None else {}
            for (rel, _), res in zip(uploads, results, strict=True):
                in_model = rel.startswith(layout.MODEL_DIR + "/")
                chunks = items.get(rel[len(layout.MODEL_DIR) + 1:], ()) if in_model else ()
                entries.append(ObjectEntry(rel, res.size, res.crc32c, chunks))
        except BaseException as e:  # noqa: BLE001 - carried to every rank by AGREE
            _cancel(futures)
            error = error or e
        return RankResult(entries, t0, error, on_commit)

    def _keep_saved(self, step: StepRef, marker: Any, owned: OwnersSavePlanner, results: list,
                    header_bytes: bytes | None) -> None:
        """Every rank, once a save planned by owners is committed: the saves that follow
        are planned from its structure (:class:`SavedStructure`), as after a load of it.
        Never raises: a rank that cannot keep it makes the next save plan by owners."""
        if not self.keep_saved_structure:
            return
        try:
            self._loaded = SavedStructure(step, marker, self.coord.rank, owned.local_plan.items, owned.owned.plan.items,
                                          results, header_bytes)
        except Exception as e:  # noqa: BLE001 - the step is committed; only how the next save plans changes
            log.warning("%s: its structure is not kept for the next saves (%s: %s)", step, type(e).__name__, e)
            self._loaded = None

    def _writer(self, work: str, on_file: Any, loaded: LoadedStructure | None, owners: bool = False) -> UploadingWriter:
        return UploadingWriter(os.path.join(work, layout.MODEL_DIR), on_file, thread_count=self.options.thread_count,
                               index_cache=self._index_cache, cache_dir=self._metadata_cache_dir, loaded=loaded,
                               owners=owners)

    def _agree_on_kept(self, step: StepRef | None, planner: Any) -> None:
        """Every rank plans this save from its kept structure (loaded, or saved by owners)
        or none does: a save planned from one runs DCP with no collective, any other with
        DCP's, so ranks that disagree (one could not keep it) all drop it. One all_reduce
        of a byte, on every rank of a save with our planner to a step, on more than one
        rank (the same condition everywhere)."""
        if planner is None and step is not None and self.coord.world_size > 1:
            if self.coord.any_rank([self._loaded is None], "plan by owners or from the loaded step")[0]:
                self._loaded = None

    def _owners_planner(self, step: StepRef | None, planner: Any) -> OwnersSavePlanner | None:
        """The planner of a save planned by owners (the module docstring), or None where
        this save plans otherwise: a later save, a caller's planner, a local step, one
        process, a store that cannot assemble ``.metadata``, or the ranks keep a
        structure (:meth:`_agree_on_kept`: then planned from it). The same answer on
        every rank."""
        if (not self.owners_first_save or self._planned or planner is not None or step is None
                or self.coord.world_size < 2 or not step.store.assembles_objects or self._loaded is not None):
            return None
        return OwnersSavePlanner(self.coord, shared_limit=MIN_PIECE_BYTES, small=SMALL_SHARED_BYTES)

    def _assemble(self, step: StepRef, writer: UploadingWriter, owned: OwnersSavePlanner,
                  uploads: list) -> bytes | None:
        """Every rank, after DCP's save planned by owners: ``.metadata`` assembled in the
        store from every rank's fragment, then the DCP index header built on rank 0 from
        the owners' records, written and uploaded (the module docstring); the header's
        bytes on rank 0, None elsewhere. Collective; raises on every rank what any rank met."""
        coord, url = self.coord, step.url_of(layout.DCP_METADATA)
        def fragment() -> bytes:
            writer.raise_error()  # DCP ran with no collective: this rank's writes may have failed
            return fragment_of(owned.owned, writer.results)

        mine = coord.agree("the .metadata fragments of " + step.url, fragment)
        t0 = time.monotonic()
        info = assemble_in_store(coord, step.store, url, mine, trailer=TRAILER,
                                 header=header(planner_data=owned.flatten_state_dict, version=CURRENT_DCP_VERSION))
        if coord.is_coordinator:
            done: Future = Future()
            done.set_result(TransferResult(url=url, local_path=None, size=info.size, crc32c=info.crc32c, attempts=1,
                                           seconds=time.monotonic() - t0, version=info.version))
            uploads.append((layout.DCP_METADATA, done))
        got = index_header(coord, owned.owned, writer.results, dcp_version=CURRENT_DCP_VERSION)
        if got is not None:
            writer.put_index_header(got)
        return got

    def _dcp_save(self, writer: UploadingWriter, state_dict: dict, planner: Any, flavour: type | None = None) -> None:
        """DCP's save through ``writer`` (``planner`` None: ours, with DCP's plan cache,
        ``flavour`` put before it: ``write``). Collective."""
        if planner is None:
            key = f"{self.coord.world_size}:{self.coord.rank}" + (f":{flavour.__qualname__}" if flavour else "")
            planner = _flavoured(caching_save_planner(key), flavour)
        try:
            # planned by owners or from a kept structure: DCP's gathers of plans and of write results
            # would carry nothing the ranks cannot agree on by an all_reduce (its coordinator makes no
            # Metadata), so DCP runs with none (one barrier at its end)
            dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=self.coord.group,
                     no_dist=self.coord.local,
                     use_collectives=not isinstance(planner, (OwnersSavePlanner, ResumedSavePlanner)))
        except BaseException:
            writer.abandoned()
            raise
        writer.completed()
        # planned with DCP's plan cache: the next saves plan with it (one planned by owners or from a
        # loaded step leaves it empty: the next save that cannot follow a kept structure plans by owners)
        self._planned = self._planned or not isinstance(planner, (ResumedSavePlanner, OwnersSavePlanner))

    def _copy_loaded(self, loaded: LoadedStructure, url: str) -> Future:
        """Rank 0: the loaded step's ``.metadata`` put at ``url`` by a copy inside the store,
        from the newest copy this writer placed (its version as the store gave it), else
        from the loaded step itself; the size and CRC32C are the loaded step's manifest's.
        A copy that cannot be made fails the save, and the next save of every rank is
        planned whole (``loaded.usable``: the coordinator's plan step says so)."""
        entry, sources = loaded.metadata_entry, list(loaded.metadata_sources)
        out: Future = Future()
        out.set_running_or_notify_cancel()

        def attempt(i: int) -> None:
            src, version = sources[i]

            def done(f: Future) -> None:
                exc = CancelledError(f"{url}: cancelled") if f.cancelled() else f.exception()
                if exc is None:
                    loaded.placed(url, getattr(f.result(), "version", None))
                    out.set_result(f.result())
                elif i + 1 < len(sources) and isinstance(exc, (NotFound, PreconditionFailed)):
                    attempt(i + 1)  # that copy is gone or replaced (a step aborted after it): an older one
                else:
                    loaded.usable = False
                    out.set_exception(exc)

            try:
                self.engine.submit_copy(src, url, size=entry.size, crc32c=entry.crc32c, src_version=version,
                                        must_crc32c=entry.crc32c).add_done_callback(done)
            except BaseException as e:  # noqa: BLE001 - the engine closed meanwhile: handed to the future
                loaded.usable = False
                out.set_exception(e)

        attempt(0)
        return out

    def upload(self, step: StepRef, files: Sequence[tuple[str, ObjectEntry]]) -> RankResult:
        """Upload files written earlier (a local step's), each checked against its entry's
        CRC32C and size. Never raises: the error is in the result."""
        t0 = time.monotonic()
        futures = [self._send(path, step, e.path, e.crc32c, e.crc32c) for path, e in files]
        error: BaseException | None = None
        try:
            for (path, e), res in zip(files, TransferEngine.wait_all(futures), strict=True):
                if res.size != e.size:
                    raise CorruptCheckpoint(f"{path}: {res.size} bytes uploaded, {e.size} were written; the local "
                                            "file changed since it was written")
        except BaseException as exc:  # noqa: BLE001 - carried to every rank by AGREE
            _cancel(futures)
            error = exc
        return RankResult([e for _, e in files] if error is None else [], t0, error)

    def close(self) -> None:
        if self._metadata_dir is not None:
            shutil.rmtree(self._metadata_dir, ignore_errors=True)
            self._metadata_dir = None

    def _metadata_cache_dir(self) -> str:
        """Rank 0's folder for the last DCP ``.metadata`` it wrote (made at first use, in
        ``work_dir``, 0700; removed by :meth:`close`)."""
        if self._metadata_dir is None:
            self._metadata_dir = private_dir(self.options.work_dir, "dcp-metadata-")
        return self._metadata_dir

    def _send(self, path: str, step: StepRef, rel: str, crc: str | None, own_crc: str | None, *,
              same_as_last: bool = False) -> Future:
        """Upload the file ``path`` as the step's object ``rel`` (``crc``: its CRC32C,
        checked by the transfer; ``own_crc``: its CRC32C whatever the checksum setting).
        DCP's ``.metadata`` with the bytes of the last one this rank sent (the writer says
        so, ``same_as_last``, or it is the same file on disk: a local step's link to it)
        is copied server-side from where that one went: rank 0 of a large job does not
        send the same ~GB at every save. The copy's source must still be the object this
        rank wrote there (its version as the store gave it right after the write: S3 ETag,
        GCS generation; and the copy's CRC32C where the store reports it): one replaced
        since, by anyone, is never copied (the file is uploaded, with a warning)."""
        url = step.url_of(rel)
        if rel != layout.DCP_METADATA or own_crc is None:
            return self.engine.submit_upload(path, url, crc32c=crc)
        ident = _file_identity(path)
        sent = self._metadata_sent
        if sent is not None and sent[1] == own_crc and (same_as_last or sent[2] == ident):
            fut = self.engine.submit_copy_or_upload(sent[0], path, url, crc32c=crc, src_version=sent[3],
                                                    must_crc32c=own_crc)
        else:
            fut = self.engine.submit_upload(path, url, crc32c=crc, record_version=True)

        def sent_it(f: Future) -> None:
            # remember where these bytes are and the version they got; a step aborted later loses
            # them: the next copy finds the source gone and uploads (engine). No version (a store
            # without them): nothing to copy from next time
            if not f.cancelled() and f.exception() is None:
                version = getattr(f.result(), "version", None)
                self._metadata_sent = None if version is None else (url, own_crc, ident, version)

        fut.add_done_callback(sent_it)
        return fut


_FLAVOURED: dict = {}  # (flavour, planner class) -> the class with the flavour first


def _flavoured(planner: Any, flavour: type | None) -> Any:
    """``planner`` (one of ours, or None) with the mixin ``flavour`` before its class
    (``RankWriter.write``); as it is when ``flavour`` is None."""
    if planner is None or flavour is None:
        return planner
    cls = type(planner)
    if (flavour, cls) not in _FLAVOURED:
        _FLAVOURED[flavour, cls] = type(f"{flavour.__name__}{cls.__name__}", (flavour, cls), {})
    out = _FLAVOURED[flavour, cls].__new__(_FLAVOURED[flavour, cls])
    out.__dict__.update(vars(planner))  # the planner as made, its class now the flavoured one
    return out


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns that it runs without torch.distributed in single-process jobs; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _cancel(futures: list[Future]) -> None:
    """Cancel the transfers not started; the ones already running end first (each within
    the engine's time limits), so a failed attempt's cleanup sees every object and none
    lands after it."""
    for f in futures:
        f.cancel()
    wait(futures)


def _file_identity(path: str) -> tuple:
    """What makes two names one file whose bytes did not change: a hard link of it (the
    writer links a reused ``.metadata``, never writes one in place)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _kept(path: str, crc: str | None) -> Future:
    """A finished 'transfer' of a file kept where it was written (local steps)."""
    fut: Future = Future()
    fut.set_result(TransferResult(url=path, local_path=path, size=os.path.getsize(path),
                                  crc32c=crc if crc is not None else crc32c_file(path), attempts=0, seconds=0.0))
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
