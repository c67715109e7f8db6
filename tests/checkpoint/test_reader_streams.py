"""The streaming reader's streams: one ranged read per run of items, each item read,
checked and put into its target on the stream's thread under a shared byte budget,
resumed after a failure from the first item not taken, never put in place twice (also
when a stalled attempt wakes up), and no target written after the load returned."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.dcp import reader as R
from cloudckpt.dcp import streaming as S
from cloudckpt.errors import CorruptCheckpoint, Transient
from cloudckpt.storage import open_store
from cloudckpt.storage.s3 import S3Store
from cloudckpt.transfer import crc32c_bytes

MiB = 1024 * 1024
URL = "s3://b/ck/model_and_optim/__0_0.distcp"


class Body:
    """A RangeReader over ``data[pos:]``; ``fail_after`` reads raise Transient;
    ``block_at`` makes the read that would cross that offset set ``reached`` and wait for ``gate``."""

    def __init__(self, data: bytes, pos: int, *, fail_after: int | None = None, block_at: int | None = None,
                 gate: threading.Event | None = None, reached: threading.Event | None = None):
        self.data, self.pos = data, pos
        self.fail_after, self.block_at, self.gate, self.reached = fail_after, block_at, gate, reached
        self.reads = 0
        self.closed = False

    def read(self, n):
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise Transient(f"get {URL}: connection problem (reset)", url=URL)
        if self.block_at is not None and self.pos <= self.block_at < self.pos + n:
            if self.reached is not None:
                self.reached.set()
            self.gate.wait(10)
        self.reads += 1
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True


def _items(n=5, size=1000, gap=24):
    """``n`` items of ``size`` random bytes ``gap`` bytes apart; their checksums."""
    data, parts, sums = bytearray(), [], {}
    for i in range(n):
        data += os.urandom(gap)
        off = len(data)
        item = os.urandom(size)
        data += item
        parts.append((off, size, f"item{i}"))
        sums[(off, size)] = crc32c_bytes(item)
    return bytes(data), parts, sums


class Placed:
    """Stands in for ``StreamingReader._consume``: records what was put in place;
    ``hold`` (an item name) makes putting that item wait for ``gate``; ``fail`` makes
    putting that item raise."""

    def __init__(self, hold: str | None = None, fail: str | None = None):
        self.items: list[tuple[str, bytes]] = []
        self.hold, self.fail = hold, fail
        self.gate, self.holding = threading.Event(), threading.Event()

    def __call__(self, req, planner, data, url):
        if req == self.fail:
            raise CorruptCheckpoint(f"{url}: {req} has shape (3,), expected (4,)")
        if req == self.hold:
            self.holding.set()
            self.gate.wait(10)
        self.items.append((req, bytes(data)))
        return True


def _joined(*threads: threading.Thread, timeout: float = 10) -> None:
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), \
        f"still running after {timeout}s: {[t.name for t in threads if t.is_alive()]}"


def opener(data, opened):
    """``open_from(fail_after)``: an ``open_from`` that records where each attempt opens
    and whose Body raises Transient after ``fail_after`` reads (None: never)."""
    def open_from(fail_after):
        def op(pos):
            opened.append(pos)
            return Body(data, pos, fail_after=fail_after)
        return op
    return open_from


def _stream(data, parts, sums, tally=None, placed=None):
    reader = R.StreamingReader(R.ShardSource("s3://b/ck/model_and_optim", lambda *a: None,
                                             checksums={"__0_0.distcp": sums}))
    reader._consume = placed if placed is not None else Placed()
    tally = tally or S._Tally(1 << 30)
    st = S._ItemStream(reader, None, tally, URL, "__0_0.distcp", parts[0][0], parts[-1][0] + parts[-1][1], parts)
    return st, tally, reader._consume


def test_a_stream_resumes_after_a_failure_at_the_first_item_not_taken():
    data, parts, sums = _items()
    st, tally, placed = _stream(data, parts, sums)
    opened = []
    open_from = opener(data, opened)

    # first attempt: two items (and the gaps before them: 4 reads), then a reset
    with pytest.raises(Transient):
        st(open_from(4), lambda n: None)
    assert st(open_from(None), lambda n: None) == 3 * 1000
    assert opened == [parts[0][0], parts[2][0]], "the retry starts at the third item, not at the range's start"
    assert [r for r, _ in placed.items] == [f"item{i}" for i in range(5)]
    assert all(d == data[off:off + n] for (_, d), (off, n, _) in zip(placed.items, parts, strict=True))
    assert (tally.items, tally.bytes, tally.direct) == (5, 5000, 5)
    tally.wait(5)


def test_a_superseded_attempt_that_wakes_up_puts_nothing_in_place():
    """The engine gave up on a stalled attempt and started another; when the first
    one's socket delivers after all, it stops: each item is put in place once."""
    data, parts, sums = _items()
    st, tally, placed = _stream(data, parts, sums)
    gate, reached = threading.Event(), threading.Event()
    errors = []

    def first():
        try:
            st(lambda pos: Body(data, pos, block_at=parts[1][0] + 10, gate=gate, reached=reached), lambda n: None)
        except S._Stopped:
            errors.append("stopped")

    t = threading.Thread(target=first, daemon=True)
    t.start()
    assert reached.wait(10), "the first attempt never reached item1"  # item0 in place, item1 blocked in the socket
    assert [r for r, _ in placed.items] == ["item0"]
    assert st(lambda pos: Body(data, pos), lambda n: None) == 4 * 1000  # the second attempt does the rest
    gate.set()
    _joined(t)
    assert errors == ["stopped"]
    assert [r for r, _ in placed.items] == [f"item{i}" for i in range(5)]
    assert tally.items == 5


