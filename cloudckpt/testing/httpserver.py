"""A static file server on 127.0.0.1 for the http(s):// backend's tests and docs.

:class:`FileServer` serves one folder over HTTP/1.1 from a thread, with or without
``Range`` support (``ranges=False`` answers every GET with the whole file, as some
servers do), and records every request it answers (``requests``: method, path, the
``Range`` header, the status) so tests can count what a load cost. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

LOOPBACK = "127.0.0.1"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    status: int


class _Handler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format, *args) -> None:  # `format`: the base class's name
        pass  # quiet: tests read server.requests instead

    def log_request(self, code="-", size="-") -> None:
        with self.server.lock:
            self.server.requests.append(Request(self.command, self.path, self.headers.get("Range"), int(code)))

    def do_GET(self) -> None:  # http.server's naming
        m = _RANGE.match(self.headers.get("Range", "").strip())
        path = self.translate_path(self.path)
        if not self.server.ranges or not m or not os.path.isfile(path):
            return super().do_GET()
        size = os.path.getsize(path)
        first = int(m.group(1))
        last = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        if first >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            f.seek(first)
            body = f.read(last - first + 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Last-Modified", self.date_time_string(int(os.path.getmtime(path))))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    ranges: bool
    requests: list
    lock: threading.Lock

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # the client dropped the connection mid-body (it read what it asked for)
        super().handle_error(request, client_address)


class FileServer:
    """Serves ``root`` on ``http://127.0.0.1:PORT`` (``url``) until ``stop()`` or the
    end of its ``with`` block."""

    def __init__(self, root: str, *, ranges: bool = True):
        self._httpd = _Server((LOOPBACK, 0), partial(_Handler, directory=os.fspath(root)))
        self._httpd.ranges = ranges
        self._httpd.requests = []
        self._httpd.lock = threading.Lock()
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="FileServer", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def requests(self) -> list[Request]:
        with self._httpd.lock:
            return list(self._httpd.requests)

    def clear(self) -> None:
        with self._httpd.lock:
            self._httpd.requests.clear()

    def start(self) -> "FileServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "FileServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
