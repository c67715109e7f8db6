"""CRC32C (Castagnoli) with google-crc32c, as 8 lowercase hex digits.

:class:`Crc32cReader` computes the CRC of a file while a backend reads it for an
upload, so the file is read once. It tracks which prefix of the file its CRC
covers: sequential reads extend it, re-reads of covered bytes are ignored, a
``seek(0)`` (what backends do before restarting an upload) starts it over. When a
backend read the file out of order the covered prefix falls short of the size and
the caller falls back to :func:`crc32c_file`.
"""

from __future__ import annotations

import os
from typing import BinaryIO, Iterator

import google_crc32c

_CHUNK = 8 * 1024 * 1024  # file reads
_VIEW_CHUNK = 1024 * 1024  # copies of non-bytes buffers: small, so the allocator reuses them


def _hex(value: int) -> str:
    return f"{value:08x}"


def bytes_pieces(data) -> Iterator[bytes]:
    """``data`` (any buffer) as ``bytes`` for google-crc32c, which takes nothing else:
    ``bytes`` as they are, other buffers copied in 1 MiB pieces (cache-sized, so the
    allocator reuses them), never whole."""
    if isinstance(data, bytes):
        yield data
        return
    mv = memoryview(data).cast("B")
    for i in range(0, len(mv), _VIEW_CHUNK):
        yield bytes(mv[i:i + _VIEW_CHUNK])


def crc32c_bytes(data: bytes | bytearray | memoryview) -> str:
    """CRC32C of ``data`` (any buffer, see :func:`bytes_pieces`) as 8 lowercase hex digits."""
    crc = 0
    for piece in bytes_pieces(data):
        crc = google_crc32c.extend(crc, piece)
    return _hex(crc)


def crc32c_file(path: str | os.PathLike, *, chunk_size: int = _CHUNK) -> str:
    """CRC32C of a whole file as 8 lowercase hex digits. Raises OSError."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                return _hex(crc)
            crc = google_crc32c.extend(crc, chunk)


class Crc32cReader:
    """Wraps a binary file object; ``read()`` returns what the file returns and
    updates the CRC. ``hexdigest()`` is the CRC of the first ``bytes_covered``
    bytes. ``close()`` does not close the wrapped file (its owner does)."""

    def __init__(self, fileobj: BinaryIO):
        self._f = fileobj
        self._pos = fileobj.tell() if hasattr(fileobj, "tell") else 0
        self._crc = 0
        self._covered = 0
        self.closed = False

    # -- the CRC
    def hexdigest(self) -> str:
        return _hex(self._crc)

    @property
    def bytes_covered(self) -> int:
        """Length of the prefix of the file the CRC covers."""
        return self._covered

    def _account(self, pos: int, data: bytes) -> None:
        end = pos + len(data)
        if pos <= self._covered < end:
            tail = data if pos == self._covered else data[self._covered - pos:]
            self._crc = google_crc32c.extend(self._crc, tail)
            self._covered = end

    # -- the file interface backends use
    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        pos = self._pos
        self._pos += len(data)
        if data:
            self._account(pos, data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        pos = self._f.seek(offset, whence)
        self._pos = pos
        if pos == 0:  # a restart from the beginning: the CRC starts over
            self._crc = 0
            self._covered = 0
        return pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return self._f.seekable()

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
