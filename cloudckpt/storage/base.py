"""The ObjectStore interface.

A backend implements a handful of primitives (marked abstract); everything else is
derived once, here. Every method takes full URLs (or plain paths for the local
backend), so nothing above ``storage/`` needs to know which backend it talks to.

Errors: every method raises only the storage branch of :mod:`cloudckpt.errors`
(NotFound, BucketNotFound, AlreadyExists, PreconditionFailed, AccessDenied,
Throttled/Transient, InvalidURL, UnsafeDelete, CopyUnsupported), with the URL in the message.
Thread safety: a store instance is shared by all threads of a process.
"""

from __future__ import annotations

import os
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, ClassVar, Iterable, Iterator, Optional
from urllib.parse import urlsplit

from .. import rules
from ..errors import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    CopyUnsupported,
    DeleteFailed,
    NotFound,
    ObjectTooLarge,
    PreconditionFailed,
    StorageError,
    Transient,
    UnsafeDelete,
)
from ..units import MiB
from . import url as urls
from .assembly import Assembly, Piece, check_pieces

Progress = Optional[Callable[[int], None]]
"""Called with the number of bytes moved since the last call."""



@dataclass(frozen=True)
class StorageOptions:
    """Per-folder storage options. ``None`` means: use the SDK's standard
    resolution (env such as ``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``AWS_REGION``,
    ``STORAGE_EMULATOR_HOST``, config files, instance metadata)."""

    endpoint_url: str | None = None
    profile: str | None = None
    region: str | None = None
    addressing_style: str | None = None  # "path" | "virtual" | "auto" (S3)
    project: str | None = None  # GCS project for bucket-level calls
    # None: the backend's default (ObjectStore.default_multipart_threshold / default_part_size):
    # S3 sends objects up to 512 MiB in one PUT and larger ones in 64 MiB parts (fewer,
    # larger requests: less CPU per byte on both ends, fewer requests against per-prefix
    # limits); GCS holds one chunk in memory per running upload, so it keeps 64 MiB / 16 MiB.
    multipart_threshold: int | None = None
    part_size: int | None = None
    max_pool_connections: int = 64
    max_attempts: int = 8  # SDK-level attempts per request (retries on 5xx/throttling/resets)
    # Time bounds (seconds). connect_timeout / read_timeout bound one attempt's wait to open a
    # connection / for the next bytes of an answer (each capped at operation_timeout).
    # operation_timeout is one request's deadline over all the SDK's attempts: once it is spent
    # the request is not retried again, and the transfer engine does not re-attempt a transfer
    # that made no progress for that long. An attempt under way is never cut by it: a slow but
    # progressing upload or download is judged by the engine's stall watchdog (stall_timeout).
    # Against an endpoint that never answers a request fails with Timeout after about
    # operation_timeout, at most operation_timeout + connect + read (docs/configuration.md).
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    operation_timeout: float = 60.0
    min_delete_depth: int = 1  # delete_prefix refuses prefixes shallower than this
    # S3: SHA-256 every request body for its SigV4 signature (client and server each hash
    # every byte, ~1 CPU-s/GiB apiece here). Off by default: TLS protects the bytes in
    # transit and cloudckpt checks its own CRC32C of every item on load and in `verify`.
    sign_payload: bool = False

    def __post_init__(self) -> None:
        rules.check("storage option ", self, STORAGE_RULES)
        if self.endpoint_url is not None:
            check_endpoint_url(self.endpoint_url)

    @property
    def attempt_timeouts(self) -> tuple[float, float]:
        """``(connect, read)`` seconds for one attempt: the options, capped at ``operation_timeout``."""
        return min(self.connect_timeout, self.operation_timeout), min(self.read_timeout, self.operation_timeout)


_optional_text = rules.text(none="for the SDK's default")
_seconds = rules.number(0, strict=True, finite=True)

