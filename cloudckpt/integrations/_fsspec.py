"""A small fsspec filesystem over cloudckpt's ObjectStore, for ``s3://`` and ``gs://``.

Lightning looks at checkpoint and log folders through fsspec (``ModelCheckpoint``
checks whether a path exists and lists its folder; ``CSVLogger`` writes
``metrics.csv`` and ``hparams.yaml``). fsspec needs s3fs/gcsfs for those schemes,
which cannot share an environment with the boto3 cloudckpt uses. This shim
serves exactly that bookkeeping with the same stores, credentials and
``StorageOptions`` as the checkpoints:

- ``info``/``exists``/``isdir``/``isfile``/``ls``: a key is a file; a key prefix
  with objects below it is a folder, as in s3fs/gcsfs (object stores have no
  empty folders);
- ``mkdir``/``makedirs`` write nothing (as in s3fs) but remember the folder for
  this process, so that "make the folder, then check it is there" passes before
  its first object exists. Lightning does that (``CSVLogger``,
  ``save_hyperparameters``) and skips the check only for the fsspec classes it
  knows (s3fs, gcsfs, adlfs); a folder made this way is visible to this process
  only and is never listed;
- ``modified`` of a committed checkpoint folder is its commit time (the marker's);
- ``open``: ``rb`` reads the whole object (at most ``MAX_FILE_BYTES``);
  ``wb``/``ab``/``xb`` buffer in memory and upload with one PUT on close (or on
  commit inside an fsspec transaction), so each object is replaced whole or not
  at all; ``ab`` reads the object and writes it back with the new bytes. Meant
  for small files (logs, ``hparams.yaml``), not for bulk data (checkpoints go
  through the CheckpointIO);
- ``rm_file``.

Every call is one or a few store requests, each bounded by the store's
``operation_timeout`` (``StorageOptions``).

:func:`register` installs it only for schemes whose fsspec package is missing,
with ``clobber=False``: an installed s3fs/gcsfs, or any class registered before,
always wins.
"""

from __future__ import annotations

import datetime
import importlib.util
import io
import logging
from typing import Any

from fsspec.spec import AbstractFileSystem

from ..checkpoint import layout
from ..errors import NotFound
from ..storage import StorageOptions, open_store
from ..storage import url as urls
from ..untrusted import read_capped

MAX_FILE_BYTES = 256 * 1024 * 1024  # a read through the shim larger than this is refused (UnsafeCheckpoint)

log = logging.getLogger(__name__)

_default_options: StorageOptions | None = None
_made: set[str] = set()  # URLs of folders made by mkdir/makedirs in this process (and their parents)


def set_default_storage_options(options: StorageOptions | None) -> None:
    """Storage options used by shim instances created without explicit ones."""
    global _default_options
    _default_options = options


