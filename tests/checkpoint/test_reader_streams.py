"""The streaming reader's streams: one ranged read per run of items, items handed
over one at a time under a byte budget, resumed after a failure from the first item
not handed over, never delivered twice (also when a stalled attempt wakes up)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.dcp import reader as R
from cloudckpt.errors import CorruptCheckpoint, Transient
from cloudckpt.storage import open_store
from cloudckpt.storage.s3 import S3Store
from cloudckpt.transfer import crc32c_bytes

MiB = 1024 * 1024
URL = "s3://b/ck/model_and_optim/__0_0.distcp"


class Body:
    """A RangeReader over ``data[pos:]``; ``fail_after`` reads raise Transient;
    ``block_at`` makes the read that would cross that offset wait for ``gate``."""

    def __init__(self, data: bytes, pos: int, *, fail_after: int | None = None, block_at: int | None = None,
                 gate: threading.Event | None = None):
        self.data, self.pos = data, pos
        self.fail_after, self.block_at, self.gate = fail_after, block_at, gate
        self.reads = 0
        self.closed = False

    def read(self, n):
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise Transient(f"get {URL}: connection problem (reset)", url=URL)
        if self.block_at is not None and self.pos <= self.block_at < self.pos + n:
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


def _stream(data, parts, sums, budget=1 << 30):
    reader = R.StreamingReader("s3://b/ck/model_and_optim", lambda *a: None, get_bytes=lambda u: b"",
                               checksums={"__0_0.distcp": sums})
    inbox = R._Inbox(budget)
    st = R._ItemStream(reader, inbox, URL, "__0_0.distcp", parts[0][0], parts[-1][0] + parts[-1][1], parts)
    return st, inbox


def _drain(inbox, n):
    got = []
    for _ in range(n):
        url, req, data, length = inbox.get()
        got.append((req, bytes(data)))
        inbox.release(length)
    return got


def test_a_stream_resumes_after_a_failure_at_the_first_item_not_handed_over():
    data, parts, sums = _items()
    st, inbox = _stream(data, parts, sums)
    opened = []

    def open_from(fail_after):
        def op(pos):
            opened.append(pos)
            return Body(data, pos, fail_after=fail_after)
        return op

    # first attempt: two items (and the gaps before them: 4 reads), then a reset
    with pytest.raises(Transient):
        st(open_from(4), lambda n: None)
    assert st(open_from(None), lambda n: None) == 3 * 1000
    assert opened == [parts[0][0], parts[2][0]], "the retry starts at the third item, not at the range's start"
    got = _drain(inbox, 5)
    assert [r for r, _ in got] == [f"item{i}" for i in range(5)]
    assert all(d == data[off:off + n] for (_, d), (off, n, _) in zip(got, parts))


def test_a_superseded_attempt_that_wakes_up_hands_over_nothing():
    """The engine gave up on a stalled attempt and started another; when the first
    one's socket delivers after all, its item is dropped: each item arrives once."""
    data, parts, sums = _items()
    st, inbox = _stream(data, parts, sums)
    gate = threading.Event()
    errors = []

    def first():
        try:
            st(lambda pos: Body(data, pos, block_at=parts[1][0] + 10, gate=gate), lambda n: None)
        except R._Stopped:
            errors.append("stopped")

    t = threading.Thread(target=first)
    t.start()
    deadline = time.monotonic() + 5
    while st._next < 1 and time.monotonic() < deadline:  # item0 handed over, item1 blocked
        time.sleep(0.01)
    assert st(lambda pos: Body(data, pos), lambda n: None) == 4 * 1000  # the second attempt does the rest
    gate.set()
    t.join(5)
    assert errors == ["stopped"]
    got = _drain(inbox, 5)
    assert [r for r, _ in got] == [f"item{i}" for i in range(5)]
    with pytest.raises(TimeoutError):  # nothing more arrives
        _get_within(inbox, 0.2)


def _get_within(inbox, seconds):
    out = []

    def get():
        try:
            out.append(inbox.get())
        except RuntimeError:  # the fail() below: nothing arrived
            pass

    t = threading.Thread(target=get, daemon=True)
    t.start()
    t.join(seconds)
    if not out:
        inbox.fail(RuntimeError("stop waiting"))
        t.join(1)
        raise TimeoutError
    return out[0]


def test_a_stream_waits_for_room_in_the_budget_and_says_it_is_alive_meanwhile():
    data, parts, sums = _items(n=3, size=1000)
    st, inbox = _stream(data, parts, sums, budget=1500)  # one item at a time
    alive = []
    t = threading.Thread(target=lambda: st(lambda pos: Body(data, pos), alive.append))
    t.start()
    first = _get_within(inbox, 5)  # item0 is handed over; item1 does not fit until it is released
    time.sleep(1.3)
    assert st._next == 1 and 0 in alive, "waiting for room, it reported progress(0) (the stall watchdog)"
    inbox.release(first[3])
    second = _get_within(inbox, 5)
    assert second[1] == "item1"
    inbox.release(second[3])
    assert _get_within(inbox, 5)[1] == "item2"
    t.join(5)


def test_a_truncated_object_or_a_corrupt_item_is_a_corrupt_checkpoint_naming_the_object():
    data, parts, sums = _items()
    st, _ = _stream(data[: parts[3][0] + 10], parts, sums)
    with pytest.raises(CorruptCheckpoint, match="truncated") as ei:
        st(lambda pos: Body(data[: parts[3][0] + 10], pos), lambda n: None)
    assert URL in str(ei.value)
    bad = bytearray(data)
    bad[parts[1][0] + 5] ^= 1
    st, _ = _stream(bytes(bad), parts, sums)
    with pytest.raises(CorruptCheckpoint, match="CRC32C mismatch") as ei:
        st(lambda pos: Body(bytes(bad), pos), lambda n: None)
    assert URL in str(ei.value)


def test_a_closed_inbox_stops_a_stream_before_its_next_item():
    data, parts, sums = _items()
    st, inbox = _stream(data, parts, sums)
    inbox.close()
    with pytest.raises(R._Stopped):
        st(lambda pos: Body(data, pos), lambda n: None)


def test_a_streaming_load_reads_each_run_of_items_through_one_request(s3_bucket, tmp_path, monkeypatch):
    """The load opens one stream per run of items (about eight per rank), not one
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
    assert ck.last_load_info["direct_items"] == 24
    assert open_store(step).exists(step + "/.metadata.json")
