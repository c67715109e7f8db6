"""A DCP StorageReader that reads byte ranges straight from the store.

Requests are grouped per shard file, sorted, and coalesced into streams (never
splitting an item; neighbours closer than ``max_gap`` join; streams of about
``budget()[1]`` bytes, within one file). Each stream is one ranged read
(``store.open_range``: one GET on S3) run by the transfer engine; on the stream's
thread, each item is read, checked against its CRC32C from the commit marker and
put into its target (items.py: straight into the target tensor where it can be),
then the next one is read. The thread running ``read_data`` waits for them all.

Memory stays bounded and proportional to what the rank loads: items being read or
put in place hold at most a sixteenth of the rank's planned bytes (32 MiB to
``max_inflight_bytes``; one item at least), and a stream waits for room before it
reads its next item. Streams are a quarter of the planned bytes (16 MiB to
``max_stream_size``), so a rank reads through about four requests at once.

A stream that fails part-way (a reset, a timeout, a stall) is retried by the engine
from its first item not taken yet; an attempt the engine gave up on takes nothing
more, so no item is put in place twice; once the load has failed, no stream starts
another item, and ``read_data`` returns only when none is being put in place.

``pre_download=True`` instead downloads, into a local folder, each run of needed
items of every file (items less than ``max_gap`` apart: a rank's own shard file is
one run): one stream per run, ``download_ahead`` (2) at a time, written to disk as
it arrives. Each item is read back as soon as its bytes have landed, and a local
file is deleted once read: the disk holds at most three of them.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ..errors import CorruptCheckpoint, NotFound
from ..storage import url as urls
from ..transfer import crc32c_bytes
from ..untrusted import MAX_METADATA_BYTES, local_name, loads_metadata, read_capped
from .items import load_tensor_into
from .predownload import FileDownload, map_bytes, unmap

_MiB = 1024 * 1024
METADATA_NAME = ".metadata"

# (offset, length) -> crc32c hex, per relative file name
Checksums = dict[str, dict[tuple[int, int], str]]


def coalesce(items: list[tuple[int, int, Any]], *, max_gap: int, max_range: int) -> list[tuple[int, int, list]]:
    """Group ``(offset, length, payload)`` into ``(start, end, [payloads])`` ranges:
    neighbours closer than ``max_gap`` merge while the range stays under
    ``max_range`` (a single larger item is its own range)."""
    out: list[tuple[int, int, list]] = []
    for off, length, p in sorted(items, key=lambda t: t[0]):
        if out:
            s, e, ps = out[-1]
            if off - e <= max_gap and (off + length) - s <= max_range:
                out[-1] = (s, max(e, off + length), ps + [(off, length, p)])
                continue
        out.append((off, off + length, [(off, length, p)]))
    return out


class StreamingReader(StorageReader):
    def __init__(
        self,
        remote_dir: str,
        stream: Callable[[str, int, int, Callable], Future],
        *,
        get_bytes: Callable[[str], bytes],
        checksums: Checksums | None = None,
        verify: bool = True,
        local_dir: str | None = None,
        max_gap: int = 1 * _MiB,
        max_stream_size: int = 512 * _MiB,
        max_inflight_bytes: int = 512 * _MiB,
        streamed: bool = True,
        download_ahead: int = 2,
        metadata_bytes: bytes | None = None,
        files: dict[str, int] | None = None,
    ):
        """``stream(url, start, end, job)`` runs ``job(open_from, progress)`` on a
        transfer thread and returns its Future (``TransferEngine.submit_stream``);
        ``get_bytes(url)`` reads a whole object; ``streamed``: the store reads a range
        as one streamed request (``ObjectStore.streams_ranges``); if not, streams are
        kept to a quarter of the in-flight budget (each is then one request, held
        whole). ``local_dir``: pre-download into this folder (streams too: one per
        file, written to disk). ``metadata_bytes``: DCP's ``.metadata`` already read (by rank 0,
        for every rank); it is checked like a fetched object. ``files``: the manifest's
        ``{relative path: size}`` of this DCP folder; every item of ``.metadata`` must
        lie inside one of them (None: a checkpoint without a manifest)."""
        super().__init__()
        self.remote_dir = remote_dir
        self._stream = stream
        self._get_bytes = get_bytes
        self.checksums = checksums or {}
        self.verify = verify
        self.local_dir = local_dir
        self.max_gap = max_gap
        self.max_stream_size = max_stream_size
        self.streamed = streamed
        self.max_inflight_bytes = max_inflight_bytes
        self.download_ahead = max(1, download_ahead)
        self._metadata_bytes = metadata_bytes
        self.files = files
        self.storage_data: dict = {}
        self.bytes_read = 0
        self.direct_items = 0  # tensor items copied straight from the fetched bytes (items.py)
        self.metadata_error: CorruptCheckpoint | None = None
        self._values_lock = threading.Lock()

    # ---------------------------------------------------------------- protocol
    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        url = urls.join(self.remote_dir, METADATA_NAME)
        try:
            data = self._metadata_bytes
            if data is None:
                if self.files is not None and METADATA_NAME not in self.files:
                    raise CorruptCheckpoint(f"{url}: the checkpoint's marker lists no DCP metadata; it is not a "
                                            "complete checkpoint")
                data = read_capped(_Getter(self._get_bytes), url, limit=MAX_METADATA_BYTES, what="DCP metadata")
            self._check(METADATA_NAME, 0, len(data), data, url)
            md = loads_metadata(data, url=url, files=self.files)
        except CorruptCheckpoint as e:
            # DCP (2.13) turns a read_metadata error into a bare AssertionError; keep the typed one
            self.metadata_error = e
            raise
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    @property
    def checkpoint_id(self):
        return self.remote_dir

    # ---------------------------------------------------------------- reading
    def _check(self, rel: str, offset: int, length: int, data, url: str) -> None:
        if len(data) != length:
            raise CorruptCheckpoint(
                f"{url}: expected {length} bytes at offset {offset}, got {len(data)}; the object is truncated"
            )
        if not self.verify:
            return
        want = self.checksums.get(rel, {}).get((offset, length))
        if want is not None and crc32c_bytes(data) != want:
            raise CorruptCheckpoint(
                f"{url}: CRC32C mismatch in bytes [{offset}, {offset + length}) (expected {want}, got {crc32c_bytes(data)}); "
                "the object is corrupt: restore it or load an older step"
            )

    def _consume(self, req: ReadItem, planner: LoadPlanner, data: memoryview, url: str) -> bool:
        """Put one item into place; True if it was copied straight into its target."""
        sinfo = self.storage_data[req.storage_index]
        if getattr(sinfo, "transform_descriptors", None):
            raise CorruptCheckpoint(f"{url}: stream transforms {sinfo.transform_descriptors} are not supported by cloudckpt")
        if req.type == LoadItemType.BYTE_IO:
            # streams put items in place concurrently; setting a value can create the
            # containers on its path (DCP's set_element), so values go one at a time
            with self._values_lock:
                planner.load_bytes(req, io.BytesIO(bytes(data)))
            return False
        target = planner.resolve_tensor(req).detach()
        direct = load_tensor_into(data, req.storage_offsets, req.lengths, target, url=url, fqn=req.storage_index.fqn)
        planner.commit_tensor(req, target)
        return direct

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        per_file: dict[str, list[tuple[int, int, ReadItem]]] = {}
        for req in plan.items:
            s = self.storage_data[req.storage_index]
            per_file.setdefault(s.relative_path, []).append((s.offset, s.length, req))
        if self.local_dir is not None:
            self._read_local(per_file, planner)
        else:
            self._read_remote(per_file, planner)
        f: torch.futures.Future = torch.futures.Future()
        f.set_result(None)
        return f

    def budget(self, planned_bytes: int) -> tuple[int, int]:
        """(in-flight bytes, stream size) for a rank that reads ``planned_bytes``: a
        sixteenth of them in flight (32 MiB to ``max_inflight_bytes``), in streams of a
        quarter of them (16 MiB to ``max_stream_size``), so about four requests at once
        (one more per shard file a stream cannot span). Ranges fetched whole, before
        streams, took 70 requests per 512 MiB, and botocore spends ~2.6 ms of CPU on
        each; eight streams were no faster than four and kept more memory. Stores that fetch a
        range in pieces (``streamed=False``: GCS) get streams of a quarter of the
        in-flight budget instead, one request each, as ranges were before."""
        inflight = min(self.max_inflight_bytes, max(32 * _MiB, planned_bytes // 16))
        if not self.streamed:  # each stream is fetched whole (store.streams_ranges is False)
            return inflight, min(self.max_stream_size, inflight // 4)
        return inflight, min(self.max_stream_size, max(16 * _MiB, planned_bytes // 4))

    def _read_local(self, per_file, planner) -> None:
        """Download into ``local_dir`` each run of needed items of every file (items
        less than ``max_gap`` apart; a rank's own shard file is one run, the few small
        items it needs from another rank's file are runs of their own, not the whole
        file between them), ``download_ahead`` runs at a time (one streamed request
        each, written to a local file as it arrives), and read each item from disk as
        soon as its bytes have landed, from whichever file they land in: the downloads
        run at the store's pace whatever the loading does, and reading keeps up with
        all of them. Each item's pages are freed once it is read
        (``FileDownload.discard_below``) and a local file is deleted once all its items
        are, so the disk holds at most ``download_ahead`` + 1 of them, mostly holes."""
        shared = threading.Condition()  # pieces landing, downloads ending
        index = {rel: i for i, rel in enumerate(per_file)}  # local names are derived, never the checkpoint's
        todo = iter([(rel, start, parts) for rel, reqs in per_file.items()
                     for start, _, parts in coalesce(reqs, max_gap=self.max_gap, max_range=1 << 62)])
        started: list[FileDownload] = []
        on_disk: list[FileDownload] = []  # started, items left to read; in the order started

        def start_more() -> None:
            # (not under ``shared``: the engine may run done callbacks, which take it,
            # while holding its own lock) a download starts while fewer than
            # download_ahead run and the disk holds at most download_ahead files
            while sum(not d.finished for d in on_disk) < self.download_ahead and len(on_disk) <= self.download_ahead:
                nxt = next(todo, None)
                if nxt is None:
                    return
                rel, start, parts = nxt  # parts: sorted by offset
                dl = FileDownload(shared, rel, urls.join(self.remote_dir, rel),
                                  os.path.join(self.local_dir, local_name(index[rel], start)), parts)
                started.append(dl)
                on_disk.append(dl)
                dl.future = self._stream(dl.url, dl.start, dl.end, dl)
                dl.future.add_done_callback(dl.on_done)

        try:
            while True:
                start_more()
                with shared:
                    # a file whose next item has landed (or whose download ended); if none,
                    # wait: a running download will land a piece or end
                    dl = next((d for d in on_disk if d.ready()), None)
                    if dl is None:
                        if not on_disk:
                            break
                        shared.wait()
                        continue
                off, length, req = dl.items[0]
                if dl.landed < off + length:  # the download failed
                    _raise_for(dl)
                    raise dl.truncated(dl.landed)
                dl.items.popleft()
                mapping, data = map_bytes(dl.fd, dl.local(off), length)  # the page cache's bytes, not a copy
                try:
                    self._check(dl.rel, off, length, data, dl.url)
                    self.direct_items += self._consume(req, planner, data, dl.url)
                finally:
                    unmap(mapping, data)
                self.bytes_read += length
                if dl.items:
                    dl.discard_below(dl.items[0][0])
                if not dl.items:
                    _raise_for(dl)  # its last bytes were read: it is done or about to be
                    dl.remove()
                    on_disk.remove(dl)
        finally:
            for dl in started:  # after a failure: those not started never will, running ones stop
                dl.future.cancel()
                dl.remove()
            # and none may still be writing when the caller removes local_dir
            wait([dl.future for dl in started])

    def _read_remote(self, per_file, planner) -> None:
        planned = sum(length for reqs in per_file.values() for _, length, _ in reqs)
        max_inflight, stream_size = self.budget(planned)
        tally = _Tally(max_inflight)
        streams = []
        for rel, reqs in per_file.items():
            url = urls.join(self.remote_dir, rel)
            for start, end, parts in coalesce(reqs, max_gap=self.max_gap, max_range=stream_size):
                streams.append(_ItemStream(self, planner, tally, url, rel, start, end, parts))
        futures: list[Future] = []
        try:
            for st in streams:
                fut = self._stream(st.url, st.start, st.end, st)
                fut.add_done_callback(st.finished)
                futures.append(fut)
            tally.wait(sum(len(st.parts) for st in streams))
        finally:
            tally.close()  # streams still running stop before their next item; waits for items being put in place
            for fut in futures:
                fut.cancel()
        self.bytes_read += tally.bytes
        self.direct_items += tally.direct


class _Getter:
    """``get_bytes`` as a store-like object for ``untrusted.read_capped``."""

    def __init__(self, get_bytes: Callable):
        self.get_bytes = get_bytes


class _Tally:
    """What the streams share: the byte budget (items being read or put into their
    targets), how many items are in place, and the first error of any stream,
    raised by ``wait``."""

    def __init__(self, budget: int):
        self._cv = threading.Condition()
        self._held = 0
        self._budget = budget
        self._error: BaseException | None = None
        self._closed = False
        self._busy = 0  # items being put into their targets
        self.items = 0
        self.bytes = 0
        self.direct = 0

    def reserve(self, n: int, alive: Callable[[int], None]) -> None:
        """Wait until ``n`` more bytes fit the budget (always, when nothing is held),
        calling ``alive(0)`` every second meanwhile (the engine's stall watchdog: a
        stream waiting for room is not stalled; an abandoned attempt's call raises)."""
        while True:
            with self._cv:
                if self._closed:
                    raise _Stopped()
                if not self._held or self._held + n <= self._budget:
                    self._held += n
                    return
                self._cv.wait(1.0)
            alive(0)

    def release(self, n: int) -> None:
        with self._cv:
            self._held -= n
            self._cv.notify_all()

    def claim(self) -> None:
        """An item is about to be put into its target (refused once closed)."""
        with self._cv:
            if self._closed:
                raise _Stopped()
            self._busy += 1

    def placed(self, n: int, direct: bool) -> None:
        with self._cv:
            self._held -= n
            self.items += 1
            self.bytes += n
            self.direct += direct
            self._cv.notify_all()

    def unclaim(self) -> None:
        with self._cv:
            self._busy -= 1
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def wait(self, total: int) -> None:
        with self._cv:
            while self.items < total and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """No stream starts another item; returns once none is being put in place,
        so no target is written after the load returned (or raised)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            while self._busy:
                self._cv.wait()


class _Stopped(Exception):
    """The load is over (it failed elsewhere): a stream stops before its next item."""


class _ItemStream:
    """The job of one stream (``TransferEngine.submit_stream``): read ``parts`` (sorted
    ``(offset, length, ReadItem)`` within ``[start, end)`` of one shard file) in
    order, check each and put it into its target, on the stream's thread. Each attempt
    starts at the first item not taken yet; an attempt that was superseded (the engine
    gave up on it as stalled and started another) takes nothing more, so every item
    is put in place once."""

    def __init__(self, reader: StreamingReader, planner: LoadPlanner, tally: _Tally, url: str, rel: str,
                 start: int, end: int, parts: list):
        self.reader, self.planner, self.tally = reader, planner, tally
        self.url, self.rel, self.start, self.end = url, rel, start, end
        self.parts = parts
        self._next = 0  # index of the first item not taken
        self._attempt = 0
        self._lock = threading.Lock()

    def __call__(self, open_from: Callable, progress: Callable[[int], None]) -> int:
        with self._lock:
            self._attempt += 1
            attempt, i = self._attempt, self._next
        if i >= len(self.parts):
            return 0
        pos = self.parts[i][0]
        # a store that fetches the range whole (not streamed) holds it all from the first
        # read: reserve all of it up front; a streamed one holds one item at a time
        held = sum(n for _, n, _ in self.parts[i:]) if not self.reader.streamed else 0
        if held:
            self.tally.reserve(held, progress)
        done = 0
        try:
            with open_from(pos) as body:
                while True:
                    with self._lock:
                        if attempt != self._attempt:
                            return done  # superseded: the current attempt goes on from self._next
                        i = self._next
                    if i >= len(self.parts):
                        return done
                    off, length, req = self.parts[i]
                    if off > pos:
                        gap = len(_read_exact(body, off - pos))  # bytes between items: not needed
                        progress(gap)
                        if gap < off - pos:
                            raise self._truncated(pos + gap)
                        pos = off
                    if not held:
                        self.tally.reserve(length, progress)
                        held = length
                    data = _read_exact(body, length)
                    progress(len(data))
                    if len(data) < length:
                        raise self._truncated(off + len(data))
                    self.reader._check(self.rel, off, length, data, self.url)
                    with self._lock:
                        if attempt != self._attempt:
                            raise _Stopped()
                        self.tally.claim()
                        self._next = i + 1
                    try:
                        direct = self.reader._consume(req, self.planner, memoryview(data), self.url)
                    finally:
                        self.tally.unclaim()
                    del data
                    held -= length
                    self.tally.placed(length, direct)  # gives back its bytes
                    pos = off + length
                    done += length
        finally:
            if held:
                self.tally.release(held)  # what this attempt reserved and did not place

    def _truncated(self, at: int) -> CorruptCheckpoint:
        return CorruptCheckpoint(
            f"{self.url}: expected bytes [{self.start}, {self.end}) but the object ends at {at}; it is truncated"
        )

    def finished(self, fut: Future) -> None:
        """Done callback of the stream's Future: its error goes to the thread waiting in ``read_data``."""
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, _Stopped):
            return
        if isinstance(exc, NotFound):
            exc = _missing(self.url)
        if exc is not None:
            self.tally.fail(exc)
        elif self._next < len(self.parts):  # cannot happen: a job returns only when done or superseded
            self.tally.fail(RuntimeError(f"{self.url}: a stream ended with items left"))


def _read_exact(body, n: int):
    """``n`` bytes from ``body`` (fewer only where it ends)."""
    data = body.read(n)
    if len(data) >= n or not data:
        return data
    pieces = [bytes(data)]
    got = len(data)
    while got < n:
        more = body.read(n - got)
        if not more:
            break
        pieces.append(bytes(more))
        got += len(more)
    return b"".join(pieces)


def _raise_for(dl: FileDownload) -> None:
    """Wait for a download; raise its error (a missing object: the step is damaged)."""
    try:
        dl.result()
    except NotFound:
        raise _missing(dl.url) from None


def _missing(url: str) -> CorruptCheckpoint:
    """A shard listed in the marker is gone: the committed step is damaged (not a storage hiccup)."""
    return CorruptCheckpoint(f"{url}: the object is listed in the checkpoint's marker but missing; the checkpoint is "
                             "damaged: restore the object or load an older step")
