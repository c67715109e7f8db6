"""What ``ObjectStore.copy`` promises beyond the conformance suite, per backend: a source
replaced between the size check and the copy is refused by the store itself (S3's
``x-amz-copy-source-if-match`` on CopyObject and on every UploadPartCopy, GCS's
``ifSourceGenerationMatch``, the local file's size and mtime), a read-only identity
cannot copy, local copies never go through a link, and the stores that cannot copy say
so with a typed error. Real servers on 127.0.0.1 (SeaweedFS, moto, fake-gcs-server)."""

from __future__ import annotations

import os
import stat

import pytest
from google.cloud.storage import Blob

from cloudckpt.errors import (
    AccessDenied,
    CopyUnsupported,
    PreconditionFailed,
    ReadOnlyLocation,
    Transient,
    UnsafeCheckpoint,
)
from cloudckpt.storage import ObjectStore, StorageOptions, clear_cache, open_store
from cloudckpt.storage.base import ObjectInfo
from cloudckpt.storage.http import HTTPStore
from cloudckpt.storage.local import LocalStore
from cloudckpt.storage.url import join
from cloudckpt.testing.servers import free_port
from cloudckpt.transfer import crc32c_bytes
from cloudckpt.units import MiB


# ---------------------------------------------------------------- stores that cannot copy
def test_the_default_copy_raises_copy_unsupported_naming_the_source(tmp_path):
    src = str(tmp_path / "a.bin")
    with pytest.raises(CopyUnsupported) as ei:
        ObjectStore.copy(LocalStore(), src, str(tmp_path / "b.bin"), size=1)  # the base class's own copy
    assert ei.value.url == src and src in str(ei.value) and "write the bytes" in str(ei.value)
    assert ObjectStore.copies_objects is False and HTTPStore.copies_objects is False


def test_a_read_only_store_refuses_to_copy_before_any_request():
    store = HTTPStore()
    with pytest.raises(ReadOnlyLocation) as ei:
        store.copy("https://127.0.0.1:9/a/src.bin", "https://127.0.0.1:9/a/dst.bin", size=3)
    assert "https://127.0.0.1:9/a/dst.bin" in str(ei.value)


# ---------------------------------------------------------------- S3 (SeaweedFS, moto)
MOTO_IGNORES_IF_MATCH = ("moto 5.2.5 ignores x-amz-copy-source-if-match: its CopyObject checks only "
                         "x-amz-copy-source-if-none-match, its UploadPartCopy no condition (moto/s3/responses.py)")


@pytest.fixture(params=["seaweedfs", "moto"])
def s3_root(request):
    bucket = request.getfixturevalue("s3_bucket" if request.param == "seaweedfs" else "moto_bucket")
    return bucket + "/copy"


def _replace_on(store, operation: str, src: str, data: bytes) -> list[str]:
    """Replace ``src`` with ``data`` (through another client) just before ``store`` sends
    its first ``operation`` request; returns the list the hook appends the operation to."""
    other = open_store(src, StorageOptions(max_attempts=2))  # a store (and client) of its own
    assert other is not store
    seen: list[str] = []

    def hook(**_):
        if not seen:
            other.put_bytes(src, data)
        seen.append(operation)

    store.client.meta.events.register(f"before-call.s3.{operation}", hook)
    return seen


@pytest.mark.parametrize("operation,size,options", [
    ("CopyObject", MiB, {}),
    ("UploadPartCopy", 12 * MiB, {"multipart_threshold": 5 * MiB, "part_size": 5 * MiB}),
])
def test_s3_copy_of_a_source_replaced_after_its_check_is_refused_by_the_store(s3_root, operation, size, options,
                                                                              request):
    """The ETag of the HEAD travels as ``CopySourceIfMatch`` on the CopyObject and on every
    UploadPartCopy: a source replaced in between (same size, other bytes) is not copied,
    and a multipart copy leaves no incomplete upload behind."""
    if "moto" in request.node.callspec.id:
        request.applymarker(pytest.mark.xfail(strict=True, reason=MOTO_IGNORES_IF_MATCH))
    store = open_store(s3_root, StorageOptions(**options))
    src, dst = join(s3_root, f"{operation}.src"), join(s3_root, f"{operation}.dst")
    store.put_bytes(src, b"a" * size)
    seen = _replace_on(store, operation, src, b"b" * size)
    with pytest.raises(PreconditionFailed) as ei:
        store.copy(src, dst, size=size)
    assert seen, f"no {operation} was sent"
    assert ei.value.url == src and "changed since it was checked" in str(ei.value)
    assert not store.exists(dst)
    assert store.list_multipart_uploads(s3_root + "/") == []
    assert store.copy(src, dst, size=size).size == size  # checked again: the new bytes are copied
    assert store.get_bytes(dst, start=0, end=4) == b"bbbb"


