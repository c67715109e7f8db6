"""Memory probes for tests: random files of a given size and the peak RSS of a block."""

from __future__ import annotations

import os
import threading


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_random(path, size: int, piece: int = 8 << 20) -> None:
    with open(path, "wb") as f:
        for _ in range(size // piece):
            f.write(os.urandom(piece))
        f.write(os.urandom(size % piece))


class PeakRss:
    """``with PeakRss() as p: ...`` then ``p.grew``: the peak RSS sampled during the
    block (every ``interval`` seconds) minus the RSS when it started."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.base = self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss())

    def __enter__(self) -> "PeakRss":
        self.base = self.peak = rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def grew(self) -> int:
        return self.peak - self.base
