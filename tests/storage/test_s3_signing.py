"""S3 request bodies are sent unsigned by default (no SHA-256 of every byte on either
side); ``sign_payload=True`` signs them. Both work against SeaweedFS, which checks
signed payloads."""

from __future__ import annotations

import os

import pytest

from cloudckpt.storage import StorageOptions, clear_cache, open_store

MiB = 1024 * 1024


@pytest.mark.parametrize("sign", [False, True])
def test_payload_signing_follows_the_option(s3_bucket, tmp_path, sign):
    clear_cache()
    store = open_store(s3_bucket, StorageOptions(sign_payload=sign))
    seen: list[str] = []
    store.client.meta.events.register(
        "before-send.s3.*", lambda request, **kw: seen.append(request.headers.get("x-amz-content-sha256", b"")))
    src = tmp_path / "blob"
    data = os.urandom(70 * MiB)  # multipart above the 64 MiB threshold
    src.write_bytes(data)
    url = s3_bucket + f"/signed-{sign}/blob"
    assert store.upload_file(str(src), url) == len(data)
    store.put_bytes(url + ".small", b"x")
    assert store.get_bytes(url, start=5, end=105) == data[5:105]
    bodies = [h.decode() if isinstance(h, bytes) else h for h in seen]
    uploads = [h for h in bodies if h and h != "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"]
    assert uploads, "no request with a body was seen"
    if sign:
        assert all(len(h) == 64 and h != "UNSIGNED-PAYLOAD" for h in uploads), bodies
    else:
        assert set(uploads) == {"UNSIGNED-PAYLOAD"}, bodies
    clear_cache()