def test_s3_copy_sends_one_head_and_copies_in_parts_with_the_uploads_part_size(s3_root):
    """Our HEAD gives s3transfer the size and ETag (it sends none of its own); parts are
    the store's part_size, as uploads' are."""
    store = open_store(s3_root, StorageOptions(multipart_threshold=5 * MiB, part_size=6 * MiB))
    src, dst = join(s3_root, "parts.src"), join(s3_root, "parts.dst")
    data = os.urandom(13 * MiB)
    store.put_bytes(src, data)
    calls: list[tuple[str, str]] = []

    def count(model=None, params=None, **_):
        calls.append((model.name, params.get("CopySourceIfMatch", "") if params else ""))

    store.client.meta.events.register("before-parameter-build.s3", count)
    progress: list[int] = []
    info = store.copy(src, dst, size=len(data), progress=progress.append)
    store.client.meta.events.unregister("before-parameter-build.s3", count)
    names = [name for name, _ in calls]
    assert names.count("HeadObject") == 2  # the source's check, the destination's result
    assert names.count("UploadPartCopy") == 3 and "CopyObject" not in names
    etags = {etag for name, etag in calls if name == "UploadPartCopy"}
    assert len(etags) == 1 and etags != {""}
    assert sorted(progress) == [MiB, 6 * MiB, 6 * MiB]
    assert info.size == len(data) and info.crc32c is None
    assert store.get_bytes(dst) == data


def test_s3_copy_with_a_read_only_identity_raises_access_denied(s3_bucket, seaweed, monkeypatch):
    src, dst = s3_bucket + "/ro/src.bin", s3_bucket + "/ro/dst.bin"
    open_store(src).put_bytes(src, b"readable")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.ro_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.ro_secret_key)
    clear_cache()
    ro = open_store(src)
    assert ro.get_bytes(src) == b"readable"
    with pytest.raises(AccessDenied) as ei:
        ro.copy(src, dst, size=8)
    assert dst in str(ei.value) and seaweed.ro_secret_key not in str(ei.value)
    assert not ro.exists(dst)


def test_s3_copy_against_an_endpoint_that_does_not_answer_is_transient_naming_it(s3_bucket):
    endpoint = f"http://127.0.0.1:{free_port()}"
    store = open_store(s3_bucket, StorageOptions(endpoint_url=endpoint, max_attempts=1))
    with pytest.raises(Transient) as ei:
        store.copy(s3_bucket + "/a", s3_bucket + "/b", size=1)
    assert endpoint in str(ei.value)


# ---------------------------------------------------------------- GCS (fake-gcs-server)
def test_gcs_copy_of_a_source_replaced_after_its_check_is_refused(gcs_bucket, monkeypatch):
    """The rewrite names the generation checked and matches it: a source replaced in
    between is not copied. (fake-gcs-server ignores ifSourceGenerationMatch on rewriteTo
    but honours sourceGeneration, answering 404 for the replaced generation: the store
    then sees the source still there and raises PreconditionFailed, as GCS's 412 does.)"""
    store = open_store(gcs_bucket)
    src, dst = gcs_bucket + "/gen/src.bin", gcs_bucket + "/gen/dst.bin"
    store.put_bytes(src, b"a" * 1000)
    other = open_store(src, StorageOptions(max_attempts=2))
    real = Blob.rewrite
    seen: list[int] = []

    def rewrite(self, source, **kw):
        if not seen:
            other.put_bytes(src, b"b" * 1000)
        seen.append(1)
        return real(self, source, **kw)

    monkeypatch.setattr(Blob, "rewrite", rewrite)
    with pytest.raises(PreconditionFailed) as ei:
        store.copy(src, dst, size=1000)
    assert seen and ei.value.url == src and "changed since it was checked" in str(ei.value)
    assert not store.exists(dst)
    info = store.copy(src, dst, size=1000)
    assert store.get_bytes(dst) == b"b" * 1000
    assert info.crc32c == crc32c_bytes(b"b" * 1000), "the CRC32C of GCS's answer, as 8 hex digits"


