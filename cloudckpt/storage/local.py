"""Local folders (plain paths and ``file://``), with object-store semantics.

Writes go to a temporary file in the target folder and are renamed into place,
so a reader never sees a half-written object. ``if_absent`` uses ``os.link``,
which fails atomically when the name exists: exactly one racing writer wins.

Symbolic links are never followed, at any component of a path. A save folder on a
shared disk may hold links planted by someone else (``step99 -> /elsewhere``):
following one would let garbage collection delete files outside the folder, or a
save write into them. So every path is opened one component at a time from ``/``
with ``O_NOFOLLOW`` and the calls below work on directory file descriptors (no
check-then-use race). A link where a folder or an object is expected raises
UnsafeCheckpoint; a listing reports a link as a plain object (never descends into
it, and logs a warning), so deleting it removes the link, never its target.
Callers canonicalise the user's own folder once (``url.resolve_local``), so a link
*above* the save folder that the user made keeps working.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat as st_
from typing import BinaryIO, Iterator

import google_crc32c

from ..errors import (
    AccessDenied,
    AlreadyExists,
    InvalidURL,
    NotFound,
    PreconditionFailed,
    StorageError,
    Transient,
    UnsafeCheckpoint,
)
from .assembly import Assembly, Piece
from .base import ListEntry, MiB, ObjectInfo, ObjectStore, Progress, RangeReader
from .url import parse_url

_CHUNK = 8 * MiB
_log = logging.getLogger(__name__)
# O_PATH opens a folder we may only search (x, no r: e.g. a 0711 home); O_RDONLY elsewhere
_O_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY


def _link_target(dfd: int, name: str) -> str | None:
    """Where the link ``name`` in the folder ``dfd`` points, or None if it cannot be read."""
    try:
        return os.readlink(name, dir_fd=dfd)
    except OSError:
        return None


def _unsafe(path: str, link: str, dfd: int, name: str) -> UnsafeCheckpoint:
    to = _link_target(dfd, name)
    target = "" if to is None else f" (to {to})"
    return UnsafeCheckpoint(
        f"{path}: {link} is a symbolic link{target}. cloudckpt does not follow links inside a save folder "
        "(a shared folder may hold links planted by someone else). Remove the link, or pass the real path "
        "of the folder (os.path.realpath) instead of a path through a link."
    )


def _open_at(dfd: int, name: str, flags: int, path: str, full: str, mode: int = 0o666) -> int:
    """``os.open(name, flags, mode, dir_fd=dfd)`` without following a link: a link there
    raises UnsafeCheckpoint (``full`` is its path, ``path`` the one being operated on)."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
    except OSError:
        try:
            is_link = st_.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            raise _unsafe(path, full, dfd, name) from None
        raise


