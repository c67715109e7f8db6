"""Hostile https:// sources (issue 31, classes 6 and 8): a server that ignores ``Range``
and announces 1 TiB, a body that never ends (with and without a length), an object
longer than its manifest says, a body that trickles, and redirects to another origin.

Each try saves an honest step into ``tmp/saves`` with cloudckpt's own writer and
serves it from a hostile server on 127.0.0.1 (a thread of the try's own process) that
answers one object (or the marker) its own way; then ONE entry point reads the step
from ``http://127.0.0.1:PORT/...``. Beside the outcome, each try checks what the
server saw: the bytes it managed to send for the hostile object (a client that stops
at the manifest's size leaves it a few MiB of socket buffers at most; one that reads
on gets :data:`CAP`), and that the other origin of a redirect got no request at all.
A breach raises :class:`Breach` (an AssertionError: untyped, a finding).

CLI tries pass ``--timeout 3`` and loads ``operation_timeout=3``: the bound on a body
that trickles is reached after 3 s (the default is 60 s, as long as a try may run).
"""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .tries import Try, cli, honest_step, outside_untouched, zero_state

MOD = "tests.security.hostile_https"
SHARD = "model_and_optim/__0_0.distcp"
MARKER = ".metadata.json"
# a hostile body stops here (or past the bound of the try): a client without a bound reads all of it (a finding)
CAP = 128 << 20
# what socket buffers (and the HTTP client's read-ahead) may take from a server after the client stopped reading,
# with the sandbox running two tries side by side on two cores: 16 MiB was once exceeded by 19 MiB that way. A
# client without a bound still reads to the server's cap (the try's size + 2 x SLACK), past this, and is a finding
SLACK = 64 << 20
TIB = 1 << 40


