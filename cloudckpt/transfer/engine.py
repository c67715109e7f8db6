"""The transfer engine: many uploads, downloads and range reads at once, bounded,
throttled, retried, watched, checksummed.

Shape (after s3transfer): every transfer gets a ``concurrent.futures.Future``
and an internal task that owns its attempts, its progress and its result.
Submitted tasks wait in a FIFO queue; a task is admitted when fewer than the
current concurrency limit are in flight and its bytes fit the byte budget; an
admitted attempt runs on the executor (a thread pool by default). The limit moves
(AIMD): halved on a throttle signal, +1 after every 8 clean successes.

What the SDKs already do, they keep doing: botocore retries each request
(``standard`` mode) and s3transfer does the multipart work; the engine adds what
they lack: a budget across files, a bandwidth cap, whole-transfer retries, a
stall watchdog and CRC32C.

Retry policy (engine level): an attempt that raises
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

Stalls: one watchdog thread fails an attempt that reported no progress for
``stall_timeout`` seconds (a range read reports none: the whole request counts; a
stream reports every item its job reads, and ``progress(0)`` while it waits)
with TransferStalled naming the URL and the timeout, even if its thread is still
blocked in a socket. That thread's late outcome is ignored, and if it makes
progress again its progress callback raises, so the backend aborts it. A stall is
retried like any Transient error; when the attempts are used up, the last stall
fails the transfer ``stall_timeout`` (+ one watchdog tick) after its last progress.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import os
import queue
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Sequence

from ..errors import Throttled, TransferStalled, Transient
from ..storage.base import ObjectStore, RangeReader, StorageOptions
from ..storage.registry import open_store
from .bandwidth import TokenBucket
from .checksum import Crc32cReader, crc32c_file
from .config import TransferConfig, TransferResult, TransferStats
from .progress import ProgressSubscriber

log = logging.getLogger(__name__)

#: AIMD: +1 to the limit after this many successes without a throttle signal.
INCREASE_EVERY = 8
#: AIMD: at most one halving per this many seconds (one throttle storm = one cut).
DECREASE_WINDOW = 1.0


class _Abandoned(Exception):
    """Raised inside a progress callback of an attempt the engine gave up on
    (stalled), so the backend stops sending bytes nobody waits for."""


class _Task:
    __slots__ = ("kind", "url", "local_path", "start", "end", "if_absent", "size", "future", "attempts",
                 "t0", "last_exc", "crc32c", "job", "progress_at", "high")

    def __init__(self, kind: str, url: str, *, local_path=None, start=None, end=None, if_absent=False, size=0,
                 crc32c=None, job=None):
        self.kind = kind
        self.url = url
        self.local_path = local_path
        self.start = start
        self.end = end
        self.if_absent = if_absent
        self.size = size  # what the attempt holds of the byte budget
        self.future: Future = Future()
        self.attempts = 0
        self.t0: float | None = None
        self.last_exc: BaseException | None = None
        self.crc32c: str | None = crc32c  # known in advance (uploads): not computed again
        self.job = job  # streams: job(reader, progress), called once per attempt
        self.progress_at: float | None = None  # when new bytes last moved (the retry budget counts from it)
        self.high = 0  # most bytes one attempt moved (a retry starts over: only more is new; streams resume)

    def describe(self) -> str:
        if self.kind == "upload":
            return f"upload {self.local_path} -> {self.url}"
        if self.kind == "download":
            return f"download {self.url} -> {self.local_path}"
        return f"read {self.url} [{self.start}, {self.end})"


class _Attempt:
    __slots__ = ("task", "number", "last_progress", "settled", "reported", "lock", "high", "moved")

    def __init__(self, task: _Task, number: int):
        self.task = task
        self.number = number
        self.last_progress = 0.0
        self.settled = False
        self.reported = 0  # bytes reported to subscribers by this attempt
        self.lock = threading.Lock()
        self.high = 0 if task.kind == "stream" else task.high  # bytes beyond this are new
        self.moved = False  # this attempt moved new bytes


class TransferEngine:
    """Runs transfers concurrently under the limits of a :class:`TransferConfig`.

    ``storage_options`` select the store options for every URL (``open_store``);
    ``progress`` receives on_queued/on_progress/on_done; ``clock``/``sleep``/``rng``
    are injectable for tests; ``executor`` runs attempts (default: a thread pool of
    ``2 * max_concurrency + 2`` threads, the headroom being for threads a stalled
    attempt leaves blocked in a socket or that sleep in a backoff; the concurrency
    limit, not the pool, bounds what is in flight). A given executor is not shut
    down by :meth:`close`.

    Thread-safe; a context manager (``close()`` on exit).
    """

    def __init__(
        self,
        config: TransferConfig | None = None,
        *,
        storage_options: StorageOptions | None = None,
        progress: ProgressSubscriber | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        executor: cf.Executor | None = None,
        rng: random.Random | None = None,
    ):
        self.config = config = config or TransferConfig()
        self.storage_options = storage_options
        self._progress = progress
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._own_executor = executor is None
        self._executor = executor or cf.ThreadPoolExecutor(
            max_workers=2 * config.max_concurrency + 2, thread_name_prefix="cloudckpt-transfer"
        )
        self._bucket = TokenBucket(config.bandwidth_limit, clock=clock, sleep=sleep) if config.bandwidth_limit else None

        self._cv = threading.Condition()
        self._queue: collections.deque[_Task] = collections.deque()
        self._running: set[_Attempt] = set()
        self._admitted = 0  # attempts holding a slot (admitted, not yet settled)
        self._bytes = 0  # bytes of the budget they hold
        self._outstanding = 0  # submitted futures not yet done
        self._limit = config.max_concurrency
        self._clean_successes = 0
        self._last_decrease = -float("inf")
        self._stats = TransferStats(concurrency=self._limit, min_concurrency_seen=self._limit)
        self._stores: dict[int, ObjectStore] = {}
        self._deadline = (storage_options or StorageOptions()).operation_timeout
        self._closed = False
        self._tls = threading.local()
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ submit
    def submit_upload(self, local_path: str, url: str, *, if_absent: bool = False,
                      crc32c: str | None = None) -> "Future[TransferResult]":
        """Upload a local file to ``url``. The future's result is a TransferResult
        (size, CRC32C of the bytes read); its exception a cloudckpt error (or the
        OSError of opening the local file). Raises RuntimeError after close().

        ``crc32c``: the file's CRC32C when the caller computed it already (the DCP
        writer does, while writing): the result carries it, and the file is
        uploaded by name (``store.upload_file``: S3 reads parts from disk as it
        sends them, holding none in memory) instead of through a checksumming reader.

        ``if_absent`` uploads are conditional creates; after an ambiguous failure
        (e.g. a reset after the store got the object) a retried attempt can see
        AlreadyExists for the object the first attempt created."""
        local_path = os.fspath(local_path)
        try:
            size = os.path.getsize(local_path)
        except OSError:
            size = 0  # the attempt will fail opening it, with the OS's message
        task = _Task("upload", url, local_path=local_path, if_absent=if_absent, size=size, crc32c=crc32c)
        return self._submit(task, size)

    def submit_download(self, url: str, local_path: str) -> "Future[TransferResult]":
        """Download ``url`` to ``local_path`` (a temporary file renamed into place,
        ``store.download_file``). The CRC32C is computed by re-reading the
        downloaded file once it is complete (S3 downloads write ranges out of
        order, so it cannot be taken on the way), unless ``TransferConfig.checksum``
        is off."""
        return self._submit(_Task("download", url, local_path=os.fspath(local_path)), None)

    def submit_read(self, url: str, start: int | None, end: int | None) -> "Future[bytes]":
        """Read the byte range ``[start, end)`` of ``url`` (None: from the start /
        to the end) via ``store.get_bytes``. The stall timeout covers the whole request."""
        size = (end - (start or 0)) if end is not None else None
        t = _Task("read", url, start=start, end=end, size=max(size or 0, 0))
        return self._submit(t, size)

    def submit_stream(self, url: str, start: int, end: int,
                      job: Callable[[Callable[[int], RangeReader], Callable[[int], None]], int]) -> "Future[int]":
        """Read ``[start, end)`` of ``url`` as one stream: each attempt calls
        ``job(open_from, progress)``; ``open_from(pos)`` opens ``[pos, end)``
        (``store.open_range``, one GET on S3), so a retried job can resume after what
        earlier attempts handled. The job reads front to back and returns how many
        bytes it handled (the future's result).

        The job calls ``progress(n)`` for every ``n`` bytes it reads (the stall
        watchdog, the bandwidth cap and progress subscribers see them; ``n=0`` only
        says it is alive); once the attempt was abandoned, that call raises, so the
        job stops. Errors are handled as for any transfer: Transient ones retry the
        whole job. The engine counts no bytes in flight for a stream (its job holds
        what it reads and bounds that itself)."""
        return self._submit(_Task("stream", url, start=start, end=end, size=0, job=job), end - start)

    def _submit(self, task: _Task, size: int | None) -> Future:
        with self._cv:
            if self._closed:
                raise RuntimeError(f"the transfer engine is closed; cannot {task.describe()}")
            self._outstanding += 1
            self._queue.append(task)
        # capture only plain values: a callback holding the task would form a cycle
        # (task -> future -> callback -> task) that keeps a finished read's bytes alive
        # until the garbage collector runs
        url, desc = task.url, task.describe()
        task.future.add_done_callback(lambda f: self._on_future_done(url, desc, f))
        self._notify("on_queued", task.url, size)
        self._pump()
        return task.future

    # ------------------------------------------------------------------ batches
    def upload_all(self, pairs: Iterable[tuple[str, str]]) -> list[TransferResult]:
        """Upload ``(local_path, url)`` pairs; results in input order. The first
        fatal error cancels the transfers that have not started and is raised
        (started ones finish in the background; ``close()`` waits for them)."""
        return self._run_all(lambda p: self.submit_upload(p[0], p[1]), pairs)

    def download_all(self, pairs: Iterable[tuple[str, str]]) -> list[TransferResult]:
        """Download ``(url, local_path)`` pairs; like :meth:`upload_all`."""
        return self._run_all(lambda p: self.submit_download(p[0], p[1]), pairs)

    def read_all(self, ranges: Iterable[tuple[str, int | None, int | None]]) -> list[bytes]:
        """Read ``(url, start, end)`` ranges; the bytes in input order; like :meth:`upload_all`."""
        return self._run_all(lambda r: self.submit_read(r[0], r[1], r[2]), ranges)

    def _run_all(self, submit: Callable[[Any], Future], items: Iterable) -> list:
        failed = threading.Event()
        futures: list[Future] = []

        def on_done(f: Future) -> None:
            # runs in the failing worker inside set_exception, before it starts the
            # next queued transfer: the rest are cancelled before any can start
            if f.cancelled() or f.exception() is not None:
                failed.set()
                for other in list(futures):
                    other.cancel()

        for item in items:
            if failed.is_set():
                break  # do not even queue the rest (matters with an inline executor)
            f = submit(item)
            futures.append(f)
            f.add_done_callback(on_done)
            if failed.is_set():
                f.cancel()
        try:
            return self.wait_all(futures)
        finally:
            # the callbacks' closure holds this list: empty it, or futures -> callback ->
            # list -> futures keeps every result (read bytes) alive until the GC runs
            futures.clear()

    @staticmethod
    def wait_all(futures: Sequence[Future]) -> list:
        """Results of ``futures`` in order. On the first error (in time) cancel the
        futures that have not started and raise that error."""
        futures = list(futures)
        done: queue.SimpleQueue = queue.SimpleQueue()
        for f in futures:
            f.add_done_callback(done.put)
        for _ in range(len(futures)):
            f = done.get()
            if f.cancelled() or f.exception() is not None:
                for other in futures:
                    other.cancel()
                if f.cancelled():
                    # a cancellation is usually the echo of an error (the batch cancels
                    # the rest from the failing future's callbacks): raise the error
                    failed = [x for x in futures if x.done() and not x.cancelled() and x.exception() is not None]
                    if failed:
                        raise failed[0].exception()
                    raise cf.CancelledError("a transfer was cancelled")
                raise f.exception()
        return [f.result() for f in futures]

    # ------------------------------------------------------------------ scheduling
    def _admits(self, task: _Task) -> bool:
        if self._admitted >= self._limit:
            return False
        return self._admitted == 0 or self._bytes + task.size <= self.config.max_bytes_in_flight

    def _pump(self) -> None:
        """Start queued tasks while the limits allow. Re-entrant calls (an inline
        executor finishing a transfer inside ``submit``) only ask the outer call
        for one more round, so the stack does not grow with the queue."""
        tls = self._tls
        if getattr(tls, "pumping", False):
            tls.again = True
            return
        tls.pumping = True
        try:
            while True:
                tls.again = False
                batch = []
                with self._cv:
                    while self._queue:
                        task = self._queue[0]
                        if task.future.cancelled():
                            self._queue.popleft()
                            continue
                        if not self._admits(task):
                            break
                        self._queue.popleft()
                        task.attempts += 1
                        self._admitted += 1
                        self._bytes += task.size
                        batch.append(_Attempt(task, task.attempts))
                for att in batch:
                    try:
                        self._executor.submit(self._run, att)
                    except RuntimeError as e:  # executor shut down under us
                        self._settle(att, exc=e, retry_ok=False)
                if not tls.again:
                    return
        finally:
            tls.pumping = False

    def _run(self, att: _Attempt) -> None:
        task = att.task
        if att.number == 1 and not task.future.set_running_or_notify_cancel():
            self._release(att)  # cancelled while waiting for a thread
            self._pump()
            return
        with self._cv:
            if att.settled:
                return
            att.last_progress = self._clock()
            if task.t0 is None:
                task.t0 = task.progress_at = att.last_progress
            self._running.add(att)
            self._ensure_watchdog()
        try:
            result = self._attempt(att)
        except BaseException as e:  # noqa: BLE001 - settled: retried or handed to the future
            delay = self._settle(att, exc=e)
        else:
            delay = self._settle(att, result=result)
        if delay is not None:
            self._retry_later(task, delay)

    def _release(self, att: _Attempt) -> bool:
        """Give back the attempt's slot and bytes. False if it was already settled."""
        with self._cv:
            if att.settled:
                return False
            att.settled = True
            self._running.discard(att)
            self._admitted -= 1
            self._bytes -= att.task.size
            self._cv.notify_all()
            return True

    def _settle(self, att: _Attempt, *, result=None, exc: BaseException | None = None, retry_ok: bool = True) -> float | None:
        """Record an attempt's outcome (once: a late outcome of an abandoned attempt
        is ignored). Returns the backoff delay when the task is to be retried."""
        task = att.task
        with self._cv:
            if att.settled:
                return None
            att.settled = True
            self._running.discard(att)
            self._admitted -= 1
            self._bytes -= task.size
            retry = (retry_ok and exc is not None and isinstance(exc, Transient)
                     and att.number < self.config.max_attempts and not self._stop.is_set()
                     and self._progressing(att, exc))
            if task.kind != "stream":
                task.high = max(task.high, att.high)
            s = self._stats
            if isinstance(exc, TransferStalled):
                s.stalls += 1
            if isinstance(exc, Throttled):
                self._throttle_locked()
            if exc is None:
                s.transfers += 1
                n = len(result) if isinstance(result, (bytes, bytearray)) else result if isinstance(result, int) else result.size
                if task.kind == "upload":
                    s.bytes_uploaded += n
                else:
                    s.bytes_downloaded += n
                self._success_locked()
            elif retry:
                s.retries += 1
            self._cv.notify_all()
        with att.lock:
            taken_back, att.reported = att.reported, 0
        if exc is not None and taken_back:
            self._notify("on_progress", task.url, -taken_back)
        if retry:
            task.last_exc = exc
            delay = self._rng.uniform(0, min(self.config.backoff_max, self.config.backoff_base * 2 ** (att.number - 1)))
            log.info("%s: attempt %d of %d failed (%s); retrying in %.2fs", task.describe(), att.number,
                     self.config.max_attempts, exc, delay)
            return delay
        if exc is None:
            task.future.set_result(result)
        else:
            task.future.set_exception(exc)
        self._pump()
        return None

    def _progressing(self, att: _Attempt, exc: BaseException) -> bool:
        """May a failed transfer be re-attempted (the retry budget, see the module docstring)?"""
        idle = self._clock() - (att.task.progress_at or 0.0)
        if idle < self._deadline or (isinstance(exc, TransferStalled) and att.moved):
            return True
        log.info("%s: not retried: no new bytes for %.0fs (operation_timeout %gs)", att.task.describe(), idle,
                 self._deadline)
        return False

    def _retry_later(self, task: _Task, delay: float) -> None:
        if delay > 0:
            self._sleep(delay)
        with self._cv:
            if self._stop.is_set():
                give_up = True
            else:
                give_up = False
                self._queue.appendleft(task)  # retries go first
        if give_up:
            task.future.set_exception(task.last_exc or RuntimeError("the transfer engine was closed"))
            return
        self._pump()

    def _on_future_done(self, url: str, desc: str, fut: Future) -> None:
        with self._cv:
            self._outstanding -= 1
            self._cv.notify_all()
        if fut.cancelled():
            self._notify("on_done", url, cf.CancelledError(f"{desc} was cancelled"))
        else:
            self._notify("on_done", url, fut.exception() or fut.result())

    # ------------------------------------------------------------------ AIMD
    def _throttle_locked(self) -> None:
        s = self._stats
        s.throttled += 1
        self._clean_successes = 0
        now = self._clock()
        if now - self._last_decrease >= DECREASE_WINDOW and self._limit > self.config.min_concurrency:
            self._last_decrease = now
            self._limit = max(self.config.min_concurrency, int(self._limit * 0.5))
            s.concurrency = self._limit
            s.min_concurrency_seen = min(s.min_concurrency_seen, self._limit)
            log.info("store throttling: concurrency limit lowered to %d", self._limit)

    def _success_locked(self) -> None:
        self._clean_successes += 1
        if self._clean_successes >= INCREASE_EVERY:
            self._clean_successes = 0
            if self._limit < self.config.max_concurrency:
                self._limit += 1
                self._stats.concurrency = self._limit

    def _on_sdk_retry(self, kind: str) -> None:
        with self._cv:
            self._stats.sdk_retries += 1
            if kind == "throttled":
                self._throttle_locked()

    # ------------------------------------------------------------------ one attempt
    def _store(self, url: str) -> ObjectStore:
        store = open_store(url, self.storage_options)
        with self._cv:
            if id(store) not in self._stores:
                self._stores[id(store)] = store
                store.add_retry_listener(self._on_sdk_retry)
        return store

    def _progress_fn(self, att: _Attempt) -> Callable[[int], None]:
        bucket, url, clock, task = self._bucket, att.task.url, self._clock, att.task
        notify = self._progress is not None

        def progress(nbytes: int) -> None:
            if att.settled:
                raise _Abandoned(f"{att.task.describe()}: attempt {att.number} was abandoned (stalled)")
            att.last_progress = clock()
            if bucket is not None:
                bucket.consume(nbytes)
                att.last_progress = clock()
            with att.lock:
                att.reported += nbytes
                # new bytes, or a stream saying it waits for its consumer (0), renew the retry
                # budget; bytes sent again after a rewind (negative, then up to the mark) do not
                if nbytes == 0 or att.reported > att.high:
                    att.high = max(att.high, att.reported)
                    att.moved = att.moved or nbytes > 0
                    task.progress_at = att.last_progress
            if notify:
                self._notify("on_progress", url, nbytes)

        return progress

    def _attempt(self, att: _Attempt):
        task = att.task
        store = self._store(task.url)
        progress = self._progress_fn(att)
        checksum = self.config.checksum
        if task.kind == "upload":
            size = os.path.getsize(task.local_path)
            if task.crc32c is not None or not checksum:
                store.upload_file(task.local_path, task.url, if_absent=task.if_absent, progress=progress)
                return TransferResult(task.url, task.local_path, size, task.crc32c, att.number, self._clock() - task.t0)
            with open(task.local_path, "rb") as f:
                reader = Crc32cReader(f) if checksum else f
                store.upload_fileobj(reader, task.url, size=size, if_absent=task.if_absent, progress=progress)
            crc = None
            if checksum:
                # on the way when the backend read the file front to back, else read it again
                crc = reader.hexdigest() if reader.bytes_covered == size else crc32c_file(task.local_path)
            return TransferResult(task.url, task.local_path, size, crc, att.number, self._clock() - task.t0)
        if task.kind == "download":
            size = store.download_file(task.url, task.local_path, progress=progress)
            crc = crc32c_file(task.local_path) if checksum else None
            return TransferResult(task.url, task.local_path, size, crc, att.number, self._clock() - task.t0)
        if task.kind == "stream":
            url, lo, hi = task.url, task.start, task.end
            return task.job(lambda start: store.open_range(url, max(start, lo), hi), progress)
        data = store.get_bytes(task.url, start=task.start, end=task.end)
        progress(len(data))
        return data

    # ------------------------------------------------------------------ watchdog
    def _ensure_watchdog(self) -> None:
        if self._watchdog is None and self.config.stall_timeout > 0:
            self._watchdog = threading.Thread(target=self._watch, name="cloudckpt-transfer-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        tick = min(1.0, max(0.01, self.config.stall_timeout / 4))
        while not self._stop.wait(tick):
            self.check_stalls()

    def check_stalls(self) -> int:
        """Fail every running attempt without progress for ``stall_timeout``
        (the watchdog calls this every ``min(1 s, stall_timeout / 4)``; tests with a
        fake clock call it directly). Returns how many attempts it failed."""
        timeout = self.config.stall_timeout
        if timeout <= 0:
            return 0
        now = self._clock()
        with self._cv:
            stalled = [a for a in self._running if now - a.last_progress > timeout]
        for att in stalled:
            t = att.task
            exc = TransferStalled(
                f"{t.describe()}: no progress for {timeout:g}s (stall_timeout), attempt {att.number} of "
                f"{self.config.max_attempts}; check the endpoint and network, or raise stall_timeout",
                url=t.url,
            )
            log.warning("%s", exc)
            delay = self._settle(att, exc=exc)
            if delay is not None:  # do not block the watchdog with the backoff
                threading.Thread(target=self._retry_later, args=(t, delay), daemon=True,
                                 name="cloudckpt-transfer-retry").start()
        return len(stalled)

    # ------------------------------------------------------------------ misc
    def _notify(self, method: str, url: str, arg) -> None:
        if self._progress is None:
            return
        try:
            getattr(self._progress, method)(url, arg)
        except Exception:  # noqa: BLE001 - a broken progress bar must not fail a transfer
            log.exception("progress subscriber %s.%s failed", type(self._progress).__name__, method)

    def stats(self) -> TransferStats:
        """A snapshot of the counters."""
        with self._cv:
            return TransferStats(**vars(self._stats))

    def close(self, wait: bool = True) -> None:
        """Stop accepting transfers. ``wait``: let queued and running ones finish
        (stalled ones fail through the watchdog); else cancel the queued ones and
        return (running ones finish in the background, without retries). Removes
        the engine's retry listeners from the stores. Idempotent."""
        with self._cv:
            if self._closed and (self._stop.is_set() or not wait):
                return
            self._closed = True
        if wait:
            with self._cv:
                while self._outstanding > 0:
                    self._cv.wait(0.1)
        else:
            with self._cv:
                queued = list(self._queue)
                self._queue.clear()
            for t in queued:
                t.future.cancel()
        self._stop.set()
        with self._cv:
            stores, self._stores = list(self._stores.values()), {}
        for s in stores:
            s.remove_retry_listener(self._on_sdk_retry)
        if self._own_executor:
            # never join: a thread a stalled attempt left blocked in a socket returns
            # only at the SDK's read timeout; idle pool threads exit by themselves
            self._executor.shutdown(wait=False)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