class _ObjectStoreFS(AbstractFileSystem):
    scheme = ""  # set by subclasses: the URL scheme cloudckpt's registry serves
    root_marker = ""

    def __init__(self, *args: Any, storage_options: StorageOptions | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._options = storage_options

    # ---------------------------------------------------------------- helpers
    @property
    def options(self) -> StorageOptions | None:
        return self._options if self._options is not None else _default_options

    def _url(self, path: str) -> str:
        return f"{self.scheme}://{self._strip_protocol(path)}"

    def _name(self, url: str) -> str:
        return url.split("://", 1)[1].rstrip("/")

    def _store(self, url: str):
        return open_store(url, self.options)

    # ---------------------------------------------------------------- queries
    def info(self, path: str, **kwargs: Any) -> dict:
        url = self._url(path)
        name = self._name(url)
        store = self._store(url)
        if "/" in name:  # a key: try the object first
            try:
                st = store.stat(url)
                return {"name": name, "size": st.size, "type": "file", "mtime": st.mtime}
            except NotFound:
                pass
        if ("/" not in name or url.rstrip("/") in _made
                or next(iter(store.list(urls.as_prefix(url), delimiter="/")), None) is not None):
            return {"name": name, "size": 0, "type": "directory"}
        raise FileNotFoundError(f"{url}: no such object or folder")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        url = self._url(path)
        out = []
        for e in self._store(url).list(urls.as_prefix(url), delimiter="/"):
            if e.is_prefix:
                out.append({"name": self._name(e.url), "size": 0, "type": "directory"})
            else:
                out.append({"name": self._name(e.url), "size": e.size, "type": "file", "mtime": e.mtime})
        if not out:
            info = self.info(path)  # a file lists as itself; a missing path raises FileNotFoundError
            out = [info] if info["type"] == "file" else []
        return out if detail else [o["name"] for o in out]

    def modified(self, path: str) -> datetime.datetime:
        """The object's time; for a committed checkpoint folder, its marker's (the commit
        time). Raises IsADirectoryError for other folders (object stores keep no folder times)."""
        info = self.info(path)
        if info["type"] == "directory":
            marker = layout.marker_url(self._url(path))
            try:
                info = {"mtime": self._store(marker).stat(marker).mtime}
            except NotFound:
                raise IsADirectoryError(f"{self._url(path)} is a folder: object stores keep no folder times") from None
        return datetime.datetime.fromtimestamp(info["mtime"], tz=datetime.timezone.utc)

    # ---------------------------------------------------------------- changes
    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Writes nothing (a folder exists once an object is written under it); this
        process sees the folder from now on."""
        url = self._url(path).rstrip("/")
        while "/" in self._name(url):
            _made.add(url)
            url = urls.parent(url).rstrip("/")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Like :meth:`mkdir`, as s3fs: succeeds whether or not the folder has objects."""
        self.mkdir(path)

    def rm_file(self, path: str) -> None:
        self._store(self._url(path)).delete(self._url(path))

    def rmdir(self, path: str) -> None:
        """Forgets a folder made by :meth:`mkdir` (objects under it stay)."""
        _made.discard(self._url(path).rstrip("/"))

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        url = self._url(path)
        if start is None and end is None:
            return read_capped(self._store(url), url, limit=MAX_FILE_BYTES, what="file")
        return self._store(url).get_bytes(url, start=start, end=end)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        url = self._url(path)
        self._store(url).put_bytes(url, bytes(value), if_absent=(mode == "create"))

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any):
        url = self._url(path)
        if mode == "rb":
            return io.BytesIO(self.cat_file(path))
        if mode in ("wb", "ab", "xb"):
            return _BufferedUpload(self._store(url), url, mode, autocommit)
        raise ValueError(f"mode {mode!r} is not supported by cloudckpt's fsspec shim (use rb, wb, ab, xb)")


class _BufferedUpload(io.BytesIO):
    """Collects the bytes of a write and uploads them in one PUT on close (or on
    ``commit()`` inside an fsspec transaction; ``discard()`` drops them)."""

    def __init__(self, store, url: str, mode: str, autocommit: bool):
        super().__init__()
        self._store, self.url, self._autocommit = store, url, autocommit
        self._if_absent = mode == "xb"
        self._done = False
        self._data = b""
        if mode == "ab":
            try:
                self.write(read_capped(store, url, limit=MAX_FILE_BYTES, what="file"))
            except NotFound:
                pass  # appending to a missing file creates it
        elif mode == "xb" and store.exists(url):
            raise FileExistsError(f"{url} already exists")

    def commit(self) -> None:
        if not self._done:
            data = self._data if self.closed else self.getvalue()
            self._store.put_bytes(self.url, data, if_absent=self._if_absent)
            self._done = True
            self._data = b""

    def discard(self) -> None:
        self._done = True
        self._data = b""

    def close(self) -> None:
        if not self.closed:
            if self._autocommit:
                self.commit()
            elif not self._done:
                self._data = self.getvalue()  # kept for commit() at the end of the transaction
        super().close()


class S3ShimFileSystem(_ObjectStoreFS):
    protocol = ("s3", "s3a")
    scheme = "s3"


class GCSShimFileSystem(_ObjectStoreFS):
    protocol = ("gs", "gcs")
    scheme = "gs"


_SHIMS = ((S3ShimFileSystem, "s3fs"), (GCSShimFileSystem, "gcsfs"))


def register(storage_options: StorageOptions | None = None) -> list[str]:
    """Register the shim for ``s3``/``s3a`` when s3fs is not installed and for
    ``gs``/``gcs`` when gcsfs is not, never replacing a class already registered.
    ``storage_options`` become the shim's defaults. Returns the protocols served by the shim."""
    import fsspec
    from fsspec.registry import registry

    if storage_options is not None:
        set_default_storage_options(storage_options)
    served = []
    for cls, package in _SHIMS:
        if importlib.util.find_spec(package) is not None:
            continue  # the real fsspec backend is installed: it serves these schemes
        for proto in cls.protocol:
            try:
                fsspec.register_implementation(proto, cls, clobber=False)
            except ValueError:
                log.debug("fsspec already has %r for %s://; leaving it", registry.get(proto), proto)
                continue
            served.append(proto)
    return served
