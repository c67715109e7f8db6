"""Pre-download: each run of needed items of a file is one streamed request written to
disk as it arrives (a rank's own shard file is one run; a few small items far apart
are not the whole file between them); items are read back as soon as their bytes
have landed; a retried download resumes where the disk copy ends; the disk holds at
most three downloads and nothing is left behind, whether the load succeeds or fails."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery
from cloudckpt.dcp import predownload as P
from cloudckpt.dcp import reader as R
from cloudckpt.errors import CorruptCheckpoint, Transient
from cloudckpt.storage import open_store
from cloudckpt.storage.s3 import S3Store

from .test_reader_streams import URL, Body, _items, opener


def _download(tmp_path, data, start, end):
    shared = threading.Condition()
    return P.FileDownload(shared, "__0_0.distcp", URL, str(tmp_path / "dl" / "__0_0.distcp"),
                           [(start, end - start, "all")])


def _on_disk(dl) -> bytes:
    with open(dl.path, "rb") as f:
        return f.read()


def test_a_download_resumes_where_the_disk_copy_ends(tmp_path, monkeypatch):
    data, parts, _ = _items(n=6, size=3000)
    monkeypatch.setattr(P.FileDownload, "PIECE", 1000)
    start, end = parts[1][0], parts[-1][0] + 3000  # the span of the needed items, not the whole object
    dl = _download(tmp_path, data, start, end)
    opened, reported = [], []
    open_from = opener(data, opened)
    with pytest.raises(Transient):
        dl(open_from(5), reported.append)
    assert dl.landed == start + 5000
    assert dl(open_from(None), reported.append) == end - start - 5000
    assert opened == [start, start + 5000], "the retry asks only for what is not on disk yet"
    assert dl.landed == end and sum(reported) == end - start
    assert _on_disk(dl) == data[start:end], "byte start of the object is byte 0 of the file"
    dl.remove()
    assert not os.path.exists(dl.path)
    dl.remove()  # again: nothing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="holes are punched with Linux's fallocate only")
@pytest.mark.parametrize("start", [0, 5000], ids=["from-0", "from-5000"])
def test_pages_below_what_was_read_are_freed_and_the_rest_kept(tmp_path, start):
    data = os.urandom(start + 64 * 4096)
    dl = _download(tmp_path, data, start, len(data))
    assert dl(lambda pos: Body(data, pos), lambda n: None) == len(data) - start
    os.fsync(dl.fd)  # blocks are allocated at writeback: count them after it
    before = os.fstat(dl.fd).st_blocks
    assert before * 512 == 64 * 4096, "the file holds the span only, no hole in front"
    dl.discard_below(start + 20 * 4096 + 100)  # the next item starts inside the file's page 20: it is kept
    freed = (before - os.fstat(dl.fd).st_blocks) * 512
    assert freed == 20 * 4096, (before, freed)
    on_disk = _on_disk(dl)
    assert on_disk[:20 * 4096] == bytes(20 * 4096) and on_disk[20 * 4096:] == data[start + 20 * 4096:]
    dl.discard_below(start + 10 * 4096)  # below what was freed: nothing
    assert (before - os.fstat(dl.fd).st_blocks) * 512 == freed


def test_a_superseded_download_writes_nothing_more(tmp_path, monkeypatch):
    """The engine gave up on a stalled attempt and started another; when the first one's
    socket delivers after all, it stops without writing."""
    data, parts, _ = _items(n=4, size=3000)
    monkeypatch.setattr(P.FileDownload, "PIECE", 1000)
    start, end = parts[0][0], len(data)
    dl = _download(tmp_path, data, start, end)
    gate, reached, results = threading.Event(), threading.Event(), []
    stale = bytes(len(data))  # what the stalled attempt would write, if it wrote

    def first():
        results.append(dl(lambda pos: Body(stale, pos, block_at=start + 2500, gate=gate, reached=reached),
                          lambda n: None))

    t = threading.Thread(target=first, daemon=True)
    t.start()
    assert reached.wait(10), "the first attempt never reached its third piece"
    assert dl.landed == start + 2000, "two pieces landed; the third one's read is blocked in the socket"
    assert dl(lambda pos: Body(data, pos), lambda n: None) == end - start - 2000
    gate.set()
    t.join(10)
    assert not t.is_alive()
    assert results == [2000], "the woken attempt returned without writing its piece"
    assert dl.landed == end
    assert _on_disk(dl)[2000:] == data[start + 2000:end]


def test_a_download_of_a_truncated_object_names_it(tmp_path):
    data, parts, _ = _items(n=3)
    dl = _download(tmp_path, data, parts[0][0], len(data) + 100)
    with pytest.raises(CorruptCheckpoint, match=r"__0_0\.distcp: .*truncated"):
        dl(lambda pos: Body(data, pos), lambda n: None)


def _save_six_files(s3_bucket, tmp_path):
    step = s3_bucket + "/run/step1"
    g = torch.Generator().manual_seed(5)
    state = {"model": {f"w{i}": torch.randn(64, 256, generator=g) for i in range(12)}}  # 64 KiB each
    with Checkpointer(work_dir=str(tmp_path / "w"), thread_count=6) as ck:  # six shard files
        ck.save(step, state, {"t": 1})
    marker = discovery.read_marker(step)  # every object of the step, the ranks' manifest parts read
    assert len([o for o in marker.objects if o.path.endswith(".distcp")]) == 6
    return step, state


def test_pre_download_streams_each_file_once_and_keeps_at_most_three_on_disk(s3_bucket, tmp_path, monkeypatch):
    """One request per shard file, two downloading at a time; every item is read
    while at most three files are on disk; nothing is left behind; bit-exact."""
    step, state = _save_six_files(s3_bucket, tmp_path)
    opened, on_disk = [], []
    real_open, real_consume = S3Store.open_range, R.StreamingReader._consume
    monkeypatch.setattr(S3Store, "open_range", lambda self, url, start, end: opened.append((url, start, end)) or
                        real_open(self, url, start, end))

    def consume(self, req, planner, data, url):
        on_disk.append(len([p for p in (tmp_path / "w2").rglob("obj*-at*") if p.is_file()]))
        return real_consume(self, req, planner, data, url)

    monkeypatch.setattr(R.StreamingReader, "_consume", consume)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    with Checkpointer(work_dir=str(tmp_path / "w2"), pre_download=True) as ck:
        ck.load(step, target, load_trainer_state=False)
    distcp = [o for o in opened if o[0].endswith(".distcp")]
    assert len(distcp) == len({u for u, _, _ in distcp}) == 6, opened
    assert len(on_disk) == 12 and max(on_disk) <= 3 and min(on_disk) >= 1, on_disk
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    assert not [p for p in (tmp_path / "w2").rglob("*") if p.is_file()]


def test_pre_download_fetches_only_the_runs_of_needed_items_not_the_file_between(s3_bucket, tmp_path, monkeypatch):
    """A rank needing two small items from a file with 8 MiB between them (as one rank
    needs another rank's replicated scalars in a resharded load) downloads the two
    items' runs, not the file between them."""
    step = s3_bucket + "/run/step1"
    state = {"model": {"a": torch.arange(16.0), "big": torch.randn(2 * 1024 * 1024), "c": torch.arange(8.0)}}
    with Checkpointer(work_dir=str(tmp_path / "w"), thread_count=1) as ck:  # one shard file
        ck.save(step, state, {"t": 1})
    shards = [o for o in discovery.read_marker(step).objects if o.path.endswith(".distcp")]
    assert len(shards) == 1 and shards[0].size > 8 * 1024 * 1024
    opened = []
    real_open = S3Store.open_range
    monkeypatch.setattr(S3Store, "open_range", lambda self, url, start, end: opened.append((url, start, end)) or
                        real_open(self, url, start, end))
    target = {"model": {"a": torch.zeros(16), "c": torch.zeros(8)}}  # a load of part of the state
    with Checkpointer(work_dir=str(tmp_path / "w2"), pre_download=True) as ck:
        ck.load(step, target, load_trainer_state=False, allow_partial=True)
    assert torch.equal(target["model"]["a"], state["model"]["a"]) \
        and torch.equal(target["model"]["c"], state["model"]["c"])
    ranges = [(s, e) for u, s, e in opened if u.endswith(".distcp")]
    assert len(ranges) == 2 and sum(e - s for s, e in ranges) < 64 * 1024, ranges
    assert not [p for p in (tmp_path / "w2").rglob("*") if p.is_file()]


def test_pre_download_reads_an_item_as_soon_as_its_bytes_have_landed(s3_bucket, tmp_path, monkeypatch):
    """The first file's download is held after its first item until that item has been
    put in place: reading does not wait for the whole file."""
    step, state = _save_six_files(s3_bucket, tmp_path)
    monkeypatch.setattr(P.FileDownload, "PIECE", 4096)
    first_placed = threading.Event()
    real_call, real_consume = P.FileDownload.__call__, R.StreamingReader._consume
    first_url = []

    def call(self, open_from, progress):
        if first_url and self.url != first_url[0]:
            return real_call(self, open_from, progress)
        first_url.append(self.url)

        def held_open(pos):
            body = open_from(pos)
            read = body.read
            got = [pos]

            def slow_read(n):
                if got[0] >= self.start + 80 * 1024 and not first_placed.is_set():  # past the first item
                    assert first_placed.wait(30), "the first item was not read while its file was downloading"
                out = read(n)
                got[0] += len(out)
                return out

            body.read = slow_read
            return body

        return real_call(self, held_open, progress)

    def consume(self, req, planner, data, url):
        out = real_consume(self, req, planner, data, url)
        if url == first_url[0]:
            first_placed.set()
        return out

    monkeypatch.setattr(P.FileDownload, "__call__", call)
    monkeypatch.setattr(R.StreamingReader, "_consume", consume)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    with Checkpointer(work_dir=str(tmp_path / "w2"), pre_download=True) as ck:
        ck.load(step, target, load_trainer_state=False)
    assert first_placed.is_set()
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())


def test_a_failed_pre_download_load_stops_its_downloads_and_leaves_no_file(s3_bucket, tmp_path, monkeypatch):
    """A corrupt item in the first file fails the load with the object's URL; the other
    downloads stop and nothing is left in the work dir."""
    step, state = _save_six_files(s3_bucket, tmp_path)
    store = open_store(step)
    shard = sorted(o.url for o in store.walk(step + "/model_and_optim/") if o.url.endswith(".distcp"))[0]
    data = bytearray(store.get_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(shard, bytes(data))
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    with Checkpointer(work_dir=str(tmp_path / "w2"), pre_download=True) as ck:
        with pytest.raises(CorruptCheckpoint, match=os.path.basename(shard)):
            ck.load(step, target, load_trainer_state=False)
    assert not [p for p in (tmp_path / "w2").rglob("*") if p.is_file()]
