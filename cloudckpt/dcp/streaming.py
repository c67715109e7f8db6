"""Streaming loads: each coalesced run of items is one stream (a ranged read run by
the transfer engine); on the stream's thread each item is read, checked and put into
its target, then the next one is read. Items being read or put in place share a byte
budget (``_Tally``); the thread running ``read_data`` waits for them all
(``read_streamed``)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

from torch.distributed.checkpoint.planner import LoadPlanner

from ..errors import NotFound
from ..storage import url as urls
from .resumable import ResumableStream, coalesce, cut, distinct, missing, spans


def read_streamed(reader, per_file: dict[str, list], planner: LoadPlanner, *, max_gap: int | None = None,
                  hold=None) -> None:
    """Load ``per_file`` (``{relative path: [(offset, length, ReadItem)]}``) through
    streams of ``reader`` (a StreamingReader: its budget, its ``_stream``, its checks),
    started in the order of ``per_file``; adds what was read to ``reader.bytes_read``
    and ``reader.direct_items``. ``max_gap``: instead of the reader's. ``hold``: the
    read-once exchange's sender (exchange.py): ``hold.keep(rel, offset, length, data,
    release)`` after an item is in place, True when its bytes stay held (in the
    budget) until ``release()``; ``hold.urgent(rel, offset, length)``: the item may take
    budget even when none is left; ``hold.attach(stop)``: ``stop(exc)`` ends the load
    with ``exc`` (no stream starts another item)."""
    planned = sum(length for reqs in per_file.values() for _, length, _ in reqs)
    max_inflight, stream_size = reader.budget(planned)
    tally = _Tally(max_inflight)
    if hold is not None:
        hold.attach(tally.fail)
    streams = []
    for rel, reqs in per_file.items():
        url = urls.join(reader.remote_dir, rel)
        for start, end, parts in coalesce(reqs, max_gap=reader.max_gap if max_gap is None else max_gap,
                                          max_range=stream_size):
            streams.append(_ItemStream(reader, planner, tally, url, rel, start, end, parts, hold))
    futures: list[Future] = []
    try:
        for st in streams:
            fut = reader._stream(st.url, st.start, st.end, st)
            fut.add_done_callback(st.finished)
            futures.append(fut)
        tally.wait(sum(len(st.spans) for st in streams))
    finally:
        tally.close()  # streams still running stop before their next item; waits for items being put in place
        for fut in futures:
            fut.cancel()
    reader.bytes_read += tally.bytes
    reader.direct_items += tally.direct


class _Tally:
    """What the streams share: the byte budget (items being read or put into their
    targets), how many spans are in place, and the first error of any stream,
    raised by ``wait``."""

    def __init__(self, budget: int):
        self._cv = threading.Condition()
        self._held = 0
        self._budget = budget
        self._error: BaseException | None = None
        self._closed = False
        self._busy = 0  # items being put into their targets
        self.items = 0
        self.bytes = 0
        self.direct = 0

    def reserve(self, n: int, alive: Callable[[int], None], urgent: Callable[[], bool] | None = None) -> None:
        """Wait until ``n`` more bytes fit the budget (always, when nothing is held, or
        once ``urgent()``), calling ``alive(0)`` every second meanwhile (the engine's
        stall watchdog: a stream waiting for room is not stalled; an abandoned attempt's
        call raises)."""
        while True:
            with self._cv:
                if self._closed:
                    raise _Stopped()
                if not self._held or self._held + n <= self._budget or (urgent is not None and urgent()):
                    self._held += n
                    return
                self._cv.wait(1.0)
            alive(0)

    def release(self, n: int) -> None:
        with self._cv:
            self._held -= n
            self._cv.notify_all()

    def claim(self) -> None:
        """An item is about to be put into its target (refused once closed)."""
        with self._cv:
            if self._closed:
                raise _Stopped()
            self._busy += 1

    def placed(self, n: int, direct: int, *, kept: int = 0) -> None:
        """A span of ``n`` bytes is in place; its bytes go back to the budget, but for
        ``kept`` bytes (items the exchange sends on: later, by ``release``)."""
        with self._cv:
            self._held -= n - kept
            self.items += 1
            self.bytes += n
            self.direct += direct
            self._cv.notify_all()

    def unclaim(self) -> None:
        with self._cv:
            self._busy -= 1
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def wait(self, total: int) -> None:
        with self._cv:
            while self.items < total and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """No stream starts another item; returns once none is being put in place,
        so no target is written after the load returned (or raised)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            while self._busy:
                self._cv.wait()


