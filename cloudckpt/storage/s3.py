"""S3 and S3-compatible stores (SeaweedFS, MinIO, R2, ...) through boto3.

Credentials and endpoint come from the standard boto3 chain and env
(``AWS_PROFILE``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ...) unless the folder's
:class:`~cloudckpt.storage.StorageOptions` names them. Request-level retries (5xx, throttling,
connection resets) are botocore's ``standard`` mode; multipart uploads and
parallel ranged downloads are s3transfer's. Every retry botocore decides on is
reported to the retry listeners, which is how the transfer engine sees throttling.

Time bounds: botocore has per-attempt connect/read timeouts and an attempt count,
but no deadline over a request's attempts (8 attempts of a 60 s read timeout would
make a LIST against an endpoint that never answers take 8 minutes). Every API call,
ours and s3transfer's, is stamped when it starts (``before-call``); once
``operation_timeout`` has passed, a retry botocore would make is refused instead
(``needs-retry``, and ``request-created`` when a backoff ended past the deadline) and
the call fails with :class:`~cloudckpt.errors.Timeout` naming the endpoint. An
attempt under way is not cut: its socket waits are bounded by
``StorageOptions.attempt_timeouts``.

Raises (translated at this boundary): NotFound, BucketNotFound, AlreadyExists,
PreconditionFailed, AccessDenied, Throttled, Timeout, Transient, InvalidURL;
ConfigError for an endpoint that is not a URL.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from datetime import datetime
from typing import BinaryIO, Iterable, Iterator
from urllib.parse import urlsplit

import boto3
import botocore.exceptions as bex
from botocore.config import Config
from botocore.retries.standard import RetryEventAdapter, StandardRetryConditions
from s3transfer.exceptions import S3CopyFailedError
from s3transfer.manager import TransferConfig, TransferManager
from s3transfer.subscribers import BaseSubscriber

from ..errors import (
    AccessDenied,
    AlreadyExists,
    BucketNotFound,
    ConfigError,
    InvalidURL,
    NotFound,
    PreconditionFailed,
    StorageError,
    Throttled,
    Timeout,
    Transient,
)
from .assembly import Assembly, Piece
from .base import (
    DeleteFailures,
    ListEntry,
    MiB,
    ObjectInfo,
    ObjectStore,
    PendingUpload,
    Progress,
    RangeReader,
    redact_endpoint,
)
from .errors_table import error_class, status_error
from .url import parse_url

_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                   "RequestThrottled", "ProvisionedThroughputExceededException", "503", "429"}
_DENIED_CODES = {"AccessDenied", "403", "SignatureDoesNotMatch", "InvalidAccessKeyId", "ExpiredToken",
                 "InvalidToken", "AllAccessDisabled", "AccountProblem", "TokenRefreshRequired", "Forbidden"}
# The status an S3 error code stands for (some come with another status: ExpiredToken
# with 400); a code made of digits (a HEAD answer has no body) is its status.
# errors_table says what each status raises.
_CODE_STATUS: dict[str, int] = {
    "NoSuchKey": 404, "NotFound": 404, "NoSuchUpload": 404,
    "PreconditionFailed": 412,
    "ConditionalRequestConflict": 409,
    **dict.fromkeys(_DENIED_CODES, 403),
    **dict.fromkeys(_THROTTLE_CODES, 503),
}
_NAME_CODES = {"InvalidBucketName", "InvalidArgument", "KeyTooLongError"}  # the store rejected a name: InvalidURL
_HINTS = {AccessDenied: "check the credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, the instance role) and that they "
                        "may use this bucket and prefix"}


# characters a key cannot carry through DeleteObjects' XML body as they are (C0, DEL, C1, surrogates)
_XML_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")

_RETRY_EVENTS = RetryEventAdapter()  # needs-retry kwargs -> botocore's RetryContext
_STARTED = "cloudckpt_started"  # request-context keys: time.monotonic() when the API call began,
_LAST = "cloudckpt_last_failure"  # and (what the last failed attempt got, whether it was throttled)


class _DeadlineSpent(Exception):
    """Raised from botocore's needs-retry event to refuse a retry after the deadline.
    Not an OSError, so s3transfer's own download retries do not retry it either;
    :func:`translate` turns it into Timeout (Throttled when the store was throttling)."""

    def __init__(self, message: str, *, throttled: bool = False):
        super().__init__(message)
        self.throttled = throttled


def _split(url: str) -> tuple[str, str]:
    p = parse_url(url)
    if p.scheme not in ("s3", "s3a"):
        raise InvalidURL(f"not an s3:// URL: {url!r}", url=url)
    return p.bucket, p.key


def translate(e: BaseException, url: str, op: str) -> BaseException:
    """Map a botocore/boto3 exception to the cloudckpt error tree."""
    if isinstance(e, StorageError):
        return e
    if isinstance(e, _DeadlineSpent):
        return (Throttled if e.throttled else Timeout)(f"{op} {url}: {e}", url=url)
    if isinstance(e, bex.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code == "NoSuchBucket":
            bucket = parse_url(url).bucket
            return BucketNotFound(f"{op} {url}: bucket {bucket!r} does not exist; create it or fix the URL", url=url)
        status = _CODE_STATUS.get(code) or (int(code) if code.isdigit() else status)
        if code in _NAME_CODES and error_class(status) is StorageError:
            return InvalidURL(f"{op} {url}: the store rejected the name ({code}): {err.get('Message', '')}", url=url)
        return status_error(status, url, op, hints=_HINTS, detail=code, message=str(err.get("Message", "")))
    if isinstance(e, (bex.NoCredentialsError, bex.PartialCredentialsError, bex.CredentialRetrievalError)):
        return AccessDenied(
            f"{op} {url}: no usable AWS credentials; set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "or run where an instance role is available",
            url=url,
        )
    if isinstance(e, bex.ProfileNotFound):
        return AccessDenied(f"{op} {url}: AWS profile not found ({e.kwargs.get('profile')}); check AWS_PROFILE / the "
                            "profile option", url=url)
    if isinstance(e, (bex.EndpointConnectionError, bex.ConnectionClosedError, bex.ReadTimeoutError,
                      bex.ConnectTimeoutError, bex.ResponseStreamingError, bex.IncompleteReadError,
                      ConnectionError, TimeoutError)):
        endpoint = _endpoint_of(e)
        where = f" reaching {endpoint}" if endpoint else ""
        return Transient(f"{op} {url}: connection problem{where} ({type(e).__name__}); check the endpoint "
                         "(AWS_ENDPOINT_URL / endpoint_url) and network", url=url)
    if isinstance(e, bex.ParamValidationError):
        return InvalidURL(f"{op} {url}: invalid request parameter", url=url)
    if isinstance(e, bex.BotoCoreError):
        return StorageError(f"{op} {url}: {type(e).__name__}", url=url)
    return e


def _endpoint_of(e: BaseException) -> str | None:
    """scheme://host[:port] botocore was connecting to, without any user info."""
    return _endpoint_of_url(getattr(e, "kwargs", {}).get("endpoint_url"))


