"""Published checkpoints over ``https://`` (and ``http://``): read-only, plain GETs.

A step put on a web server, a CDN or behind a public bucket's HTTPS URL
(``https://host/runs/run-7/step1000``) loads like any other step: its marker's
manifest names every object with its size and CRC32C, so nothing needs a listing.
The bytes are untrusted like any store's: the readers above (``untrusted/``, the DCP
reader's per-item CRC32C) check them; this module only makes sure a server never
hands a caller more bytes than it asked for.

Reads:

- ``get_bytes`` / ``open_range``: one GET with a ``Range`` header. A 206 answer must be
  exactly the range asked for (``Content-Range`` starts where asked, ends inside the
  request, ``Content-Length`` agrees) and is read as the caller goes, never past it.
- A server that ignores ``Range`` answers 200 with the whole object. A read from
  byte 0 reads that body up to the end asked for, then drops the connection. A read
  further in remembers the origin as range-less and reads from a whole copy of the
  object fetched once into cached-path's cache (:mod:`.http_cache`).
- ``stat``: HEAD (a one-byte ranged GET where HEAD is refused); ``download_fileobj``:
  one streamed GET.

Everything else (writes, deletes, conditional replace, listing) raises
:class:`~cloudckpt.errors.ReadOnlyLocation`, saying where to save instead, or to pass a
step URL. No credentials are sent (``user:password@`` in a URL is never repeated in a
message); proxies and CA bundles follow the standard ``HTTPS_PROXY`` / ``NO_PROXY`` /
``REQUESTS_CA_BUNDLE`` environment.

Time bounds (as S3): every attempt has the connect/read timeouts of
``StorageOptions.attempt_timeouts``; 429/5xx answers and connection failures are
retried with backoff while ``operation_timeout`` and ``max_attempts`` allow, then raise
Timeout / Throttled / Transient naming the endpoint. A body must keep coming: once a
reader has waited on it for ``operation_timeout`` seconds it must have averaged at
least :data:`MIN_RATE` bytes per second waited, else Timeout (a server that trickles
a byte now and then holds a read for little longer than that; a reader that pauses
between reads is not counted against the server).

The server is untrusted like the bytes (a hostile mirror, a hijacked CDN):

- Sizes: every body is held to the size the caller expects. A range read never goes
  past its end; ``download_fileobj(size=)`` (``download_sized``: the manifest's size)
  stops after ``size`` bytes and raises ObjectTooLarge when the answer holds or
  announces more; a read whose length the caller does not state stops at
  :data:`MAX_UNSIZED_BYTES`. A whole-object copy for a server that ignores ``Range``
  needs the size announced and room for it in the cache folder (never fills a disk).
- Redirects are followed only within the origin (scheme, host, port) of the URL
  given, at most :data:`MAX_REDIRECTS` of them; one to another origin (another
  host, another port of the same host, https to http) raises RedirectRefused.

Raises: NotFound, AccessDenied, Throttled, Timeout, Transient, InvalidURL,
ReadOnlyLocation, StorageError (an answer that breaks the protocol).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from email.utils import parsedate_to_datetime
from typing import BinaryIO, Iterator
from urllib.parse import urljoin, urlsplit

import cached_path  # noqa: F401 - the https extra: a missing one fails in open_store with the install hint
import requests
import urllib3.exceptions as u3
from requests.adapters import HTTPAdapter

from .._version import __version__
from ..errors import (
    AccessDenied,
    InvalidURL,
    ObjectTooLarge,
    ReadOnlyLocation,
    RedirectRefused,
    StorageError,
    Throttled,
    Timeout,
    Transient,
)
from .base import ListEntry, MiB, ObjectInfo, Progress, RangeReader, redact_endpoint
from .errors_table import status_error
from .readonly import ReadOnlyStore
from .url import as_prefix, http_url_message

log = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 1 * MiB

MAX_REDIRECTS = 5  # same-origin redirects followed for one request
MAX_UNSIZED_BYTES = 1024 * MiB  # a read whose length the caller does not state (no end, no size) stops here
MIN_RATE = 64 * 1024  # bytes/s a body must average once it is older than operation_timeout
_HINTS = {AccessDenied: "cloudckpt sends no credentials to http(s):// sources: publish the checkpoint publicly, or "
                        "read it from s3:// or gs:// with credentials"}
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def _origin(url: str) -> str:
    p = urlsplit(url)
    port = p.port or {"http": 80, "https": 443}.get(p.scheme)
    return f"{p.scheme}://{p.hostname}:{port}"


def _shown(url: str) -> str:
    """``url`` without any ``user:password@`` part."""
    return redact_endpoint(url)


class HTTPStore(ReadOnlyStore):
    """Read-only store for ``http://`` and ``https://`` URLs (one instance serves both)."""

    scheme = "https"
    streams_ranges = True  # a 206 body is read as the caller goes; a cached copy is a file

    def __init__(self, options=None):
        super().__init__(options)
        self._lock = threading.Lock()
        self._session: requests.Session | None = None
        self._no_ranges: set[str] = set()  # origins that answered a Range request with 200

    # ------------------------------------------------------------ requests
    @property
    def session(self) -> requests.Session:
        with self._lock:
            if self._session is None:
                s = requests.Session()
                # retries are ours (bounded by operation_timeout), not urllib3's
                adapter = HTTPAdapter(pool_connections=4, pool_maxsize=self.options.max_pool_connections, max_retries=0)
                s.mount("http://", adapter)
                s.mount("https://", adapter)
                # ranges of the bytes as stored, never of a compressed encoding of them
                s.headers.update({"Accept-Encoding": "identity", "User-Agent": f"cloudckpt/{__version__}"})
                self._session = s
            return self._session

    def connect(self) -> None:
        self.session  # noqa: B018 - builds it

    def close(self) -> None:
        with self._lock:
            s, self._session = self._session, None
        if s is not None:
            s.close()

    @staticmethod
    def _check_url(url: str) -> None:
        try:
            p = urlsplit(url)
            host, _ = p.hostname, p.port
        except ValueError:
            host, p = None, None
        if p is None or p.scheme not in ("http", "https") or not host:
            raise InvalidURL(f"{_shown(url)!r} is not an http:// or https:// URL with a host", url=_shown(url))
        if p.query or p.fragment or url.endswith(("?", "#")):
            raise InvalidURL(f"{_shown(url)!r} has a query or fragment: give the step folder's plain URL "
                             "(cloudckpt appends the object names to it)", url=_shown(url))

    def _request(self, method: str, url: str, op: str, headers: dict | None = None) -> requests.Response:
        """One request, retried on 429/5xx and connection failures while the deadline and
        ``max_attempts`` allow, following redirects within ``url``'s origin only.
        Returns a streamed response whose status is neither retryable nor a redirect."""
        self._check_url(url)
        o = self.options
        started = time.monotonic()
        attempt = hops = 0
        at = url  # where the request goes now (a same-origin redirect moves it)
        while True:
            attempt += 1
            throttled = False
            try:
                r = self.session.request(method, at, headers=headers, stream=True, timeout=o.attempt_timeouts,
                                         allow_redirects=False)
            except requests.RequestException as e:
                last, err = type(e).__name__, e
            else:
                if r.status_code in _REDIRECT_STATUS and "Location" in r.headers:
                    hops += 1
                    at = self._redirect(url, at, r, op, hops)
                    attempt = 0
                    continue
                if r.status_code not in _RETRY_STATUS:
                    return r
                r.close()
                last, err, throttled = f"HTTP {r.status_code}", None, r.status_code in (429, 503)
            spent = time.monotonic() - started
            delay = min(5.0, 0.1 * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            if attempt >= o.max_attempts or spent + delay >= o.operation_timeout:
                raise self._gave_up(url, op, attempt, last, err, throttled,
                                    deadline=spent + delay >= o.operation_timeout)
            self._notify_retry("throttled" if throttled else "transient")
            time.sleep(delay)

    @staticmethod
    def _redirect(url: str, at: str, r: requests.Response, op: str, hops: int) -> str:
        """Where the redirect answer ``r`` (to a request for ``at``) points, if it stays
        in ``url``'s origin; closes ``r``. Raises RedirectRefused, StorageError."""
        location = r.headers.get("Location", "")
        r.close()
        target = urljoin(at, location.strip())
        shown = ascii(_shown(target)[:200])
        try:
            same = _origin(target) == _origin(url) and urlsplit(target).scheme in ("http", "https")
        except ValueError:
            same = False
        if not same:
            raise RedirectRefused(f"{op} {_shown(url)}: the server redirects (HTTP {r.status_code}) to {shown}, "
                                  f"another origin than {_origin(url)}; cloudckpt follows redirects within the origin "
                                  "of the URL it was given only: pass the URL the checkpoint is published at",
                                  url=_shown(url))
        if hops > MAX_REDIRECTS:
            raise StorageError(f"{op} {_shown(url)}: more than {MAX_REDIRECTS} redirects (the last to {shown}); "
                               "pass the URL the checkpoint is published at", url=_shown(url))
        log.info("%s %s: redirected (HTTP %d) to %s", op, _shown(url), r.status_code, shown)
        return target

    def _gave_up(self, url: str, op: str, attempts: int, last: str, err: BaseException | None, throttled: bool,
                 *, deadline: bool) -> StorageError:
        o = self.options
        shown, endpoint = _shown(url), _origin(url)
        if deadline:
            cls = Throttled if throttled else Timeout
            return cls(f"{op} {shown}: no successful answer from {endpoint} within operation_timeout="
                       f"{o.operation_timeout:g}s ({attempts} attempt(s), the last: {last}; read_timeout "
                       f"{o.attempt_timeouts[1]:g}s); check the URL and the network, or raise operation_timeout "
                       "(--timeout)", url=shown)
        if throttled:
            return Throttled(f"{op} {shown}: {endpoint} is throttling requests ({last}); {attempts} attempts were "
                             "made", url=shown)
        if isinstance(err, requests.Timeout):
            return Timeout(f"{op} {shown}: {endpoint} did not answer within the connect/read timeouts "
                           f"{o.attempt_timeouts[0]:g}s/{o.attempt_timeouts[1]:g}s ({attempts} attempt(s)); check "
                           "the URL and the network, or raise --connect-timeout / read_timeout", url=shown)
        if err is not None:
            return Transient(f"{op} {shown}: connection problem reaching {endpoint} ({last}, {attempts} attempt(s)); "
                             "check the URL and the network", url=shown)
        return Transient(f"{op} {shown}: server error ({last}, {attempts} attempt(s))", url=shown)

    @staticmethod
    def _check_status(r: requests.Response, url: str, op: str) -> None:
        s = r.status_code
        if s in (200, 206):
            enc = r.headers.get("Content-Encoding", "identity").strip().lower()
            if enc in ("", "identity"):
                return
            r.close()
            raise StorageError(f"{op} {_shown(url)}: the server sent the object {enc}-encoded although cloudckpt asked "
                               "for it as stored (Accept-Encoding: identity); serve checkpoint files without "
                               "compression", url=_shown(url))
        r.close()
        raise status_error(s, _shown(url), op, detail=f"HTTP {s}", hints=_HINTS)

    # ------------------------------------------------------------ reads
    def get_bytes(self, url: str, *, start: int | None = None, end: int | None = None) -> bytes:
        if end is not None and end <= (start or 0):
            return b""
        with self._open(url, start or 0, end, "get") as r:
            return r.read(-1)

    def open_range(self, url: str, start: int, end: int) -> RangeReader:
        if end <= start:
            return _Bytes(b"")
        return self._open(url, start, end, "get")

    def _open(self, url: str, start: int, end: int | None, op: str) -> RangeReader:
        if start > 0 and _origin(url) in self._no_ranges:
            return self._cached(url, start, end)
        ranged = start > 0 or end is not None
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if ranged else None
        r = self._request("GET", url, op, headers)
        if r.status_code == 416 and ranged:  # the range starts at or after the end: like slicing
            r.close()
            return _Bytes(b"")
        self._check_status(r, url, op)
        if r.status_code == 206:
            length = self._checked_range(r, url, op, start, end)
            return _Body(r, url, length, exact=True, min_after=self.options.operation_timeout)
        if start == 0:  # the whole object from its start: read what was asked for of it
            return _Body(r, url, end, exact=False, min_after=self.options.operation_timeout,
                         ceiling=MAX_UNSIZED_BYTES if end is None else None)
        r.close()  # drops the connection: the rest of the body is not read
        with self._lock:
            self._no_ranges.add(_origin(url))
        log.info("%s answers Range requests with the whole object: reading %s from a cached copy (cached-path)",
                 _origin(url), _shown(url))
        return self._cached(url, start, end)

    @staticmethod
    def _checked_range(r: requests.Response, url: str, op: str, start: int, end: int | None) -> int:
        """The length of a 206 body after checking it is the range asked for."""
        cr = r.headers.get("Content-Range", "").strip()
        m = _CONTENT_RANGE.match(cr)
        first, last = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
        if not m or first != start or last < first or (end is not None and last >= end):
            r.close()
            asked = f"{start}-{'' if end is None else end - 1}"
            raise StorageError(f"{op} {_shown(url)}: the server answered the range bytes {asked} with "
                               f"Content-Range {cr[:80]!r}; refusing an answer that is not the range asked for",
                               url=_shown(url))
        length = last - first + 1
        cl = r.headers.get("Content-Length")
        if cl is not None and cl.strip() != str(length):
            r.close()
            raise StorageError(f"{op} {_shown(url)}: the server's Content-Length {cl[:30]!r} does not match its "
                               f"Content-Range {cr[:80]!r}; refusing the answer", url=_shown(url))
        return length

    def _cached(self, url: str, start: int, end: int | None) -> RangeReader:
        from .http_cache import cached_file

        path = cached_file(self, url)
        f = open(path, "rb")
        try:
            f.seek(start)
        except BaseException:
            f.close()
            raise
        return _FileSlice(f, None if end is None else end - start)

    def head(self, url: str, op: str = "stat") -> dict:
        """The object's headers (``Content-Length`` is its size): a HEAD, or a one-byte
        ranged GET where the server refuses HEAD (405/501). Raises NotFound."""
        r = self._request("HEAD", url, op)
        if r.status_code not in (405, 501):
            r.close()
            self._check_status(r, url, op)
            return dict(r.headers)
        r.close()
        r = self._request("GET", url, op, {"Range": "bytes=0-0"})
        r.close()
        if r.status_code == 416:  # an empty object
            return {**r.headers, "Content-Length": "0"}
        self._check_status(r, url, op)
        h = dict(r.headers)
        if r.status_code == 206:
            m = _CONTENT_RANGE.match(h.get("Content-Range", "").strip())
            if not m or m.group(3) == "*":
                raise StorageError(f"{op} {_shown(url)}: the server does not say the object's size", url=_shown(url))
            h["Content-Length"] = m.group(3)
        return h

    def stat(self, url: str) -> ObjectInfo:
        h = self.head(url)
        try:
            size = int(h["Content-Length"])
        except (KeyError, ValueError):
            raise StorageError(f"stat {_shown(url)}: the server does not say the object's size "
                               "(no Content-Length)", url=_shown(url)) from None
        mtime = None
        try:
            mtime = parsedate_to_datetime(h["Last-Modified"]).timestamp()
        except (KeyError, TypeError, ValueError):
            pass  # no or unreadable Last-Modified: the age is unknown
        return ObjectInfo(url, size, mtime)

    def download_fileobj(self, url: str, fileobj: BinaryIO, *, progress: Progress = None,
                         size: int | None = None) -> int:
        """Write the object to ``fileobj``; returns the bytes written. ``size``: the
        length the caller expects (the manifest's): an answer that announces or holds
        more raises ObjectTooLarge after at most ``size`` bytes were written (a shorter
        one is returned short: the caller compares). Without ``size`` the object may
        hold up to :data:`MAX_UNSIZED_BYTES`."""
        limit = MAX_UNSIZED_BYTES if size is None else size
        n = 0
        with self._open(url, 0, limit + 1, "download") as r:
            announced = r.announced if isinstance(r, _Body) else None
            if announced is not None and announced > limit:
                raise self._too_large(url, limit, f"the server announces {announced} bytes", size is None)
            while True:
                chunk = r.read(_CHUNK)
                if not chunk:
                    break
                if n + len(chunk) > limit:
                    raise self._too_large(url, limit, "the server sent more", size is None)
                n += len(chunk)
                fileobj.write(chunk)
                if progress:
                    progress(len(chunk))
        return n

    def download_sized(self, url: str, fileobj: BinaryIO, *, size: int, progress: Progress = None) -> int:
        return self.download_fileobj(url, fileobj, progress=progress, size=size)

    @staticmethod
    def _too_large(url: str, limit: int, what: str, unsized: bool) -> ObjectTooLarge:
        expected = (f"the {limit}-byte ceiling for an object whose size the caller does not state" if unsized
                    else f"the {limit} bytes expected (its size in the checkpoint's manifest)")
        return ObjectTooLarge(f"download {_shown(url)}: {what} than {expected}; refusing to read further (the "
                              "published object is not the one the checkpoint lists)", url=_shown(url))

    # ------------------------------------------------------------ what a read-only source cannot do
    def read_only_error(self, url: str, op: str) -> ReadOnlyLocation:
        """Writes, deletes and conditional replace (:class:`~cloudckpt.storage.readonly.ReadOnlyStore`): where
        to save instead."""
        return ReadOnlyLocation(f"cannot {op} {_shown(url)}: " + http_url_message(url), url=_shown(url))

    def list(self, prefix: str, *, delimiter: str | None = "/") -> Iterator[ListEntry]:
        shown = as_prefix(_shown(prefix))
        raise ReadOnlyLocation(
            f"cannot list {shown}: an http(s):// server has no listing. To load a published checkpoint pass its "
            f"step folder, e.g. {shown}step1000 (`cloudckpt inspect`, `verify`, `download` and Checkpointer.load "
            "take it; find the step numbers where the run was saved). A step written by another tool (a marker "
            "without cloudckpt's manifest) is described by listing it, so it cannot be loaded from http(s)://: "
            "load it from where it was saved. " + http_url_message(prefix), url=shown)


class _Bytes(RangeReader):
    def __init__(self, data: bytes):
        self._view = memoryview(data)

    def read(self, n: int):
        out = self._view if n < 0 else self._view[:n]
        self._view = self._view[len(out):]
        return bytes(out)


class _Body(RangeReader):
    """The body of one GET, read as the caller goes and never past ``limit`` bytes
    (None: to its end, at most ``ceiling``). ``exact``: the body must hold all ``limit``
    bytes (a 206). Once it has kept its reader waiting for ``min_after`` seconds it must
    have averaged :data:`MIN_RATE` bytes a second of that waiting (checked between socket
    reads; time the reader spends elsewhere, e.g. waiting for a memory budget, does not
    count), else Timeout."""

    def __init__(self, r: requests.Response, url: str, limit: int | None, *, exact: bool, min_after: float,
                 ceiling: int | None = None):
        self._r, self._url, self._left, self._exact = r, url, limit, exact
        self._ceiling, self._min_after = ceiling, min_after
        self._got = 0
        self._waited = 0.0  # seconds spent blocked in socket reads
        try:
            self.announced: int | None = int(r.headers["Content-Length"])
        except (KeyError, ValueError):
            self.announced = None  # chunked, or unreadable: only what arrives counts

    def _check_pace(self) -> None:
        spent = self._waited
        if spent > self._min_after and self._got < (spent - self._min_after) * MIN_RATE:
            self.close()
            raise Timeout(f"get {_shown(self._url)}: the answer arrives too slowly ({self._got} bytes in {spent:.0f} s "
                          f"of waiting; after the first {self._min_after:g} s (operation_timeout) a body must average "
                          f"{MIN_RATE // 1024} KiB/s); check the server and the network", url=_shown(self._url))

    def _read_up_to(self, want: int) -> bytes:
        """Up to ``want`` bytes, fewer only where the body ends; socket read by socket read."""
        pieces, have = [], 0
        while have < want:
            self._check_pace()
            t0 = time.monotonic()
            piece = self._r.raw.read1(min(want - have, _CHUNK), decode_content=False)
            self._waited += time.monotonic() - t0
            if not piece:
                break
            pieces.append(piece)
            have += len(piece)
            self._got += len(piece)
        return b"".join(pieces)

    def read(self, n: int) -> bytes:
        if self._r is None or self._left == 0:
            return b""
        want = self._left if n < 0 else (n if self._left is None else min(n, self._left))
        try:
            if want is None:  # everything that is left, up to the ceiling
                cap = (self._ceiling or MAX_UNSIZED_BYTES) + 1 - self._got
                data = self._read_up_to(cap)
                if self._got > (self._ceiling or MAX_UNSIZED_BYTES):
                    self.close()
                    raise ObjectTooLarge(f"get {_shown(self._url)}: the answer holds more than "
                                         f"{self._ceiling or MAX_UNSIZED_BYTES} bytes, the ceiling for a read whose "
                                         "size the caller does not state; refusing to read further",
                                         url=_shown(self._url))
            else:
                data = self._read_up_to(want)
        except StorageError:
            raise  # ours (Timeout is also an OSError)
        except (u3.HTTPError, requests.RequestException, OSError) as e:
            self.close()
            timeout = isinstance(e, (u3.ReadTimeoutError, requests.Timeout, TimeoutError))
            raise (Timeout if timeout else Transient)(
                f"get {_shown(self._url)}: the answer broke off after {self._got} bytes ({type(e).__name__})",
                url=_shown(self._url)) from None
        if self._left is not None:
            self._left -= len(data)
            if self._exact and self._left > 0 and len(data) < want:
                self.close()
                raise Transient(f"get {_shown(self._url)}: the answer ended after {self._got} bytes, "
                                f"{self._got + self._left} were announced", url=_shown(self._url))
        elif self._ceiling is not None and self._got > self._ceiling:
            self.close()
            raise ObjectTooLarge(f"get {_shown(self._url)}: the answer holds more than {self._ceiling} bytes, the "
                                 "ceiling for a read whose size the caller does not state", url=_shown(self._url))
        return data

    def close(self) -> None:
        if self._r is not None:
            self._r.close()  # a body not read to its end drops its connection
            self._r = None


class _FileSlice(RangeReader):
    """At most ``left`` bytes (None: to the end) of an open cached file, from where it is."""

    def __init__(self, f: BinaryIO, left: int | None):
        self._f, self._left = f, left

    def read(self, n: int) -> bytes:
        if self._left is None:
            return self._f.read(n)
        data = self._f.read(self._left if n < 0 else min(n, self._left))
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._f.close()
