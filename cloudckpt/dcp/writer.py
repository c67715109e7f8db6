"""A DCP StorageWriter that writes shards to a local work dir and uploads each
file as soon as it is closed (writing and uploading overlap).

The files are standard DCP (``__{R}_{K}.distcp`` + ``.metadata``), so the folder
stays readable by stock ``FileSystemReader`` once downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import pickle
import queue
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import google_crc32c
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem
from torch.distributed.checkpoint.planner import WriteItemType
from torch.futures import Future

from .._torch_compat import ResumedSavePlanner, element_size, split_by_size_and_type, stock_metadata, write_files
from ..checkpoint import layout
from ..errors import SaveFailed
from ..transfer.checksum import bytes_pieces
from ..units import MiB
from . import index

_SENT = ("cloudckpt", "write results sent")  # index_cache: the digest this rank's last completed save sent
_MERGED = ("cloudckpt", "write results merged")  # index_cache, coordinator: what its last finish merged
# a .metadata this large is kept (linked) for the next save instead of pickled again (and copied in
# the store): a repeated save then costs the coordinator O(R), not O(R x T) (a few MB already grow
# with the job on 8 ranks); smaller ones (tens of ms) are pickled again, and work_dir stays empty
KEEP_METADATA_BYTES = 1 * MiB


def _chunk_bytes(item) -> int:
    td = item.tensor_data
    return math.prod(td.chunk.sizes) * element_size(td.properties.dtype)


@dataclass
class FileChecksums:
    """CRC32C of a file written through the writer, computed while it was written:
    ``crc32c`` of the whole file and ``segments`` ``{(start, end): crc32c}`` of the
    byte ranges between the positions DCP asked for with ``tell()`` (DCP calls it
    before and after every item, so each item is one segment)."""

    crc32c: str
    size: int
    segments: dict[tuple[int, int], str] = field(default_factory=dict)

    def range_crc(self, offset: int, length: int) -> str | None:
        return self.segments.get((offset, offset + length))


class _ChecksummingStream:
    """Wraps the binary file DCP writes to; CRC32C of everything written, and of
    each span between two ``tell()`` calls. Writes are appended at the end only
    (what DCP does); a seek is refused rather than silently miscounted."""

    def __init__(self, f):
        self._f = f
        self._pos = f.tell()
        self._crc = 0
        self._seg_start = self._pos
        self._seg_crc = 0
        self.segments: dict[tuple[int, int], str] = {}

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = self._f.write(mv)
        n = len(mv) if n is None else n
        for piece in bytes_pieces(mv[:n]):  # ~0.2 s/GiB with the CRC
            self._crc = google_crc32c.extend(self._crc, piece)
            self._seg_crc = google_crc32c.extend(self._seg_crc, piece)
        self._pos += n
        return n

    def tell(self) -> int:
        if self._pos != self._seg_start:
            self.segments[(self._seg_start, self._pos)] = f"{self._seg_crc:08x}"
        self._seg_start, self._seg_crc = self._pos, 0
        return self._pos

    def seek(self, *a):
        raise io.UnsupportedOperation("cloudckpt's DCP writer streams are append-only")

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:  # the create_stream context closes the file itself
        self._f.flush()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def checksums(self) -> FileChecksums:
        self.tell()
        return FileChecksums(f"{self._crc:08x}", self._pos, dict(self.segments))


class _NotifyingFileSystem(FileSystem):
    """A local FileSystem that checksums what is written and calls
    ``on_closed(path, FileChecksums)`` for every finished file (``.tmp`` files
    are reported after their rename)."""

    def __init__(self, on_closed: Callable[[str, "FileChecksums | None"], None]):
        self._on_closed = on_closed
        self._pending: dict[str, FileChecksums] = {}  # .tmp files awaiting their rename
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksummingStream(raw)
            yield stream
        sums = stream.checksums()
        if str(path).endswith(".tmp"):
            with self._lock:
                self._pending[str(path)] = sums
        else:
            self._on_closed(str(path), sums)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            sums = self._pending.pop(str(path), None)
        self._on_closed(str(new_path), sums)


def _done(value: Any) -> Future:
    """A Future already holding ``value`` (what DCP's ``write_data`` returns)."""
    out: Future = Future()
    out.set_result(value)
    return out


@dataclass(frozen=True)
class RankResults:
    """What a rank hands DCP's gather of write results (``write_data``'s value, which
    DCP passes to the coordinator's ``finish`` untouched): a digest of its WriteResults
    and the results themselves, or None when they are the ones it sent at the last
    save that completed (the coordinator still holds those). A repeated save then
    gathers 16 bytes a rank instead of one WriteResult per item (0.3-0.4 MB a rank for
    a 70B model with AdamW), and the coordinator reuses the ``.metadata`` it wrote."""

    digest: bytes
    results: list | None


def results_digest(results: list) -> bytes:
    """A digest of a rank's WriteResults (every field: index, size, file, offset, length),
    whatever the order the writer's threads finished them in."""
    ordered = sorted(results, key=lambda wr: (wr.index.fqn, tuple(wr.index.offset or ()), wr.index.index or 0))
    return hashlib.blake2b(pickle.dumps(ordered, protocol=4), digest_size=16).digest()


@dataclass
class _Merged:
    """The coordinator's last finish: the metadata it completed (DCP's plan cache hands
    the same object again while no rank's plan changes), the merged storage, each
    rank's keys and digest, and where the ``.metadata`` it wrote is kept."""

    metadata: Any
    state_dict_metadata: Any
    planner_data: Any
    storage: dict
    keys: list
    digests: list
    file: str
    sums: "FileChecksums | None"


class UploadingWriter(FileSystemWriter):
    """Writes into ``local_dir`` and calls ``on_file(local_path, checksums)`` when
    each file is complete (``checksums``: a FileChecksums computed while writing, or
    None when the file was written some other way); the coordinator's ``.metadata``
    comes as ``on_file(local_path, checksums, True)`` when it is the one handed on at
    the last save, byte for byte (the caller may copy it server-side). After the save, :meth:`manifest`
    gives the CRC32C of every item of every shard file it wrote (what the step's
    manifest records); ``ranges`` holds the item byte ranges of every shard file:
    ``{file_name: [(offset, length), ...]}``. ``loaded``: the coordinator's
    LoadedStructure (checkpoint/structure.py) for a save planned from the loaded step
    (``ResumedSavePlanner``): its ``.metadata`` comes as ``on_file(local_path, None,
    copy_of=loaded)`` when every rank's results are where the loaded step had them
    (no file is written; the caller copies it in the store). ``owners``: a save planned
    by owners (dcp/owners.py, ``OwnersSavePlanner``): the rank keeps its write results
    (:attr:`results`), DCP runs with no collective (``use_collectives=False``), a
    write's error is kept in :attr:`error` instead of raised (the caller raises it on
    every rank), and ``finish`` writes neither ``.metadata`` nor the index header:
    after the save every rank assembles them (``owners.fragment_of`` /
    ``assemble_store``, ``owners.index_header``)."""

    def __init__(
        self,
        local_dir: str,
        on_file: Callable[[str, FileChecksums | None], None],
        *,
        thread_count: int = 2,
        target_file_size: int = 256 * MiB,
        max_files_per_rank: int = 64,
        index_cache: dict | None = None,
        cache_dir: Callable[[], str] | None = None,
        loaded: Any = None,
        owners: bool = False,
    ):
        super().__init__(local_dir, single_file_per_rank=True, sync_files=False, thread_count=thread_count,
                         overwrite=True)
        self._on_file = on_file
        self._sums: dict[str, FileChecksums | None] = {}  # file name -> checksums taken while writing
        self.fs = _NotifyingFileSystem(self._closed)
        self.target_file_size = target_file_size
        self.max_files_per_rank = max_files_per_rank
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        self.index_items: list[list] = []  # this rank's part of the DCP index (dcp/index/)
        self.index_cache = {} if index_cache is None else index_cache  # kept across saves by the caller
        self._cache_dir = cache_dir  # the coordinator keeps its last .metadata there (None: not kept)
        self._digest: bytes | None = None
        self._loaded = loaded  # the coordinator: the step this job loaded (checkpoint/structure.py), for finish
        self._resumed = False  # this save was planned from the loaded step (ResumedSavePlanner)
        self._owners = owners
        self.results: list = []  # a save planned by owners: this rank's WriteResults
        self.error: BaseException | None = None  # planned by owners or from a kept step: what writing raised
        self._moved = False  # planned from a kept step: this rank's results are not where they were
        self._lock = threading.Lock()

    # DCP with no collective (a save planned by owners or from a kept structure): a rank that
    # raised in DCP's steps would leave its peers waiting in DCP's closing barrier; its error is
    # kept (``error``) and raised by every rank in the agreement that follows the save

    def prepare_local_plan(self, plan):
        if self.use_collectives:
            return super().prepare_local_plan(plan)
        try:
            return super().prepare_local_plan(plan)
        except BaseException as e:  # noqa: BLE001 - raised on every rank by the caller's agreement
            self.error = self.error or e
            return plan

    def write_data(self, plan, planner):
        if isinstance(planner, ResumedSavePlanner):
            self._resumed = True
        if self.use_collectives:
            return self._write_plan(plan, planner)
        try:
            self.raise_error()  # this rank's preparation failed: nothing to write
            return self._write_plan(plan, planner)
        except BaseException as e:  # noqa: BLE001 - raised on every rank by the caller's agreement
            self.error = self.error or e
            return _done([])

    def raise_error(self) -> None:
        """Raise what this rank's preparation or writes met while DCP ran with no
        collective (kept in :attr:`error`), if anything."""
        if self.error is not None:
            raise self.error

    def _write_plan(self, plan, planner):
        # More, smaller files than stock DCP (one per thread) so uploads start while
        # later files are still being written; bounded to keep request counts low.
        items = plan.items
        # this rank's bytes: DCP's _item_size counts the whole (global) tensor, not the chunk
        total = sum(_chunk_bytes(i) for i in items if i.type != WriteItemType.BYTE_IO)
        bins = max(self.thread_count, min(self.max_files_per_rank, math.ceil(total / self.target_file_size)))
        bins = max(1, min(bins, len(items)))
        file_queue: queue.Queue = queue.Queue()
        for k, bucket in enumerate(b for b in split_by_size_and_type(bins, list(items)) if b):
            name = f"{plan.storage_data.prefix}{k}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
        results = write_files(self, planner, file_queue).value()
        for wr in results:
            sd = wr.storage_data
            with self._lock:
                self.ranges.setdefault(sd.relative_path, []).append((sd.offset, sd.length))
        self.index_items = index.part_items(items, results)
        if self._owners:  # the rank's own .metadata fragment and index entries come from these, after the save
            self.results = results
            return _done([])
        if isinstance(planner, ResumedSavePlanner):  # kept here: finish_kept tells whether any rank's moved
            same = planner.expected is not None and len(results) == len(planner.expected) and all(
                planner.expected.get(wr.index) == (wr.storage_data.relative_path, wr.storage_data.offset,
                                                   wr.storage_data.length) for wr in results)
            self.results, self._moved = ([] if same else results), not same
            return _done([])
        self._digest = results_digest(results)
        same = self._cache_dir is not None and self.index_cache.get(_SENT) == self._digest
        return _done(RankResults(self._digest, None if same else results))

    def completed(self) -> None:
        """DCP's save returned on this rank (the coordinator's finish merged what this
        rank sent): the next save may send only the digest if its results are the same."""
        if self._resumed or self._owners:  # nothing merged on the coordinator: the next plain save sends them whole
            self.index_cache.pop(_SENT, None)
            self.index_cache.pop(_MERGED, None)
        elif self._digest is not None:
            self.index_cache[_SENT] = self._digest

    def abandoned(self) -> None:
        """DCP's save failed on this rank: the next save sends its results whole (and the
        coordinator, which may not have merged this one, forgets what it holds)."""
        self.index_cache.pop(_SENT, None)
        self.index_cache.pop(_MERGED, None)

    def finish(self, metadata, results) -> None:
        """On the coordinator: DCP's ``.metadata``, then the DCP index's header beside
        the DCP folder (``index/header.json``, dcp/index/), each handed to ``on_file``.

        ``results``: each rank's :class:`RankResults`. A rank that sent only its digest
        has the entries merged last time (no unpickling or merging of its items); when
        every rank did and DCP handed the same metadata as at the last finish, a
        ``.metadata`` of ``KEEP_METADATA_BYTES`` or more written then is used again
        (linked from ``cache_dir``, not pickled again): a repeated save of a large job
        costs the coordinator O(R) here instead of O(R x T). ``Metadata.storage_meta``
        is not written (stock readers supply one), so the bytes are the same from save
        to save."""
        if self._owners or self._resumed or not self.use_collectives:  # placed by the ranks after the save
            self.index_cache.pop(_MERGED, None)
            return
        prev = self.index_cache.pop(_MERGED, None)
        for r, got in enumerate(results):
            if got.results is None and (prev is None or len(prev.digests) != len(results)
                                        or prev.digests[r] != got.digest):
                raise SaveFailed(f"rank {r} sent the digest of its write results (the same as at its last save) but "
                                 "the coordinator does not hold them (an earlier save failed between the ranks); "
                                 "save again: the next save sends them whole")
        meta_path = os.path.join(str(self.path), ".metadata")
        if (prev is not None and prev.file and all(got.results is None for got in results)
                and prev.metadata is metadata and prev.state_dict_metadata is metadata.state_dict_metadata
                and prev.planner_data is metadata.planner_data and os.path.isfile(prev.file)):
            metadata.storage_data = prev.storage
            metadata.storage_meta = None
            _link_or_copy(prev.file, meta_path)
            self._on_file(meta_path, prev.sums, True)  # the bytes handed on at the last save
            merged = prev
        else:
            storage: dict = {}
            keys: list = []
            for r, got in enumerate(results):
                if got.results is None:  # its entries are the ones merged last time
                    mine = prev.keys[r]
                    storage.update((k, prev.storage[k]) for k in mine)
                else:
                    mine = [wr.index for wr in got.results]
                    storage.update((wr.index, wr.storage_data) for wr in got.results)
                keys.append(mine)
            metadata.version = CURRENT_DCP_VERSION  # as FileSystemWriter.finish writes it
            metadata.storage_data = storage
            metadata.storage_meta = None
            tmp = os.path.join(str(self.path), ".metadata.tmp")
            with self.fs.create_stream(tmp, "wb") as f:
                pickle.dump(stock_metadata(metadata), f)  # the class stock readers unpickle
            self.fs.rename(tmp, meta_path)  # on_file, with the CRC32C taken while writing
            merged = _Merged(metadata, metadata.state_dict_metadata, metadata.planner_data, storage, keys,
                             [got.digest for got in results], "", self._sums.get(".metadata"))
            if self._cache_dir is not None and os.path.getsize(meta_path) >= KEEP_METADATA_BYTES:
                merged.file = os.path.join(self._cache_dir(), ".metadata")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(merged.file + ".tmp")
                _link_or_copy(meta_path, merged.file + ".tmp")
                os.replace(merged.file + ".tmp", merged.file)  # a step that linked the old one keeps it
        self.index_cache[_MERGED] = merged
        self.put_index_header(index.header_bytes(metadata, self.index_cache))

    def put_index_header(self, data: bytes) -> None:
        """The DCP index header ``data`` written beside the DCP folder and handed on as a
        closed file (``on_file``)."""
        path = os.path.join(os.path.dirname(str(self.path)), layout.INDEX_HEADER)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        self._on_file(path, None)

    def finish_kept(self, coord: Any) -> None:
        """Every rank, after DCP's save of a plan from a kept structure (it ran with no
        collective): every rank's write succeeded (else every rank raises what the
        lowest failing rank met: one all_reduce), then whether any rank's write results
        moved from where the kept step had them (one all_reduce of a byte); only then
        are the moved ranks' results gathered on the coordinator, which places the
        step's ``.metadata`` and index header (:meth:`_finish_resumed`). Nothing here
        grows with the world size unless results moved."""
        def outcome() -> bool:
            self.raise_error()
            return self._moved

        moved = coord.agree("the writes of a save planned from the kept step", outcome)
        lists: list = []
        if coord.any_rank([moved], "did any rank's write results move")[0]:
            got = coord.gather_some("the write results that moved", lambda: self.results if moved else None)
            lists = [r for r in got or () if r is not None]
        if coord.is_coordinator:
            self._finish_resumed(lists)

    def _finish_resumed(self, moved: list) -> None:
        """The coordinator, for a save planned from the loaded step (``moved``: the
        write results of each rank whose results moved). None moved: the loaded step's
        ``.metadata`` is copied inside the store (``on_file(path, None,
        copy_of=loaded)``) and its index header's bytes written again. Else the loaded
        ``.metadata`` (read once) with the moved ranks' results put in is written, and
        its header built, as a first save does."""
        self.index_cache.pop(_MERGED, None)
        meta_path = os.path.join(str(self.path), ".metadata")
        if not moved:
            self._on_file(meta_path, None, copy_of=self._loaded)
            self.put_index_header(self._loaded.header_bytes)
            return
        loaded = self._loaded.metadata()
        storage = dict(loaded.storage_data)
        for res in moved:
            storage.update((wr.index, wr.storage_data) for wr in res)
        md = stock_metadata(loaded)
        md.version, md.storage_data, md.storage_meta = CURRENT_DCP_VERSION, storage, None
        tmp = os.path.join(str(self.path), ".metadata.tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            pickle.dump(md, f)
        self.fs.rename(tmp, meta_path)
        self.put_index_header(index.header_bytes(md, self.index_cache))

    def write_index_part(self, rank: int) -> str | None:
        """After the save: this rank's part of the DCP index (its chunks of sharded
        tensors) written beside the DCP folder; its path, or None when it wrote none."""
        if not self.index_items:
            return None
        path = os.path.join(os.path.dirname(str(self.path)), layout.index_part_name(rank))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(index.part_bytes(rank, self.index_items))
        return path

    def _closed(self, path: str, sums: FileChecksums | None) -> None:
        with self._lock:
            self._sums[os.path.basename(path)] = sums
        self._on_file(path, sums)

    def manifest(self) -> dict[str, tuple[tuple[int, int, str], ...]]:
        """After the save: ``{shard file name: ((offset, length, crc32c), ...)}``, every
        item of every shard file this writer wrote, by offset. Each CRC32C comes from
        the segments computed while writing, or from reading the range back where
        DCP did not ask for that exact span."""
        out = {}
        with self._lock:
            ranges, sums = {k: sorted(v) for k, v in self.ranges.items()}, dict(self._sums)
        for name, spans in ranges.items():
            path = os.path.join(str(self.path), name)
            out[name] = tuple((o, n, _item_crc(sums.get(name), path, o, n)) for o, n in spans)
        return out

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def _item_crc(sums: FileChecksums | None, path: str, offset: int, length: int) -> str:
    crc = sums.range_crc(offset, length) if sums is not None else None
    if crc is not None:
        return crc
    with open(path, "rb") as f:
        f.seek(offset)
        return f"{google_crc32c.value(f.read(length)):08x}"



def _link_or_copy(src: str, dst: str) -> None:
    """``dst`` a new name of ``src``'s bytes: a hard link (never written in place
    afterwards: each is replaced by a rename), or a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
