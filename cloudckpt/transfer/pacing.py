"""Job-wide request pacing: every rank's share of the store's per-prefix request rate.

A store answers 503 SlowDown above a request rate per prefix (S3: about 3,500 writes
and 5,500 reads per second), and every rank of a job starts a save or a load at the
same moment, under the same ``step{N}/`` prefix. The AIMD limit of one engine
(``scheduler.py``) only reacts once the store throttles, and each rank has a few
transfers, below its limit: it cannot shape a fleet-wide burst. So each engine also
holds a :class:`RequestPacer`: the job-wide budget (``TransferConfig.request_rate``,
or the store's ``default_request_rates``) divided by the job's world size, one
schedule for writes (PUT, multipart create/part/complete) and one for reads (GET,
ranged GET, HEAD). Before an attempt the engine takes from it as many request slots as
the attempt will send (:meth:`~cloudckpt.transfer.attempts.Task.requests`) and waits for the first.

A schedule is a virtual-time token bucket without idle credit (like the bandwidth
cap, ``bandwidth.py``): request ``k`` gets the slot right after request ``k - 1``'s,
``1 / rate`` seconds long, and waits for its slot's start; a quiet spell gives no
credit for a later burst. The first request after a quiet spell (the schedule free
for at least the jitter window) waits ``uniform(0, window)`` first: ranks that start
together spread their first requests over the window (default: one interval of the
rank, ``world_size / rate``, so the fleet's first requests arrive at the job's rate;
none for a job of one rank). Waits shorter than :data:`MIN_WAIT` are not slept (the
slot is still taken, so the rate holds over any span longer than that): a store
measures its rate per second, and a process of one rank at S3's default rate would
otherwise sleep a fraction of a millisecond between close requests.

Over any ``T`` seconds one rank sends at most ``1 + T * rate / world_size`` requests
of a kind, the job at most ``world_size + T * rate``, and the ``world_size`` term is
spread over the jitter window. A multipart transfer (or a chunked read) takes all its
slots before it starts: the rank's average stays in its share, though the parts of
that one transfer go out as fast as the SDK sends them. SDK retries are not paced
(the AIMD limit reacts to them). Requests every rank sends outside the engine at the
same moment (its manifest part at save; its manifest and DCP index parts and train
state at load) take their slots through ``TransferEngine.pace``; rank 0's few (lock,
marker, index header, listings) do not.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)

WRITE, READ = "write", "read"
#: seconds: a shorter wait for a slot is not slept
MIN_WAIT = 0.001


class Schedule:
    """One kind of request of one rank: ``rate`` requests/s, start jitter ``window``."""

    def __init__(self, rate: float, window: float, *, rng: random.Random):
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a finite number of requests/s > 0, got {rate!r}")
        if not (window >= 0 and math.isfinite(window)):
            raise ValueError(f"window must be a finite number of seconds >= 0, got {window!r}")
        self.rate = float(rate)
        self.window = float(window)
        self._rng = rng
        self._lock = threading.Lock()
        self._next_free = -math.inf

    def reserve(self, n: int, now: float) -> float:
        """Take ``n`` consecutive request slots; returns when the first one starts
        (``>= now``)."""
        with self._lock:
            if now - self._next_free >= self.window:  # quiet spell (or the very first request): jitter
                start = now + (self._rng.uniform(0.0, self.window) if self.window > 0 else 0.0)
            else:
                start = max(now, self._next_free)
            self._next_free = start + max(n, 1) / self.rate
            return start


class RequestPacer:
    """One rank's share of a job-wide request budget, for one store.

    ``rates``: ``(writes/s, reads/s)`` for the whole job; ``world_size``: ranks that
    share them (each gets ``rate / world_size``); ``jitter``: the start-jitter
    window in seconds, or None for one interval of each schedule
    (``world_size / rate``; 0 when ``world_size`` is 1). ``clock``/``sleep``/``rng``
    are injectable."""

    def __init__(self, rates: tuple[float, float], world_size: int, *, jitter: Optional[float] = None,
                 clock: Callable[[], float], sleep: Callable[[float], None], rng: random.Random):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.world_size = world_size
        self.job_rates = rates
        self._clock = clock
        self._sleep = sleep
        self.schedules = {}
        for kind, job_rate in zip((WRITE, READ), rates, strict=True):
            rate = job_rate / world_size
            window = (1.0 / rate if world_size > 1 else 0.0) if jitter is None else jitter
            self.schedules[kind] = Schedule(rate, window, rng=rng)

    def rank_rate(self, kind: str) -> float:
        """Requests/s this rank may send of ``kind``."""
        return self.schedules[kind].rate

    def wait(self, kind: str, n: int) -> float:
        """Take ``n`` slots of ``kind`` and sleep until the first one starts (unless
        that is less than MIN_WAIT away); returns the seconds slept."""
        now = self._clock()
        delay = self.schedules[kind].reserve(n, now) - now
        if delay >= MIN_WAIT:
            self._sleep(delay)
            return delay
        return 0.0

    def describe(self) -> str:
        w, r = self.schedules[WRITE], self.schedules[READ]
        return (f"{self.job_rates[0]:g} writes/s and {self.job_rates[1]:g} reads/s for the job, "
                f"{w.rate:.4g} and {r.rate:.4g} for this rank (world size {self.world_size}), "
                f"start jitter up to {w.window:.3g} s / {r.window:.3g} s")


def job_rates(request_rate: Optional[float],
              store_default: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """The job-wide ``(writes/s, reads/s)`` to pace at: ``request_rate`` for both when
    set (0: none), else the store's default (None: none)."""
    if request_rate is None:
        return tuple(store_default) if store_default else None
    return (float(request_rate), float(request_rate)) if request_rate > 0 else None


def make_pacer(request_rate: Optional[float], store, world_size: int, *, jitter: Optional[float],
               clock: Callable[[], float], sleep: Callable[[float], None],
               rng: random.Random) -> Optional[RequestPacer]:
    """The pacer of an engine for ``store`` (None: no pacing for it)."""
    rates = job_rates(request_rate, getattr(store, "default_request_rates", None))
    if rates is None:
        return None
    pacer = RequestPacer(rates, world_size, jitter=jitter, clock=clock, sleep=sleep, rng=rng)
    log.info("request pacing for %s: %s", type(store).__name__, pacer.describe())
    return pacer


def parts(size: int, store) -> int:
    """Requests to move ``size`` bytes in the store's parts or chunks (at least 1)."""
    return max(1, math.ceil(size / store.part_size))


def upload_requests(size: int, store) -> int:
    """One PUT, or a multipart upload: create, the parts, complete."""
    return 1 if size <= store.multipart_threshold else parts(size, store) + 2


def download_requests(size: Optional[int], store) -> int:
    """One GET, or ranged GETs of the store's part size above its multipart threshold;
    an unknown size costs a HEAD first (and counts one GET)."""
    if size is None:
        return 2
    return 1 if size <= store.multipart_threshold else parts(size, store)


def range_requests(size: Optional[int], store) -> int:
    """One GET where the store streams a range, else one per ``part_size`` chunk."""
    return 1 if store.streams_ranges or not size else parts(size, store)
