"""A finished transfer's result is freed as soon as the caller drops its future (no reference cycle)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref

import pytest
from memprobe import PeakRss

from cloudckpt.transfer import TransferEngine


@pytest.fixture
def blob(tmp_path) -> str:
    """A local file of 1 MiB of random bytes."""
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    return str(path)


@contextlib.contextmanager
def engine_without_gc():
    """An engine, with the garbage collector off: only reference counts free anything."""
    with TransferEngine() as eng:
        gc.disable()
        try:
            yield eng
        finally:
            gc.enable()


def test_finished_read_is_freed_without_the_garbage_collector(blob):
    with engine_without_gc() as eng:
        fut = eng.submit_read(blob, 0, 1 << 20)
        assert len(fut.result()) == 1 << 20
        ref = weakref.ref(fut)
        del fut
        assert ref() is None, "the future (and its bytes) outlived the caller's reference"


def test_read_all_keeps_no_reference_to_its_results(blob):
    with engine_without_gc() as eng:
        out = eng.read_all([(blob, 0, 1 << 19), (blob, 1 << 19, 1 << 20)])
        assert sum(map(len, out)) == 1 << 20
        # as many references as bytes held by a plain list only: one more would be a
        # finished future kept alive by a reference cycle
        control = [os.urandom(8), os.urandom(8)]
        assert [sys.getrefcount(b) for b in out] == [sys.getrefcount(b) for b in control]


@pytest.mark.slow  # a 256 MiB shard up, then down twice
def test_s3_download_to_a_file_holds_a_few_mib_of_pieces(s3_bucket, tmp_path, shard_file):
    """s3transfer hands each received piece to a writer thread through a bounded queue
    (cloudckpt: 16 x 256 KiB); what two downloads in a row hold must stay a few tens of MiB."""
    src, size, crc = shard_file
    url = s3_bucket + "/big/shard.distcp"
    with TransferEngine() as eng:
        eng.submit_upload(src, url, crc32c=crc).result()
        eng.submit_read(url, 0, 1024).result()  # the client and its connection pool exist
        with PeakRss() as mem:
            for name in ("first", "second"):  # the second reuses what the first left behind
                res = eng.submit_download(url, str(tmp_path / name)).result()
    assert res.crc32c == crc and os.path.getsize(tmp_path / "second") == size
    grew = mem.grew
    # measured here: 33-34 MiB (the queue, the transfer threads and their malloc arenas);
    # 76-147 MiB with the earlier 64 x 1 MiB queue
    assert grew < 56 * 1024 * 1024, f"RSS grew by {grew / 2**20:.0f} MiB downloading a {size >> 20} MiB object"
