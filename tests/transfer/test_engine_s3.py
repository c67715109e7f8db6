"""The transfer engine against real servers on 127.0.0.1: moto (faults injected
with a botocore ``before-send`` hook on the store's client), SeaweedFS
(credentials enforced) and, for the round trip, fake-gcs-server and a local folder."""

from __future__ import annotations

import os
import threading
import time

import botocore.exceptions as bex
import google_crc32c
import pytest
from botocore.awsrequest import AWSResponse

from cloudckpt.errors import AccessDenied
from cloudckpt.storage import StorageOptions
from cloudckpt.storage.registry import clear_cache, open_store
from cloudckpt.transfer import TransferConfig, TransferEngine

MiB = 1024 * 1024
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


def g_crc(data: bytes) -> str:
    return google_crc32c.Checksum(data).hexdigest().decode()


class _Raw:
    def __init__(self, body: bytes):
        self._body = body

    def stream(self, **kw):
        yield self._body


class Faults:
    """A ``before-send`` hook: the first ``n`` requests of ``operation`` get a 503
    SlowDown, or a connection reset (``reset=True``), instead of reaching the server."""

    def __init__(self, store, operation: str, n: int, *, reset: bool = False):
        self.left = n
        self.seen = 0
        self.reset = reset
        self._lock = threading.Lock()
        store.client.meta.events.register(f"before-send.s3.{operation}", self)

    def __call__(self, request, **kw):
        with self._lock:
            self.seen += 1
            if self.left <= 0:
                return None
            self.left -= 1
        if self.reset:
            raise bex.ConnectionClosedError(endpoint_url=request.url)
        return AWSResponse(request.url, 503, {}, _Raw(SLOW_DOWN))


def _file(tmp_path, size: int, name: str = "data.bin") -> tuple[str, bytes]:
    data = os.urandom(size)
    p = tmp_path / name
    p.write_bytes(data)
    return str(p), data


def _get(url: str) -> bytes:
    return open_store(url).get_bytes(url)


def test_sdk_retries_on_503_are_counted_as_throttles_and_halve_concurrency(moto_bucket, tmp_path):
    path, data = _file(tmp_path, 256 * 1024)
    url = f"{moto_bucket}/sdk-503.bin"
    faults = Faults(open_store(url), "PutObject", 1)
    with TransferEngine(TransferConfig(max_concurrency=8)) as engine:
        result = engine.submit_upload(path, url).result()
        s = engine.stats()
    assert faults.seen == 2
    assert result.attempts == 1 and result.crc32c == g_crc(data)
    assert (s.sdk_retries, s.throttled, s.retries, s.min_concurrency_seen) == (1, 1, 0, 4)
    assert _get(url) == data


def test_engine_retries_503_after_the_sdk_gives_up(moto_bucket, tmp_path):
    path, data = _file(tmp_path, 256 * 1024)
    url = f"{moto_bucket}/engine-503.bin"
    opts = StorageOptions(max_attempts=1)  # no SDK retries: every 503 reaches the engine
    Faults(open_store(url, opts), "PutObject", 2)
    sleeps = []
    with TransferEngine(TransferConfig(max_attempts=4), storage_options=opts, sleep=sleeps.append) as engine:
        result = engine.submit_upload(path, url).result()
        s = engine.stats()
    assert result.attempts == 3 and len(sleeps) == 2
    assert (s.retries, s.throttled, s.sdk_retries) == (2, 2, 0)
    assert _get(url) == data


def test_connection_reset_during_multipart_is_retried_and_crc_matches(moto_bucket, tmp_path):
    path, data = _file(tmp_path, 12 * MiB)
    url = f"{moto_bucket}/reset-multipart.bin"
    opts = StorageOptions(max_attempts=1, multipart_threshold=5 * MiB, part_size=5 * MiB)
    faults = Faults(open_store(url, opts), "UploadPart", 1, reset=True)
    with TransferEngine(storage_options=opts, sleep=lambda s: None) as engine:
        result = engine.submit_upload(path, url).result()
        s = engine.stats()
    assert faults.seen > 3, "the restart uploaded every part again"
    assert result.attempts == 2 and s.retries == 1
    assert result.crc32c == g_crc(data) and result.size == len(data)
    assert _get(url) == data


def test_sdk_retry_of_a_connection_reset_is_counted(moto_bucket, tmp_path):
    path, data = _file(tmp_path, 64 * 1024)
    url = f"{moto_bucket}/sdk-reset.bin"
    Faults(open_store(url), "PutObject", 1, reset=True)
    with TransferEngine() as engine:
        result = engine.submit_upload(path, url).result()
        s = engine.stats()
    assert result.attempts == 1 and (s.sdk_retries, s.throttled) == (1, 0)
    assert _get(url) == data


def test_wrong_secret_is_access_denied_at_once_without_retries(s3_bucket, tmp_path, monkeypatch):
    path, _ = _file(tmp_path, 1024)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    clear_cache()
    with TransferEngine(TransferConfig(max_attempts=4, backoff_base=5.0)) as engine:
        t0 = time.monotonic()
        with pytest.raises(AccessDenied, match="access denied"):
            engine.submit_upload(path, f"{s3_bucket}/denied.bin").result()
        elapsed = time.monotonic() - t0
        s = engine.stats()
    # the mechanism; the time is a sanity bound with room for a loaded machine
    assert (s.retries, s.sdk_retries) == (0, 0)
    assert elapsed < 10.0


def test_round_trip_on_every_backend_with_matching_crc32c(any_root, tmp_path):
    """local folder, SeaweedFS (S3) and fake-gcs-server: upload, download, ranges."""
    files = [_file(tmp_path, n, f"f{n}.bin") for n in (0, 1, 3 * MiB)]
    pairs = [(p, f"{any_root}/rt/{os.path.basename(p)}") for p, _ in files]
    with TransferEngine() as engine:
        up = engine.upload_all(pairs)
        down = engine.download_all([(u, str(tmp_path / "back" / os.path.basename(u))) for _, u in pairs])
        ranges = engine.read_all([(pairs[2][1], 10, 1000), (pairs[1][1], None, None), (pairs[2][1], 3 * MiB - 5, None)])
        s = engine.stats()
    for (_, data), u, d in zip(files, up, down, strict=True):
        assert u.crc32c == d.crc32c == g_crc(data) and u.size == d.size == len(data)
        assert open(d.local_path, "rb").read() == data
    assert ranges == [files[2][1][10:1000], files[1][1], files[2][1][-5:]]
    assert s.bytes_uploaded == s.bytes_downloaded - 990 - 1 - 5 == 3 * MiB + 1
