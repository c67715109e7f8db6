"""What both ways of loading share: the ranges streams read (``coalesce``) and the
resumable stream (``ResumableStream``), the job ``TransferEngine.submit_stream`` runs
for a range of a shard file: the streaming reader's item streams (streaming.py) and
pre-download's file downloads (predownload.py) are its two kinds."""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..errors import CorruptCheckpoint
from ..storage.base import RangeReader


def coalesce(items: list[tuple[int, int, Any]], *, max_gap: int, max_range: int) -> list[tuple[int, int, list]]:
    """Group ``(offset, length, payload)`` into ``(start, end, [payloads])`` ranges:
    neighbours closer than ``max_gap`` merge while the range stays under
    ``max_range`` (a single larger item is its own range)."""
    out: list[tuple[int, int, list]] = []
    for off, length, p in sorted(items, key=lambda t: t[0]):
        if out:
            s, e, ps = out[-1]
            if off - e <= max_gap and (off + length) - s <= max_range:
                ps.append((off, length, p))  # in place: linear in the items, whatever the range holds
                out[-1] = (s, max(e, off + length), ps)
                continue
        out.append((off, off + length, [(off, length, p)]))
    return out


class ResumableStream:
    """The job of one stream (``TransferEngine.submit_stream``) over ``[start, end)`` of
    ``url``, read front to back. Each call is one attempt of the engine: it goes on from
    what earlier attempts handled (``resume_at``: None when nothing is left), and once a
    later attempt has started (the engine gave up on this one as stalled and retried),
    it handles nothing more (``current``). ``lock`` guards the attempt count and what
    ``resume_at`` reads. A subclass does the reading in ``attempt``."""

    def __init__(self, url: str, start: int, end: int, lock: threading.Lock | threading.Condition):
        self.url, self.start, self.end = url, start, end
        self._lock = lock
        self._attempt = 0

    def __call__(self, open_from: Callable[[int], RangeReader], progress: Callable[[int], None]) -> int:
        with self._lock:
            self._attempt += 1
            attempt, at = self._attempt, self.resume_at()
        if at is None:
            return 0
        return self.attempt(attempt, at, open_from, progress)

    def resume_at(self) -> Any:
        """Where the next attempt starts (called under the lock; what ``attempt`` gets
        as ``at``); None: all is done."""
        raise NotImplementedError

    def attempt(self, attempt: int, at: Any, open_from: Callable[[int], RangeReader],
                progress: Callable[[int], None]) -> int:
        """Attempt number ``attempt``, from ``at`` on: returns the bytes it handled."""
        raise NotImplementedError

    def current(self, attempt: int) -> bool:
        """No later attempt has started."""
        return attempt == self._attempt

    def read(self, body: RangeReader, pos: int, n: int, progress: Callable[[int], None], *,
             whole: bool = True):
        """The bytes at ``pos`` from ``body``, reported to ``progress``: all ``n`` of them
        when ``whole``, else what one read gives (at most ``n``). Where the object ends
        before them, it is truncated: CorruptCheckpoint."""
        data = read_exact(body, n) if whole else body.read(n)
        progress(len(data))  # raises once the engine gave up on this attempt
        if (len(data) < n) if whole else not data:
            raise self.truncated(pos + len(data))
        return data

    def truncated(self, at: int) -> CorruptCheckpoint:
        return CorruptCheckpoint(
            f"{self.url}: expected bytes [{self.start}, {self.end}) but the object ends at {at}; it is truncated"
        )


def read_exact(body: RangeReader, n: int):
    """``n`` bytes from ``body`` (fewer only where it ends)."""
    data = body.read(n)
    if len(data) >= n or not data:
        return data
    pieces = [bytes(data)]
    got = len(data)
    while got < n:
        more = body.read(n - got)
        if not more:
            break
        pieces.append(bytes(more))
        got += len(more)
    return b"".join(pieces)


def missing(url: str) -> CorruptCheckpoint:
    """A shard listed in the marker is gone: the committed step is damaged (not a storage hiccup)."""
    return CorruptCheckpoint(f"{url}: the object is listed in the checkpoint's marker but missing; the checkpoint is "
                             "damaged: restore the object or load an older step")
