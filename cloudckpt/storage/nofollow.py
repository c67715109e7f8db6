"""Local folders worked in by name without following links: the node-local tier's
folder, pre-download files and the per-rank work dirs.

The rule is the local backend's (``storage/local.py``): the folder the user named is
resolved once (``resolve``: a link the user made, ``~/x -> /nfs/x``, and links above
it keep working), and everything *inside* it is reached from an open directory file
descriptor, one component at a time, with ``O_NOFOLLOW``. A link where a folder or a
file is expected raises UnsafeCheckpoint naming it; removing a link removes the link,
never its target. Folders made here are private (mode 0700) unless said otherwise, so
no other user can plant anything in them once they exist.

    with Folder.open(resolve(local_dir), create=True, what="local_dir") as root:
        with root.folder("step20", create=True) as step:
            step.write("part.json", body)
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat as st_

from ..errors import ConfigError, StorageError, UnsafeCheckpoint
from .local import _link_target, _open_at, _open_dir

_PRIVATE = 0o700
_euid = getattr(os, "geteuid", lambda: 0)  # whose folders are ours (a seam for tests run as root or not)


def resolve(path: str) -> str:
    """The user's own folder with every link in it resolved (``os.path.realpath``),
    ``~`` expanded: done once, before anything inside it is opened."""
    return os.path.realpath(os.path.expanduser(path))


def _link_error(full: str, dfd: int, name: str, what: str) -> UnsafeCheckpoint:
    to = _link_target(dfd, name)
    target = "" if to is None else f" (to {to!r})"
    return UnsafeCheckpoint(
        f"{full} is a symbolic link{target} inside {what}. cloudckpt never follows a link inside the folders it "
        "works in (someone else may have planted it there): nothing was read or written through it. Remove the "
        "link; to keep files elsewhere, point the setting itself at that folder.")


def _not_regular(full: str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"{full} in {what} is not a regular file (a device, a FIFO or a socket?); cloudckpt "
                            "did not open it: remove it")


class Folder:
    """An open folder (``fd``; ``path`` for messages and for code that needs a path),
    and what can be done inside it by name, never through a link. ``what`` names the
    folder in errors (``"local_dir /dev/shm/ckpt"``). Close it (or use ``with``)."""

    def __init__(self, fd: int, path: str, what: str):
        self.fd, self.path, self.what = fd, path, what

    @classmethod
    def open(cls, path: str, *, create: bool = False, what: str | None = None) -> "Folder":
        """The folder at the absolute, already resolved ``path``, opened from ``/``
        without following a link at any component (UnsafeCheckpoint); ``create``: make
        the missing ones. Raises OSError (FileNotFoundError when missing)."""
        return cls(_open_dir(path, create=create, listable=True), path, what or path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Folder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def join(self, rel: str = "") -> str:
        return os.path.join(self.path, *[c for c in rel.split("/") if c])

    # ------------------------------------------------------------ opening by name
    def _open_at(self, dfd: int, name: str, flags: int, full: str, mode: int = 0o600) -> int:
        try:  # the local backend's open: O_NOFOLLOW, a link there told apart from other errors
            return _open_at(dfd, name, flags, full, full, mode)
        except UnsafeCheckpoint:
            raise _link_error(full, dfd, name, self.what) from None

    def _walk(self, comps: list[str], *, create: bool, mode: int) -> int:
        """An fd of the folder ``comps`` below this one (the caller closes it)."""
        fd = os.dup(self.fd)
        try:
            for i, c in enumerate(comps):
                full = os.path.join(self.path, *comps[: i + 1])
                try:
                    nfd = self._open_at(fd, c, os.O_RDONLY | os.O_DIRECTORY, full)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):  # a racing maker (or a link: caught next)
                        os.mkdir(c, mode, dir_fd=fd)
                    nfd = self._open_at(fd, c, os.O_RDONLY | os.O_DIRECTORY, full)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _split(rel: str) -> list[str]:
        comps = [c for c in rel.split("/") if c]
        if any(c in (".", "..") for c in comps):
            raise UnsafeCheckpoint(f"{rel!r} climbs out of its folder; refused")
        return comps

    def folder(self, rel: str, *, create: bool = False, mode: int = _PRIVATE) -> "Folder":
        """The folder ``rel`` (``a/b``) inside this one; ``create``: make the missing
        ones with ``mode``. A link on the way: UnsafeCheckpoint. Raises OSError."""
        return Folder(self._walk(self._split(rel), create=create, mode=mode), self.join(rel), self.what)

    def _parent(self, rel: str) -> tuple["Folder", str]:
        comps = self._split(rel)
        if not comps:
            raise UnsafeCheckpoint(f"an empty file name in {self.what}; refused")
        return self.folder("/".join(comps[:-1])), comps[-1]

    def open_file(self, rel: str) -> int:
        """An fd of the regular file ``rel``, open for reading (a link on the way or as
        the file: UnsafeCheckpoint; a FIFO or device: UnsafeCheckpoint, never opened
        blocking). Raises OSError (FileNotFoundError when missing)."""
        parent, name = self._parent(rel)
        with parent:
            # O_NONBLOCK: a planted FIFO must not hang the open (no effect on regular files)
            fd = self._open_at(parent.fd, name, os.O_RDONLY | os.O_NONBLOCK, self.join(rel))
        if not st_.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _not_regular(self.join(rel), self.what)
        os.set_blocking(fd, True)
        return fd

    def read(self, rel: str, *, limit: int) -> bytes:
        """The first ``limit + 1`` bytes at most of the regular file ``rel`` (a caller
        that sees more than ``limit`` refuses the file)."""
        with os.fdopen(self.open_file(rel), "rb") as f:
            return f.read(limit + 1)

    def file_stat(self, rel: str) -> os.stat_result | None:
        """The stat of ``rel`` if it is a regular file reached without a link; None if
        missing; UnsafeCheckpoint for a link."""
        try:
            parent, name = self._parent(rel)
        except (FileNotFoundError, NotADirectoryError):
            return None
        with parent:
            st = parent.lstat(name)
            if st is not None and st_.S_ISLNK(st.st_mode):
                raise _link_error(self.join(rel), parent.fd, name, self.what)
        return st if st is not None and st_.S_ISREG(st.st_mode) else None

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry ``name`` of this folder itself (a link is reported as a link); None if missing."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_link(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and st_.S_ISLNK(st.st_mode)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    # ------------------------------------------------------------ writing
    def new_file(self, name: str, *, flags: int = os.O_WRONLY, mode: int = 0o600) -> int:
        """An fd of a file ``name`` created here now (``O_EXCL``: a link or anything
        already there is never opened: FileExistsError, or UnsafeCheckpoint for a link)."""
        return self._open_at(self.fd, name, flags | os.O_CREAT | os.O_EXCL, self.join(name), mode)

    def write(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data`` atomically (a temporary file renamed over it:
        a link there is replaced itself, never written through)."""
        tmp = f".tmp-{secrets.token_hex(8)}"
        try:
            with os.fdopen(self.new_file(tmp), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)

    def touch(self, name: str) -> None:
        """Make the empty file ``name`` (already there: kept; a link: UnsafeCheckpoint)."""
        os.close(self._open_at(self.fd, name, os.O_WRONLY | os.O_CREAT, self.join(name)))

    def mkdtemp(self, prefix: str) -> str:
        """A new private folder named ``prefix`` + random hex; returns its name."""
        for _ in range(100):
            name = prefix + secrets.token_hex(6)
            try:
                os.mkdir(name, _PRIVATE, dir_fd=self.fd)
                return name
            except FileExistsError:
                continue  # planted or taken: another name
        raise StorageError(f"{self.path}: could not make a new folder named {prefix}*: 100 names were taken",
                           url=self.path)

    def rename(self, src: str, dst: str) -> None:
        """Move the entry ``src`` of this folder to ``dst`` (an empty folder or a file
        there is replaced; remove anything else first)."""
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove(self, name: str) -> None:
        """Remove the entry ``name``: a file or a link itself (never its target), a
        folder with everything in it (walked by fd: links inside are removed, not
        followed). Missing: nothing."""
        st = self.lstat(name)
        if st is None:
            return
        if not st_.S_ISDIR(st.st_mode):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.fd)
            return
        shutil.rmtree(name, dir_fd=self.fd, ignore_errors=True)  # fd-based: never follows a link
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(name, dir_fd=self.fd)  # raises if something could not be removed

    def link_file(self, rel: str, dest: "Folder", dest_name: str) -> None:
        """Put the regular file ``rel`` into ``dest`` as ``dest_name``: a hard link,
        else (another file system, no rights to link) a copy; never through a link."""
        fd = self.open_file(rel)  # checks: regular, no link on the way
        try:
            parent, name = self._parent(rel)
            with parent:
                try:
                    st = os.fstat(fd)
                    os.link(name, dest_name, src_dir_fd=parent.fd, dst_dir_fd=dest.fd, follow_symlinks=False)
                    linked = os.stat(dest_name, dir_fd=dest.fd, follow_symlinks=False)
                    if (linked.st_dev, linked.st_ino) == (st.st_dev, st.st_ino):
                        return
                    os.unlink(dest_name, dir_fd=dest.fd)  # the name changed under us: copy what we opened
                except OSError as e:
                    if e.errno == errno.EEXIST:
                        raise
            with os.fdopen(dest.new_file(dest_name), "wb") as out, os.fdopen(os.dup(fd), "rb") as src:
                shutil.copyfileobj(src, out, 8 << 20)
        finally:
            os.close(fd)


