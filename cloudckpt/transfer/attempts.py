"""Attempts of the transfer engine: what one attempt of each kind of transfer does,
when a failed one is tried again, and the watchdog that ends a stalled one.

Kinds: a transfer is a :class:`Task` subclass (upload, download, range read,
stream) whose ``run`` is one attempt against the store; the engine calls it, it
never asks which kind it holds.

Retry policy (:class:`RetryPolicy`): an attempt that raises
:class:`~cloudckpt.errors.Transient` (which includes Throttled, Timeout and
TransferStalled) is retried, up to ``max_attempts`` attempts in all, after a
full-jitter exponential backoff, from the start (uploads re-open the file, so the
CRC starts over), while the transfer is making progress: it moved new bytes within
the last ``operation_timeout`` (:class:`~cloudckpt.storage.StorageOptions`), or the
attempt that stalled had moved new bytes. Bytes sent again (an SDK retry rewinds the
body and sends it anew) are not new. So a store that never answers fails a transfer
once the SDK's own deadline is spent, instead of the SDK's attempts times the
engine's, while a slow transfer that keeps moving is never cut. Everything else fails
the transfer at once: AccessDenied, NotFound, PreconditionFailed, AlreadyExists,
InvalidURL, local OSErrors.

Stalls (:class:`Watchdog`): one thread fails an attempt that reported no progress
for ``stall_timeout`` seconds (a range read reports none: the whole request counts;
a stream reports every item its job reads, and ``progress(0)`` while it waits) with
TransferStalled naming the URL and the timeout, even if its thread is still blocked
in a socket. That thread's late outcome is ignored, and if it makes progress again
its progress callback raises, so the backend aborts it. A stall is retried like any
Transient error; when the attempts are used up, the last stall fails the transfer
``stall_timeout`` (+ one watchdog tick) after its last progress.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from concurrent.futures import Future
from typing import Any, Callable

from ..errors import PreconditionFailed, TransferStalled, Transient
from ..storage.base import ObjectStore, RangeReader
from . import pacing
from .checksum import Crc32cReader, crc32c_file
from .config import TransferConfig, TransferResult

log = logging.getLogger(__name__)

Clock = Callable[[], float]
StreamJob = Callable[[Callable[[int], RangeReader], Callable[[int], None]], int]


class _Abandoned(Exception):
    """Raised inside a progress callback of an attempt the engine gave up on
    (stalled), so the backend stops sending bytes nobody waits for."""


# ---------------------------------------------------------------------- kinds
class Task:
    """One transfer: its future, its attempts so far and what they moved. A subclass
    per kind says what one attempt does (``run``)."""

    __slots__ = ("url", "size", "future", "attempts", "t0", "last_exc", "progress_at", "high")
    #: its bytes count as uploaded (else as downloaded) in the engine's stats
    uploads = False
    #: each attempt goes on where the last one ended (streams): its new bytes count from 0
    resumes = False
    #: its bytes pass through this process (the bandwidth cap applies); a server-side copy's do not
    local_bytes = True

    def __init__(self, url: str, size: int = 0):
        self.url = url
        self.size = size  # what an attempt holds of the byte budget
        self.future: Future = Future()
        self.attempts = 0
        self.t0: float | None = None
        self.last_exc: BaseException | None = None
        self.progress_at: float | None = None  # when new bytes last moved (the retry budget counts from it)
        self.high = 0  # most bytes one attempt moved (a retry starts over: only more is new; streams resume)

    def describe(self) -> str:
        raise NotImplementedError

    def requests(self, store: ObjectStore) -> tuple[str, int]:
        """What one attempt sends, for the request pacer: (``pacing.WRITE`` or
        ``pacing.READ``, how many requests)."""
        raise NotImplementedError

    def run(self, store: ObjectStore, progress: Callable[[int], None], number: int, *, checksum: bool,
            clock: Clock) -> Any:
        """One attempt (number ``number``): the future's result, or raise."""
        raise NotImplementedError

    def nbytes(self, result) -> int:
        """Bytes a successful attempt moved (its result's size)."""
        return result.size

    def _result(self, local_path: str, size: int, crc: str | None, number: int, clock: Clock,
                version: str | None = None) -> TransferResult:
        return TransferResult(self.url, local_path, size, crc, number, clock() - self.t0, version)