#: one rule per field of StorageOptions (cloudckpt/rules.py), checked in __post_init__
STORAGE_RULES: dict[str, rules.Rule] = {
    "endpoint_url": lambda v: None,  # checked whole after the table: check_endpoint_url
    "profile": _optional_text,
    "region": _optional_text,
    "addressing_style": lambda v: None if v is None or (type(v) is str and v in ("path", "virtual", "auto"))
    else "use 'path', 'virtual' or 'auto'",
    "project": _optional_text,
    "multipart_threshold": rules.integer(1, none="for the backend's default"),
    "part_size": rules.integer(5 * MiB, none="for the backend's default", why=" (5 MiB: S3's smallest part)"),
    "max_pool_connections": rules.integer(1),
    "max_attempts": rules.integer(1),
    "connect_timeout": _seconds,
    "read_timeout": _seconds,
    "operation_timeout": _seconds,
    "min_delete_depth": rules.integer(0),
    "sign_payload": rules.boolean(),
}


def check_endpoint_url(endpoint: str) -> None:
    """Raise ConfigError unless ``endpoint`` is an ``http://`` or ``https://`` URL with a host."""

    if not isinstance(endpoint, str):
        raise ConfigError(f"storage option endpoint_url={endpoint!r} is not a URL: write e.g. http://127.0.0.1:9000")
    try:
        p = urlsplit(endpoint)
        host, _ = p.hostname, p.port
    except ValueError:
        host, p = None, None
    if p is not None and p.scheme in ("http", "https") and host:
        return
    shown = redact_endpoint(endpoint)
    where = f"storage option endpoint_url={shown!r} (--endpoint-url, CLOUDCKPT_ENDPOINT_URL)"
    if "://" not in endpoint:
        raise ConfigError(f"{where} has no scheme: write http://{shown} (or https://{shown} for TLS)")
    raise ConfigError(f"{where} is not an http:// or https:// URL with a host: write e.g. http://127.0.0.1:9000")


def redact_endpoint(endpoint: str) -> str:
    """``endpoint`` without any ``user:password@`` part (for messages)."""
    head, sep, rest = str(endpoint).partition("://")
    if not sep:
        head, rest = "", head
    netloc, slash, path = rest.partition("/")
    netloc = netloc.rpartition("@")[2]
    return f"{head}{sep}{netloc}{slash}{path}"


@dataclass(frozen=True)
class ObjectInfo:
    url: str
    size: int
    mtime: float | None = None  # seconds since the epoch
    # CRC32C of the object's bytes as 8 lowercase hex digits (cloudckpt.transfer.checksum's
    # form), where the backend had it for free (``copy``: GCS's answer, local's own pass);
    # None otherwise: never a promise that the store checked anything
    crc32c: str | None = None
    # the object's version token (S3 ETag, GCS generation, local inode-mtime-size) where
    # the backend had it for free (``copy``'s destination); None otherwise
    version: str | None = None


@dataclass(frozen=True)
class ListEntry:
    """One result of :meth:`ObjectStore.list`: an object, or a common prefix
    (``is_prefix``; its url ends with ``/``)."""

    url: str
    is_prefix: bool = False
    size: int = 0
    mtime: float | None = None


@dataclass(frozen=True)
class PendingUpload:
    """An incomplete multipart upload (S3)."""

    url: str
    upload_id: str
    initiated: float | None = None
    extra: dict = field(default_factory=dict, compare=False)


