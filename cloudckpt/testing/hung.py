"""Endpoints that misbehave slowly, on 127.0.0.1, for time-bound tests.

- :class:`SilentServer` accepts TCP connections, reads what the client sends and never
  answers: the "hung endpoint" (a stuck load balancer, a half-dead store). Point
  ``AWS_ENDPOINT_URL`` / ``endpoint_url`` or ``STORAGE_EMULATOR_HOST`` at
  ``server.endpoint_url``.
- :class:`ThrottledForwarder` forwards TCP connections to a loopback upstream at a
  capped rate in each direction: a slow link that keeps making progress.

Both bind 127.0.0.1 only, run one daemon thread per connection and close everything
on ``stop()`` (or leaving the ``with`` block).
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


class _Listener:
    def __init__(self, *, rcvbuf: int | None = None) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:  # set before listen(): accepted sockets inherit it (and the window it allows)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._sock.bind((LOOPBACK, 0))
        self._sock.listen()
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.connections = 0  # accepted so far
        self._thread = threading.Thread(target=self._accept, name=type(self).__name__, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self):
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            with self._lock:
                self._conns.append(conn)
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except OSError:
                pass  # already closed by its thread

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SilentServer(_Listener):
    """Accepts, reads and discards whatever arrives, never sends a byte."""

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        while not self._stop.is_set():
            try:
                if not conn.recv(65536):
                    return  # the client gave up
            except socket.timeout:
                continue
            except OSError:
                return


class ThrottledForwarder(_Listener):
    """Forwards each connection to ``upstream`` (``http://127.0.0.1:PORT``), sending at
    most ``rate`` bytes per second in each direction, in ``chunk``-byte pieces.

    Its receive buffer is kept small (``4 * chunk``), as a slow link's bandwidth-delay
    product is: a client's "sent" then means "on its way", not megabytes parked in
    loopback buffers that take seconds to drain after the client has sent its last byte."""

    def __init__(self, upstream: str, *, rate: float, chunk: int = 16 * 1024):
        u = urlsplit(upstream)
        if u.hostname not in (LOOPBACK, "localhost"):
            raise ValueError(f"ThrottledForwarder forwards to loopback only, not {upstream!r}")
        self._upstream = (LOOPBACK, u.port or 80)
        self.rate, self.chunk = float(rate), int(chunk)
        super().__init__(rcvbuf=4 * self.chunk)

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * self.chunk)  # downloads: the same small window
            up.settimeout(10)
            up.connect(self._upstream)
        except OSError:
            conn.close()
            return
        with self._lock:
            self._conns.append(up)
        threading.Thread(target=self._pump, args=(up, conn), daemon=True).start()
        self._pump(conn, up)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(self.chunk)
                except socket.timeout:
                    continue
                if not data:
                    break
                dst.sendall(data)
                time.sleep(len(data) / self.rate)
        except OSError:
            pass  # either side closed: end this direction
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already shut