class UploadTask(Task):
    __slots__ = ("local_path", "if_absent", "crc32c", "record_version")
    uploads = True

    def __init__(self, url: str, local_path: str, *, if_absent: bool, size: int, crc32c: str | None,
                 record_version: bool = False):
        super().__init__(url, size)
        self.local_path = local_path
        self.if_absent = if_absent
        self.crc32c = crc32c  # known in advance: not computed again
        self.record_version = record_version  # the result carries the object's version (one request more)

    def describe(self) -> str:
        return f"upload {self.local_path} -> {self.url}"

    def requests(self, store):
        return pacing.WRITE, pacing.upload_requests(self.size, store)

    def run(self, store, progress, number, *, checksum, clock):
        size = os.path.getsize(self.local_path)
        if self.crc32c is not None or not checksum:
            store.upload_file(self.local_path, self.url, if_absent=self.if_absent, progress=progress)
            crc = self.crc32c
        else:
            with open(self.local_path, "rb") as f:
                reader = Crc32cReader(f)
                store.upload_fileobj(reader, self.url, size=size, if_absent=self.if_absent, progress=progress)
            # on the way when the backend read the file front to back, else read it again
            crc = reader.hexdigest() if reader.bytes_covered == size else crc32c_file(self.local_path)
        # asked at once: an object replaced between the upload and this request is the window left
        version = store.version(self.url) if self.record_version else None
        return self._result(self.local_path, size, crc, number, clock, version)


class CopyTask(Task):
    """A server-side copy of ``src`` to ``url`` in one store (``store.copy``): no byte
    passes through this process, so it holds none of the byte budget and the bandwidth
    cap does not apply. The destination must hold ``expected`` bytes (and ``crc32c``,
    where the store reports the copy's CRC32C), else PreconditionFailed."""

    __slots__ = ("src", "local_path", "expected", "crc32c", "src_version", "must_crc32c")
    local_bytes = False

    def __init__(self, src: str, url: str, *, size: int, crc32c: str | None, local_path: str | None,
                 src_version: str | None = None, must_crc32c: str | None = None):
        super().__init__(url, 0)
        self.src = src
        self.expected = size
        self.crc32c = crc32c  # what the result reports (None: checksums off)
        self.local_path = local_path  # the local file with the same bytes (the result names it)
        self.src_version = src_version  # the version src must have (store.copy's src_version)
        self.must_crc32c = must_crc32c or crc32c  # what the copy must hold where the store reports it

    def describe(self) -> str:
        return f"copy {self.src} -> {self.url}"

    def requests(self, store):
        return pacing.WRITE, pacing.upload_requests(self.expected, store) + 1  # a HEAD of src first

    def run(self, store, progress, number, *, checksum, clock):
        if self.src_version is not None:
            info = store.copy(self.src, self.url, size=self.expected, src_version=self.src_version,
                              progress=progress)
        else:
            info = store.copy(self.src, self.url, size=self.expected, progress=progress)
        got, want = getattr(info, "crc32c", None), self.must_crc32c
        if info.size != self.expected or (want is not None and got is not None and got != want):
            raise PreconditionFailed(f"{self.describe()}: the copy holds {info.size} bytes (CRC32C {got}), not "
                                     f"{self.expected} (CRC32C {want}); the source changed", url=self.url)
        return self._result(self.local_path, self.expected, self.crc32c, number, clock,
                            getattr(info, "version", None))


class DownloadTask(Task):
    __slots__ = ("local_path", "expected")

    def __init__(self, url: str, local_path: str, expected: int | None = None):
        super().__init__(url)
        self.local_path = local_path
        self.expected = expected  # the size the caller expects: no more is written (ObjectTooLarge)

    def describe(self) -> str:
        return f"download {self.url} -> {self.local_path}"

    def requests(self, store):
        return pacing.READ, pacing.download_requests(self.expected, store)

    def run(self, store, progress, number, *, checksum, clock):
        size = store.download_file(self.url, self.local_path, progress=progress, size=self.expected)
        crc = crc32c_file(self.local_path) if checksum else None
        return self._result(self.local_path, size, crc, number, clock)


class ReadTask(Task):
    """A byte range read whole (``store.get_bytes``); the result is the bytes."""

    __slots__ = ("start", "end")

    def __init__(self, url: str, start: int | None, end: int | None, size: int = 0):
        super().__init__(url, size)
        self.start = start
        self.end = end

    def describe(self) -> str:
        return f"read {self.url} [{self.start}, {self.end})"

    def requests(self, store):
        return pacing.READ, 1  # get_bytes: one GET

    def run(self, store, progress, number, *, checksum, clock):
        data = store.get_bytes(self.url, start=self.start, end=self.end)
        progress(len(data))
        return data

    def nbytes(self, result) -> int:
        return len(result)


class StreamTask(ReadTask):
    """A byte range read as one stream by a job (``TransferEngine.submit_stream``);
    the result is what the job returns (bytes it handled)."""

    __slots__ = ("job",)
    resumes = True

    def __init__(self, url: str, start: int, end: int, job: StreamJob):
        super().__init__(url, start, end)
        self.job = job

    def requests(self, store):
        return pacing.READ, pacing.range_requests(self.end - self.start, store)

    def run(self, store, progress, number, *, checksum, clock):
        url, lo, hi = self.url, self.start, self.end
        return self.job(lambda start: store.open_range(url, max(start, lo), hi), progress)

    def nbytes(self, result) -> int:
        return result