class Breach(AssertionError):
    """A finding: the client read past the size it expected, or reached another origin."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *a) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    # ------------------------------------------------------------ honest files
    def _file(self, head: bool) -> None:
        # /mirror/... is the same step under another path (a same-origin redirect's target)
        rel = self.path.lstrip("/").replace("mirror/", "run/", 1) if self.path.startswith("/mirror/") else \
            self.path.lstrip("/")
        path = os.path.join(self.server.root, *rel.split("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            data = f.read()
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and not head:
            a, _, b = rng[6:].partition("-")
            first, last = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
            if first >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = data[first:last + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{len(data)}"')
        self.end_headers()
        if not head:
            self.wfile.write(body)

    # ------------------------------------------------------------ hostile answers
    def _endless(self, *, length: int | None) -> None:
        self.send_response(200)
        if length is None:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(length))
        self.send_header("ETag", '"hostile"')
        self.end_headers()
        block = b"\0" * (1 << 20)
        try:
            while self.server.sent < self.server.cap:
                if length is None:
                    self.wfile.write(b"%x\r\n" % len(block) + block + b"\r\n")
                else:
                    self.wfile.write(block)
                with self.server.lock:
                    self.server.sent += len(block)
        except (ConnectionError, OSError):
            pass
        self.close_connection = True

    def _broken(self) -> None:
        """A 206 of the range asked for that breaks off after half of it."""
        path = os.path.join(self.server.root, *self.path.lstrip("/").split("/"))
        with open(path, "rb") as f:
            data = f.read()
        last = min(int(self.headers["Range"][len("bytes=0-"):] or len(data) - 1), len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes 0-{last}/{len(data)}")
        self.send_header("Content-Length", str(last + 1))
        self.end_headers()
        self.wfile.write(data[:(last + 1) // 2])
        self.wfile.flush()
        self.close_connection = True

    def _trickle(self) -> None:
        path = os.path.join(self.server.root, *self.path.lstrip("/").split("/"))
        size = os.path.getsize(path)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        import time

        try:
            for _ in range(size):
                if self.server.stop.is_set():
                    break
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.5)
        except (ConnectionError, OSError):
            pass
        self.close_connection = True

    def _answer(self, head: bool) -> None:
        s = self.server
        with s.lock:
            s.seen.append((self.command, self.path, self.headers.get("Range")))
        rel = self.path[len(s.step_path):]
        mode = s.modes.get(rel) if self.path.startswith(s.step_path) else None
        if mode is None:
            return self._file(head)
        if mode == "huge-inside":  # breaks off a read from byte 0; ignores Range further in, announcing 1 TiB
            rng = self.headers.get("Range", "")
            if not head and rng.startswith("bytes=0-"):
                return self._broken()
            mode = "huge"
        if mode in ("huge", "endless-length"):
            if head:
                self.send_response(200)
                self.send_header("Content-Length", str(TIB))
                self.send_header("ETag", '"hostile"')
                self.end_headers()
                return
            return self._endless(length=TIB)
        if mode == "endless-chunked":
            if head:
                self.send_response(200)
                self.send_header("ETag", '"hostile"')
                self.end_headers()
                return
            return self._endless(length=None)
        if mode == "trickle":
            return self._file(head) if head else self._trickle()
        if mode.startswith("redirect:"):
            self.send_response(int(s.redirect_status))
            self.send_header("Location", mode[len("redirect:"):].format(other=s.other_port, port=s.port,
                                                                         path=self.path))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        raise AssertionError(mode)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client hanging up mid-body is what a bounded client does


class Hostile:
    """Serves ``root`` on 127.0.0.1; ``modes`` maps an object of the step at
    ``/{step}/`` to a hostile answer."""

    def __init__(self, root: str, modes: dict[str, str], *, redirect_status: int = 302, step: str = "run/step1"):
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        h = self.httpd
        h.root, h.modes, h.redirect_status = root, modes, redirect_status
        h.step_path = f"/{step}/"
        h.sent, h.seen, h.lock, h.stop = 0, [], threading.Lock(), threading.Event()
        h.cap = CAP
        h.port = h.server_address[1]
        h.other_port = 0
        self.url = f"http://127.0.0.1:{h.port}"
        threading.Thread(target=h.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.httpd.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class Other:
    """The other origin a redirect points at: another port of 127.0.0.1, serving a
    secret and recording every request it gets (none may come)."""

    def __init__(self, secret_root: str):
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        h = self.httpd
        h.root, h.modes, h.step_path = secret_root, {}, "/never/"
        h.sent, h.seen, h.lock, h.stop = 0, [], threading.Lock(), threading.Event()
        h.port = h.server_address[1]
        threading.Thread(target=h.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _step(tmp: str) -> str:
    saves = os.path.join(tmp, "saves")
    honest_step(os.path.join(saves, "run"))
    return saves


def _entry(entry: str, url: str, tmp: str) -> str:
    if entry == "load":
        from cloudckpt import Checkpointer
        from cloudckpt.storage import StorageOptions

        with Checkpointer(work_dir=os.path.join(tmp, "work"),
                          storage_options=StorageOptions(operation_timeout=3.0)) as ck:
            ck.load(url, zero_state())
        return ""
    argv = {"cli_inspect": ["inspect", url], "cli_verify": ["verify", url],
            "cli_download": ["download", url, os.path.join(tmp, "dest", "step1")]}[entry]
    return cli(*argv, "--timeout", "3")


def _size(saves: str, rel: str) -> int:
    return os.path.getsize(os.path.join(saves, "run", "step1", *rel.split("/")))


def _dest_bytes(tmp: str) -> int:
    total = 0
    for d, _, files in os.walk(os.path.join(tmp, "dest")):
        total += sum(os.path.getsize(os.path.join(d, n)) for n in files)
    return total


# ----------------------------------------------------------------- class 6: bodies
def body(tmp: str, root: str, *, mode: str, entry: str, rel: str = SHARD, longer: int = 0) -> str:
    """Serve the step with ``rel`` answered by ``mode`` ("huge": ignores Range, announces
    1 TiB and sends until stopped; "endless-chunked": no length, never ends; "trickle":
    one byte every half second; "honest" with ``longer`` bytes appended to the object
    behind the manifest's back), then call ``entry``."""
    from cloudckpt.untrusted.limits import MAX_MARKER_BYTES

    saves = _step(tmp)
    # what a bounded client may read: the manifest's size; for the marker (no manifest) its ceiling
    expected = MAX_MARKER_BYTES + 1 if rel == MARKER else _size(saves, rel)
    if longer:
        with open(os.path.join(saves, "run", "step1", *rel.split("/")), "ab") as f:
            f.write(b"\0" * longer)
    srv = Hostile(saves, {} if mode == "honest" else {rel: mode})
    srv.httpd.cap = max(CAP, expected + 2 * SLACK)
    try:
        with outside_untouched(tmp):
            out = _entry(entry, f"{srv.url}/run/step1", tmp)
    finally:
        sent = srv.httpd.sent
        srv.stop()
        if sent > expected + SLACK:
            raise Breach(f"the client let the server send {sent} bytes of {rel} ({expected} expected)")
        if _dest_bytes(tmp) > 4 << 20:
            raise Breach(f"download wrote {_dest_bytes(tmp)} bytes for a step of a few KiB")
    return out[-2000:]


# ----------------------------------------------------------------- class 8: redirects
def redirect(tmp: str, root: str, *, location: str, entry: str, rel: str = SHARD, status: int = 302) -> str:
    """Serve the step with ``rel`` (or the marker) answered by a redirect to ``location``
    (``{other}``: the port of another server on 127.0.0.1 holding a copy of the step
    and a secret; ``{port}``: this server's port; ``{path}``: the path asked for)."""
    saves = _step(tmp)
    other = Other(saves)  # the other origin serves the same step: only its request log tells
    srv = Hostile(saves, {rel: "redirect:" + location}, redirect_status=status)
    srv.httpd.other_port = other.httpd.port
    try:
        with outside_untouched(tmp):
            out = _entry(entry, f"{srv.url}/run/step1", tmp)
    finally:
        srv.stop()
        other.stop()
        if other.httpd.seen:
            raise Breach(f"a redirect reached another origin: {other.httpd.seen[:3]}")
    return out[-2000:]


def redirect_loop(tmp: str, root: str, *, entry: str) -> str:
    """Every object redirects to itself (same origin): bounded, refused."""
    saves = _step(tmp)
    srv = Hostile(saves, {MARKER: "redirect:{path}", SHARD: "redirect:{path}"})
    try:
        with outside_untouched(tmp):
            return _entry(entry, f"{srv.url}/run/step1", tmp)[-2000:]
    finally:
        seen = len(srv.httpd.seen)
        srv.stop()
        if seen > 50:
            raise Breach(f"{seen} requests for a redirect loop")


def _tries() -> list[Try]:
    out: list[Try] = []
    bodies = [
        ("range-ignored-1tib", "ignores Range, announces 1 TiB and sends until the client stops", "huge", 0, "refused"),
        ("endless-chunked", "no Content-Length, a chunked body that never ends", "endless-chunked", 0, "refused"),
        ("trickle", "a body of one byte every 0.5 s (--timeout 3)", "trickle", 0, "refused"),
    ]
    for case, what, mode, _longer, expect in bodies:
        for entry in ("cli_download", "cli_verify", "load"):
            out.append(Try(6, f"https-{case}-{entry}", f"https: {what}", entry, f"{MOD}:body",
                           {"mode": mode, "entry": entry}, expect=expect, timeout=60))
    out.append(Try(6, "https-range-ignored-inside-1tib-load", "https: honest from byte 0, ignores Range further in "
                   "and announces 1 TiB (the whole-object copy needs room for it)", "load", f"{MOD}:body",
                   {"mode": "huge-inside", "entry": "load"}))
    # an object that holds 64 MiB more than its manifest says (the server honours Range)
    for entry, expect in (("cli_download", "refused"), ("cli_verify", "refused"), ("load", "ok")):
        out.append(Try(6, f"https-longer-than-manifest-{entry}", "https: an object 64 MiB longer than the manifest "
                       "says (items intact: a load reads only its ranges)", entry, f"{MOD}:body",
                       {"mode": "honest", "entry": entry, "longer": 64 << 20}, expect=expect))
    # the marker itself: 1 TiB announced, or never ending (no manifest bounds it: the marker ceiling does)
    for mode in ("huge", "endless-chunked"):
        out.append(Try(6, f"https-marker-{mode}", f"https: the marker answered {mode} (the marker's ceiling holds)",
                       "cli_inspect", f"{MOD}:body", {"mode": mode, "entry": "cli_inspect", "rel": MARKER}))
    redirects = [
        ("other-port", "a redirect to another port of 127.0.0.1", "http://127.0.0.1:{other}{path}", 302),
        ("other-port-307", "a 307 redirect to another port", "http://127.0.0.1:{other}{path}", 307),
        ("protocol-relative", "a protocol-relative redirect to another port", "//127.0.0.1:{other}{path}", 301),
        ("userinfo", "a redirect whose user-info names this origin",
         "http://127.0.0.1:{port}@127.0.0.1:{other}{path}", 302),
        ("scheme", "a redirect to https on the same host and port", "https://127.0.0.1:{port}{path}", 308),
        ("file", "a redirect to file:///etc/passwd", "file:///etc/passwd", 302),
    ]
    for case, what, loc, status in redirects:
        for entry in ("cli_download", "cli_verify", "load"):
            out.append(Try(8, f"https-redirect-{case}-{entry}", f"https: {what}", entry, f"{MOD}:redirect",
                           {"location": loc, "entry": entry, "status": status}))
    for entry in ("cli_inspect", "load"):
        out.append(Try(8, f"https-redirect-marker-other-port-{entry}", "https: the marker redirects to another port",
                       entry, f"{MOD}:redirect", {"location": "http://127.0.0.1:{other}{path}", "entry": entry,
                                                  "rel": MARKER}))
    for entry in ("cli_verify", "load"):
        out.append(Try(8, f"https-redirect-same-origin-{entry}", "https: a redirect within the origin (followed: "
                       "the control)", entry, f"{MOD}:redirect",
                       {"location": "/mirror/step1/" + SHARD, "entry": entry}, expect="ok"))
        out.append(Try(8, f"https-redirect-loop-{entry}", "https: a same-origin redirect loop", entry,
                       f"{MOD}:redirect_loop", {"entry": entry}))
    return out


TRIES: list[Try] = _tries()