def _open_dir(path: str, *, create: bool = False, listable: bool = False) -> int:
    """An fd of the folder ``path``, opened from ``/`` one component at a time, never
    through a link (UnsafeCheckpoint). ``create``: make missing folders. ``listable``: an
    fd ``os.scandir`` accepts. Raises OSError (FileNotFoundError when missing)."""
    comps = [c for c in path.split("/") if c]
    fd = os.open("/", (os.O_RDONLY | os.O_DIRECTORY) if listable and not comps else _O_DIR)
    try:
        for i, c in enumerate(comps):
            flags = os.O_RDONLY | os.O_DIRECTORY if listable and i == len(comps) - 1 else _O_DIR
            full = "/" + "/".join(comps[: i + 1])
            try:
                nfd = _open_at(fd, c, flags, path, full)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(c, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass  # made by a racing writer (or a link planted meanwhile: caught below)
                nfd = _open_at(fd, c, flags, path, full)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


class LocalStore(ObjectStore):
    scheme = "file"
    streams_ranges = True
    conditional_replace = True  # compare-and-rename under a lock
    copies_objects = True  # a file copy through this process (temp file, then rename)
    assembles_objects = True  # a temporary file written at offsets, then renamed

    @staticmethod
    def _assembly_name(assembly: Assembly) -> str:
        """The temporary file of an assembly, beside its object (listings skip ``.tmp-``)."""
        return f".tmp-assembly-{assembly.token}"

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
            return StorageError(f"{what}: no space left on the device holding {url}; free space or use another folder",
                                url=url)
        return Transient(f"{what} {url}: {e}", url=url)

    def _parent(self, url: str, what: str, *, create: bool = False) -> tuple[int, str, str]:
        """(fd of the object's folder, its name, its path); the caller closes the fd."""
        path = self._path(url)
        d, name = os.path.split(path)
        try:
            return _open_dir(d, create=create), name, path
        except OSError as e:
            raise self._err(e, url, what) from e

    # ------------------------------------------------------------ writes
    def _write_at(self, dfd: int, name: str, url: str, fill, *, if_absent: bool) -> None:
        tmp = ".tmp-" + secrets.token_hex(8)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:
            raise self._err(e, url, "write") from e
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            self._place(dfd, tmp, name, url, if_absent=if_absent)
        except StorageError:
            raise  # AlreadyExists is an OSError too: keep it as it is
        except OSError as e:
            raise self._err(e, url, "write") from e
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass  # renamed into place

    @staticmethod
    def _place(dfd: int, tmp: str, name: str, url: str, *, if_absent: bool) -> None:
        """The complete file ``tmp`` of the folder ``dfd`` becomes ``name``: renamed over
        it, or (``if_absent``) linked, which raises AlreadyExists where the name is taken
        (the caller removes ``tmp`` then)."""
        if if_absent:
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:  # also when a link holds the name: it is left alone
                raise AlreadyExists(f"{url} already exists", url=url) from None
            os.unlink(tmp, dir_fd=dfd)
        else:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a link itself, not its target

    def _write(self, url: str, fill, *, if_absent: bool) -> None:
        dfd, name, _ = self._parent(url, "write", create=True)
        try:
            self._write_at(dfd, name, url, fill, if_absent=if_absent)
        finally:
            os.close(dfd)

    def put_bytes(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        self._write(url, lambda f: f.write(data), if_absent=if_absent)

    def upload_fileobj(self, fileobj: BinaryIO, url: str, *, size: int, if_absent: bool = False,
                       progress: Progress = None) -> None:
        def fill(f):
            while True:
                chunk = fileobj.read(_CHUNK)
                if not chunk:
                    return
                f.write(chunk)
                if progress:
                    progress(len(chunk))

        self._write(url, fill, if_absent=if_absent)

    def copy(self, src_url: str, dst_url: str, *, size: int, src_version: str | None = None,
             progress: Progress = None) -> ObjectInfo:
        """Copy the file through this process, as every local write goes: the source
        opened without following a link (a regular file of ``size`` bytes and, given
        ``src_version``, that inode-mtime-size), its bytes written to a temporary file
        beside the destination (mode 0600, fsynced) and renamed into place, the CRC32C
        computed on the way; ``progress`` per chunk. A source that grows, shrinks or is
        modified while it is read raises PreconditionFailed and leaves no destination.
        The result's ``version`` is the new file's."""
        with self._open(src_url) as src:  # NotFound / UnsafeCheckpoint naming the source
            fd = src.fileno()
            before = os.fstat(fd)
            self._check_copy_source(ObjectInfo(src_url, before.st_size, version=self._version(before)), size, dst_url,
                                    src_version)
            if self._path(src_url) == self._path(dst_url):  # onto itself: nothing to change
                return ObjectInfo(dst_url, size, before.st_mtime, version=self._version(before))
            state = {"crc": 0, "n": 0, "mtime": None, "version": None}

            def changed(how: str) -> PreconditionFailed:
                return PreconditionFailed(f"copy {src_url} to {dst_url}: the source {how} while it was copied; "
                                          "nothing was written (copy it again once no one writes it)", url=src_url)

            def fill(f) -> None:
                while True:
                    try:  # at most one byte past ``size``: enough to see that the source grew
                        chunk = src.read(min(_CHUNK, size + 1 - state["n"]))
                    except OSError as e:
                        raise self._err(e, src_url, "copy: read") from e
                    if not chunk:
                        break
                    state["n"] += len(chunk)
                    if state["n"] > size:
                        raise changed("grew")
                    state["crc"] = google_crc32c.extend(state["crc"], chunk)
                    f.write(chunk)
                    if progress:
                        progress(len(chunk))
                after = os.fstat(fd)
                if state["n"] != size or after.st_size != size:
                    raise changed("shrank")
                if (after.st_mtime_ns, after.st_ino) != (before.st_mtime_ns, before.st_ino):
                    raise changed("was modified")
                f.flush()
                st = os.fstat(f.fileno())  # the rename into place keeps the inode, mtime and size
                state["mtime"], state["version"] = st.st_mtime, self._version(st)

            self._write(dst_url, fill, if_absent=False)
        return ObjectInfo(dst_url, size, state["mtime"], f"{state['crc']:08x}", state["version"])

    # ------------------------------------------------------------ assembly
    def begin_assembly(self, url: str) -> Assembly:
        """Create the empty temporary file ``.tmp-assembly-{token}`` beside the object
        (mode 0600, its folders made as for any write); pieces are written into it at
        their offsets, and the complete renames it into place."""
        assembly = Assembly(url, secrets.token_hex(8))
        dfd, name, path = self._parent(url, "begin assembly of", create=True)
        try:
            tmp = self._assembly_name(assembly)
            os.close(_open_at(dfd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, path, tmp, 0o600))
        except OSError as e:
            raise self._err(e, url, "begin assembly of") from e
        finally:
            os.close(dfd)
        return assembly

    def _open_assembly(self, assembly: Assembly, what: str) -> tuple[int, int, str]:
        """(fd of the object's folder, fd of the assembly's file open for writing, the
        file's name); NotFound once the assembly is completed or aborted."""
        dfd, _, path = self._parent(assembly.url, what)
        tmp = self._assembly_name(assembly)
        try:
            fd = _open_at(dfd, tmp, os.O_WRONLY, path, tmp)
        except OSError as e:
            os.close(dfd)
            if isinstance(e, FileNotFoundError):
                raise NotFound(f"{what} {assembly.url}: the assembly is not under way (completed or aborted)",
                               url=assembly.url) from None
            raise self._err(e, assembly.url, what) from e
        return dfd, fd, tmp

    def put_piece(self, assembly: Assembly, index: int, data: bytes, *, offset: int) -> Piece:
        """Write ``data`` at ``offset`` of the assembly's temporary file (another process
        of a shared folder writes its own pieces into the same file)."""
        if index < 0 or offset < 0:
            raise PreconditionFailed(f"put piece {index} of {assembly.url} at {offset}: pieces are numbered, and "
                                     "placed, from 0", url=assembly.url)
        dfd, fd, _ = self._open_assembly(assembly, f"put piece {index} of")
        try:
            view, at = memoryview(data), offset
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
        except OSError as e:
            raise self._err(e, assembly.url, f"put piece {index} of") from e
        finally:
            os.close(fd)
            os.close(dfd)
        return Piece(index, offset, len(data))

    def _complete_assembly(self, assembly: Assembly, pieces: list[Piece], *, if_absent: bool) -> ObjectInfo:
        """fsync the temporary file (it must hold exactly the pieces' bytes) and rename it
        into place (``if_absent``: link it, which fails if the name exists)."""
        url = assembly.url
        total = pieces[-1].offset + pieces[-1].size
        dfd, fd, tmp = self._open_assembly(assembly, "complete assembly of")
        try:
            st = os.fstat(fd)
            if st.st_size != total:
                raise PreconditionFailed(f"complete assembly of {url}: its file holds {st.st_size} bytes, not the "
                                         f"{total} of its {len(pieces)} pieces (a piece written elsewhere or "
                                         "twice); abort it and assemble again", url=url)
            os.fsync(fd)
            self._place(dfd, tmp, os.path.basename(self._path(url)), url, if_absent=if_absent)
        except StorageError:
            raise
        except OSError as e:
            raise self._err(e, url, "complete assembly of") from e
        finally:
            os.close(fd)
            os.close(dfd)
        return ObjectInfo(url, total, st.st_mtime, version=self._version(st))

    def abort_assembly(self, assembly: Assembly) -> None:
        """Remove the temporary file (already gone: nothing to do)."""
        self.delete(f"{assembly.url.rpartition('/')[0]}/{self._assembly_name(assembly)}")

    # ------------------------------------------------------------ reads
    def _open(self, url: str) -> BinaryIO:
        """The object, open for reading; a folder (or anything but a regular file) is NotFound."""
        dfd, name, path = self._parent(url, "read")
        try:
            # O_NONBLOCK: a planted FIFO must not hang the open (no effect on regular files)
            fd = _open_at(dfd, name, os.O_RDONLY | os.O_NONBLOCK, path, path)
        except OSError as e:
            raise self._err(e, url, "read") from e
        finally:
            os.close(dfd)
        if not st_.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotFound(f"read: {url} is a folder, not an object", url=url)
        return os.fdopen(fd, "rb")

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
    def _version(st: os.stat_result) -> str:
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def version(self, url: str) -> str | None:
        """The file's inode-mtime-size (opened without following a link)."""
        with self._open(url) as f:
            return self._version(os.fstat(f.fileno()))

    def get_bytes_versioned(self, url: str, *, limit: int | None = None) -> tuple[bytes, str]:
        with self._open(url) as f:
            try:
                return f.read(-1 if limit is None else limit + 1), self._version(os.fstat(f.fileno()))
            except OSError as e:
                raise self._err(e, url, "read") from e

    def put_bytes_if_match(self, url: str, data: bytes, version: str) -> None:
        """Compare-and-replace under an flock on a sidecar lock file; readers need no
        lock because the replace is an atomic rename (a new inode). The holder removes
        the sidecar before releasing it (no file is left behind: a folder holding only a
        sidecar would never look empty to gc); a waiter that then gets the flock of the
        removed file sees that the name no longer points at it and starts over."""
        import fcntl

        dfd, name, path = self._parent(url, "write")
        try:
            # the lock file's ".tmp-" name keeps it out of listings
            lock = ".tmp-cas-" + name
            while True:
                lk = _open_at(dfd, lock, os.O_RDWR | os.O_CREAT, path, os.path.join(os.path.dirname(path), lock))
                fcntl.flock(lk, fcntl.LOCK_EX)
                try:
                    current = os.stat(lock, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    current = None
                if current is not None and current.st_ino == os.fstat(lk).st_ino:
                    break  # we hold the lock file that the name points at
                os.close(lk)  # a former holder removed it: take the new one
            try:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None and st_.S_ISLNK(st.st_mode):
                    raise _unsafe(path, path, dfd, name)
                if st is None or self._version(st) != version:
                    raise PreconditionFailed(f"put {url}: the object changed since it was read", url=url)
                self._write_at(dfd, name, url, lambda f: f.write(data), if_absent=False)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock, dir_fd=dfd)  # before releasing: waiters then see it is gone
                os.close(lk)  # releases the flock
        except StorageError:
            raise  # already translated (NotFound is an OSError too)
        except OSError as e:
            raise self._err(e, url, "write") from e
        finally:
            os.close(dfd)

    def download_fileobj(self, url: str, fileobj: BinaryIO, *, progress: Progress = None) -> int:
        n = 0
        with self._open(url) as f:
            try:
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
        dfd, name, path = self._parent(url, "stat")
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if st_.S_ISLNK(st.st_mode):
                raise _unsafe(path, path, dfd, name)
        except OSError as e:
            raise self._err(e, url, "stat") from e
        finally:
            os.close(dfd)
        if not st_.S_ISREG(st.st_mode):
            raise NotFound(f"stat: {url} is a folder, not an object", url=url)
        return ObjectInfo(url, st.st_size, st.st_mtime)

    # ------------------------------------------------------------ listing, deletes
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
            dfd = _open_dir(folder, listable=True)  # a link as the folder: UnsafeCheckpoint
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err(e, prefix, "list") from e
        try:
            yield from self._scan(dfd, folder, prefix, stem, recursive=delimiter is None)
        finally:
            os.close(dfd)

    def _scan(self, dfd: int, folder: str, prefix: str, stem: str, *, recursive: bool) -> Iterator[ListEntry]:
        """Entries of the folder open at ``dfd`` whose names start with ``stem``, sorted;
        ``recursive``: the objects of its subfolders instead of one prefix entry each.
        A link is an object entry (its own size), never descended into."""
        try:
            with os.scandir(dfd) as it:
                entries = sorted((e for e in it if e.name.startswith(stem) and not e.name.startswith(".tmp-")),
                                 key=lambda e: e.name)
        except OSError as e:
            raise self._err(e, prefix, "list") from e
        for e in entries:
            full = os.path.join(folder, e.name)
            try:
                if e.is_dir(follow_symlinks=False):
                    if not recursive:
                        yield ListEntry(self._out(prefix, full + "/"), is_prefix=True)
                        continue
                    sub = _open_at(dfd, e.name, os.O_RDONLY | os.O_DIRECTORY, full, full)
                    try:
                        yield from self._scan(sub, full, prefix, "", recursive=True)
                    finally:
                        os.close(sub)
                    continue
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the scan
            except OSError as err:
                raise self._err(err, prefix, "list") from err
            if st_.S_ISLNK(st.st_mode):
                _log.warning("%s is a symbolic link: cloudckpt does not follow links inside a save folder; "
                             "it is listed as an object and never descended into (remove it if it is not yours)", full)
            yield ListEntry(self._out(prefix, full), size=st.st_size, mtime=st.st_mtime)

    def delete(self, url: str) -> None:
        d, name = os.path.split(self._path(url))
        try:
            dfd = _open_dir(d)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err(e, url, "delete") from e
        try:
            os.unlink(name, dir_fd=dfd)  # a link is removed itself, never its target
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err(e, url, "delete") from e
        finally:
            os.close(dfd)

    def delete_prefix(self, prefix: str, *, force: bool = False) -> int:
        n = super().delete_prefix(prefix, force=force)  # its walk refuses a prefix whose folder is a link
        d, name = os.path.split(self._path(prefix).rstrip("/"))
        if not name:
            return n
        # object stores have no folders: drop the emptied folder tree and temp files too;
        # rmtree with dir_fd never follows a link (and refuses a link as the top)
        try:
            dfd = _open_dir(d)
        except OSError:
            return n
        try:
            shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
        finally:
            os.close(dfd)
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