# ---------------------------------------------------------------------- one attempt
class Attempt:
    """One attempt of a task, from admission to its outcome. ``settled`` (set under
    the engine's lock) once its outcome is recorded or it was abandoned."""

    __slots__ = ("task", "number", "last_progress", "settled", "reported", "lock", "high", "moved")

    def __init__(self, task: Task, number: int):
        self.task = task
        self.number = number
        self.last_progress = 0.0
        self.settled = False
        self.reported = 0  # bytes reported to subscribers by this attempt
        self.lock = threading.Lock()
        self.high = 0 if task.resumes else task.high  # bytes beyond this are new
        self.moved = False  # this attempt moved new bytes

    def progress_fn(self, clock: Clock, throttle: Callable[[int], Any] | None,
                    notify: Callable[[int], None] | None) -> Callable[[int], None]:
        """The callback the store calls with each ``n`` bytes moved: renews the
        attempt's stall timer and the task's retry budget, waits for the bandwidth cap
        (``throttle``), tells ``notify``; raises once the attempt was abandoned."""
        task = self.task

        def progress(nbytes: int) -> None:
            if self.settled:
                raise _Abandoned(f"{task.describe()}: attempt {self.number} was abandoned (stalled)")
            self.last_progress = clock()
            if throttle is not None:
                throttle(nbytes)
                self.last_progress = clock()
            with self.lock:
                self.reported += nbytes
                # new bytes, or a stream saying it waits for its consumer (0), renew the retry
                # budget; bytes sent again after a rewind (negative, then up to the mark) do not
                if nbytes == 0 or self.reported > self.high:
                    self.high = max(self.high, self.reported)
                    self.moved = self.moved or nbytes > 0
                    task.progress_at = self.last_progress
            if notify is not None:
                notify(nbytes)

        return progress

    def settle_locked(self) -> None:
        """Mark the attempt settled (under the engine's lock) and keep its mark of
        bytes moved for the next attempt (unless the task resumes)."""
        self.settled = True
        if not self.task.resumes:
            self.task.high = max(self.task.high, self.high)

    def take_back(self) -> int:
        """The bytes this attempt reported (once; then 0)."""
        with self.lock:
            taken, self.reported = self.reported, 0
        return taken


# ---------------------------------------------------------------------- retries
class RetryPolicy:
    """Engine-level retries (module docstring): which failures are tried again,
    within the transfer's deadline (``operation_timeout`` since its last new bytes),
    after which backoff."""

    def __init__(self, config: TransferConfig, deadline: float, clock: Clock, rng: random.Random):
        self.config = config
        self.deadline = deadline
        self._clock = clock
        self._rng = rng

    def retries(self, att: Attempt, exc: BaseException | None, *, stopping: bool) -> bool:
        return (isinstance(exc, Transient) and att.number < self.config.max_attempts and not stopping
                and self._progressing(att, exc))

    def _progressing(self, att: Attempt, exc: BaseException) -> bool:
        """May a failed transfer be re-attempted (the retry budget, see the module docstring)?"""
        idle = self._clock() - (att.task.progress_at or 0.0)
        if idle < self.deadline or (isinstance(exc, TransferStalled) and att.moved):
            return True
        log.info("%s: not retried: no new bytes for %.0fs (operation_timeout %gs)", att.task.describe(), idle,
                 self.deadline)
        return False

    def backoff(self, att: Attempt, exc: BaseException) -> float:
        """Full-jitter exponential backoff before the next attempt (logged)."""
        c = self.config
        delay = self._rng.uniform(0, min(c.backoff_max, c.backoff_base * 2 ** (att.number - 1)))
        log.info("%s: attempt %d of %d failed (%s); retrying in %.2fs", att.task.describe(), att.number,
                 c.max_attempts, exc, delay)
        return delay


# ---------------------------------------------------------------------- stalls
class Watchdog:
    """One daemon thread, started on first use, that calls ``check`` every
    ``min(1 s, stall_timeout / 4)`` until ``stop`` is set (none when ``stall_timeout``
    is 0)."""

    def __init__(self, stall_timeout: float, check: Callable[[], Any], stop: threading.Event):
        self.stall_timeout = stall_timeout
        self._check = check
        self._stop = stop
        self._thread: threading.Thread | None = None

    def ensure_started(self) -> None:
        """Start the thread (call under the engine's lock: started once)."""
        if self._thread is None and self.stall_timeout > 0:
            self._thread = threading.Thread(target=self._watch, name="cloudckpt-transfer-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        tick = min(1.0, max(0.01, self.stall_timeout / 4))
        while not self._stop.wait(tick):
            self._check()


def stalled(running, now: float, timeout: float) -> list[Attempt]:
    """The attempts of ``running`` without progress for more than ``timeout`` seconds."""
    return [a for a in running if now - a.last_progress > timeout]


def stall_error(att: Attempt, timeout: float, max_attempts: int) -> TransferStalled:
    t = att.task
    return TransferStalled(
        f"{t.describe()}: no progress for {timeout:g}s (stall_timeout), attempt {att.number} of "
        f"{max_attempts}; check the endpoint and network, or raise stall_timeout",
        url=t.url,
    )