class _SizedWriter:
    """A file object that passes writes to ``f`` until they would end past ``size``
    bytes (counted by position when ``f`` seeks: s3transfer writes ranges in place),
    then raises ObjectTooLarge."""

    def __init__(self, f: BinaryIO, size: int, url: str):
        self._f, self._size, self._url = f, size, url
        self._pos = 0
        self._seekable = bool(getattr(f, "seekable", lambda: False)())

    def write(self, b) -> int:
        n = len(memoryview(b))
        if self._pos + n > self._size:
            raise ObjectTooLarge(f"download {self._url}: the object holds more than the {self._size} bytes expected "
                                 "(its size in the checkpoint's manifest); refusing to write further", url=self._url)
        self._f.write(b)
        self._pos += n
        return n

    def seekable(self) -> bool:
        return self._seekable

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = self._f.seek(pos, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        getattr(self._f, "flush", lambda: None)()


class DeleteFailures:
    """The objects of one ``delete_many`` that were not deleted. ``add`` raises at once
    an error that is not about the object itself (AccessDenied, a missing bucket,
    Transient: trying the other objects would fail the same way)."""

    SHOWN = 5  # keys named in the message

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.first: StorageError | None = None

    def add(self, url: str, err: StorageError) -> None:
        if isinstance(err, (AccessDenied, BucketNotFound, Transient)):
            raise err
        self.urls.append(url)
        self.first = self.first or err

    def raise_if_any(self, deleted: int) -> None:
        if not self.urls:
            return
        names = ", ".join(ascii(u) for u in self.urls[:self.SHOWN]) + (", ..." if len(self.urls) > self.SHOWN else "")
        first = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(self.first)[:300])
        raise DeleteFailed(f"delete: {len(self.urls)} object(s) were not deleted ({deleted} were): {names}; the "
                           f"first error: {first}. Delete them with the store's own tools (the names are shown "
                           "with Python escapes)", url=self.urls[0], failed=tuple(self.urls), deleted=deleted) \
            from self.first


class RangeReader:
    """Sequential reads of the byte range ``[start, end)`` of one object, from
    :meth:`ObjectStore.open_range`. ``read(n)`` returns up to ``n`` bytes (a
    bytes-like object), fewer only where the range or the object ends. Errors are
    the store's typed ones. Use it as a context manager (``close`` frees the
    connection or file)."""

    def read(self, n: int):  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        """Release the connection or file (also when not everything was read)."""

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ChunkedRangeReader(RangeReader):
    """The default :class:`RangeReader`: ``get_bytes`` of ``chunk``-byte pieces (or
    of the whole read, when it is larger), served from a memoryview, so a small
    read does not become a request and a large one is one request."""

    def __init__(self, store: "ObjectStore", url: str, start: int, end: int, chunk: int):
        self._store, self._url, self._chunk = store, url, max(1, chunk)
        self._next, self._end = start, end  # what to fetch next
        self._buf = memoryview(b"")
        self._eof = end <= start

    def read(self, n: int):
        pieces = []
        want = n
        while want > 0:
            if not len(self._buf):
                if self._eof:
                    break
                size = min(max(want, self._chunk), self._end - self._next)
                data = self._store.get_bytes(self._url, start=self._next, end=self._next + size)
                self._next += len(data)
                self._eof = len(data) < size or self._next >= self._end  # the object (or the range) ends here
                self._buf = memoryview(data)
                if not data:
                    break
            piece, self._buf = self._buf[:want], self._buf[want:]
            pieces.append(piece)
            want -= len(piece)
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def close(self) -> None:
        self._buf = memoryview(b"")
        self._eof = True


