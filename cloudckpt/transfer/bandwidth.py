"""A bandwidth cap shared by every transfer of an engine.

A virtual-schedule token bucket (like s3transfer's leaky bucket): each chunk of
``n`` bytes is given the slot ``[t, t + n / rate)`` right after the previous
chunk's slot (or now, if the link was idle); the caller sleeps until its slot
ends. Whatever the number of threads, bytes pass at most at ``rate`` on average,
and a transfer of ``B`` bytes takes at least ``B / rate`` seconds. There is no
idle credit: a quiet period does not allow a later burst. The clock and the sleep
are injectable, so the schedule can be tested without waiting.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class TokenBucket:
    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate!r}")
        self.rate = float(rate)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._next_free = -float("inf")

    def consume(self, nbytes: int) -> float:
        """Account ``nbytes`` and sleep until the cap allows them. Returns the sleep."""
        if nbytes <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self.rate
            wait = self._next_free - now
        if wait > 0:
            self._sleep(wait)
        return max(wait, 0.0)
