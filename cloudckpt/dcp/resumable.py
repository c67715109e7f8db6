"""What both ways of loading share: the ranges streams read (``coalesce``) and the
resumable stream (``ResumableStream``), the job ``TransferEngine.submit_stream`` runs
for a range of a shard file: the streaming reader's item streams (streaming.py) and
pre-download's file downloads (predownload.py) are its two kinds.

A plan may read one stored item several times (a ``ShardedTensor`` with several local
shards of one saved chunk: each shard is a ReadItem of the same bytes), and a hostile
``.metadata`` may place items that overlap. ``coalesce`` keeps overlapping items in one
range and ``spans`` groups them: each span's bytes are read once and every item of it
is cut from them. A stream reads front to back (``Body`` knows where it is): a read
anywhere but there, or outside the range the stream opened, is a cloudckpt bug
(InternalError), never a truncated object; only the object ending inside the range our
plan checked against the manifest is CorruptCheckpoint."""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..errors import CorruptCheckpoint, InternalError
from ..storage.base import RangeReader


def coalesce(items: list[tuple[int, int, Any]], *, max_gap: int, max_range: int) -> list[tuple[int, int, list]]:
    """Group ``(offset, length, payload)`` into ``(start, end, [payloads])`` ranges:
    neighbours closer than ``max_gap`` merge while the range stays under
    ``max_range`` (a single larger item is its own range); an item that overlaps the
    range before it (the same stored item read twice) always joins it, so its bytes
    are read once (``spans``)."""
    out: list[tuple[int, int, list]] = []
    for off, length, p in sorted(items, key=lambda t: t[0]):
        if out:
            s, e, ps = out[-1]
            if off < e or (off == ps[-1][0] and length == ps[-1][1]) or \
                    (off - e <= max_gap and (off + length) - s <= max_range):
                ps.append((off, length, p))  # in place: linear in the items, whatever the range holds
                out[-1] = (s, max(e, off + length), ps)
                continue
        out.append((off, off + length, [(off, length, p)]))
    return out


def spans(parts: list[tuple[int, int, Any]]) -> list[tuple[int, int, list]]:
    """``parts`` (``(offset, length, payload)`` sorted by offset, one range of
    ``coalesce``) grouped into ``(start, end, [parts])`` spans of overlapping items
    (identical ranges included): spans are disjoint and in order, each is read once
    and its items are cut from its bytes (``cut``)."""
    out: list[tuple[int, int, list]] = []
    for off, length, p in parts:
        if out:
            s, e, ps = out[-1]
            if off < e or (off == ps[-1][0] and length == ps[-1][1]):
                ps.append((off, length, p))
                out[-1] = (s, max(e, off + length), ps)
                continue
        out.append((off, off + length, [(off, length, p)]))
    return out


def distinct(items: list[tuple[int, int, Any]]) -> list[tuple[int, int]]:
    """The distinct ``(offset, length)`` of a span's items, in order."""
    return list(dict.fromkeys((off, length) for off, length, _ in items))


def cut(data, start: int, off: int, length: int):
    """Bytes ``[off, off + length)`` of a span read from ``start`` (``data`` itself when
    they are all of it: no copy, no view)."""
    if off == start and length == len(data):
        return data
    return memoryview(data)[off - start: off - start + length]


class Body(RangeReader):
    """A stream's reader of ``[pos, end)`` that knows where it is (``pos``)."""

    def __init__(self, body: RangeReader, pos: int, end: int):
        self.body, self.pos, self.end = body, pos, end

    def read(self, n: int):
        data = self.body.read(n)
        self.pos += len(data)
        return data

    def close(self) -> None:
        self.body.close()

    def __enter__(self) -> "Body":
        self.body.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.body.__exit__(*exc)


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
        return self.attempt(attempt, at, lambda pos: Body(open_from(pos), pos, self.end), progress)

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

    def read(self, body: Body, pos: int, n: int, progress: Callable[[int], None], *,
             whole: bool = True):
        """The bytes at ``pos`` from ``body`` (``open_from``'s), reported to ``progress``:
        all ``n`` of them when ``whole``, else what one read gives (at most ``n``). A read
        that is not where the body is, or not inside the stream's range, is this
        library's bug: InternalError. Where the object ends before them (inside the
        range the plan checked), it is truncated: CorruptCheckpoint."""
        if body.pos != pos or pos < self.start or n < 0 or pos + n > self.end:
            raise InternalError(f"{self.url}: the load's stream over bytes [{self.start}, {self.end}) was asked for "
                                f"bytes [{pos}, {pos + n}) while it stands at byte {body.pos}")
        data = read_exact(body, n) if whole else body.read(n)
        progress(len(data))  # raises once the engine gave up on this attempt
        if (len(data) < n) if whole else not data:
            raise self.truncated(body.pos)
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
