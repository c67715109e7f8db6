"""Google Cloud Storage through google-cloud-storage (JSON API).

Credentials are Application Default Credentials (``gcloud auth
application-default login``, ``GOOGLE_APPLICATION_CREDENTIALS``, the metadata
server), and the project is ``StorageOptions.project`` or the ADC/env default. When
``STORAGE_EMULATOR_HOST`` is set (fake-gcs-server, the official emulator) the
client uses anonymous credentials and that endpoint instead; the variable is read
when the client is first needed, not at import.

Request retries are google-api-core's, as the library's ``DEFAULT_RETRY`` (its
predicate: 408, 429, 5xx, connection resets and timeouts; exponential backoff with
jitter). api-core's ``Retry(timeout=...)`` is already a deadline over a request's
attempts (no retry starts after it): it is ``StorageOptions.operation_timeout``, per
request or per upload chunk, and each attempt's socket waits are
``StorageOptions.attempt_timeouts``. A request whose deadline passed without an answer
raises :class:`~cloudckpt.errors.Timeout` naming the endpoint. Every retry
is reported to the retry listeners (``"throttled"`` for 429/503, ``"transient"``
otherwise), which is how the transfer engine sees throttling. ``max_attempts=1``
turns retries off.

Uploads up to ``multipart_threshold`` bytes (default 64 MiB) go in one media request;
larger ones are resumable uploads sent in chunks of ``part_size`` (default 16 MiB, rounded down to a multiple
of 256 KiB, as GCS requires). The library verifies CRC32C end to end on uploads
and on whole-object downloads. Memory: one chunk per concurrent upload
(``max(part_size, multipart_threshold)`` at most).

Raises (translated at this boundary): NotFound, BucketNotFound, AlreadyExists,
PreconditionFailed, AccessDenied, Throttled, Transient, InvalidURL.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import logging
import os
import random
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime
from typing import BinaryIO, Callable, Iterable, Iterator

import google.auth
import google.auth.exceptions as gauth_exc
import google_crc32c
import requests
import requests.adapters
import urllib3.exceptions
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage
from google.cloud.storage import retry as gcs_retry
from google.cloud.storage._media import _upload as _gcs_upload
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from ..errors import (
    AccessDenied,
    AlreadyExists,
    BucketNotFound,
    InvalidURL,
    NotFound,
    PreconditionFailed,
    StorageError,
    Throttled,
    Timeout,
    Transient,
)
from .assembly import Assembly, Piece
from .base import DeleteFailures, ListEntry, ObjectInfo, ObjectStore, PendingUpload, Progress, redact_endpoint
from .errors_table import STATUS_ERRORS, status_error
from .url import parse_url

# google-cloud-storage (checked: 3.17) draws each multipart upload's boundary from the
# process-wide ``random`` module, so every small-object save moved the training
# script's Python RNG (and a resumed run drifted from an uninterrupted one). Its
# module gets a generator of its own: same draws, the caller's ``random`` untouched.
_gcs_upload.random = random.Random()


_log = logging.getLogger(__name__)
_CHUNK_MULTIPLE = 256 * 1024  # GCS resumable chunks must be multiples of 256 KiB
_SINGLE_REQUEST_MAX = 8 * 1024 * 1024  # google-cloud-storage sends up to this in one multipart request
_EMULATOR_PROJECT = "cloudckpt-emulator"
_ADC_HINT = (
    "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a "
    "service-account key file, or run where a service account is attached"
)
_HINTS = {AccessDenied: f"check the credentials ({_ADC_HINT}) and that they may use this bucket and prefix"}
# The library's own retry predicate (408, 429, 5xx, resets, timeouts); kept if it moves.
_should_retry: Callable[[BaseException], bool] = (getattr(gcs_retry, "_should_retry", None)
                                                  or gcs_retry.DEFAULT_RETRY._predicate)


def _split(url: str) -> tuple[str, str]:
    p = parse_url(url)
    if p.scheme not in ("gs", "gcs"):
        raise InvalidURL(f"not a gs:// URL: {url!r}", url=url)
    return p.bucket, p.key


def _object(url: str) -> tuple[str, str]:
    bucket, key = _split(url)
    if not key or key.endswith("/"):
        raise InvalidURL(f"{url!r} names a bucket or folder, not an object: write gs://bucket/path/to/object", url=url)
    return bucket, key


def _status(e: BaseException) -> int:
    if isinstance(e, gexc.GoogleAPICallError) and isinstance(e.code, int):
        return e.code
    if isinstance(e, InvalidResponse) and getattr(e, "response", None) is not None:
        return int(getattr(e.response, "status_code", 0) or 0)
    return 0


def _server_message(e: BaseException) -> str:
    msg = getattr(e, "message", None) or str(e)
    return str(msg).strip()[:300]


def _bucket_missing_hint(e: BaseException) -> bool | None:
    """True/False when GCS's 404 message says which of bucket/object is missing; None
    when it does not (emulators answer a bare "Not Found")."""
    m = _server_message(e).lower()
    if "bucket does not exist" in m or "bucket not found" in m or "no such bucket" in m:
        return True
    if "no such object" in m:
        return False
    return None


_CONNECTION_ERRORS = (
    ConnectionError,
    TimeoutError,
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    gauth_exc.TransportError,
)


_TIMEOUT_ERRORS = (requests.exceptions.Timeout, urllib3.exceptions.TimeoutError, TimeoutError)


def translate(e: BaseException, url: str, op: str, *, bucket_exists: Callable[[], bool] | None = None,
              endpoint: str | None = None, deadline: float | None = None) -> BaseException:
    """Map a google-cloud-storage / google-auth / requests exception to the cloudckpt
    error tree. ``bucket_exists`` is asked when a 404 does not say whether the bucket
    or the object is missing; ``endpoint`` and ``deadline`` (the operation_timeout) are
    named in Timeout messages."""
    if isinstance(e, StorageError):
        return e
    where = f" from {redact_endpoint(endpoint)}" if endpoint else ""
    if isinstance(e, gexc.RetryError):
        cause = e.cause
        if isinstance(cause, _TIMEOUT_ERRORS) or (cause is None and str(e).startswith("Timeout")):
            within = f"operation_timeout={deadline:g}s" if deadline else "the deadline"
            return Timeout(f"{op} {url}: no answer{where} within {within} (the last: "
                           f"{type(cause).__name__ if cause is not None else 'timeout'}); check the endpoint "
                           "(STORAGE_EMULATOR_HOST / endpoint_url) and network, or raise operation_timeout (--timeout)",
                           url=url)
        if cause is not None and cause is not e:
            out = translate(cause, url, op, bucket_exists=bucket_exists, endpoint=endpoint, deadline=deadline)
            if isinstance(out, Transient) and "retries were exhausted" not in str(out):
                return type(out)(f"{out}; retries were exhausted", url=url)
            return out
        return Transient(f"{op} {url}: retries were exhausted", url=url)
    if isinstance(e, gauth_exc.DefaultCredentialsError):
        return AccessDenied(f"{op} {url}: no Google Application Default Credentials found; {_ADC_HINT}", url=url)
    if isinstance(e, gauth_exc.RefreshError):
        return AccessDenied(
            f"{op} {url}: the Google credentials could not be refreshed (expired or revoked); {_ADC_HINT}", url=url
        )
    if isinstance(e, DataCorruption):
        return Transient(f"{op} {url}: checksum mismatch between the bytes sent and received (CRC32C); retry", url=url)
    status = _status(e)
    if status:
        if status == 404:
            missing = _bucket_missing_hint(e)
            if missing is None and bucket_exists is not None:
                missing = not bucket_exists()
            if missing:
                bucket = parse_url(url).bucket
                return BucketNotFound(f"{op} {url}: bucket {bucket!r} does not exist; create it or fix the URL",
                                      url=url)
        if status == 400 and "name" in _server_message(e).lower():
            return InvalidURL(f"{op} {url}: the store rejected the name: {_server_message(e)}", url=url)
        return status_error(status, url, op, hints=_HINTS, message=_server_message(e))
    if isinstance(e, _CONNECTION_ERRORS):
        return Transient(f"{op} {url}: connection problem ({type(e).__name__}); check the endpoint and network",
                         url=url)
    return e


def _retry_kind(e: BaseException) -> str:
    return "throttled" if STATUS_ERRORS.get(_status(e)) is Throttled else "transient"


class GCSStore(ObjectStore):
    """``gs://bucket/key`` objects.

    GCS has no S3-style multipart uploads to list through the JSON API (resumable
    upload sessions expire on their own after a week and cannot be enumerated), so
    :meth:`list_multipart_uploads` returns ``[]``, the base default.
    """

    scheme = "gs"
    conditional_replace = True  # if_generation_match
    copies_objects = True  # rewriteTo
    # a bucket starts at about 1,000 object writes and 5,000 reads per second (it scales
    # up over minutes; above that GCS answers 429/503)
    default_request_rates = (1000.0, 5000.0)
    # an assembly: each piece a component object beside the URL, composed 32 at a time
    assembles_objects = True
    COMPOSE_MAX = 32  # source objects of one compose request

    def __init__(self, options=None):
        super().__init__(options)
        self._lock = threading.Lock()
        self._client: storage.Client | None = None
        self._known_buckets: set[str] = set()
        self._timeout = self.options.attempt_timeouts
        self._endpoint: str | None = None  # named in Timeout messages once the client exists

    # ------------------------------------------------------------ client
    @property
    def client(self) -> storage.Client:
        """The google-cloud-storage client, created on first use (reads the env then)."""
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> storage.Client:
        o = self.options
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            endpoint = emulator if "://" in emulator else "http://" + emulator
            credentials = AnonymousCredentials()
            project = o.project or os.environ.get("GOOGLE_CLOUD_PROJECT") or _EMULATOR_PROJECT
        else:
            endpoint = o.endpoint_url
            credentials, adc_project = google.auth.default(scopes=storage.Client.SCOPE)  # callers translate
            project = o.project or adc_project
        self._endpoint = endpoint or "https://storage.googleapis.com"
        session = AuthorizedSession(credentials)
        adapter = requests.adapters.HTTPAdapter(
            pool_connections=o.max_pool_connections, pool_maxsize=o.max_pool_connections, max_retries=0
        )
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return storage.Client(
            project=project,
            credentials=credentials,
            _http=session,
            client_options={"api_endpoint": endpoint} if endpoint else None,
        )

    def _retry(self, on_retry: Callable[[], None] | None = None) -> Retry | None:
        """A Retry with the library's predicate that reports every retry."""
        if self.options.max_attempts <= 1:
            return None

        def on_error(exc: Exception) -> None:
            if on_retry is not None:
                on_retry()
            self._notify_retry(_retry_kind(exc))

        # api-core's default backoff (1 s doubling to 60 s, with jitter); no retry starts after the deadline
        return Retry(predicate=_should_retry, timeout=self.options.operation_timeout, on_error=on_error)

    def _bucket_exists(self, bucket: str) -> Callable[[], bool]:
        def check() -> bool:
            if bucket in self._known_buckets:
                return True
            try:
                ok = self.client.bucket(bucket).exists(timeout=self._timeout, retry=self._retry())
            except Exception:  # noqa: BLE001 - cannot tell (e.g. no bucket.get permission): assume it exists
                return True
            if ok:
                self._known_buckets.add(bucket)
            return ok

        return check

    def _translate(self, e: BaseException, url: str, op: str) -> BaseException:
        kw = {"endpoint": self._endpoint, "deadline": self.options.operation_timeout}
        try:
            bucket = parse_url(url).bucket
        except InvalidURL:
            return translate(e, url, op, **kw)
        return translate(e, url, op, bucket_exists=self._bucket_exists(bucket), **kw)

    def connect(self) -> None:
        self.client  # noqa: B018 (the property builds it)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client._http.close()
            except Exception:  # noqa: BLE001 - closing idle connections is best-effort
                pass

    def __getstate__(self):
        return {"options": self.options}

    def __setstate__(self, state):
        self.__init__(state["options"])

    # ------------------------------------------------------------ primitives
    def _chunk_size(self, size: int) -> int:
        if size > self.multipart_threshold:
            return max(_CHUNK_MULTIPLE, self.part_size // _CHUNK_MULTIPLE * _CHUNK_MULTIPLE)
        # one request: a chunk at least as large as the object
        return max(_CHUNK_MULTIPLE, -(-size // _CHUNK_MULTIPLE) * _CHUNK_MULTIPLE)

    def _upload(self, stream: BinaryIO, url: str, size: int, *, if_absent: bool, retry: Retry | None) -> None:
        bucket, key = _object(url)
        blob = self.client.bucket(bucket).blob(key, chunk_size=self._chunk_size(size))
        blob.upload_from_file(
            stream,
            size=size,
            content_type="application/octet-stream",
            if_generation_match=0 if if_absent else None,
            timeout=self._timeout,
            retry=retry,
        )

    def put_bytes(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        retried = []
        try:
            self._upload(io.BytesIO(data), url, len(data), if_absent=if_absent,
                         retry=self._retry(lambda: retried.append(1)))
        except Exception as e:  # noqa: BLE001 - translated below
            err = self._translate(e, url, "put")
            if if_absent and isinstance(err, PreconditionFailed):
                # A retried create whose first attempt landed (response lost) sees its own
                # object: that is a win, not a conflict.
                if retried and self._has_crc32c(url, data):
                    return
                raise AlreadyExists(f"{url} already exists", url=url) from None
            raise err from None

    def _has_crc32c(self, url: str, data: bytes) -> bool:
        bucket, key = _object(url)
        try:
            blob = self.client.bucket(bucket).blob(key)
            blob.reload(timeout=self._timeout, retry=self._retry())
        except Exception:  # noqa: BLE001 - cannot tell: report the conflict
            return False
        want = base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()
        return blob.crc32c == want and blob.size == len(data)

    def get_bytes(self, url: str, *, start: int | None = None, end: int | None = None) -> bytes:
        bucket, key = _object(url)
        if end is not None and end <= (start or 0):
            return b""
        try:
            blob = self.client.bucket(bucket).blob(key)
            # google's ``end`` is inclusive; ours is exclusive
            return blob.download_as_bytes(
                start=start or None,
                end=None if end is None else end - 1,
                raw_download=True,
                timeout=self._timeout,
                retry=self._retry(),
            )
        except gexc.RequestRangeNotSatisfiable:
            return b""  # the range starts at or after the end of the object
        except Exception as e:  # noqa: BLE001 - translated below
            raise self._translate(e, url, "get") from None

    def get_bytes_versioned(self, url: str, *, limit: int | None = None) -> tuple[bytes, str]:
        bucket, key = _object(url)
        try:
            blob = self.client.bucket(bucket).get_blob(key, timeout=self._timeout, retry=self._retry())
            if blob is None:
                raise NotFound(f"get {url}: no such object", url=url)
            end = limit if limit is not None and (blob.size or 0) > limit else None  # inclusive: limit + 1 bytes
            data = blob.download_as_bytes(if_generation_match=blob.generation, raw_download=True,
                                          start=None if end is None else 0, end=end,
                                          timeout=self._timeout, retry=self._retry())
            return data, str(blob.generation)
        except Exception as e:  # noqa: BLE001 - translated below
            raise self._translate(e, url, "get") from None

    def put_bytes_if_match(self, url: str, data: bytes, version: str) -> None:
        bucket, key = _object(url)
        try:
            blob = self.client.bucket(bucket).blob(key)
            blob.upload_from_string(data, content_type="application/octet-stream", if_generation_match=int(version),
                                    timeout=self._timeout, retry=self._retry())
        except Exception as e:  # noqa: BLE001 - translated below
            err = self._translate(e, url, "put")
            if isinstance(err, NotFound):
                raise PreconditionFailed(f"put {url}: the object changed or was deleted", url=url) from None
            raise err from None

    def upload_fileobj(
        self, fileobj: BinaryIO, url: str, *, size: int, if_absent: bool = False, progress: Progress = None
    ) -> None:
        _object(url)
        if if_absent and size <= _SINGLE_REQUEST_MAX:
            # one request: put_bytes knows how to tell a lost-response retry from a conflict
            data = fileobj.read(size)
            self.put_bytes(url, data, if_absent=True)
            if progress and data:
                progress(len(data))
            return
        reader = _Reader(fileobj, size, progress)
        try:
            self._upload(reader, url, size, if_absent=if_absent, retry=self._retry())
        except Exception as e:  # noqa: BLE001 - translated below
            err = self._translate(e, url, "upload")
            if if_absent and isinstance(err, PreconditionFailed):
                raise AlreadyExists(f"{url} already exists", url=url) from None
            raise err from None
        reader.finish()

    def download_fileobj(self, url: str, fileobj: BinaryIO, *, progress: Progress = None) -> int:
        bucket, key = _object(url)
        writer = _Writer(fileobj, progress)
        try:
            blob = self.client.bucket(bucket).blob(key)
            blob.download_to_file(writer, raw_download=True, timeout=self._timeout, retry=self._retry())
        except Exception as e:  # noqa: BLE001 - translated below
            raise self._translate(e, url, "download") from None
        return writer.total

    def _reload(self, url: str, op: str) -> storage.Blob:
        """The object's Blob with its metadata (size, generation, crc32c) read."""
        bucket, key = _object(url)
        try:
            blob = self.client.bucket(bucket).blob(key)
            blob.reload(timeout=self._timeout, retry=self._retry())
        except Exception as e:  # noqa: BLE001 - translated below
            raise self._translate(e, url, op) from None
        return blob

    def stat(self, url: str) -> ObjectInfo:
        blob = self._reload(url, "stat")
        return ObjectInfo(url, int(blob.size or 0), _ts(blob.updated))

    def version(self, url: str) -> str | None:
        """The object's generation: what ``copy(src_version=...)`` matches."""
        gen = self._reload(url, "stat").generation
        return None if gen is None else str(gen)

    def copy(self, src_url: str, dst_url: str, *, size: int, src_version: str | None = None,
             progress: Progress = None) -> ObjectInfo:
        """Read the source's metadata (its size must be ``size``, its generation
        ``src_version`` when given), then ``rewriteTo`` with ``ifSourceGenerationMatch`` =
        that generation, called again on its rewrite token until done (a large rewrite
        across locations or storage classes takes several calls; within one bucket GCS
        finishes in one). Each call has the store's retry and deadline. ``progress``: per
        call, the bytes it rewrote. The result's ``crc32c`` is GCS's, from the final
        answer; its ``version`` the copy's generation."""
        src_bucket, src_key = _object(src_url)
        bucket, key = _object(dst_url)
        src = self._reload(src_url, "copy")
        gen = None if src.generation is None else str(src.generation)
        self._check_copy_source(ObjectInfo(src_url, int(src.size or 0), version=gen), size, dst_url, src_version)
        if (src_bucket, src_key) == (bucket, key):  # onto itself: nothing to change
            return ObjectInfo(dst_url, size, _ts(src.updated), _crc32c_hex(src.crc32c), gen)
        generation = src.generation
        dst = self.client.bucket(bucket).blob(key)
        token, done = None, 0
        try:
            while True:
                # ``src`` has its generation: the request names it (sourceGeneration) and
                # matches it (ifSourceGenerationMatch), so only the bytes checked are copied
                token, rewritten, _total = dst.rewrite(src, token=token, if_source_generation_match=generation,
                                                       timeout=self._timeout, retry=self._retry())
                rewritten = min(rewritten, size)  # the server's count: never more than the object
                if progress and rewritten > done:
                    progress(rewritten - done)
                done = max(done, rewritten)
                if token is None:
                    break
        except Exception as e:  # noqa: BLE001 - translated below
            err = self._translate(e, dst_url, f"copy {src_url} to")
            if isinstance(err, NotFound) and not isinstance(err, BucketNotFound):
                # the generation named is gone: the source was deleted, or replaced (a bucket
                # without versioning keeps no older generation; fake-gcs-server answers 404)
                if not self._exists_quietly(src_bucket, src_key):
                    raise NotFound(f"copy {src_url} to {dst_url}: the source was deleted during the copy",
                                   url=src_url) from None
                err = PreconditionFailed("", url=src_url)
            if isinstance(err, PreconditionFailed):
                raise PreconditionFailed(f"copy {src_url} to {dst_url}: the source changed since it was checked "
                                         f"(its generation is no longer {generation}); nothing was copied",
                                         url=src_url) from None
            raise err from None
        got = int(dst.size if dst.size is not None else size)
        if got != size:
            raise PreconditionFailed(f"copy {src_url} to {dst_url}: the store says the copy holds {got} bytes, not "
                                     f"the source's {size}; check the destination", url=dst_url)
        if progress and size > done:  # the final answer counted fewer bytes than the object holds
            progress(size - done)
        return ObjectInfo(dst_url, size, _ts(dst.updated), _crc32c_hex(dst.crc32c),
                          None if dst.generation is None else str(dst.generation))

    def _exists_quietly(self, bucket: str, key: str) -> bool:
        """Whether the object exists; True when that cannot be told (an error)."""
        try:
            return self.client.bucket(bucket).blob(key).exists(timeout=self._timeout, retry=self._retry())
        except Exception:  # noqa: BLE001 - cannot tell: assume it exists
            return True

    def list(self, prefix: str, *, delimiter: str | None = "/") -> Iterator[ListEntry]:
        bucket, key = _split(prefix)
        base = f"{parse_url(prefix).scheme}://{bucket}/"  # the caller's spelling (gs:// or gcs://)
        try:
            it = self.client.list_blobs(
                bucket,
                prefix=key or None,
                delimiter=delimiter or None,
                page_size=1000,
                fields="items(name,size,updated),prefixes,nextPageToken",
                timeout=self._timeout,
                retry=self._retry(),
            )
            for page in it.pages:
                for p in page.prefixes:
                    yield ListEntry(base + p, is_prefix=True)
                for b in page:
                    yield ListEntry(base + b.name, size=int(b.size or 0), mtime=_ts(b.updated))
        except Exception as e:  # noqa: BLE001 - translated below
            err = translate(e, prefix, "list", endpoint=self._endpoint, deadline=self.options.operation_timeout)
            if type(err) is NotFound:  # listing an existing bucket never answers 404
                err = BucketNotFound(f"list {prefix}: bucket {bucket!r} does not exist; create it or fix the URL",
                                     url=prefix)
            raise err from None

    def delete(self, url: str) -> None:
        bucket, key = _object(url)
        try:
            self.client.bucket(bucket).blob(key).delete(timeout=self._timeout, retry=self._retry())
        except Exception as e:  # noqa: BLE001 - translated below
            err = self._translate(e, url, "delete")
            if not isinstance(err, NotFound) or isinstance(err, BucketNotFound):
                raise err from None

    def delete_many(self, urls_: Iterable[str]) -> int:
        """Deletes concurrently (a small thread pool). The JSON batch endpoint is not
        used: fake-gcs-server does not implement it, and its sub-requests are not retried
        by the library. Each name travels percent-encoded in its own request's URL, so a
        name with control characters is deleted like any other. Returns how many are
        gone; a failure that is not about one object (AccessDenied, a missing bucket,
        Transient) cancels the deletes not yet started and is raised; the others are
        collected into one DeleteFailed naming the objects."""
        todo = list(urls_)
        failed = DeleteFailures()
        if len(todo) <= 1:
            return super().delete_many(todo)
        with ThreadPoolExecutor(max_workers=min(16, self.options.max_pool_connections, len(todo)),
                                thread_name_prefix="cloudckpt-gcs-delete") as ex:
            futures = {ex.submit(self.delete, u): u for u in todo}
            n = 0
            try:
                for f in as_completed(futures):
                    e = f.exception()
                    if e is None:
                        n += 1
                    elif isinstance(e, StorageError):
                        failed.add(futures[f], e)  # raises the errors that are not about one object
                    else:
                        raise e
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        failed.raise_if_any(n)
        return n

    # ------------------------------------------------------------ assembly: compose
    @staticmethod
    def _pieces_prefix(assembly: Assembly) -> str:
        """Where an assembly's component objects live: ``{url}.tmp-assembly-{token}/``."""
        return f"{assembly.url}.tmp-assembly-{assembly.token}/"

    def begin_assembly(self, url: str) -> Assembly:
        """A random token (no request): pieces are uploaded as component objects under
        ``{url}.tmp-assembly-{token}/``, composed at the complete, then deleted."""
        _object(url)
        return Assembly(url, secrets.token_hex(8))

    def put_piece(self, assembly: Assembly, index: int, data: bytes, *, offset: int) -> Piece:
        """One component object (a retried or repeated piece replaces it); the record's
        tag is its generation, which the compose names (a piece replaced since is not used)."""
        if index < 0:
            raise PreconditionFailed(f"put piece {index} of {assembly.url}: pieces are numbered from 0",
                                     url=assembly.url)
        url = f"{self._pieces_prefix(assembly)}p{index:06d}"
        bucket, key = _object(url)
        try:
            blob = self.client.bucket(bucket).blob(key, chunk_size=self._chunk_size(len(data)))
            blob.upload_from_file(io.BytesIO(data), size=len(data), content_type="application/octet-stream",
                                  timeout=self._timeout, retry=self._retry())
        except Exception as e:  # noqa: BLE001 - translated below
            raise self._translate(e, url, f"put piece {index} of {assembly.url}:") from None
        return Piece(index, offset, len(data), str(blob.generation))

    def _compose(self, sources: list[tuple[str, int]], dst_key: str, bucket: str, url: str,
                 if_generation_match: int | None = None) -> tuple[str, int, storage.Blob]:
        """Compose ``sources`` (``(name, generation)``, at most COMPOSE_MAX) into ``dst_key``;
        ``(dst_key, its generation, its Blob)``."""
        b = self.client.bucket(bucket)
        dst = b.blob(dst_key)
        try:
            dst.compose([b.blob(n, generation=g) for n, g in sources], if_generation_match=if_generation_match,
                        if_source_generation_match=[g for _, g in sources], timeout=self._timeout,
                        retry=self._retry())
        except Exception as e:  # noqa: BLE001 - translated below
            raise self._translate(e, url, "complete assembly of") from None
        return dst_key, int(dst.generation), dst

    def _complete_assembly(self, assembly: Assembly, pieces: list[Piece], *, if_absent: bool) -> ObjectInfo:
        """Compose the pieces, COMPOSE_MAX at a time: while more than that remain, each
        run of them becomes one intermediate component (a level's composes run side by
        side); the last compose writes the URL (``if_generation_match=0`` for
        ``if_absent``). Then every component is deleted (a failure to delete is logged:
        the object is complete; ``abort_assembly`` removes what is left)."""
        url = assembly.url
        bucket, key = _object(url)
        prefix_key = _split(self._pieces_prefix(assembly))[1]
        sources = [(f"{prefix_key}p{p.index:06d}", int(p.tag)) for p in pieces]
        level = 0
        while len(sources) > self.COMPOSE_MAX:
            runs = [sources[i:i + self.COMPOSE_MAX] for i in range(0, len(sources), self.COMPOSE_MAX)]
            with ThreadPoolExecutor(max_workers=min(16, len(runs)), thread_name_prefix="cloudckpt-compose") as ex:
                names = [f"{prefix_key}c{level}-{j:06d}" for j in range(len(runs))]
                done = list(ex.map(lambda run, name: self._compose(run, name, bucket, url), runs, names))
            sources = [(name, gen) for name, gen, _ in done]
            level += 1
        try:
            _, gen, blob = self._compose(sources, key, bucket, url, 0 if if_absent else None)
        except PreconditionFailed:
            if if_absent:
                raise AlreadyExists(f"{url} already exists", url=url) from None
            raise
        try:
            self.delete_prefix(self._pieces_prefix(assembly), force=True)
        except StorageError as e:
            _log.warning("assembled %s, but its components under %s were not all deleted: %s (abort_assembly "
                         "removes them)", url, self._pieces_prefix(assembly), e)
        return ObjectInfo(url, int(blob.size if blob.size is not None else sum(p.size for p in pieces)),
                          _ts(blob.updated), _crc32c_hex(blob.crc32c), str(gen))

    def abort_assembly(self, assembly: Assembly) -> None:
        """Delete every component object of the assembly (pieces and intermediate ones)."""
        self.delete_prefix(self._pieces_prefix(assembly), force=True)

    def list_multipart_uploads(self, prefix: str) -> list[PendingUpload]:
        """Always ``[]``: GCS resumable sessions cannot be listed (they expire after a week)."""
        _split(prefix)
        return []


class _Reader:
    """Reads at most ``size`` bytes of ``f`` from its current position, presenting
    that position as 0 (the library requires it). Progress is reported for bytes the
    server has acknowledged: a read at position p means every byte before p was sent
    (the library reads the next chunk only after the previous one succeeded, and
    seeks back to the server's offset after a failure)."""

    def __init__(self, f: BinaryIO, size: int, progress: Progress):
        self._f = f
        self._size = size
        self._progress = progress
        self._pos = 0
        self._acked = 0
        try:
            self._start = f.tell()
        except (OSError, AttributeError, ValueError):
            self._start = None  # not seekable: read straight through

    def _ack(self, pos: int) -> None:
        if pos > self._acked:
            if self._progress:
                self._progress(pos - self._acked)
            self._acked = pos

    def read(self, n: int | None = -1) -> bytes:
        self._ack(self._pos)
        left = self._size - self._pos
        n = left if n is None or n < 0 else min(n, left)
        data = self._f.read(n) if n > 0 else b""
        self._pos += len(data)
        return data

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: self._size + offset}[whence]
        if target != self._pos:
            if self._start is None:
                raise io.UnsupportedOperation("the upload source is not seekable")
            self._f.seek(self._start + target)
            self._pos = target
        return self._pos

    def seekable(self) -> bool:
        return self._start is not None

    def finish(self) -> None:
        """The upload completed: every byte is acknowledged."""
        self._ack(self._size)


class _Writer:
    """Forwards writes to ``f`` and counts them (the library resumes failed downloads
    with a range request, so every byte is written once)."""

    def __init__(self, f: BinaryIO, progress: Progress):
        self._f = f
        self._progress = progress
        self.total = 0

    def write(self, b) -> int:
        n = self._f.write(b)
        n = len(b) if n is None else n
        self.total += n
        if self._progress and n:
            self._progress(n)
        return n

    def seek(self, *a):  # only for decompressive transcoding, which raw downloads never do
        self.total = 0
        return self._f.seek(*a)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()


def _crc32c_hex(value: str | None) -> str | None:
    """GCS's CRC32C (base64 of 4 big-endian bytes) as cloudckpt writes CRCs (8 lowercase
    hex digits); None when absent or not 4 bytes of base64 (never trusted as given)."""
    if not value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 4 else None


def _ts(v) -> float | None:
    return v.timestamp() if isinstance(v, datetime) else None