def _endpoint_of_url(raw: str | None) -> str | None:
    """scheme://host[:port] of a URL, without user info or path."""
    if not raw:
        return None
    try:
        p = urlsplit(str(raw))
        port = p.port
    except ValueError:  # a malformed endpoint: the message names the URL only
        return None
    return f"{p.scheme}://{p.hostname}{':' + str(port) if port else ''}" if p.hostname else None


class S3Store(ObjectStore):
    scheme = "s3"
    streams_ranges = True
    conditional_replace = True  # If-Match / If-None-Match on PutObject
    copies_objects = True  # CopyObject / UploadPartCopy
    # Checkpoint shard files are ~256 MiB (the DCP writer's target): each goes up in one
    # PUT, larger ones in 64 MiB parts. Measured against 16 MiB parts on SeaweedFS (1 GiB,
    # 2 ranks): the store spent 30-50 % less CPU per save and saves ran 1.3-1.7x faster;
    # on S3 it is one request per shard file instead of ~18, against the per-prefix
    # request rate (bench/NOTES.md). Uploads by file name read each part from disk
    # while sending, so larger parts cost no memory there.
    default_multipart_threshold = 512 * MiB
    default_part_size = 64 * MiB
    # S3 answers 503 SlowDown above about 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD
    # requests per second per partitioned prefix
    default_request_rates = (3500.0, 5500.0)
    # an assembly is a multipart upload: parts of 5 MiB at least (but the last), 10,000 at most
    assembles_objects = True
    min_piece_size = 5 * MiB
    max_pieces = 10_000

    def __init__(self, options=None):
        super().__init__(options)
        self._lock = threading.Lock()
        self._client = None
        self._manager: TransferManager | None = None
        self._would_retry = StandardRetryConditions(max_attempts=self.options.max_attempts)

    # ------------------------------------------------------------ clients

    @staticmethod
    def _on_before_call(context=None, **kw):
        if context is not None:
            context.setdefault(_STARTED, time.monotonic())
        return None  # a non-None value would replace the request

    def _on_needs_retry(self, response=None, attempts=None, caught_exception=None, **kw):
        # Observe (return None: botocore's own handler decides on the retry and its delay),
        # except that a retry botocore would make once the request's deadline is spent is
        # refused (raised).
        if attempts is None or attempts >= self.options.max_attempts:
            return None
        request_dict = kw.get("request_dict") or {}
        context = request_dict.get("context")
        kind, last = None, None
        if caught_exception is not None:
            kind, last = "transient", type(caught_exception).__name__
        elif response is not None:
            http, parsed = response
            status = getattr(http, "status_code", 0)
            code = (parsed or {}).get("Error", {}).get("Code", "")
            last = str(code or status)
            if status in (429, 503) or code in _THROTTLE_CODES:
                kind = "throttled"
            elif status >= 500:
                kind = "transient"
        if context is not None and last is not None:
            context[_LAST] = (last, kind == "throttled")
            if self._deadline_spent(context) and self._would_retry.is_retryable(_RETRY_EVENTS.create_retry_context(
                    response=response, attempts=attempts, caught_exception=caught_exception, **kw)):
                raise self._deadline_error(context, request_dict.get("url")) from caught_exception
        if kind:
            self._notify_retry(kind)
        return None

    def _on_request_created(self, request=None, **kw):
        # each attempt: a retry (one with a failure before it) does not start after the deadline
        context = getattr(request, "context", None)
        if context and _LAST in context and self._deadline_spent(context):
            raise self._deadline_error(context, getattr(request, "url", None))

    def _deadline_spent(self, context: dict) -> bool:
        started = context.get(_STARTED)
        return started is not None and time.monotonic() - started >= self.options.operation_timeout

    def _deadline_error(self, context: dict, request_url: str | None) -> _DeadlineSpent:
        o = self.options
        last, throttled = context[_LAST]
        attempts = (context.get("retries") or {}).get("attempt", "?")
        endpoint = _endpoint_of_url(request_url)
        return _DeadlineSpent(
            f"no successful answer{' from ' + endpoint if endpoint else ''} within operation_timeout="
            f"{o.operation_timeout:g}s ({attempts} attempt(s), the last: {last}; "
            f"read_timeout {o.attempt_timeouts[1]:g}s); "
            "check the endpoint (AWS_ENDPOINT_URL / endpoint_url) and network, or raise operation_timeout (--timeout)",
            throttled=throttled,
        )

    @property
    def client(self):
        with self._lock:
            if self._client is None:
                o = self.options
                session = boto3.session.Session(profile_name=o.profile) if o.profile else boto3.session.Session()
                s3cfg: dict = {"payload_signing_enabled": o.sign_payload}
                if o.addressing_style:
                    s3cfg["addressing_style"] = o.addressing_style
                connect_timeout, read_timeout = o.attempt_timeouts
                cfg = Config(
                    retries={"mode": "standard", "total_max_attempts": o.max_attempts},
                    max_pool_connections=o.max_pool_connections,
                    connect_timeout=connect_timeout,
                    read_timeout=read_timeout,
                    s3=s3cfg,
                    signature_version="s3v4",
                    # cloudckpt records and verifies CRC32C end to end (marker manifest); botocore's own
                    # per-request CRC32 costs ~1.5 CPU-s/GiB here and is skipped unless an API requires it
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                try:
                    self._client = session.client("s3", endpoint_url=o.endpoint_url, region_name=o.region, config=cfg)
                except ValueError:  # botocore's "Invalid endpoint" (e.g. AWS_ENDPOINT_URL without a scheme)
                    endpoint = (o.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                                or os.environ.get("AWS_ENDPOINT_URL", ""))
                    raise ConfigError(f"the S3 endpoint {redact_endpoint(endpoint)!r} (endpoint_url / "
                                      "AWS_ENDPOINT_URL) is not a URL: write it as http://host:port or "
                                      "https://host") from None
                except bex.BotoCoreError as e:
                    raise translate(e, o.endpoint_url or "s3://", "connect") from None
                events = self._client.meta.events
                events.register_first("before-call.s3", self._on_before_call)
                events.register_first("request-created.s3", self._on_request_created)
                events.register_first("needs-retry.s3", self._on_needs_retry)
            return self._client

    @property
    def manager(self) -> TransferManager:
        client = self.client
        with self._lock:
            if self._manager is None:
                o = self.options
                self._manager = TransferManager(
                    client,
                    TransferConfig(
                        multipart_threshold=self.multipart_threshold,
                        multipart_chunksize=self.part_size,
                        max_request_concurrency=max(1, o.max_pool_connections - 2),
                        # downloads hand each io_chunksize piece to a writer thread through
                        # this queue: 256 KiB pieces (s3transfer's default), at most 16 waiting
                        # (4 MiB). Pre-download of 1 GiB, 2 ranks, 3 reps: 2.7-3.6 s and peak
                        # RSS 1.21-1.22x the bytes loaded, against 3.8-4.1 s and 1.38-1.40x
                        # with 1 MiB pieces and 64 waiting; 64 or 128 KiB pieces were slower.
                        io_chunksize=256 * 1024,
                        max_io_queue_size=16,
                        # file-object uploads buffer parts: at most ~256 MiB of them (4 at 64 MiB)
                        max_in_memory_upload_chunks=max(2, min(o.max_pool_connections // 2,
                                                               256 * MiB // self.part_size)),
                        max_in_memory_download_chunks=max(4, o.max_pool_connections // 2),
                    ),
                )
            return self._manager

    def connect(self) -> None:
        self.client  # noqa: B018 (the property builds it)

    def close(self) -> None:
        with self._lock:
            if self._manager is not None:
                self._manager.shutdown()
            self._manager = None
            self._client = None

    def __getstate__(self):
        return {"options": self.options}

    def __setstate__(self, state):
        self.__init__(state["options"])

    # ------------------------------------------------------------ primitives
    def put_bytes(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        bucket, key = _split(url)
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self.client.put_object(Bucket=bucket, Key=key, Body=data, **extra)
        except Exception as e:  # noqa: BLE001 - translated below
            err = translate(e, url, "put")
            if if_absent and isinstance(err, PreconditionFailed):
                raise AlreadyExists(f"{url} already exists", url=url) from None
            raise err from None

    def _get_body(self, url: str, start: int | None, end: int | None):
        """The body of a GET of ``url``, or of ``[start, end)`` of it; None when there
        is nothing to read (an empty range, or one starting at or after the end)."""
        bucket, key = _split(url)
        kw = {}
        if start is not None or end is not None:
            if end is not None and end <= (start or 0):
                return None
            kw["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        try:
            return self.client.get_object(Bucket=bucket, Key=key, **kw)["Body"]
        except bex.ClientError as e:
            if kw and e.response.get("Error", {}).get("Code") == "InvalidRange":
                return None  # the range starts at or after the end (or the object is empty): like slicing
            raise translate(e, url, "get") from None
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, url, "get") from None

    def get_bytes(self, url: str, *, start: int | None = None, end: int | None = None) -> bytes:
        return _S3Range(self._get_body(url, start, end), url).read(-1)

    def open_range(self, url: str, start: int, end: int) -> RangeReader:
        """One ranged GET whose body is read as the caller goes (``StreamingBody.read``):
        a long range costs one request and holds only what the caller keeps."""
        return _S3Range(self._get_body(url, start, end), url)

    def get_bytes_versioned(self, url: str, *, limit: int | None = None) -> tuple[bytes, str]:
        bucket, key = _split(url)
        try:
            r = self.client.get_object(Bucket=bucket, Key=key)
            with contextlib.closing(r["Body"]) as body:  # closed unread past the limit: the rest is never fetched
                return body.read(None if limit is None else limit + 1), r["ETag"]
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, url, "get") from None

    def put_bytes_if_match(self, url: str, data: bytes, version: str) -> None:
        bucket, key = _split(url)
        try:
            self.client.put_object(Bucket=bucket, Key=key, Body=data, IfMatch=version)
        except Exception as e:  # noqa: BLE001 - translated below
            err = translate(e, url, "put")
            if isinstance(err, NotFound):  # deleted in between: the precondition does not hold
                raise PreconditionFailed(f"put {url}: the object changed or was deleted", url=url) from None
            raise err from None

    def upload_fileobj(self, fileobj: BinaryIO, url: str, *, size: int, if_absent: bool = False,
                       progress: Progress = None) -> None:
        bucket, key = _split(url)
        if if_absent:
            # s3transfer cannot send If-None-Match; a conditional create is one PUT (<= 5 GiB)
            data = fileobj.read()
            self.put_bytes(url, data, if_absent=True)
            if progress:
                progress(len(data))
            return
        try:
            fut = self.manager.upload(fileobj, bucket, key, subscribers=[_Count(progress)] if progress else None)
            fut.result()
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, url, "upload") from None

    def upload_file(self, local_path: str, url: str, *, if_absent: bool = False, progress: Progress = None) -> int:
        if if_absent:
            return super().upload_file(local_path, url, if_absent=True, progress=progress)
        bucket, key = _split(url)
        size = os.path.getsize(local_path)
        try:
            # by file name, s3transfer opens each part lazily and reads it while sending:
            # no part buffers in memory (a file object would be read into 16 MiB chunks)
            fut = self.manager.upload(os.fspath(local_path), bucket, key,
                                      subscribers=[_Count(progress)] if progress else None)
            fut.result()
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, url, "upload") from None
        return size

    def copy(self, src_url: str, dst_url: str, *, size: int, src_version: str | None = None,
             progress: Progress = None) -> ObjectInfo:
        """HEAD the source (its size must be ``size``, its ETag ``src_version`` when given),
        then s3transfer's managed copy with ``CopySourceIfMatch`` = that ETag: one
        CopyObject below ``multipart_threshold``, else UploadPartCopy in ``part_size`` parts
        (a single CopyObject stops at 5 GiB). s3transfer aborts the multipart upload when a
        part fails. ``progress``: once per request, with the bytes it copied. The result's
        ``crc32c`` is None; its ``version`` the copy's ETag (a HEAD after it)."""
        src_bucket, src_key = _split(src_url)
        bucket, key = _split(dst_url)
        src = self._head(src_url, "copy")
        self._check_copy_source(ObjectInfo(src_url, int(src["ContentLength"]), version=src.get("ETag")), size,
                                dst_url, src_version)
        if (src_bucket, src_key) == (bucket, key):  # S3 refuses to copy an object onto itself as it is
            return ObjectInfo(dst_url, size, _ts(src.get("LastModified")), version=src.get("ETag"))
        etag = src["ETag"]
        subscribers = [_KnownSource(size, etag)] + ([_Count(progress)] if progress else [])
        try:
            self.manager.copy({"Bucket": src_bucket, "Key": src_key}, bucket, key,
                              extra_args={"CopySourceIfMatch": etag}, subscribers=subscribers).result()
        except Exception as e:  # noqa: BLE001 - translated below
            err = translate(_part_copy_cause(e), dst_url, f"copy {src_url} to")
            if isinstance(err, PreconditionFailed):
                raise PreconditionFailed(f"copy {src_url} to {dst_url}: the source changed since it was checked "
                                         f"(its ETag is no longer {etag}); nothing was copied", url=src_url) from None
            if isinstance(err, NotFound) and not isinstance(err, BucketNotFound):
                raise NotFound(f"copy {src_url} to {dst_url}: the source was deleted during the copy", url=src_url) \
                    from None
            raise err from None
        r = self._head(dst_url, "stat")
        info = ObjectInfo(dst_url, int(r["ContentLength"]), _ts(r.get("LastModified")), version=r.get("ETag"))
        if info.size != size:  # someone replaced the destination meanwhile
            raise PreconditionFailed(f"copy {src_url} to {dst_url}: the destination holds {info.size} bytes after "
                                     f"the copy, not {size}: another writer replaced it", url=dst_url)
        return info

    def download_fileobj(self, url: str, fileobj: BinaryIO, *, progress: Progress = None) -> int:
        bucket, key = _split(url)
        counter = _Count(progress)
        try:
            self.manager.download(bucket, key, fileobj, subscribers=[counter]).result()
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, url, "download") from None
        return counter.total

    def _head(self, url: str, op: str) -> dict:
        bucket, key = _split(url)
        try:
            return self.client.head_object(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, url, op) from None

    def stat(self, url: str) -> ObjectInfo:
        r = self._head(url, "stat")
        return ObjectInfo(url, int(r["ContentLength"]), _ts(r.get("LastModified")))

    def version(self, url: str) -> str | None:
        """The object's ETag (a HEAD): what ``copy(src_version=...)`` and ``If-Match`` match."""
        return self._head(url, "stat").get("ETag")

    def list(self, prefix: str, *, delimiter: str | None = "/") -> Iterator[ListEntry]:
        bucket, key = _split(prefix)
        kw = {"Bucket": bucket, "Prefix": key}
        if delimiter:
            kw["Delimiter"] = delimiter
        base = f"s3://{bucket}/"
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(**kw):
                for cp in page.get("CommonPrefixes", ()):
                    yield ListEntry(base + cp["Prefix"], is_prefix=True)
                for o in page.get("Contents", ()):
                    yield ListEntry(base + o["Key"], size=int(o["Size"]), mtime=_ts(o.get("LastModified")))
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, prefix, "list") from None

    def delete(self, url: str) -> None:
        bucket, key = _split(url)
        try:
            self.client.delete_object(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - translated below
            err = translate(e, url, "delete")
            if not isinstance(err, NotFound) or isinstance(err, BucketNotFound):
                raise err from None

    def delete_many(self, urls_: Iterable[str]) -> int:
        """DeleteObjects in batches of at most 1,000 keys (one batch per bucket). A key
        that the request's XML cannot carry as it is (a control character: XML 1.0 has
        no C0 but tab/newline, and a carriage return would be read as a newline) is
        deleted alone with DeleteObject, whose key travels in the URL. Every key is
        tried; returns how many are gone; raises DeleteFailed naming the keys that are
        not (AccessDenied, a missing bucket or Transient for the whole request at once)."""
        failed = DeleteFailures()
        n = 0
        batch: list[str] = []
        for u in urls_:
            if _XML_UNSAFE.search(u):
                try:
                    self.delete(u)
                    n += 1
                except StorageError as e:
                    failed.add(u, e)
                continue
            batch.append(u)
            if len(batch) == 1000:
                n += self._delete_batch(batch, failed)
                batch = []
        if batch:
            n += self._delete_batch(batch, failed)
        failed.raise_if_any(n)
        return n

    def _delete_batch(self, batch: list[str], failed: DeleteFailures) -> int:
        """Delete ``batch``; returns how many are gone, adds the others to ``failed``."""
        by_bucket: dict[str, list[str]] = {}
        for u in batch:
            b, k = _split(u)
            by_bucket.setdefault(b, []).append(k)
        gone = 0
        for bucket, keys in by_bucket.items():
            try:
                r = self.client.delete_objects(Bucket=bucket,
                                               Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
            except Exception as e:  # noqa: BLE001 - translated below
                raise translate(e, f"s3://{bucket}/{keys[0]}", f"delete ({len(keys)} keys in one request)") from None
            errors = [x for x in r.get("Errors", ()) if x.get("Code") != "NoSuchKey"]
            for x in errors:
                url = f"s3://{bucket}/{x.get('Key')}"
                answer = {"Error": {"Code": x.get("Code"), "Message": x.get("Message", "")}}
                failed.add(url, translate(bex.ClientError(answer, "DeleteObjects"), url, "delete"))
            gone += len(keys) - len(errors)
        return gone

    def list_multipart_uploads(self, prefix: str) -> list[PendingUpload]:
        bucket, key = _split(prefix)
        out = []
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=key):
                for u in page.get("Uploads", ()):
                    out.append(PendingUpload(f"s3://{bucket}/{u['Key']}", u["UploadId"], _ts(u.get("Initiated"))))
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, prefix, "list multipart uploads") from None
        return out

    def abort_multipart_upload(self, upload: PendingUpload) -> None:
        bucket, key = _split(upload.url)
        try:
            self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload.upload_id)
        except Exception as e:  # noqa: BLE001 - translated below
            err = translate(e, upload.url, "abort multipart upload")
            if not isinstance(err, NotFound):
                raise err from None


    # ------------------------------------------------------------ assembly: a multipart upload
    def begin_assembly(self, url: str) -> Assembly:
        """CreateMultipartUpload; the token is its upload id."""
        bucket, key = _split(url)
        try:
            r = self.client.create_multipart_upload(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, url, "begin assembly of") from None
        return Assembly(url, r["UploadId"])

    def put_piece(self, assembly: Assembly, index: int, data: bytes, *, offset: int) -> Piece:
        """UploadPart number ``index + 1`` of the shared upload id (any process may send
        any part); the record's tag is the part's ETag."""
        bucket, key = _split(assembly.url)
        if not 0 <= index < self.max_pieces:
            raise PreconditionFailed(f"put piece {index} of {assembly.url}: S3 numbers parts 1..{self.max_pieces}",
                                     url=assembly.url)
        try:
            r = self.client.upload_part(Bucket=bucket, Key=key, UploadId=assembly.token, PartNumber=index + 1,
                                        Body=data)
        except Exception as e:  # noqa: BLE001 - translated below
            raise translate(e, assembly.url, f"put piece {index} of") from None
        return Piece(index, offset, len(data), r["ETag"])

    def _complete_assembly(self, assembly: Assembly, pieces: list[Piece], *, if_absent: bool) -> ObjectInfo:
        """CompleteMultipartUpload with every part's number and ETag (``If-None-Match:
        *`` for ``if_absent``)."""
        bucket, key = _split(assembly.url)
        parts = [{"PartNumber": p.index + 1, "ETag": p.tag} for p in pieces]
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            r = self.client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=assembly.token,
                                                      MultipartUpload={"Parts": parts}, **extra)
        except Exception as e:  # noqa: BLE001 - translated below
            err = translate(e, assembly.url, "complete assembly of")
            if if_absent and isinstance(err, PreconditionFailed):
                raise AlreadyExists(f"{assembly.url} already exists", url=assembly.url) from None
            raise err from None
        return ObjectInfo(assembly.url, sum(p.size for p in pieces), version=r.get("ETag"))

    def abort_assembly(self, assembly: Assembly) -> None:
        """AbortMultipartUpload (an upload already gone is not an error)."""
        self.abort_multipart_upload(PendingUpload(assembly.url, assembly.token))


