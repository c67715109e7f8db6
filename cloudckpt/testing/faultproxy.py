"""A fault-injecting HTTP proxy on 127.0.0.1, for tests against real local stores.

Put it in front of SeaweedFS (S3) or fake-gcs-server (GCS) and point the client at
it (``AWS_ENDPOINT_URL`` / ``StorageOptions(endpoint_url=...)`` for S3,
``STORAGE_EMULATOR_HOST`` for GCS)::

    with FaultProxy(seaweed.endpoint_url, seed=7) as proxy:
        proxy.add(Rule("slowdown", rate=0.10))                        # 10% of requests: 503 SlowDown
        proxy.add(Rule("reset", rate=0.02))                           # 2%: connection reset
        proxy.add(Rule("stall", method="PUT", key=r"__1_.*\\.distcp", times=1, after_bytes=4096))
        env = {**seaweed.env(), "AWS_ENDPOINT_URL": proxy.endpoint_url}
        ...
        proxy.injected()   # Counter({"slowdown": 3, "reset": 1, "stall": 1})

Faults (``Rule.fault``):

- ``slowdown`` 503 with an S3 ``SlowDown`` XML body (a JSON error body in GCS flavour);
  ``error500`` 500 InternalError; ``throttle429`` 429 TooManyRequests. The request
  never reaches the store (its body is read and dropped).
- ``reset``: the connection is reset (TCP RST) instead of an answer. With
  ``when="request"`` (default) the store never sees the request; with
  ``when="response"`` the request is forwarded and applied, and its answer is lost
  (the ambiguous case: a retried conditional create then meets its own object).
- ``stall``: hang after ``after_bytes`` bytes of the body, for ``hold`` seconds (or
  until the proxy stops), then reset. The body is the request body when the request
  has one (an upload stops being read), else the response body (a download stops).
- ``truncate``: forward, send the answer's headers (with the full length) and the
  first ``after_bytes`` bytes of its body, then close the connection.
- ``latency``: wait ``delay`` seconds, then forward normally.

Choosing requests: a rule matches on ``method`` (one or a set) and ``key`` (a regex
searched in the request target, path and query: the S3 ``/bucket/key`` or the GCS
``.../b/bucket/o/name`` / ``?name=``; a GCS single-request upload names its object in
its body, so ``&name=...`` taken from the body's JSON part is appended to the target). Among
matching requests it fires on the ``nth`` (1-based, an int or a set), or with probability ``rate``, or above a request
rate (``above_rate``: it lets at most that many matching requests through in any
``per`` seconds, sliding, and fires on the others: ``Rule("slowdown", above_rate=20)``
is a store that answers SlowDown above 20 requests/s), or always; at most
``times`` times. The first rule that fires decides; ``nth`` counts every request
the rule matches, including ones an earlier rule took. Rate decisions are seeded and
drawn from a hash of (seed, rule, method, path, how often that method+path was seen),
so the same requests get the same faults whatever order threads run in.

Forwarding keeps what the client signed: the request line and every header (``Host``
included) are sent upstream unchanged, so SigV4 signatures made for the proxy's
host:port verify at the store. Only ``Expect: 100-continue`` (not signed) is answered
by the proxy itself. ``Location`` headers pointing at the upstream (GCS resumable
uploads) are rewritten to the proxy. Bodies are streamed, never buffered whole.

One thread per client connection (``ThreadingHTTPServer``); one upstream connection
per request. Binds 127.0.0.1 only and forwards only to a 127.0.0.1 / localhost upstream.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import http.server
import json
import logging
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
FAULTS = ("slowdown", "error500", "throttle429", "reset", "stall", "truncate", "latency")
_CHUNK = 64 * 1024
_PEEK = 4096  # bytes of a GCS multipart upload read to find the object name
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect"}


@dataclass
class Rule:
    """One fault and the requests it applies to. See the module docstring."""

    fault: str
    method: Union[str, Iterable[str], None] = None
    key: Optional[str] = None
    nth: Union[int, Iterable[int], None] = None
    rate: Optional[float] = None
    times: Optional[int] = None
    after_bytes: int = 0  # stall / truncate: body bytes let through first
    hold: float = 60.0  # stall: seconds to hang before resetting
    delay: float = 0.0  # latency: seconds added
    when: str = "request"  # reset: "request" (never forwarded) or "response" (forwarded, answer lost)
    above_rate: Optional[float] = None  # fire on matching requests beyond this many per ``per`` seconds
    per: float = 1.0
    seen: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; use one of {', '.join(FAULTS)}")
        if self.when not in ("request", "response"):
            raise ValueError(f"when={self.when!r}: use 'request' or 'response'")
        if self.rate is not None and not 0 <= self.rate <= 1:
            raise ValueError(f"rate={self.rate!r}: use a probability in [0, 1]")
        if self.above_rate is not None and not self.above_rate > 0:
            raise ValueError(f"above_rate={self.above_rate!r}: use requests per `per` seconds > 0")
        if not self.per > 0:
            raise ValueError(f"per={self.per!r}: use seconds > 0")
        self._passed: collections.deque = collections.deque()  # above_rate: when matching requests went through
        if isinstance(self.method, str):
            self.method = {self.method.upper()}
        elif self.method is not None:
            self.method = {m.upper() for m in self.method}
        if isinstance(self.nth, int):
            self.nth = {self.nth}
        elif self.nth is not None:
            self.nth = set(self.nth)
        self._key_re = re.compile(self.key) if self.key else None

    def over_rate(self, now: float) -> bool:
        """``above_rate``: True when ``above_rate`` matching requests went through in
        the last ``per`` seconds (this one fires), else count this one as let through."""
        while self._passed and self._passed[0] <= now - self.per:
            self._passed.popleft()
        if len(self._passed) >= self.above_rate:
            return True
        self._passed.append(now)
        return False

    def matches(self, method: str, target: str) -> bool:
        if self.method is not None and method not in self.method:
            return False
        return self._key_re is None or self._key_re.search(urllib.parse.unquote(target)) is not None


@dataclass(frozen=True)
class Event:
    """One request the proxy handled: what it was and which fault (None: forwarded)."""

    t: float
    method: str
    target: str
    fault: Optional[str]


@dataclass(frozen=True)
class Completed:
    """A request the store answered and whose answer reached the client in full:
    ``start`` when the proxy received it, ``end`` when the answer was sent (monotonic
    seconds). The server-side order of writes, for request-order assertions."""

    start: float
    end: float
    method: str
    target: str
    status: int


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # never join a handler thread hanging in a stall
    proxy: "FaultProxy"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.open_connections: set = set()
        self.conn_lock = threading.Lock()

    def process_request(self, request, client_address):
        with self.conn_lock:
            self.open_connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self.conn_lock:
            self.open_connections.discard(request)
        super().shutdown_request(request)

    def reset_all(self) -> None:
        """Reset every open client connection (idle keep-alive ones included)."""
        with self.conn_lock:
            conns, self.open_connections = list(self.open_connections), set()
        for c in conns:
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed


class FaultProxy:
    """The proxy. ``upstream``: the store's ``http://127.0.0.1:PORT``. ``flavor``:
    ``"s3"`` (XML error bodies) or ``"gcs"`` (JSON error bodies). ``seed`` seeds the
    rate decisions. A context manager; ``start()``/``stop()`` otherwise."""

    def __init__(self, upstream: str, *, seed: int = 0, flavor: str = "s3", rules: Iterable[Rule] = ()):
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or u.hostname not in (LOOPBACK, "localhost"):
            raise ValueError(f"upstream {upstream!r}: the fault proxy only forwards to http://127.0.0.1:PORT")
        if flavor not in ("s3", "gcs"):
            raise ValueError(f"flavor={flavor!r}: use 's3' or 'gcs'")
        self.upstream_host, self.upstream_port = LOOPBACK, u.port or 80
        self.flavor = flavor
        self.seed = seed
        self._lock = threading.Lock()
        self._rules: list[Rule] = list(rules)
        self._counts: collections.Counter = collections.Counter()
        self._occurrences: collections.Counter = collections.Counter()
        self.events: list[Event] = []
        self.completed: list[Completed] = []
        self.requests = 0
        self._stopping = threading.Event()
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self.port = 0

    # ------------------------------------------------------------ lifecycle
    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> "FaultProxy":
        self._server = _Server((LOOPBACK, 0), _Handler)
        self._server.proxy = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"faultproxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; stalled connections are released (reset)."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.reset_all()
            self._server = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ rules and counters
    def add(self, *rules: Rule) -> "FaultProxy":
        with self._lock:
            self._rules.extend(rules)
        return self

    def clear(self) -> None:
        """Remove every rule (counters and events are kept)."""
        with self._lock:
            self._rules = []

    def reset_counters(self) -> None:
        with self._lock:
            self._counts.clear()
            self.events = []
            self.completed = []
            self.requests = 0

    def injected(self) -> collections.Counter:
        """How many times each fault was injected (``latency`` included)."""
        with self._lock:
            return collections.Counter(self._counts)

    def _choose(self, method: str, target: str) -> Optional[Rule]:
        path = target.split("?", 1)[0]
        with self._lock:
            self.requests += 1
            self._occurrences[(method, path)] += 1
            occurrence = self._occurrences[(method, path)]
            chosen = None
            for i, r in enumerate(self._rules):
                if not r.matches(method, target):
                    continue
                r.seen += 1  # every matching request counts for ``nth``, even one an earlier rule took
                if chosen is not None or (r.times is not None and r.fired >= r.times):
                    continue
                if r.above_rate is not None:
                    fire = r.over_rate(time.monotonic())
                elif r.nth is not None:
                    fire = r.seen in r.nth
                elif r.rate is not None:
                    fire = _draw(self.seed, i, method, path, occurrence) < r.rate
                else:
                    fire = True
                if fire:
                    r.fired += 1
                    chosen = r
            if chosen is not None:
                self._counts[chosen.fault] += 1
            self.events.append(Event(time.monotonic(), method, target, chosen.fault if chosen else None))
            return chosen

    # ------------------------------------------------------------ error bodies
    def error_body(self, status: int) -> tuple[bytes, str]:
        code = {503: "SlowDown", 500: "InternalError", 429: "TooManyRequests"}[status]
        msg = {503: "Please reduce your request rate.", 500: "We encountered an internal error. Please try again.",
               429: "Too many requests."}[status]
        if self.flavor == "gcs":
            error = {"code": status, "message": msg, "errors": [{"reason": code, "message": msg}]}
            return json.dumps({"error": error}).encode(), "application/json; charset=UTF-8"
        return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{msg}</Message>'
                f"<RequestId>faultproxy</RequestId></Error>").encode(), "application/xml"


def _draw(seed: int, rule: int, method: str, path: str, occurrence: int) -> float:
    h = hashlib.blake2b(f"{seed}|{rule}|{method}|{path}|{occurrence}".encode(), digest_size=8).digest()
    return struct.unpack(">Q", h)[0] / 2**64


class _Reset(Exception):
    """Abort the connection with a TCP reset."""


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the stores
    server: _Server

    def log_message(self, format, *args) -> None:  # BaseHTTPRequestHandler's signature
        log.debug("faultproxy: " + format, *args)

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except _Reset:
            self._rst()
        except (ConnectionError, socket.timeout, BrokenPipeError):
            self.close_connection = True

    def _rst(self) -> None:
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass  # already gone

    def do_GET(self):
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = do_GET

    # ------------------------------------------------------------ request body
    def _body_chunks(self, limit: Optional[int] = None):
        """Yield the request body as raw bytes (chunked framing kept as is). Stops
        after ``limit`` bytes when given (the rest stays unread)."""
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        sent = 0
        if "chunked" in te:
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise ConnectionError("client closed mid-body")
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                piece = line + (self.rfile.read(size) if size else b"")
                if size == 0:  # trailers up to an empty line
                    while True:
                        t = self.rfile.readline(65537)
                        piece += t
                        if t in (b"\r\n", b"\n", b""):
                            break
                else:
                    piece += self.rfile.readline(65537)
                if limit is not None and sent + len(piece) > limit:
                    yield piece[: limit - sent]
                    return
                sent += len(piece)
                yield piece
                if size == 0:
                    return
        else:
            left = int(self.headers.get("Content-Length") or 0) - len(self._prefix)
            if self._prefix:
                piece = self._prefix if limit is None else self._prefix[:limit]
                sent += len(piece)
                yield piece
                if limit is not None and sent >= limit:
                    return
            while left > 0:
                want = min(_CHUNK, left)
                if limit is not None:
                    want = min(want, limit - sent)
                    if want <= 0:
                        return
                data = self.rfile.read(want)
                if not data:
                    raise ConnectionError("client closed mid-body")
                left -= len(data)
                sent += len(data)
                yield data

    def _has_body(self) -> bool:
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        return bool(int(self.headers.get("Content-Length") or 0)) or chunked

    # ------------------------------------------------------------ the proxy
    def _proxy(self) -> None:
        proxy = self.server.proxy
        self._prefix = b""
        started = time.monotonic()
        target = self.path
        multipart = (self.headers.get("Content-Type") or "").startswith("multipart/related")
        if multipart and self.headers.get("Content-Length"):
            # a GCS single-request upload names its object in the JSON part at the start of the body
            self._prefix = self.rfile.read(min(_PEEK, int(self.headers["Content-Length"])))
            m = re.search(rb'"name"\s*:\s*"([^"]*)"', self._prefix)
            if m:
                name = urllib.parse.quote(m.group(1).decode("utf-8", "replace"))
                target += ("&" if "?" in target else "?") + "name=" + name
        rule = proxy._choose(self.command, target)
        fault = rule.fault if rule else None
        if fault in ("slowdown", "error500", "throttle429"):
            for _ in self._body_chunks():
                pass
            status = {"slowdown": 503, "error500": 500, "throttle429": 429}[fault]
            body, ctype = proxy.error_body(status)
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if status in (503, 429):
                self.send_header("Retry-After", "1")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self.wfile.flush()
            return
        if fault == "reset" and rule.when == "request":
            raise _Reset()
        if fault == "latency":
            if proxy._stopping.wait(rule.delay):
                raise _Reset()
        stall_request = fault == "stall" and self._has_body()

        up = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=300)
        try:
            up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in _HOP_BY_HOP:
                    up.putheader(k, v)
            up.endheaders()
            for piece in self._body_chunks(rule.after_bytes if stall_request else None):
                up.send(piece)
            if stall_request:
                self._hang(rule)
            resp = up.getresponse()
            if fault == "reset":  # when == "response": the store applied it; the answer is lost
                resp.read()
                raise _Reset()
            self._forward_response(resp, rule if fault in ("stall", "truncate") else None)
            if fault not in ("stall", "truncate"):
                with proxy._lock:
                    proxy.completed.append(Completed(started, time.monotonic(), self.command, target, resp.status))
        finally:
            up.close()

    def _hang(self, rule: Rule) -> None:
        self.server.proxy._stopping.wait(rule.hold)
        raise _Reset()

    def _forward_response(self, resp: http.client.HTTPResponse, cut: Optional[Rule]) -> None:
        proxy = self.server.proxy
        chunked = resp.getheader("Content-Length") is None and self.command != "HEAD" and resp.status not in (204, 304)
        self.send_response_only(resp.status, resp.reason)
        upstream_base = f"{proxy.upstream_host}:{proxy.upstream_port}"
        for k, v in resp.getheaders():
            lk = k.lower()
            if lk in _HOP_BY_HOP or lk == "transfer-encoding":
                continue
            if lk == "location" and upstream_base in v:
                v = v.replace(upstream_base, f"{LOOPBACK}:{proxy.port}")
            self.send_header(k, v)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if resp.will_close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        budget = cut.after_bytes if cut is not None else None
        while True:
            data = resp.read(_CHUNK)
            if budget is not None and len(data) >= budget:
                data = data[:budget]
                self._write(data, chunked)
                self.wfile.flush()
                if cut.fault == "stall":
                    self._hang(cut)
                self.close_connection = True  # truncate: close with the body unfinished
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if budget is not None:
                budget -= len(data)
            if not data:
                break
            self._write(data, chunked)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write(self, data: bytes, chunked: bool) -> None:
        if not data:
            return
        if chunked:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        else:
            self.wfile.write(data)
