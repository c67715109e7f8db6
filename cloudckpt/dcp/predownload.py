"""Pre-download loads (``pre_download=True``): each run of needed items of every
file (items less than ``max_gap`` apart: a rank's own shard file is one run) is one
streamed download written to a local file as it arrives (``FileDownload``, the job
``TransferEngine.submit_stream`` runs), ``download_ahead`` (2) at a time; each item
is read back, through a read-only mapping of its bytes (``map_bytes``), as soon as
its bytes have landed, pages are freed behind the reader
(``FileDownload.discard_below``) and a local file is deleted once read: the disk
holds at most three of them (``read_predownloaded``).

The files are made in the load's own private folder under ``work_dir``
(``storage.nofollow.private_dir``), opened without following a link: a link (or any
entry) already in the place of one is never written through (UnsafeCheckpoint or
StorageError)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import mmap
import os
import sys
import threading
from concurrent.futures import Future, wait

from torch.distributed.checkpoint.planner import LoadPlanner

from ..errors import InternalError, NotFound, StorageError
from ..storage import url as urls
from ..storage.nofollow import Folder, resolve
from ..units import MiB
from ..untrusted import local_name
from .resumable import ResumableStream, coalesce, cut, distinct, missing, spans

_FULL = (errno.ENOSPC, errno.EDQUOT)


def read_predownloaded(reader, per_file: dict[str, list], planner: LoadPlanner) -> None:
    """Download into ``reader.local_dir`` each run of needed items of every file (items
    less than ``max_gap`` apart; a rank's own shard file is one run, the few small
    items it needs from another rank's file are runs of their own, not the whole
    file between them), ``download_ahead`` runs at a time (one streamed request
    each, written to a local file as it arrives), and read each item from disk as
    soon as its bytes have landed, from whichever file they land in: the downloads
    run at the store's pace whatever the loading does, and reading keeps up with
    all of them. Each item's pages are freed once it is read
    (``FileDownload.discard_below``) and a local file is deleted once all its items
    are, so the disk holds at most ``download_ahead`` + 1 of them, mostly holes.
    ``reader`` is the StreamingReader (its settings, ``_stream``, its checks);
    adds what was read to ``reader.bytes_read`` and ``reader.direct_items``."""
    shared = threading.Condition()  # pieces landing, downloads ending
    index = {rel: i for i, rel in enumerate(per_file)}  # local names are derived, never the checkpoint's
    todo = iter([(rel, start, parts) for rel, reqs in per_file.items()
                 for start, _, parts in coalesce(reqs, max_gap=reader.max_gap, max_range=1 << 62)])
    started: list[FileDownload] = []
    on_disk: list[FileDownload] = []  # started, items left to read; in the order started
    ahead = reader.download_ahead

    def start_more() -> None:
        # (not under ``shared``: the engine may run done callbacks, which take it,
        # while holding its own lock) a download starts while fewer than
        # download_ahead run and the disk holds at most download_ahead files
        while sum(not d.finished for d in on_disk) < ahead and len(on_disk) <= ahead:
            nxt = next(todo, None)
            if nxt is None:
                return
            rel, start, parts = nxt  # parts: sorted by offset
            dl = FileDownload(shared, rel, urls.join(reader.remote_dir, rel),
                              os.path.join(reader.local_dir, local_name(index[rel], start)), parts)
            started.append(dl)
            on_disk.append(dl)
            dl.future = reader._stream(dl.url, dl.start, dl.end, dl)
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
            start, end, items = dl.items[0]  # a span: overlapping items (one item read twice), read once
            if dl.landed < end:  # the download ended short of what it was to land
                dl.result()  # its error, if it failed
                raise InternalError(f"pre-download of {dl.url}: the download of bytes [{dl.start}, {dl.end}) ended "
                                    f"without error at byte {dl.landed}, before the item at [{start}, {end})")
            dl.items.popleft()
            mapping, data = map_bytes(dl.fd, dl.local(start), end - start)  # the page cache's bytes, not a copy
            try:
                for off, length in distinct(items):
                    with memoryview(cut(data, start, off, length)) as view:
                        reader._check(dl.rel, off, length, view, dl.url)
                for off, length, req in items:
                    with memoryview(cut(data, start, off, length)) as view:
                        reader.direct_items += reader._consume(req, planner, view, dl.url)
            finally:
                unmap(mapping, data)
            reader.bytes_read += end - start
            if dl.items:
                dl.discard_below(dl.items[0][0])
            if not dl.items:
                dl.result()  # its last bytes were read: it is done or about to be
                dl.remove()
                on_disk.remove(dl)
    finally:
        for dl in started:  # after a failure: those not started never will, running ones stop
            dl.future.cancel()
            dl.remove()
        # and none may still be writing when the caller removes local_dir
        wait([dl.future for dl in started])


class FileDownload(ResumableStream):
    """The job of one pre-download (``TransferEngine.submit_stream``): write bytes
    ``[start, end)`` of ``url`` (the span of ``items``, a run of the file's items to load)
    into a local file as they arrive, byte ``start + i`` of the object at ``i`` of the file
    (``local``; no hole in front, so no file system needs to support sparse files):
    ``[start, landed)`` is on disk, and whoever waits on ``shared`` hears of each piece. A retried attempt resumes at
    ``landed``; an attempt the engine gave up on, or one still running once the file
    was closed (``remove``), writes nothing more."""

    PIECE = 1 * MiB

    def __init__(self, shared: threading.Condition, rel: str, url: str, path: str, items: list):
        super().__init__(url, items[0][0], max(off + n for off, n, _ in items), shared)
        self.shared, self.rel, self.path = shared, rel, path
        # the spans not read yet (resumable.spans: (start, end, [(offset, length, ReadItem)]), in order)
        self.items = collections.deque(spans(items))
        self.landed = self.start
        self.finished = False  # the future is done (set under ``shared``)
        self.future: Future | None = None
        self._discarded = 0  # the local file's bytes below this were freed (discard_below)
        self._io = threading.Lock()  # a write, or closing the file
        self.fd = -1
        folder, self._name = os.path.split(path)
        try:  # the folder: the user's work_dir resolved once; nothing below it followed
            self._dir: Folder | None = Folder.open(resolve(folder), create=True,
                                                   what=f"the pre-download folder {folder}")
        except OSError as e:
            raise (self._no_space(e) if e.errno in _FULL else e) from None
        try:
            self.fd = self._dir.new_file(self._name, flags=os.O_RDWR)  # O_EXCL: nothing planted is opened
        except FileExistsError:
            self._dir.close()
            raise StorageError(f"pre-download of {url}: {path} already exists; cloudckpt makes a new file there and "
                               "never writes into one it did not make: remove it", url=url) from None
        except BaseException as e:
            self._dir.close()
            if isinstance(e, OSError) and e.errno in _FULL:
                raise self._no_space(e) from None
            raise

    def resume_at(self) -> int | None:
        """What has landed (under ``shared``)."""
        return self.landed if self.landed < self.end else None

    def attempt(self, attempt, at, open_from, progress) -> int:
        pos, got = at, 0
        with open_from(pos) as body:
            while pos < self.end:
                piece = self.read(body, pos, min(self.PIECE, self.end - pos), progress, whole=False)
                with self._io:
                    if not self.current(attempt) or self.fd < 0:
                        return got
                    view = memoryview(piece)
                    try:
                        while view:
                            view = view[os.pwrite(self.fd, view, self.local(pos + len(piece) - len(view))):]
                    except OSError as e:
                        raise (self._no_space(e) if e.errno in _FULL else e) from None
                pos += len(piece)
                got += len(piece)
                with self.shared:
                    if self.current(attempt):
                        self.landed = pos
                        self.shared.notify_all()
        return got

    def local(self, off: int) -> int:
        """Where byte ``off`` of the object is in the local file."""
        return off - self.start

    def ready(self) -> bool:
        """The next item has landed, or the download ended (call under ``shared``)."""
        return bool(self.items) and (self.finished or self.landed >= self.items[0][1])

    def discard_below(self, pos: int) -> None:
        """Free the file's pages below ``pos`` (read already, Linux: a hole is punched):
        the pieces landing next reuse the memory just freed. Writing into memory the
        machine has not written lately costs more than the copy here (the page cache's
        pages of a new file: 0.13-0.29 CPU-s per 512 MiB against 0.06 over pages just
        used); with files freed whole once read, a 1 GiB pre-download load took 2.2-2.6 s,
        with pages freed behind the reader 1.7-2.5 s (bench/NOTES.md)."""
        upto = self.local(pos)
        upto -= upto % _PAGE
        if upto > self._discarded and self.fd >= 0 and _punch_hole(self.fd, self._discarded, upto - self._discarded):
            self._discarded = upto

    def on_done(self, fut: Future) -> None:
        with self.shared:
            self.finished = True
            self.shared.notify_all()

    def result(self) -> None:
        """Wait for the download; raise its error (a missing object: the step is damaged)."""
        try:
            self.future.result()
        except NotFound:
            raise missing(self.url) from None

    def _no_space(self, e: OSError) -> StorageError:
        return StorageError(
            f"pre-download of {self.url}: no space left in {os.path.dirname(self.path)} (under work_dir; "
            f"{e.strerror}; this file needs up "
            f"to {self.end - self.start} bytes, two or three files at a time); free space there, set work_dir to a "
            "larger folder, or load with pre_download=False (streaming needs no disk)", url=self.url)

    def remove(self) -> None:
        """Close and delete the file (again: nothing)."""
        with self._io:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            folder, self._dir = self._dir, None
        if folder is None:
            return  # removed before
        with folder:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._name, dir_fd=folder.fd)  # the entry itself: never a link's target


def _libc_fallocate():
    """libc's ``fallocate`` (Linux; Python's ``os`` has no call that punches holes), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    f.restype = ctypes.c_int
    return f


_fallocate = _libc_fallocate()
_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_PAGE = mmap.PAGESIZE


def _punch_hole(fd: int, off: int, n: int) -> bool:
    """Free ``[off, off + n)`` of the file (its pages and blocks; it reads as zeros).
    False where the system or the file system cannot (nothing else happens then)."""
    return _fallocate is not None and _fallocate(fd, _PUNCH_HOLE_KEEP_SIZE, off, n) == 0


def map_bytes(fd: int, off: int, length: int) -> tuple[mmap.mmap | None, memoryview]:
    """Bytes ``[off, off + length)`` of a file, mapped read-only: reading an item
    through its mapping skips the copy a read into a buffer makes (0.06-0.13 CPU-s
    less per 512 MiB here). One mapping per item, unmapped once it is in place, so
    the file's pages do not add up in the process's RSS."""
    if not length:
        return None, memoryview(b"")
    base = off - off % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, off + length - base, prot=mmap.PROT_READ, offset=base)
    return mapping, memoryview(mapping)[off - base:]


def unmap(mapping: mmap.mmap | None, view: memoryview) -> None:
    # a view still held elsewhere (it should not be) keeps the mapping until it goes
    with contextlib.suppress(BufferError):
        view.release()
        if mapping is not None:
            mapping.close()