class _Count(BaseSubscriber):
    """Counts bytes moved and forwards them to a progress callback."""

    def __init__(self, fn: Progress):
        self._fn = fn
        self.total = 0

    def on_progress(self, future, bytes_transferred, **kwargs):
        self.total += bytes_transferred
        if self._fn and bytes_transferred > 0:
            self._fn(bytes_transferred)


def _part_copy_cause(e: BaseException) -> BaseException:
    """The ClientError behind s3transfer's S3CopyFailedError (an UploadPartCopy answered
    412, which s3transfer re-raises as its own error), else ``e``."""
    cause = e.__cause__ or e.__context__
    if isinstance(e, S3CopyFailedError) and isinstance(cause, bex.ClientError):
        return cause
    return e


class _KnownSource(BaseSubscriber):
    """Tells s3transfer a copy's source size and ETag (from our own HEAD), so it sends no
    HEAD of its own and every part request carries ``CopySourceIfMatch``."""

    def __init__(self, size: int, etag: str):
        self._size, self._etag = size, etag

    def on_queued(self, future, **kwargs):
        future.meta.provide_transfer_size(self._size)
        future.meta.provide_object_etag(self._etag)


def _ts(v) -> float | None:
    return v.timestamp() if isinstance(v, datetime) else None


class _S3Range(RangeReader):
    """The body of one ranged GET (None: an empty range)."""

    def __init__(self, body, url: str):
        self._body, self._url = body, url

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (``n < 0``: all that is left)."""
        if self._body is None:
            return b""
        try:
            return self._body.read(None if n < 0 else n)
        except Exception as e:  # noqa: BLE001 - a reset or timeout mid-body: Transient
            raise translate(e, self._url, "get") from None

    def close(self) -> None:
        if self._body is not None:
            self._body.close()  # a body not read to its end drops its connection instead of reusing it
            self._body = None
