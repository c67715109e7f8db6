"""The transfer engine: many uploads, downloads and range reads at once, bounded,
throttled, retried, watched, checksummed.

Shape (after s3transfer): every transfer gets a ``concurrent.futures.Future``
and an internal task that owns its attempts, its progress and its result.
:class:`TransferEngine` is the facade over three parts:

- admission (``scheduler.py``): a FIFO queue; a task is admitted when fewer than
  the current concurrency limit are in flight and its bytes fit the byte budget;
  the limit moves (AIMD): halved on a throttle signal, +1 after every 8 clean
  successes;
- attempts (``attempts.py``): what one attempt of each kind does, the retry policy
  (Transient errors, backoff, the deadline since the last new bytes) and the stall
  watchdog; an admitted attempt runs on the executor (a thread pool by default);
- pacing (``pacing.py``): the rank's share of a job-wide request rate per store
  (``request_rate / world_size``) with start jitter; an attempt waits for its
  request slots before it runs (and before the stall watchdog watches it);
- batches (``batch.py``): many transfers, results in order, stop at the first error.
  A transfer's slot is given back only after its future's callbacks have run, so a
  batch cancels its queued transfers from a failure's callback before any of them
  can be admitted into the failed one's slot.

What the SDKs already do, they keep doing: botocore retries each request
(``standard`` mode) and s3transfer does the multipart work; the engine adds what
they lack: a budget across files, a bandwidth cap, whole-transfer retries, a
stall watchdog and CRC32C.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import random
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable, Sequence

from ..errors import AccessDenied, CopyUnsupported, NotFound, PreconditionFailed, Throttled, TransferStalled
from ..storage.base import ObjectStore, RangeReader, StorageOptions
from ..storage.registry import open_store
from . import batch, pacing
from .attempts import (
    Attempt,
    CopyTask,
    DownloadTask,
    ReadTask,
    RetryPolicy,
    StreamTask,
    Task,
    UploadTask,
    Watchdog,
    stall_error,
    stalled,
)
from .bandwidth import TokenBucket
from .config import TransferConfig, TransferResult, TransferStats
from .progress import ProgressSubscriber
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class TransferEngine:
    """Runs transfers concurrently under the limits of a :class:`TransferConfig`.

    ``storage_options`` select the store options for every URL (``open_store``);
    ``progress`` receives on_queued/on_progress/on_done; ``clock``/``sleep``/``rng``
    are injectable for tests; ``executor`` runs attempts (default: a thread pool of
    ``2 * max_concurrency + 2`` threads, the headroom being for threads a stalled
    attempt leaves blocked in a socket or that sleep in a backoff; the concurrency
    limit, not the pool, bounds what is in flight). A given executor is not shut
    down by :meth:`close`. ``world_size``: ranks of the job that each run an engine
    like this one; each paces its requests at ``1 / world_size`` of the job's
    request rate (``TransferConfig.request_rate``, ``pacing.py``).

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
        world_size: int = 1,
    ):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.world_size = world_size
        self.config = config = config or TransferConfig()
        self.storage_options = storage_options
        self._progress = progress
        self._clock = clock
        self._sleep = sleep
        self._own_executor = executor is None
        self._executor = executor or cf.ThreadPoolExecutor(
            max_workers=2 * config.max_concurrency + 2, thread_name_prefix="cloudckpt-transfer"
        )
        self._bucket = TokenBucket(config.bandwidth_limit, clock=clock, sleep=sleep) if config.bandwidth_limit else None
        self._stats = TransferStats(concurrency=config.max_concurrency, min_concurrency_seen=config.max_concurrency)
        self._sched = Scheduler(config, self._stats, clock)
        self._cv = self._sched.cv  # the one lock of the engine's bookkeeping
        deadline = (storage_options or StorageOptions()).operation_timeout
        self._rng = rng or random.Random()
        self._retry = RetryPolicy(config, deadline, clock, self._rng)
        self._pacers: dict[int, pacing.RequestPacer | None] = {}  # by id(store), as _stores
        self._running: set[Attempt] = set()  # attempts started and not settled (the watchdog's list)
        self._stores: dict[int, ObjectStore] = {}
        self._stop = threading.Event()
        self._watchdog = Watchdog(config.stall_timeout, self.check_stalls, self._stop)

    # ------------------------------------------------------------------ submit
    def submit_upload(self, local_path: str, url: str, *, if_absent: bool = False,
                      crc32c: str | None = None, record_version: bool = False) -> "Future[TransferResult]":
        """Upload a local file to ``url``. The future's result is a TransferResult
        (size, CRC32C of the bytes read); its exception a cloudckpt error (or the
        OSError of opening the local file). Raises RuntimeError after close().

        ``crc32c``: the file's CRC32C when the caller computed it already (the DCP
        writer does, while writing): the result carries it, and the file is
        uploaded by name (``store.upload_file``: S3 reads parts from disk as it
        sends them, holding none in memory) instead of through a checksumming reader.

        ``if_absent`` uploads are conditional creates; after an ambiguous failure
        (e.g. a reset after the store got the object) a retried attempt can see
        AlreadyExists for the object the first attempt created.

        ``record_version``: the result carries the object's version token, asked of the
        store right after the upload (``store.version``: one request more), for a caller
        that copies from it later (:meth:`submit_copy_or_upload`)."""
        local_path = os.fspath(local_path)
        try:
            size = os.path.getsize(local_path)
        except OSError:
            size = 0  # the attempt will fail opening it, with the OS's message
        return self._submit(UploadTask(url, local_path, if_absent=if_absent, size=size, crc32c=crc32c,
                                       record_version=record_version), size)

    def submit_copy(self, src: str, url: str, *, size: int, crc32c: str | None = None,
                    local_path: str | None = None, src_version: str | None = None,
                    must_crc32c: str | None = None) -> "Future[TransferResult]":
        """Copy the object ``src`` to ``url`` server-side (``store.copy``: no byte passes
        through this process; retried, paced and bounded like an upload; it holds none
        of the byte budget and the bandwidth cap does not apply). ``size`` (and
        ``crc32c``, where the store reports the copy's) is what the copy must hold,
        else PreconditionFailed. ``src_version``: the version ``src`` must still have
        (``store.copy``'s); ``must_crc32c``: the CRC32C the copy must hold where the
        store reports it, when the result reports none (``crc32c`` None: checksums off).
        The result is a TransferResult with ``size``, ``crc32c``, ``local_path`` (a local
        file with the same bytes, if any) and the copy's ``version`` where the store has
        it. ``src`` in another store than ``url`` fails with CopyUnsupported."""
        if self._store(src) is not self._store(url):
            fut: Future = Future()
            fut.set_exception(CopyUnsupported(f"copy {src} -> {url}: not in the same store; upload it instead",
                                              url=url))
            return fut
        return self._submit(CopyTask(src, url, size=size, crc32c=crc32c, local_path=local_path,
                                     src_version=src_version, must_crc32c=must_crc32c), 0)

    def submit_copy_or_upload(self, src: str, local_path: str, url: str, *, crc32c: str | None = None,
                              src_version: str | None = None,
                              must_crc32c: str | None = None) -> "Future[TransferResult]":
        """Put the file ``local_path`` at ``url`` by copying ``src`` (an object the
        caller put there from a file with the same bytes: ``src_version`` the version it
        got, ``must_crc32c`` the file's CRC32C, checked where the store reports the
        copy's) server-side; when the copy cannot be made (``src`` gone, changed or
        replaced by someone else: NotFound, PreconditionFailed; a store without copies:
        CopyUnsupported; no read access to ``src``: AccessDenied) the file is uploaded
        instead (logged). Other failures (the store failing, timeouts) fail the future as
        an upload's would. The result carries the object's version either way (the
        copy's, or the upload's, asked right after it), for the next copy. A copy's bytes
        are not reported to the progress subscriber (they do not pass through this
        process). The future cannot be cancelled (it is running from the start)."""
        size = os.path.getsize(local_path)
        out: Future = Future()
        out.set_running_or_notify_cancel()

        def settle(f: Future) -> None:
            exc = cf.CancelledError(f"{url}: cancelled") if f.cancelled() else f.exception()
            out.set_result(f.result()) if exc is None else out.set_exception(exc)

        def after_copy(f: Future) -> None:
            exc = None if f.cancelled() else f.exception()
            if f.cancelled() or not isinstance(exc, (NotFound, PreconditionFailed, CopyUnsupported, AccessDenied)):
                settle(f)
                return
            if isinstance(exc, AccessDenied):  # a copy reads the source: a write-only grant does not cover it
                log.warning("%s: not copied from %s (%s: a copy needs read access to the source, e.g. s3:GetObject); "
                            "uploading %s instead", url, src, exc, local_path)
            elif isinstance(exc, PreconditionFailed):  # someone else's bytes there now: never copied
                log.warning("%s: not copied from %s (%s); uploading %s instead", url, src, exc, local_path)
            else:
                log.info("%s: not copied from %s (%s); uploading %s instead", url, src, exc, local_path)
            try:
                self.submit_upload(local_path, url, crc32c=crc32c, record_version=True).add_done_callback(settle)
            except BaseException as e:  # noqa: BLE001 - closed meanwhile: handed to the future
                out.set_exception(e)

        self.submit_copy(src, url, size=size, crc32c=crc32c, local_path=local_path, src_version=src_version,
                         must_crc32c=must_crc32c).add_done_callback(after_copy)
        return out

    def submit_download(self, url: str, local_path: str, *, size: int | None = None) -> "Future[TransferResult]":
        """Download ``url`` to ``local_path`` (a temporary file renamed into place,
        ``store.download_file``). The CRC32C is computed by re-reading the
        downloaded file once it is complete (S3 downloads write ranges out of
        order, so it cannot be taken on the way), unless ``TransferConfig.checksum``
        is off. ``size``: the size the caller expects (a manifest's): an object that
        holds more fails with ObjectTooLarge after at most ``size`` bytes."""
        return self._submit(DownloadTask(url, os.fspath(local_path), size), None)

    def submit_read(self, url: str, start: int | None, end: int | None) -> "Future[bytes]":
        """Read the byte range ``[start, end)`` of ``url`` (None: from the start /
        to the end) via ``store.get_bytes``. The stall timeout covers the whole request."""
        size = (end - (start or 0)) if end is not None else None
        return self._submit(ReadTask(url, start, end, size=max(size or 0, 0)), size)

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
        return self._submit(StreamTask(url, start, end, job), end - start)

    def _submit(self, task: Task, size: int | None) -> Future:
        self._sched.enqueue(task)
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
        return batch.run_all(lambda p: self.submit_upload(p[0], p[1]), pairs)

    def download_all(self, pairs: Iterable[tuple[str, str]]) -> list[TransferResult]:
        """Download ``(url, local_path)`` pairs; like :meth:`upload_all`."""
        return batch.run_all(lambda p: self.submit_download(p[0], p[1]), pairs)

    def read_all(self, ranges: Iterable[tuple[str, int | None, int | None]]) -> list[bytes]:
        """Read ``(url, start, end)`` ranges; the bytes in input order; like :meth:`upload_all`."""
        return batch.run_all(lambda r: self.submit_read(r[0], r[1], r[2]), ranges)

    @staticmethod
    def wait_all(futures: Sequence[Future]) -> list:
        """Results of ``futures`` in order. On the first error (in time) cancel the
        futures that have not started and raise that error."""
        return batch.wait_all(futures)

    # ------------------------------------------------------------------ attempts
    def _pump(self) -> None:
        """Start queued tasks while the scheduler admits them."""
        self._sched.pump(self._start)

    def _start(self, task: Task, number: int) -> None:
        att = Attempt(task, number)
        try:
            self._executor.submit(self._run, att)
        except RuntimeError as e:  # executor shut down under us
            self._settle(att, exc=e, retry_ok=False)

    def _run(self, att: Attempt) -> None:
        task = att.task
        if att.number == 1 and not task.future.set_running_or_notify_cancel():
            self._release(att)  # cancelled while waiting for a thread
            self._pump()
            return
        try:
            self._pace(task)
        except BaseException as e:  # noqa: BLE001 - settled: handed to the future
            self._settle(att, exc=e, retry_ok=False)
            return
        with self._cv:
            if att.settled:
                return
            att.last_progress = self._clock()
            if task.t0 is None:
                task.t0 = task.progress_at = att.last_progress
            self._running.add(att)
            self._watchdog.ensure_started()
        try:
            result = self._attempt(att)
        except BaseException as e:  # noqa: BLE001 - settled: retried or handed to the future
            delay = self._settle(att, exc=e)
        else:
            delay = self._settle(att, result=result)
        if delay is not None:
            self._retry_later(task, delay)

    def pace(self, url: str, kind: str = pacing.READ, requests: int = 1) -> float:
        """Wait for ``requests`` slots of the engine's request pacing (``kind``:
        ``"read"`` or ``"write"``) before sending them to ``url``'s store yourself
        (a request that does not go through the engine: a small object read or
        written with the store's own methods). Returns the seconds waited (0 when
        the store is not paced)."""
        if kind not in (pacing.READ, pacing.WRITE):
            raise ValueError(f"kind={kind!r}: use 'read' or 'write'")
        return self._wait_for_slots(self._store(url), kind, requests)

    def _wait_for_slots(self, store: ObjectStore, kind: str, n: int) -> float:
        pacer = self._pacers.get(id(store))
        if pacer is None:
            return 0.0
        waited = pacer.wait(kind, n)
        with self._cv:
            self._stats.paced_requests += n
            self._stats.paced_seconds += waited
        return waited

    def _pace(self, task: Task) -> None:
        """Wait for the request slots of the attempt about to run (none when the
        store is not paced). The wait does not count against the retry budget."""
        store = self._store(task.url)
        if self._pacers.get(id(store)) is None:
            return
        kind, n = task.requests(store)
        waited = self._wait_for_slots(store, kind, n)
        if waited:
            with self._cv:
                if task.progress_at is not None:
                    task.progress_at += waited

    def _attempt(self, att: Attempt):
        task = att.task
        store = self._store(task.url)
        notify = None
        if self._progress is not None and task.local_bytes:  # a server-side copy's bytes are not ours to count
            def notify(nbytes: int) -> None:
                self._notify("on_progress", task.url, nbytes)
        throttle = self._bucket.consume if self._bucket is not None and task.local_bytes else None
        progress = att.progress_fn(self._clock, throttle, notify)
        return task.run(store, progress, att.number, checksum=self.config.checksum, clock=self._clock)

    def _free_locked(self, att: Attempt, *, keep_slot: bool = False) -> None:
        """Settle the attempt: it leaves the running set and (unless ``keep_slot``)
        gives back its slot."""
        att.settle_locked()
        self._running.discard(att)
        if not keep_slot:
            self._sched.release_locked(att.task.size)

    def _release(self, att: Attempt) -> bool:
        """Give back the attempt's slot and bytes. False if it was already settled."""
        with self._cv:
            if att.settled:
                return False
            self._free_locked(att)
            return True

    def _settle(self, att: Attempt, *, result=None, exc: BaseException | None = None,
                retry_ok: bool = True) -> float | None:
        """Record an attempt's outcome (once: a late outcome of an abandoned attempt
        is ignored). Returns the backoff delay when the task is to be retried."""
        task = att.task
        with self._cv:
            if att.settled:
                return None
            retry = retry_ok and exc is not None and self._retry.retries(att, exc, stopping=self._stop.is_set())
            # a final outcome keeps the slot until the future's callbacks have run:
            # a batch cancels its queued transfers from the failing future's callback,
            # and no queued transfer may be admitted into this slot before that
            self._free_locked(att, keep_slot=not retry)
            s = self._stats
            if isinstance(exc, TransferStalled):
                s.stalls += 1
            if isinstance(exc, Throttled):
                self._sched.throttled_locked()
            if exc is None:
                s.transfers += 1
                if not task.local_bytes:
                    s.bytes_copied += task.nbytes(result)
                elif task.uploads:
                    s.bytes_uploaded += task.nbytes(result)
                else:
                    s.bytes_downloaded += task.nbytes(result)
                self._sched.succeeded_locked()
            elif retry:
                s.retries += 1
        taken_back = att.take_back()
        if exc is not None and taken_back and task.local_bytes:
            self._notify("on_progress", task.url, -taken_back)
        if retry:
            task.last_exc = exc
            return self._retry.backoff(att, exc)
        try:
            if exc is None:
                task.future.set_result(result)
            else:
                task.future.set_exception(exc)
        finally:
            with self._cv:
                self._sched.release_locked(task.size)
        self._pump()
        return None

    def _retry_later(self, task: Task, delay: float) -> None:
        if delay > 0:
            self._sleep(delay)
        if not self._sched.requeue(task, self._stop):  # retries go first
            task.future.set_exception(task.last_exc or RuntimeError("the transfer engine was closed"))
            return
        self._pump()

    def _on_future_done(self, url: str, desc: str, fut: Future) -> None:
        self._sched.future_done()
        if fut.cancelled():
            self._notify("on_done", url, cf.CancelledError(f"{desc} was cancelled"))
        else:
            self._notify("on_done", url, fut.exception() or fut.result())

    # ------------------------------------------------------------------ stores
    def _on_sdk_retry(self, kind: str) -> None:
        with self._cv:
            self._stats.sdk_retries += 1
            if kind == "throttled":
                self._sched.throttled_locked()

    def _store(self, url: str) -> ObjectStore:
        store = open_store(url, self.storage_options)
        with self._cv:
            if id(store) not in self._stores:
                self._stores[id(store)] = store
                store.add_retry_listener(self._on_sdk_retry)
                self._pacers[id(store)] = pacing.make_pacer(
                    self.config.request_rate, store, self.world_size, jitter=self.config.start_jitter,
                    clock=self._clock, sleep=self._sleep, rng=self._rng)
        return store

    # ------------------------------------------------------------------ watchdog
    def check_stalls(self) -> int:
        """Fail every running attempt without progress for ``stall_timeout``
        (the watchdog calls this every ``min(1 s, stall_timeout / 4)``; tests with a
        fake clock call it directly). Returns how many attempts it failed."""
        timeout = self.config.stall_timeout
        if timeout <= 0:
            return 0
        now = self._clock()
        with self._cv:
            found = stalled(self._running, now, timeout)
        for att in found:
            exc = stall_error(att, timeout, self.config.max_attempts)
            log.warning("%s", exc)
            delay = self._settle(att, exc=exc)
            if delay is not None:  # do not block the watchdog with the backoff
                threading.Thread(target=self._retry_later, args=(att.task, delay), daemon=True,
                                 name="cloudckpt-transfer-retry").start()
        return len(found)

    # ------------------------------------------------------------------ misc
    def _notify(self, method: str, url: str, arg) -> None:
        if self._progress is None:
            return
        try:
            getattr(self._progress, method)(url, arg)
        except Exception:  # a broken progress bar must not fail a transfer
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
            if self._sched.closed and (self._stop.is_set() or not wait):
                return
            self._sched.closed = True
        if wait:
            self._sched.wait_idle()
        else:
            for t in self._sched.drain():
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