def test_gcs_copy_follows_rewrite_tokens_until_done_reporting_each_calls_bytes(gcs_bucket, monkeypatch):
    """A rewrite GCS does not finish in one call (across locations or storage classes)
    answers a token; the store calls again with it. fake-gcs-server always finishes in
    one call, so its answer is split in three here (the copy itself is the server's)."""
    store = open_store(gcs_bucket)
    src, dst = gcs_bucket + "/tok/src.bin", gcs_bucket + "/tok/dst.bin"
    data = os.urandom(3000)
    store.put_bytes(src, data)
    real = Blob.rewrite
    tokens: list = []

    def rewrite(self, source, token=None, **kw):
        tokens.append(token)
        if token is None:
            return "t1", 1000, 3000
        if token == "t1":
            return "t2", 2500, 3000
        return real(self, source, **kw)

    monkeypatch.setattr(Blob, "rewrite", rewrite)
    progress: list[int] = []
    info = store.copy(src, dst, size=3000, progress=progress.append)
    assert tokens == [None, "t1", "t2"]
    assert progress == [1000, 1500, 500]
    assert info.size == 3000 and info.crc32c == crc32c_bytes(data)
    assert store.get_bytes(dst) == data


# ---------------------------------------------------------------- local folders
def test_local_copy_of_a_source_modified_while_it_is_read_is_refused_and_leaves_nothing(tmp_path):
    store = LocalStore()
    src, dst = str(tmp_path / "src.bin"), str(tmp_path / "out" / "dst.bin")
    size = 20 * MiB  # three 8 MiB reads
    store.put_bytes(src, b"a" * size)
    for how, change in [("grew", lambda f: (f.seek(0, 2), f.write(b"more"))),
                        ("shrank", lambda f: f.truncate(size - 1)),
                        ("was modified", lambda f: (f.seek(0), f.write(b"b" * 10)))]:
        with open(src, "r+b") as f:
            f.truncate(size)
            f.seek(0)
            f.write(b"a" * 10)
        os.utime(src, ns=(1, 1))  # a clearly older mtime: the modification below changes it

        def progress(n, change=change):
            with open(src, "r+b") as f:
                change(f)

        with pytest.raises(PreconditionFailed) as ei:
            store.copy(src, dst, size=size, progress=progress)
        assert how in str(ei.value) and ei.value.url == src
        assert os.listdir(tmp_path / "out") == [], "no destination, no temporary file"


def test_local_copy_is_written_like_any_object_and_never_through_a_link(tmp_path):
    store = LocalStore()
    d = tmp_path / "folder"
    src, dst, put = str(d / "src.bin"), str(d / "dst.bin"), str(d / "put.bin")
    data = os.urandom(MiB + 3)
    store.put_bytes(src, data)
    store.put_bytes(put, b"x")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not to be written")
    os.symlink(outside, dst)  # a planted link holds the destination's name: replaced, never written through
    info = store.copy(src, dst, size=len(data))
    assert info == ObjectInfo(dst, len(data), os.stat(dst).st_mtime, crc32c_bytes(data), store.version(dst))
    assert not os.path.islink(dst) and open(dst, "rb").read() == data
    assert outside.read_bytes() == b"not to be written"
    assert stat.S_IMODE(os.stat(dst).st_mode) == stat.S_IMODE(os.stat(put).st_mode), "the mode of any object"
    os.symlink(outside, d / "link.bin")  # a link as the source: refused
    with pytest.raises(UnsafeCheckpoint):
        store.copy(str(d / "link.bin"), str(d / "from-link.bin"), size=len(b"not to be written"))
    assert not os.path.exists(d / "from-link.bin")


# ---------------------------------------------------------------- a copy of what the caller wrote, or none
def test_copy_takes_only_the_version_the_caller_wrote_on_every_backend(any_root):
    """``copy(src_version=...)``: the version token the caller got when it wrote the source
    (``store.version`` right after, or an earlier copy's ``ObjectInfo.version``). Someone
    who replaced the source since (the same size, other bytes; or the same bytes written
    again) has another version: PreconditionFailed naming the source, nothing written.
    A copy's own version is what ``version`` says of its destination, so copies chain."""
    store = open_store(any_root)
    src, dst, dst2 = (join(any_root, n) for n in ("ours.bin", "copy.bin", "copy2.bin"))
    store.put_bytes(src, b"a" * 1000)
    ours = store.version(src)
    assert ours is not None
    info = store.copy(src, dst, size=1000, src_version=ours)
    assert info.version is not None and info.version == store.version(dst)
    assert store.copy(dst, dst2, size=1000, src_version=info.version).size == 1000  # a copy is a source too
    store.delete(dst2)
    store.put_bytes(src, b"b" * 1000)  # someone else's bytes, the same size
    if store.version(src) == ours:
        pytest.fail(f"{type(store).__name__}: an object replaced by other bytes kept its version {ours}")
    with pytest.raises(PreconditionFailed) as ei:
        store.copy(src, dst2, size=1000, src_version=ours)
    assert ei.value.url == src and "someone replaced it" in str(ei.value) and src in str(ei.value)
    assert not store.exists(dst2)
    with pytest.raises(PreconditionFailed):  # a version never given: refused as well
        store.copy(dst, dst2, size=1000, src_version="not-a-version")
    assert not store.exists(dst2)
