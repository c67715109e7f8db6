"""Admission for the transfer engine: which queued transfer may start an attempt.

Submitted tasks wait in a FIFO queue (retries go to its head); a task is admitted
when fewer than the current concurrency limit hold a slot and its bytes fit the byte
budget (``max_bytes_in_flight``; a task larger than the budget runs when nothing
else does). The limit moves (AIMD): halved on a throttle signal (at most once per
``DECREASE_WINDOW`` seconds, never below ``min_concurrency``), +1 after every
``INCREASE_EVERY`` clean successes (never above ``max_concurrency``).

The scheduler knows nothing of stores or attempts: it hands an admitted task and
its attempt number to the engine, which gives the slot back (``release_locked``)
when that attempt is settled.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

from .config import TransferConfig, TransferStats

log = logging.getLogger(__name__)

#: AIMD: +1 to the limit after this many successes without a throttle signal.
INCREASE_EVERY = 8
#: AIMD: at most one halving per this many seconds (one throttle storm = one cut).
DECREASE_WINDOW = 1.0


class Scheduler:
    """The queue, the slots and the byte budget of one engine, and its AIMD limit.

    ``cv`` is the engine's one lock: the engine's own bookkeeping (attempts running,
    counters) is done under it too, so an attempt's slot, its outcome and the
    counters change together. Methods named ``*_locked`` expect it held; the
    others take it. ``stats`` is the engine's counters (throttle signals and the
    limit are recorded in it)."""

    def __init__(self, config: TransferConfig, stats: TransferStats, clock: Callable[[], float]):
        self.config = config
        self.cv = threading.Condition()
        self.closed = False  # no more submissions
        self.outstanding = 0  # submitted futures not yet done
        self._stats = stats
        self._clock = clock
        self._queue: collections.deque = collections.deque()
        self._admitted = 0  # attempts holding a slot (admitted, not yet settled)
        self._bytes = 0  # bytes of the budget they hold
        self._limit = config.max_concurrency
        self._clean_successes = 0
        self._last_decrease = -float("inf")
        self._tls = threading.local()

    # ------------------------------------------------------------------ queue
    def enqueue(self, task) -> None:
        """Queue a new task (RuntimeError once closed)."""
        with self.cv:
            if self.closed:
                raise RuntimeError(f"the transfer engine is closed; cannot {task.describe()}")
            self.outstanding += 1
            self._queue.append(task)

    def requeue(self, task, stopping: threading.Event) -> bool:
        """Queue a task to be retried, ahead of the others; False (not queued) once
        ``stopping`` is set."""
        with self.cv:
            if stopping.is_set():
                return False
            self._queue.appendleft(task)
        return True

    def drain(self) -> list:
        """Take every queued task out of the queue (closing without waiting)."""
        with self.cv:
            queued = list(self._queue)
            self._queue.clear()
        return queued

    def future_done(self) -> None:
        with self.cv:
            self.outstanding -= 1
            self.cv.notify_all()

    def wait_idle(self) -> None:
        """Wait until every submitted future is done."""
        with self.cv:
            while self.outstanding > 0:
                self.cv.wait(0.1)

    # ------------------------------------------------------------------ admission
    def _admits(self, task) -> bool:
        if self._admitted >= self._limit:
            return False
        return self._admitted == 0 or self._bytes + task.size <= self.config.max_bytes_in_flight

    def pump(self, start: Callable[[object, int], None]) -> None:
        """Admit queued tasks while the limits allow, calling ``start(task, attempt
        number)`` for each (outside the lock). Re-entrant calls (an inline executor
        finishing a transfer inside ``start``) only ask the outer call for one more
        round, so the stack does not grow with the queue."""
        tls = self._tls
        if getattr(tls, "pumping", False):
            tls.again = True
            return
        tls.pumping = True
        try:
            while True:
                tls.again = False
                batch = []
                with self.cv:
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
                        batch.append((task, task.attempts))
                for task, number in batch:
                    start(task, number)
                if not tls.again:
                    return
        finally:
            tls.pumping = False

    def release_locked(self, size: int) -> None:
        """Give back an attempt's slot and its ``size`` bytes of the budget."""
        self._admitted -= 1
        self._bytes -= size
        self.cv.notify_all()

    # ------------------------------------------------------------------ AIMD
    def throttled_locked(self) -> None:
        """A throttle signal: halve the limit (once per DECREASE_WINDOW)."""
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

    def succeeded_locked(self) -> None:
        """A clean success: every INCREASE_EVERY of them raise the limit by one."""
        self._clean_successes += 1
        if self._clean_successes >= INCREASE_EVERY:
            self._clean_successes = 0
            if self._limit < self.config.max_concurrency:
                self._limit += 1
                self._stats.concurrency = self._limit