class _Stopped(Exception):
    """The load is over (it failed elsewhere): a stream stops before its next item."""


class _ItemStream(ResumableStream):
    """One stream of the load: read ``parts`` (sorted ``(offset, length, ReadItem)``
    within ``[start, end)`` of one shard file) in order, a span at a time (overlapping
    items, the same stored item read twice included, are one span: read once, each
    item cut from it), check each item and put it into its target, on the stream's
    thread. Each attempt starts at the first span not taken yet; a superseded attempt
    takes nothing more, so every item is put in place once."""

    def __init__(self, reader, planner: LoadPlanner, tally: _Tally, url: str, rel: str,
                 start: int, end: int, parts: list, hold=None):
        super().__init__(url, start, end, threading.Lock())
        self.reader, self.planner, self.tally = reader, planner, tally
        self.hold = hold
        self.rel = rel
        self.spans = spans(parts)
        self._next = 0  # index of the first span not taken

    def resume_at(self) -> int | None:
        """The index of the first span not taken."""
        return self._next if self._next < len(self.spans) else None

    def attempt(self, attempt, at, open_from, progress) -> int:
        pos = self.spans[at][0]
        # a store that fetches the range whole (not streamed) holds it all from the first
        # read: reserve all of it up front; a streamed one holds one span at a time
        held = sum(e - s for s, e, _ in self.spans[at:]) if not self.reader.streamed else 0
        if held:
            self.tally.reserve(held, progress, self._urgent(at))
        done = 0
        try:
            with open_from(pos) as body:
                while True:
                    with self._lock:
                        if not self.current(attempt):
                            return done  # superseded: the current attempt goes on from self._next
                        i = self._next
                    if i >= len(self.spans):
                        return done
                    start, end, items = self.spans[i]
                    if start > pos:
                        self.read(body, pos, start - pos, progress)  # bytes between spans: not needed
                        pos = start
                    if not held:
                        self.tally.reserve(end - start, progress, self._urgent(i))
                        held = end - start
                    data = self.read(body, start, end - start, progress)
                    keys = distinct(items)
                    for off, length in keys:
                        self.reader._check(self.rel, off, length, cut(data, start, off, length), self.url)
                    with self._lock:
                        if not self.current(attempt):
                            raise _Stopped()
                        self.tally.claim()
                        self._next = i + 1
                    direct = kept = 0
                    try:
                        for off, length, req in items:
                            direct += self.reader._consume(req, self.planner, memoryview(cut(data, start, off, length)),
                                                           self.url)
                        if self.hold is not None:  # the exchange sends it on: its bytes stay held until sent
                            for off, length in keys:
                                if self.hold.keep(self.rel, off, length, cut(data, start, off, length),
                                                  lambda n=length: self.tally.release(n)):
                                    kept += length
                    finally:
                        self.tally.unclaim()
                    del data
                    held -= end - start
                    self.tally.placed(end - start, direct, kept=kept)  # gives back its bytes (but those kept)
                    pos = end
                    done += end - start
        finally:
            if held:
                self.tally.release(held)  # what this attempt reserved and did not place

    def _urgent(self, i: int) -> Callable[[], bool] | None:
        if self.hold is None:
            return None
        keys = distinct(self.spans[i][2])
        return lambda: any(self.hold.urgent(self.rel, off, length) for off, length in keys)

    def finished(self, fut: Future) -> None:
        """Done callback of the stream's Future: its error goes to the thread waiting in ``read_data``."""
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, _Stopped):
            return
        if isinstance(exc, NotFound):
            exc = missing(self.url)
        if exc is not None:
            self.tally.fail(exc)
        elif self._next < len(self.spans):  # cannot happen: a job returns only when done or superseded
            self.tally.fail(RuntimeError(f"{self.url}: a stream ended with items left"))