class ObjectStore(ABC):
    """One backend. Subclasses set ``scheme`` and implement the abstract primitives."""

    scheme: ClassVar[str]
    #: ``open_range`` streams one request (S3: one GET read as the caller goes; local:
    #: the file). False (the default, GCS): it fetches ``part_size`` pieces, so a caller
    #: reading long ranges should keep them short (the DCP reader does).
    streams_ranges: ClassVar[bool] = False

    #: ``get_bytes_versioned`` + ``put_bytes_if_match`` work: a small object can be
    #: replaced only if nobody replaced it since it was read (S3 ``If-Match``, GCS
    #: generation match, local compare-and-rename). The ``latest`` pointer and a stale
    #: save lock's takeover need it; where it is False (the default: a backend declares
    #: it) the checkpointer leaves the pointer alone and discovery lists.
    conditional_replace: ClassVar[bool] = False

    #: ``copy`` works: S3 and GCS copy within the store (no byte passes through this
    #: process), local folders copy the file. False (the default): ``copy`` raises
    #: CopyUnsupported and the caller sends the bytes itself.
    copies_objects: ClassVar[bool] = False

    #: ``begin_assembly`` / ``put_piece`` / ``complete_assembly`` / ``abort_assembly`` work
    #: (storage/assembly.py: one object from pieces different processes upload; S3
    #: multipart, GCS compose, local offsets). False (the default): they raise StorageError.
    assembles_objects: ClassVar[bool] = False
    #: The least bytes of every piece of an assembly but the last (S3: 5 MiB).
    min_piece_size: ClassVar[int] = 0
    #: The most pieces of one assembly (S3: 10,000); None: no limit.
    max_pieces: ClassVar[Optional[int]] = None

    #: Used when StorageOptions leaves multipart_threshold / part_size as None.
    default_multipart_threshold: ClassVar[int] = 64 * MiB
    default_part_size: ClassVar[int] = 16 * MiB
    #: Job-wide request rates the store sustains per prefix, ``(writes/s, reads/s)``: the
    #: transfer engine paces a job's requests under them (TransferConfig.request_rate
    #: overrides). None (the default: local folders): no pacing.
    default_request_rates: ClassVar[Optional[tuple[float, float]]] = None

    def __init__(self, options: StorageOptions | None = None):
        self.options = options or StorageOptions()
        self._retry_listeners: list[Callable[[str], None]] = []

    # a pickled store is its options: clients, listeners (transfer engines of this
    # process) and caches are made again in the copy
    def __getstate__(self):
        return {"options": self.options}

    def __setstate__(self, state):
        self.__init__(state["options"])

    @property
    def multipart_threshold(self) -> int:
        """Objects larger than this are uploaded in parts (the option, or this backend's default)."""
        v = self.options.multipart_threshold
        return self.default_multipart_threshold if v is None else v

    @property
    def part_size(self) -> int:
        """Size of each part or chunk of a larger upload (the option, or this backend's default)."""
        v = self.options.part_size
        return self.default_part_size if v is None else v

    def add_retry_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(kind)`` is called for every request the SDK retries; ``kind`` is
        ``"throttled"`` (503 SlowDown, 429) or ``"transient"`` (5xx, resets, timeouts).
        The transfer engine uses it to count retries and back off its concurrency."""
        self._retry_listeners.append(fn)

    def remove_retry_listener(self, fn: Callable[[str], None]) -> None:
        try:
            self._retry_listeners.remove(fn)
        except ValueError:
            pass  # never added, or already removed: nothing to do

    def _notify_retry(self, kind: str) -> None:
        for fn in list(self._retry_listeners):
            fn(kind)

    # ------------------------------------------------------------ primitives
    @abstractmethod
    def put_bytes(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a small object. ``if_absent``: create only if it does not exist
        (raises AlreadyExists otherwise; exactly one of racing writers wins)."""

    @abstractmethod
    def get_bytes(self, url: str, *, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object, or the byte range ``[start, end)`` of it. Raises NotFound."""

    def open_range(self, url: str, start: int, end: int) -> RangeReader:
        """Read ``[start, end)`` of ``url`` front to back, in pieces the caller chooses
        (:class:`RangeReader`). This default fetches ``part_size`` pieces with
        ``get_bytes``; S3 streams one GET. Raises NotFound (here or on the first read)."""
        return ChunkedRangeReader(self, url, start, end, self.part_size)

    @abstractmethod
    def upload_fileobj(
        self, fileobj: BinaryIO, url: str, *, size: int, if_absent: bool = False, progress: Progress = None
    ) -> None:
        """Upload ``size`` bytes read sequentially from ``fileobj`` (multipart above the
        threshold). The file object is read once, front to back, unless the backend
        has to restart the upload, in which case it seeks back to 0 first."""

    @abstractmethod
    def download_fileobj(self, url: str, fileobj: BinaryIO, *, progress: Progress = None) -> int:
        """Write the object's bytes to ``fileobj``, front to back. Returns the size."""

    @abstractmethod
    def stat(self, url: str) -> ObjectInfo:
        """Size and modification time of one object. Raises NotFound."""

    @abstractmethod
    def list(self, prefix: str, *, delimiter: str | None = "/") -> Iterator[ListEntry]:
        """Objects whose URL starts with ``prefix`` (all pages). With ``delimiter="/"``
        objects below a further ``/`` are folded into one prefix entry each.
        Raises BucketNotFound when the bucket does not exist."""

    @abstractmethod
    def delete(self, url: str) -> None:
        """Delete one object; deleting a missing object is not an error."""

    def delete_many(self, urls_: Iterable[str]) -> int:
        """Delete objects (batched where the backend can). Every object is tried; returns
        how many are gone (deleted, or already missing). Raises DeleteFailed naming the
        objects a delete refused (each object's own problem, e.g. a key the store will
        not take); a failure that is not about one object (AccessDenied, a missing
        bucket, Transient after retries) is raised at once."""
        failed = DeleteFailures()
        n = 0
        for u in urls_:
            try:
                self.delete(u)
                n += 1
            except StorageError as e:
                failed.add(u, e)
        failed.raise_if_any(n)
        return n

    def get_bytes_versioned(self, url: str, *, limit: int | None = None) -> tuple[bytes, str]:
        """Read a small object and its version token (S3 ETag, GCS generation, local
        inode+mtime+size) for a later ``put_bytes_if_match``. With ``limit``, at most
        ``limit + 1`` bytes are read (the caller refuses more). Raises NotFound; a
        store without :attr:`conditional_replace` raises StorageError."""
        raise self._no_conditional_replace(url)

    def put_bytes_if_match(self, url: str, data: bytes, version: str) -> None:
        """Replace the object only if it still has ``version``; raises PreconditionFailed
        otherwise (someone else wrote it in between). A store without
        :attr:`conditional_replace` raises StorageError."""
        raise self._no_conditional_replace(url)

    def _no_conditional_replace(self, url: str) -> StorageError:
        return StorageError(f"{url}: the {type(self).__name__} backend cannot replace an object conditionally "
                            "(its conditional_replace is False); callers check store.conditional_replace first",
                            url=url)

    def copy(self, src_url: str, dst_url: str, *, size: int, src_version: str | None = None,
             progress: Progress = None) -> ObjectInfo:
        """Server-side copy of the object ``src_url`` to ``dst_url`` in the same store (no
        byte passes through this process on S3/GCS). ``size``: the size the caller expects
        src to have. ``src_version``: the version token src must still have (what
        :meth:`version` or an earlier copy's ``ObjectInfo.version`` said when the caller
        wrote it: S3 ETag, GCS generation, local inode-mtime-size), so that an object
        someone else put there since is never copied. An existing ``dst_url`` is replaced; a
        copy of an object onto itself changes nothing. Returns the destination's ObjectInfo
        (``crc32c`` and ``version`` where the backend has them for free). Raises NotFound
        (src missing, naming src), PreconditionFailed (src is not ``size`` bytes, not
        ``src_version``, or it changed between the check and the copy; nothing is written
        then), the usual StorageError types otherwise (AccessDenied, Transient,
        InvalidURL...). This default (a store without :attr:`copies_objects`) raises
        CopyUnsupported."""
        raise CopyUnsupported(f"copy {src_url} to {dst_url}: the {type(self).__name__} backend cannot copy an "
                              "object within the store; read it and write the bytes instead", url=src_url)

    def version(self, url: str) -> str | None:
        """The object's version token now (what ``copy(src_version=...)`` matches: S3 ETag,
        GCS generation, local inode-mtime-size), or None where the backend has none (this
        default). Raises NotFound."""
        return None

    @staticmethod
    def _check_copy_source(info: ObjectInfo, size: int, dst_url: str, src_version: str | None = None) -> None:
        """Raise PreconditionFailed unless the copy's source ``info`` holds ``size`` bytes
        and, given ``src_version``, has that version."""
        if info.size != size:
            raise PreconditionFailed(f"copy {info.url} to {dst_url}: the source holds {info.size} bytes, not the "
                                     f"{size} expected; nothing was copied (send the bytes instead, or pass the "
                                     "size the source has)", url=info.url)
        if src_version is not None and info.version != src_version:
            raise PreconditionFailed(f"copy {info.url} to {dst_url}: the source is version {info.version}, not the "
                                     f"{src_version} the caller wrote (someone replaced it); nothing was copied",
                                     url=info.url)

    # ------------------------------------------------------------ assembly (storage/assembly.py)
    def begin_assembly(self, url: str) -> Assembly:
        """(one process) Start assembling the object ``url`` from pieces; nothing is
        visible at ``url`` until :meth:`complete_assembly`. A store without
        :attr:`assembles_objects` raises StorageError."""
        raise self._no_assembly(url)

    def put_piece(self, assembly: Assembly, index: int, data: bytes, *, offset: int) -> Piece:
        """(any process) Upload piece ``index`` (0, 1, ...): bytes ``[offset, offset +
        len(data))`` of the object. Uploading a piece again replaces it. Returns the
        record :meth:`complete_assembly` needs. Raises NotFound once the assembly is
        aborted or completed (where the store can tell)."""
        raise self._no_assembly(assembly.url)

    def complete_assembly(self, assembly: Assembly, pieces: Iterable[Piece], *,
                          if_absent: bool = False) -> ObjectInfo:
        """(one process) Make the object from ``pieces`` (every piece's record, any order;
        checked by ``assembly.check_pieces`` first: PreconditionFailed, nothing sent): it
        appears at the URL whole, at once. ``if_absent``: only if no object is there
        (AlreadyExists otherwise; the assembly is left for :meth:`abort_assembly`).
        Returns the object's ObjectInfo (size; ``crc32c`` and ``version`` where free)."""
        url = assembly.url
        if not self.assembles_objects:
            raise self._no_assembly(url)
        ordered = check_pieces(url, list(pieces), min_piece_size=self.min_piece_size, max_pieces=self.max_pieces)
        return self._complete_assembly(assembly, ordered, if_absent=if_absent)

    def _complete_assembly(self, assembly: Assembly, pieces: list[Piece], *, if_absent: bool) -> ObjectInfo:
        """The backend's complete: ``pieces`` checked, in order."""
        raise self._no_assembly(assembly.url)

    def abort_assembly(self, assembly: Assembly) -> None:
        """(any process) Give up the assembly: nothing appears at the URL and the pieces
        uploaded so far are removed. Aborting twice, or after a complete, is not an error."""
        raise self._no_assembly(assembly.url)

    def _no_assembly(self, url: str) -> StorageError:
        return StorageError(f"{url}: the {type(self).__name__} backend cannot assemble an object from pieces (its "
                            "assembles_objects is False); callers check store.assembles_objects first", url=url)

    def list_multipart_uploads(self, prefix: str) -> list[PendingUpload]:
        """Incomplete multipart uploads under ``prefix`` (empty where the backend has none)."""
        return []

    def abort_multipart_upload(self, upload: PendingUpload) -> None:  # noqa: B027 - optional: nothing by default
        """Abort one incomplete multipart upload."""

    def check_bucket(self, url: str) -> None:
        """Raise BucketNotFound / AccessDenied if the URL's bucket cannot be used."""
        next(iter(self.list(urls.as_prefix(url), delimiter="/")), None)

    # ------------------------------------------------------------ derived
    def exists(self, url: str) -> bool:
        try:
            self.stat(url)
            return True
        except NotFound:
            return False

    def upload_file(self, local_path: str, url: str, *, if_absent: bool = False, progress: Progress = None) -> int:
        """Upload a local file; returns its size. Backends that can read parts straight
        from the file (S3: s3transfer reads each part from disk as it sends it)
        override this so that no part is held in memory; the default streams the
        file through upload_fileobj."""
        with open(local_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.upload_fileobj(f, url, size=size, if_absent=if_absent, progress=progress)
        return size

    def download_sized(self, url: str, fileobj: BinaryIO, *, size: int, progress: Progress = None) -> int:
        """``download_fileobj`` of an object the caller expects to hold ``size`` bytes
        (its manifest's size): at most ``size`` bytes reach ``fileobj``; an object that
        holds more raises ObjectTooLarge (a hostile store cannot fill a disk). Returns
        the bytes written (fewer than ``size`` when the object is shorter: the caller
        compares). This default counts what the backend writes; http(s) also refuses
        an answer that announces more."""
        return self.download_fileobj(url, _SizedWriter(fileobj, size, url), progress=progress)

    def download_file(self, url: str, local_path: str, *, progress: Progress = None, size: int | None = None) -> int:
        """Download to ``local_path`` via a temporary file and a rename, so a partial
        download never has the final name. ``size``: as ``download_sized``."""
        d = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as f:
                if size is None:
                    n = self.download_fileobj(url, f, progress=progress)
                else:
                    n = self.download_sized(url, f, size=size, progress=progress)
            os.replace(tmp, local_path)
            return n
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass  # already renamed or never created: nothing to clean
            raise

    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix``, recursively."""
        for e in self.list(prefix, delimiter=None):
            if not e.is_prefix:
                yield ObjectInfo(e.url, e.size, e.mtime)

    def delete_prefix(self, prefix: str, *, force: bool = False) -> int:
        """Delete every object under the folder ``prefix`` (a trailing ``/`` is added).
        Refuses (UnsafeDelete) a bucket root or a prefix shallower than
        ``options.min_delete_depth`` unless ``force``. Returns the number deleted (gone);
        raises DeleteFailed (see ``delete_many``) when some were not."""
        prefix = urls.as_prefix(prefix)
        d = urls.depth(prefix)
        if not force and (d == 0 or d < self.options.min_delete_depth):
            raise UnsafeDelete(
                f"refusing to delete everything under {prefix!r}: it is "
                f"{'a bucket root' if d == 0 else f'only {d} level(s) deep'} "
                f"(min_delete_depth={self.options.min_delete_depth}); pass force=True if you really mean it",
                url=prefix,
            )
        return self.delete_many(o.url for o in self.walk(prefix))

    def abort_multipart_uploads(self, prefix: str, *, older_than: float | None = None,
                                now: float | None = None) -> list[PendingUpload]:
        """Abort incomplete multipart uploads under ``prefix`` initiated more than
        ``older_than`` seconds ago (all when None). Returns the aborted ones."""
        now = time.time() if now is None else now
        done = []
        for up in self.list_multipart_uploads(prefix):
            if older_than is not None and up.initiated is not None and now - up.initiated < older_than:
                continue
            self.abort_multipart_upload(up)
            done.append(up)
        return done

    def connect(self) -> None:  # noqa: B027 - optional: nothing by default
        """Build the backend's client now instead of on first use. Sends no request to
        the store (finding credentials may, as it would on first use: e.g. Google's
        default credentials on a GCE VM). Building boto3's S3 client takes ~0.15-0.3 s
        of CPU: the checkpointer has ranks do it while they would otherwise wait for
        rank 0. Default: nothing."""

    def close(self) -> None:  # noqa: B027 - optional: nothing by default
        """Release connections. The store stays usable (clients are re-created lazily)."""