def test_streams_share_the_byte_budget_and_a_waiting_one_says_it_is_alive():
    """Two streams, a budget of one item: while stream A puts an item in place
    (held), stream B waits before reading, reporting progress(0) to the watchdog."""
    data, parts, sums = _items(n=2, size=1000)
    tally = S._Tally(1500)
    placed = Placed(hold="item0")
    a, _, _ = _stream(data, parts[:1], sums, tally, placed)
    b, _, _ = _stream(data, parts[1:], sums, tally, placed)
    alive = []
    ta = threading.Thread(target=lambda: a(lambda pos: Body(data, pos), lambda n: None), daemon=True)
    ta.start()
    assert placed.holding.wait(5)
    tb = threading.Thread(target=lambda: b(lambda pos: Body(data, pos), alive.append), daemon=True)
    tb.start()
    deadline = time.monotonic() + 10  # the waiting stream says so once a second
    while 0 not in alive:
        assert time.monotonic() < deadline, "B never reported progress(0) while waiting for room"
        time.sleep(0.01)
    assert placed.items == [], "B waited for room (A holds the budget), saying it is alive"
    placed.gate.set()
    _joined(ta, tb)
    assert [r for r, _ in placed.items] == ["item0", "item1"]
    tally.wait(2)


def test_a_stream_from_a_store_that_fetches_it_whole_reserves_all_of_it_first():
    """GCS (``streams_ranges`` False) fetches the range at the first read: the
    stream holds all of it from then on, so it reserves all of it before opening."""
    data, parts, sums = _items(n=3, size=1000)
    placed = Placed(hold="item0")
    st, tally, _ = _stream(data, parts, sums, S._Tally(1500), placed)
    st.reader.streamed = False
    t = threading.Thread(target=lambda: st(lambda pos: Body(data, pos), lambda n: None))
    t.start()
    assert placed.holding.wait(5)
    assert tally._held == 3000, "all three items reserved (alone, it may exceed the budget)"
    placed.gate.set()
    _joined(t)
    assert tally._held == 0 and tally.items == 3


def test_a_truncated_object_or_a_corrupt_item_is_a_corrupt_checkpoint_naming_the_object():
    data, parts, sums = _items()
    st, _, _ = _stream(data, parts, sums)
    with pytest.raises(CorruptCheckpoint, match="truncated") as ei:
        st(lambda pos: Body(data[: parts[3][0] + 10], pos), lambda n: None)
    assert URL in str(ei.value)
    bad = bytearray(data)
    bad[parts[1][0] + 5] ^= 1
    st, _, placed = _stream(bytes(bad), parts, sums)
    with pytest.raises(CorruptCheckpoint, match="CRC32C mismatch") as ei:
        st(lambda pos: Body(bytes(bad), pos), lambda n: None)
    assert URL in str(ei.value)
    assert [r for r, _ in placed.items] == ["item0"], "the corrupt item never reached its target"


def test_an_error_putting_an_item_in_place_fails_the_stream_and_frees_its_budget():
    data, parts, sums = _items()
    st, tally, placed = _stream(data, parts, sums, S._Tally(1500), Placed(fail="item2"))
    with pytest.raises(CorruptCheckpoint, match="item2"):
        st(lambda pos: Body(data, pos), lambda n: None)
    assert tally._held == 0 and tally._busy == 0
    tally.close()  # returns at once: nothing is being put in place


def test_closing_stops_streams_before_their_next_item_and_waits_for_the_one_being_put_in_place():
    """After a load fails, no stream may write a target once ``read_data`` has returned."""
    data, parts, sums = _items()
    st, tally, placed = _stream(data, parts, sums, placed=Placed(hold="item1"))
    stopped = []

    def run():
        try:
            st(lambda pos: Body(data, pos), lambda n: None)
        except S._Stopped:
            stopped.append(True)

    t = threading.Thread(target=run)
    t.start()
    assert placed.holding.wait(5)
    closed = threading.Event()
    tc = threading.Thread(target=lambda: (tally.close(), closed.set()))
    tc.start()
    assert not closed.wait(0.3), "close waits while item1 is being put in place"
    placed.gate.set()
    assert closed.wait(5)
    _joined(t, tc)
    assert stopped == [True] and [r for r, _ in placed.items] == ["item0", "item1"]


def test_a_streaming_load_reads_each_run_of_items_through_one_request(s3_bucket, tmp_path, monkeypatch):
    """The load opens one stream per run of items (about four per rank), not one
    request per few MiB, and is bit-exact."""
    step = s3_bucket + "/run/step1"
    sd = {"model": {f"w{i}": torch.randn(256, 1024) for i in range(24)}}  # 24 MiB in 24 items
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, sd, {"t": 1})
    opened = []
    real = S3Store.open_range
    monkeypatch.setattr(S3Store, "open_range", lambda self, url, start, end: opened.append((url, start, end)) or
                        real(self, url, start, end))
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
    ck = Checkpointer(work_dir=str(tmp_path / "w2"))
    ck.load(step, target)
    ck.close()
    assert all(torch.equal(target["model"][k], v) for k, v in sd["model"].items())
    distcp = [o for o in opened if o[0].endswith(".distcp")]
    # 24 MiB planned: streams of 16 MiB (the floor), so 2 streams
    assert len(distcp) == 2, opened
    assert ck.last_load_info.direct_items == 24
    assert open_store(step).exists(step + "/.metadata.json")
