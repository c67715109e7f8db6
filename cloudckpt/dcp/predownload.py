"""Pre-download's files: one streamed download per shard file written to a local
file as it arrives (``FileDownload``, the job ``TransferEngine.submit_stream``
runs), items read back through read-only mappings of their bytes (``map_bytes``),
and pages freed behind the reader (``FileDownload.discard_below``). The loading
itself is ``StreamingReader._read_local`` (reader.py)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import mmap
import os
import sys
import threading
from concurrent.futures import Future
from typing import Callable

from ..errors import CorruptCheckpoint, StorageError

_MiB = 1024 * 1024
_FULL = (errno.ENOSPC, errno.EDQUOT)


class FileDownload:
    """The job of one pre-download (``TransferEngine.submit_stream``): write bytes
    ``[start, end)`` of ``url`` (the span of ``items``, a run of the file's items to load)
    into a local file as they arrive, byte ``start + i`` of the object at ``i`` of the file
    (``local``; no hole in front, so no file system needs to support sparse files):
    ``[start, landed)`` is on disk, and whoever waits on ``shared`` hears of each piece. A retried attempt resumes at
    ``landed``; an attempt the engine gave up on, or one still running once the file
    was closed (``remove``), writes nothing more."""

    PIECE = 1 * _MiB

    def __init__(self, shared: threading.Condition, rel: str, url: str, path: str, items: list):
        self.shared, self.rel, self.url, self.path = shared, rel, url, path
        self.items = collections.deque(items)  # sorted (offset, length, ReadItem) not read yet
        self.start, self.end = items[0][0], max(off + n for off, n, _ in items)
        self.landed = self.start
        self.finished = False  # the future is done (set under ``shared``)
        self.future: Future | None = None
        self._attempt = 0
        self._discarded = 0  # the local file's bytes below this were freed (discard_below)
        self._io = threading.Lock()  # a write, or closing the file
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise self._no_space(e) if e.errno in _FULL else e

    def __call__(self, open_from: Callable, progress: Callable[[int], None]) -> int:
        with self.shared:
            self._attempt += 1
            attempt, pos = self._attempt, self.landed
        got = 0
        if pos >= self.end:
            return got
        with open_from(pos) as body:
            while pos < self.end:
                piece = body.read(min(self.PIECE, self.end - pos))
                if not piece:
                    raise self.truncated(pos)
                progress(len(piece))  # raises once the engine gave up on this attempt
                with self._io:
                    if attempt != self._attempt or self.fd < 0:
                        return got
                    view = memoryview(piece)
                    try:
                        while view:
                            view = view[os.pwrite(self.fd, view, self.local(pos + len(piece) - len(view))):]
                    except OSError as e:
                        raise self._no_space(e) if e.errno in _FULL else e
                pos += len(piece)
                got += len(piece)
                with self.shared:
                    if attempt == self._attempt:
                        self.landed = pos
                        self.shared.notify_all()
        return got

    def local(self, off: int) -> int:
        """Where byte ``off`` of the object is in the local file."""
        return off - self.start

    def ready(self) -> bool:
        """The next item has landed, or the download ended (call under ``shared``)."""
        return bool(self.items) and (self.finished or self.landed >= self.items[0][0] + self.items[0][1])

    def discard_below(self, pos: int) -> None:
        """Free the file's pages below ``pos`` (read already, Linux: a hole is punched):
        the pieces landing next reuse the memory just freed. Writing into memory the
        machine has not written lately costs more than the copy here (the page cache's
        pages of a new file: 0.13-0.29 CPU-s per 512 MiB against 0.06 over pages just
        used); with files freed whole once read, a 1 GiB pre-download load took 2.2-2.6 s,
        with pages freed behind the reader 1.7-2.5 s (docs/performance.md)."""
        upto = self.local(pos)
        upto -= upto % _PAGE
        if upto > self._discarded and self.fd >= 0 and _punch_hole(self.fd, self._discarded, upto - self._discarded):
            self._discarded = upto

    def on_done(self, fut: Future) -> None:
        with self.shared:
            self.finished = True
            self.shared.notify_all()

    def result(self) -> None:
        """Raise the download's error, if any."""
        self.future.result()

    def _no_space(self, e: OSError) -> StorageError:
        return StorageError(
            f"pre-download of {self.url}: no space left in {os.path.dirname(self.path)} (under work_dir; "
            f"{e.strerror}; this file needs up "
            f"to {self.end - self.start} bytes, two or three files at a time); free space there, set work_dir to a "
            "larger folder, or load with pre_download=False (streaming needs no disk)", url=self.url)

    def truncated(self, at: int) -> CorruptCheckpoint:
        return CorruptCheckpoint(
            f"{self.url}: expected bytes [{self.start}, {self.end}) but the object ends at {at}; it is truncated"
        )

    def remove(self) -> None:
        """Close and delete the file (again: nothing)."""
        with self._io:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # removed before


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
