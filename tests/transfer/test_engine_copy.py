"""The engine's server-side copies (``submit_copy``) and the copy-else-upload that rank 0
uses for a repeated save's ``.metadata`` (``submit_copy_or_upload``), on real local
folders (the stores' own copies are tested by the conformance suite)."""

from __future__ import annotations

import logging

import pytest

from cloudckpt.errors import AccessDenied, CopyUnsupported, PreconditionFailed
from cloudckpt.storage.registry import open_store
from cloudckpt.transfer import TransferConfig, TransferEngine
from cloudckpt.transfer.checksum import crc32c_bytes

MiB = 1024 * 1024


@pytest.fixture
def placed(tmp_path, make_files):
    """A local file and the same bytes as an object of a local 'bucket': (path, bytes, url, crc)."""
    [(path, data)] = make_files(1, MiB)
    url = (tmp_path / "bucket" / "step1" / "meta").as_uri()
    open_store(url).put_bytes(url, data)
    return path, data, url, crc32c_bytes(data)


def test_a_copy_is_checked_counted_apart_and_not_held_to_the_bandwidth_cap(placed, tmp_path):
    path, data, src, crc = placed
    waits: list[float] = []
    dst = (tmp_path / "bucket" / "step2" / "meta").as_uri()
    # 1 kB/s: an upload of the same MiB would sleep ~1,000 s on the cap (recorded, not slept)
    with TransferEngine(TransferConfig(bandwidth_limit=1000), sleep=waits.append) as engine:
        res = engine.submit_copy(src, dst, size=len(data), crc32c=crc, local_path=path).result(timeout=60)
        stats = engine.stats()
    assert (res.size, res.crc32c, res.local_path, res.url) == (len(data), crc, path, dst)
    assert open_store(dst).get_bytes(dst) == data
    assert sum(waits) == 0
    assert (stats.bytes_copied, stats.bytes_uploaded, stats.bytes_downloaded, stats.transfers) == (len(data), 0, 0, 1)


def test_a_copy_whose_source_changed_fails_and_copy_or_upload_uploads_the_file_instead(placed, tmp_path, caplog):
    path, data, src, crc = placed
    open_store(src).put_bytes(src, bytes(reversed(data)))  # same size, other bytes: only the CRC32C tells
    dst = (tmp_path / "bucket" / "step2" / "meta").as_uri()
    with TransferEngine() as engine:
        with pytest.raises(PreconditionFailed, match="the source changed"):
            engine.submit_copy(src, dst, size=len(data), crc32c=crc).result(timeout=60)
        with caplog.at_level(logging.INFO, logger="cloudckpt.transfer.engine"):
            res = engine.submit_copy_or_upload(src, path, dst, crc32c=crc).result(timeout=60)
        stats = engine.stats()
    assert res.size == len(data) and open_store(dst).get_bytes(dst) == data
    assert stats.bytes_uploaded == len(data) and stats.bytes_copied == 0
    assert [r for r in caplog.records if "not copied from" in r.getMessage() and src in r.getMessage()]


def test_a_source_in_another_store_or_a_store_without_copies_is_uploaded(placed, faulty, make_files):
    path, data, src, crc = placed
    with TransferEngine() as engine:
        with pytest.raises(CopyUnsupported, match="not in the same store"):
            engine.submit_copy(src, "faulty://bucket/m", size=len(data)).result(timeout=60)
        assert engine.submit_copy_or_upload(src, path, "faulty://bucket/m").result(timeout=60).size == len(data)
        faulty.put_bytes("faulty://bucket/src", data)  # an in-memory store that has no copy
        with pytest.raises(CopyUnsupported):
            engine.submit_copy("faulty://bucket/src", "faulty://bucket/n", size=len(data)).result(timeout=60)
        engine.submit_copy_or_upload("faulty://bucket/src", path, "faulty://bucket/n").result(timeout=60)
        assert engine.stats().bytes_uploaded == 2 * len(data)
    assert faulty.get_bytes("faulty://bucket/m") == faulty.get_bytes("faulty://bucket/n") == data


def test_a_denied_copy_is_uploaded_with_a_warning_and_a_timeout_is_not_papered_over(placed, tmp_path, monkeypatch,
                                                                                     caplog):
    # a copy reads the source: a grant that lets the trainer write but not read that object denies it, and
    # the upload then decides; a store that times out is failing: the copy's error is the transfer's
    from cloudckpt.errors import Timeout

    path, data, src, crc = placed
    store = open_store(src)
    raised = {"error": AccessDenied(f"copy {src}: denied (injected)", url=src)}

    def failing(*a, **kw):
        raise raised["error"]

    monkeypatch.setattr(store, "copy", failing)
    dst = (tmp_path / "bucket" / "step2" / "meta").as_uri()
    with TransferEngine() as engine:
        with caplog.at_level(logging.WARNING, logger="cloudckpt.transfer.engine"):
            assert engine.submit_copy_or_upload(src, path, dst, crc32c=crc).result(timeout=60).size == len(data)
        assert engine.stats().bytes_uploaded == len(data)
        assert [r for r in caplog.records if r.levelno == logging.WARNING and "read access" in r.getMessage()]
        raised["error"] = Timeout(f"copy {src}: no answer (injected)", url=src)
        dst2 = (tmp_path / "bucket" / "step3" / "meta").as_uri()
        with pytest.raises(Timeout, match="injected"):
            engine.submit_copy_or_upload(src, path, dst2, crc32c=crc).result(timeout=120)
        assert engine.stats().bytes_uploaded == len(data)
    assert not open_store(dst2).exists(dst2)


def test_a_progress_bar_counts_an_upload_not_a_copy(placed, tmp_path):
    from cloudckpt.transfer.progress import ProgressSubscriber

    class Count(ProgressSubscriber):
        queued = moved = 0

        def on_queued(self, url, size):
            self.queued += size or 0

        def on_progress(self, url, nbytes):
            self.moved += nbytes

    path, data, src, crc = placed
    bar = Count()
    with TransferEngine(progress=bar) as engine:
        engine.submit_copy(src, (tmp_path / "bucket" / "c").as_uri(), size=len(data), crc32c=crc).result(timeout=60)
        assert (bar.queued, bar.moved) == (0, 0)
        engine.submit_upload(path, (tmp_path / "bucket" / "u").as_uri()).result(timeout=60)
    assert (bar.queued, bar.moved) == (len(data), len(data))