def private_dir(base: str, prefix: str) -> str:
    """A new private folder (mode 0700, named ``prefix`` + random hex) for one rank's
    scratch files, in the work folder ``base`` (made 0700 if missing); returns its
    path. ``base`` is the user's (links the user made are followed once), but a link
    in its place that another user owns, or a ``base`` that another user owns (a
    ``/tmp/cloudckpt-work-<uid>`` made first by someone else), is refused with
    ConfigError: its owner could swap the folders made in it for links."""
    parent, name = os.path.split(os.path.abspath(os.path.expanduser(base)))
    parent = resolve(parent)
    os.makedirs(parent, exist_ok=True)
    path = os.path.join(parent, name)
    me = _euid()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and st_.S_ISLNK(st.st_mode):
        if st.st_uid not in (me, 0):
            raise _foreign(base, path, st.st_uid, "a symbolic link made by")
        path = resolve(path)
    try:
        os.mkdir(path, _PRIVATE)
    except FileExistsError:
        pass
    with Folder.open(path, what=f"work_dir {base}") as f:
        owner = os.fstat(f.fd).st_uid
        if owner not in (me, 0):
            raise _foreign(base, path, owner, "a folder owned by")
        return os.path.join(path, f.mkdtemp(prefix))


def _foreign(base: str, path: str, uid: int, what: str) -> ConfigError:
    return ConfigError(
        f"work_dir {base!r}: {path} is {what} another user (uid {uid}), not by this process (uid {_euid()}); "
        "that user could swap the scratch folders cloudckpt makes there for links. Remove it, or set work_dir "
        "to a folder you own")


__all__ = ["Folder", "private_dir", "resolve"]
