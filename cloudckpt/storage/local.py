"""Local folders (plain paths and ``file://``), with object-store semantics.

Writes go to a temporary file in the target folder and are renamed into place,
so a reader never sees a half-written object. ``if_absent`` uses ``os.link``,
which fails atomically when the name exists: exactly one racing writer wins.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import BinaryIO, Iterator

from ..errors import AccessDenied, AlreadyExists, InvalidURL, NotFound, PreconditionFailed, StorageError, Transient
from .base import MiB, ListEntry, ObjectInfo, ObjectStore, Progress, RangeReader
from .url import parse_url

_CHUNK = 8 * MiB


class LocalStore(ObjectStore):
    scheme = "file"
    streams_ranges = True

    @staticmethod
    def _path(url: str) -> str:
        p = parse_url(url)
        if p.scheme != "file":
            raise InvalidURL(f"not a local path or file:// URL: {url!r}", url=url)
        return p.key

    @staticmethod
    def _err(e: OSError, url: str, what: str) -> StorageError:
        if isinstance(e, FileNotFoundError) or e.errno == errno.ENOTDIR:
            return NotFound(f"{what}: {url} does not exist", url=url)
        if isinstance(e, PermissionError):
            return AccessDenied(f"{what}: permission denied on {url}; check the folder's owner and mode", url=url)
        if e.errno == errno.ENOSPC:
            return StorageError(f"{what}: no space left on the device holding {url}; free space or use another folder", url=url)
        return Transient(f"{what} {url}: {e}", url=url)

    def _write(self, url: str, fill, *, if_absent: bool) -> None:
        path = self._path(url)
        d = os.path.dirname(path)
        try:
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        except OSError as e:
            raise self._err(e, url, "write") from e
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise AlreadyExists(f"{url} already exists", url=url) from None
            else:
                os.replace(tmp, path)
        except StorageError:
            raise  # AlreadyExists is an OSError too: keep it as it is
        except OSError as e:
            raise self._err(e, url, "write") from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass  # renamed into place

    def put_bytes(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        self._write(url, lambda f: f.write(data), if_absent=if_absent)

    def _open(self, url: str) -> BinaryIO:
        try:
            return open(self._path(url), "rb")
        except IsADirectoryError:
            raise NotFound(f"read: {url} is a folder, not an object", url=url) from None
        except OSError as e:
            raise self._err(e, url, "read") from e

    def get_bytes(self, url: str, *, start: int | None = None, end: int | None = None) -> bytes:
        if end is not None and end <= (start or 0):
            return b""
        with self._open(url) as f:
            try:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(end - (start or 0))
            except OSError as e:
                raise self._err(e, url, "read") from e

    def open_range(self, url: str, start: int, end: int) -> RangeReader:
        return _FileRange(self, self._open(url), url, start, end)

    @staticmethod
    def _version(path: str) -> str:
        st = os.stat(path)
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def get_bytes_versioned(self, url: str) -> tuple[bytes, str]:
        path = self._path(url)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                return f.read(), f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"
        except OSError as e:
            raise self._err(e, url, "read") from e

    def put_bytes_if_match(self, url: str, data: bytes, version: str) -> None:
        """Compare-and-replace under an flock on a sidecar lock file; readers need no
        lock because the replace is an atomic rename (a new inode)."""
        import fcntl

        path = self._path(url)
        try:
            # the lock file's ".tmp-" name keeps it out of listings
            with open(os.path.join(os.path.dirname(path), ".tmp-cas-" + os.path.basename(path)), "a") as lk:
                fcntl.flock(lk, fcntl.LOCK_EX)
                try:
                    current = self._version(path)
                except FileNotFoundError:
                    current = None
                if current != version:
                    raise PreconditionFailed(f"put {url}: the object changed since it was read", url=url)
                self.put_bytes(url, data)
        except OSError as e:
            raise self._err(e, url, "write") from e

    def upload_fileobj(self, fileobj: BinaryIO, url: str, *, size: int, if_absent: bool = False, progress: Progress = None) -> None:
        def fill(f):
            while True:
                chunk = fileobj.read(_CHUNK)
                if not chunk:
                    return
                f.write(chunk)
                if progress:
                    progress(len(chunk))

        self._write(url, fill, if_absent=if_absent)

    def download_fileobj(self, url: str, fileobj: BinaryIO, *, progress: Progress = None) -> int:
        n = 0
        try:
            with open(self._path(url), "rb") as f:
                while True:
                    chunk = f.read(_CHUNK)
                    if not chunk:
                        return n
                    fileobj.write(chunk)
                    n += len(chunk)
                    if progress:
                        progress(len(chunk))
        except OSError as e:
            raise self._err(e, url, "read") from e

    def stat(self, url: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(url))
        except OSError as e:
            raise self._err(e, url, "stat") from e
        if not os.path.isfile(self._path(url)):
            raise NotFound(f"stat: {url} is a folder, not an object", url=url)
        return ObjectInfo(url, st.st_size, st.st_mtime)

    def _out(self, prefix_url: str, path: str) -> str:
        # keep the caller's form (plain path or file://)
        return ("file://" + path) if prefix_url.startswith("file://") else path

    def list(self, prefix: str, *, delimiter: str | None = "/") -> Iterator[ListEntry]:
        p = self._path(prefix)
        if prefix.endswith("/") and not p.endswith("/"):
            p += "/"
        folder, _, stem = p.rpartition("/")
        folder = folder or "/"
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err(e, prefix, "list") from e
        for name in names:
            if not name.startswith(stem) or name.startswith(".tmp-"):
                continue
            full = os.path.join(folder, name)
            if os.path.isdir(full):
                if delimiter is None:
                    for root, dirs, files in os.walk(full):
                        dirs.sort()
                        for fn in sorted(files):
                            if fn.startswith(".tmp-"):
                                continue
                            fp = os.path.join(root, fn)
                            st = os.stat(fp)
                            yield ListEntry(self._out(prefix, fp), size=st.st_size, mtime=st.st_mtime)
                else:
                    yield ListEntry(self._out(prefix, full + "/"), is_prefix=True)
            else:
                st = os.stat(full)
                yield ListEntry(self._out(prefix, full), size=st.st_size, mtime=st.st_mtime)

    def delete(self, url: str) -> None:
        path = self._path(url)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err(e, url, "delete") from e

    def delete_prefix(self, prefix: str, *, force: bool = False) -> int:
        n = super().delete_prefix(prefix, force=force)
        path = self._path(prefix).rstrip("/")
        # object stores have no folders: drop the emptied folder tree and temp files too
        shutil.rmtree(path, ignore_errors=True)
        return n


class _FileRange(RangeReader):
    """``[start, end)`` of a local file, read with ``read(n)``."""

    def __init__(self, store: LocalStore, f: BinaryIO, url: str, start: int, end: int):
        self._store, self._f, self._url = store, f, url
        self._left = max(0, end - start)
        f.seek(start)

    def read(self, n: int) -> bytes:
        try:
            data = self._f.read(min(n, self._left))
        except OSError as e:
            raise self._store._err(e, self._url, "read") from e
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._f.close()
