"""One ObjectStore conformance suite, run unchanged against every backend.

Backends: a local folder, SeaweedFS (S3, credentials enforced), moto server (S3) and
fake-gcs-server (GCS), all on 127.0.0.1. Each test gets a fresh bucket (or folder)
through the ``backend`` fixture. What differs between backends is data on the
fixture (a raw S3 client, whether credentials are enforced), never the assertions.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import pytest

from cloudckpt.errors import (
    AccessDenied,
    AlreadyExists,
    BucketNotFound,
    InvalidURL,
    NotFound,
    Transient,
    UnsafeDelete,
)
from cloudckpt.storage import ObjectStore, StorageOptions, clear_cache, open_store
from cloudckpt.storage import url as urls
from cloudckpt.storage.url import parse_url

MiB = 1024 * 1024
BIG_SIZE = 200 * MiB


@dataclass
class Backend:
    name: str  # "local" | "seaweedfs" | "moto" | "gcs"
    root: str  # a fresh, empty folder for this test
    bucket: Optional[str]  # "s3://b" / "gs://b" (None for local folders)
    store: ObjectStore
    server: object = None  # the SeaweedFS / MotoS3 / FakeGCS handle, None for local

    @property
    def creates_buckets_on_write(self) -> bool:
        # SeaweedFS creates a missing bucket on the first PUT by an admin identity
        return self.name == "seaweedfs"

    @property
    def is_s3(self) -> bool:
        return self.name in ("seaweedfs", "moto")

    def url(self, *parts: str) -> str:
        return urls.join(self.root, *parts)

    def store_with(self, **options) -> ObjectStore:
        return open_store(self.root, StorageOptions(**options))

    def s3_client(self):
        """The raw boto3 client of the store (S3 backends only)."""
        assert self.is_s3
        return self.store.client


BACKENDS = ["local", "seaweedfs", "moto", "gcs"]


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path) -> Backend:
    name = request.param
    if name == "local":
        root = str(tmp_path / "store")
        os.makedirs(root)
        return Backend(name, root, None, open_store(root))
    bucket = request.getfixturevalue({"seaweedfs": "s3_bucket", "moto": "moto_bucket", "gcs": "gcs_bucket"}[name])
    server = request.getfixturevalue({"seaweedfs": "seaweed", "moto": "moto_s3", "gcs": "fake_gcs"}[name])
    root = bucket + "/root"
    return Backend(name, root, bucket, open_store(root), server)


def _payload(n: int, seed: int = 0) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (n // 32) + b"x" * (n % 32)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _put_many(store: ObjectStore, items: dict[str, bytes]) -> None:
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda kv: store.put_bytes(kv[0], kv[1]), items.items()))


# ---------------------------------------------------------------- round trips
def test_bytes_round_trip_returns_what_was_written(backend):
    data = _payload(MiB + 7)
    u = backend.url("a/b/obj.bin")
    backend.store.put_bytes(u, data)
    assert backend.store.get_bytes(u) == data
    backend.store.put_bytes(u, b"replaced")
    assert backend.store.get_bytes(u) == b"replaced"


def test_connect_builds_the_client_ahead_and_sends_no_request(backend):
    """``connect()`` (the checkpointer's warm-up on ranks waiting for rank 0) is
    idempotent, leaves the store usable, and does not touch the network: on S3 it
    succeeds against an endpoint where nothing listens."""
    store = backend.store_with(connect_timeout=5.0)  # a new store: its client is not built yet
    store.connect()
    store.connect()
    u = backend.url("connected.bin")
    store.put_bytes(u, b"hello")
    assert store.get_bytes(u) == b"hello"
    if backend.is_s3:
        from cloudckpt.testing.servers import free_port

        dead = open_store(backend.root, StorageOptions(endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=1))
        dead.connect()
        with pytest.raises(Transient, match=r"reaching http://127\.0\.0\.1:"):  # the first request fails, naming the endpoint
            dead.get_bytes(u)


def test_file_round_trip_reports_progress_and_leaves_no_partial_files(backend, tmp_path):
    src = tmp_path / "src.bin"
    data = _payload(3 * MiB + 11, seed=1)
    src.write_bytes(data)
    u = backend.url("files/src.bin")
    up: list[int] = []
    assert backend.store.upload_file(str(src), u, progress=up.append) == len(data)
    assert sum(up) == len(data)
    dst = tmp_path / "out" / "dst.bin"
    down: list[int] = []
    assert backend.store.download_file(u, str(dst), progress=down.append) == len(data)
    assert sum(down) == len(data)
    assert dst.read_bytes() == data
    assert os.listdir(dst.parent) == ["dst.bin"]


# (start, end) -> the Python slice the read must equal; one object serves every case
RANGES = [
    ((3, None), slice(3, None)),  # start only
    ((3, 10), slice(3, 10)),  # start and end (end exclusive)
    ((None, 5), slice(0, 5)),  # end only
    ((90, 1000), slice(90, None)),  # end beyond the size
    ((100, None), slice(100, None)),  # start at the size: empty
    ((150, 200), slice(150, 200)),  # start beyond the size: empty
    ((7, 7), slice(7, 7)),  # empty range
    ((10, 5), slice(10, 5)),  # end before start: empty
]


def test_byte_range_reads_match_python_slicing(backend):
    data = bytes(range(100))
    u = backend.url("range.bin")
    backend.store.put_bytes(u, data)
    for (start, end), expect in RANGES:
        assert backend.store.get_bytes(u, start=start, end=end) == data[expect], f"start={start} end={end}"


@pytest.mark.parametrize("pieces", [[1, 2, 3], [100], [40, 40, 40], [7] * 20])
def test_open_range_reads_front_to_back_in_the_callers_pieces(backend, pieces):
    """``open_range`` is what a streaming load reads through (one GET on S3): pieces
    of any size, concatenated, are the range; past the range or the object's end a
    read returns what is left, then nothing."""
    data = os.urandom(100)
    u = backend.url("stream.bin")
    backend.store.put_bytes(u, data)
    for start, end in [(0, 100), (5, 60), (90, 150), (100, 120), (130, 140), (7, 7)]:
        got = []
        with backend.store.open_range(u, start, end) as r:
            for n in pieces:
                got.append(bytes(r.read(n)))
            rest = bytes(r.read(1000))
        assert b"".join(got) + rest == data[start:end], f"[{start}, {end}) in pieces {pieces}"
        with backend.store.open_range(u, start, end) as r:
            assert bytes(r.read(end - start + 10)) == data[start:end]
            assert bytes(r.read(1)) == b""


def test_open_range_of_a_missing_object_raises_not_found_naming_the_url(backend):
    u = backend.url("nope/missing-stream.bin")
    with pytest.raises(NotFound) as ei:
        with backend.store.open_range(u, 0, 10) as r:
            r.read(10)  # the chunked default fetches on the first read
    assert u in str(ei.value)


def test_open_range_sends_one_request_for_a_streamed_range(backend):
    """A range read in many small pieces costs one GET on S3 (the body is streamed);
    the default (GCS, fetching ``part_size`` chunks) one per chunk. Counted with a
    wrapper around the store's own primitive, so it counts what the backend asks of it."""
    data = os.urandom(12 * MiB)
    u = backend.url("stream-count.bin")
    backend.store.put_bytes(u, data)
    store = backend.store_with(part_size=5 * MiB)  # cached per options: every change below is undone
    calls = []
    if backend.is_s3:
        def count(params, **_):
            calls.append(params.get("Range"))
        store.client.meta.events.register("before-parameter-build.s3.GetObject", count)
        undo = lambda: store.client.meta.events.unregister("before-parameter-build.s3.GetObject", count)  # noqa: E731
    else:
        real = store.get_bytes
        store.get_bytes = lambda url, **kw: calls.append((kw.get("start"), kw.get("end"))) or real(url, **kw)
        undo = lambda: vars(store).pop("get_bytes")  # noqa: E731
    try:
        got = []
        with store.open_range(u, 10, len(data)) as r:
            while piece := r.read(64 * 1024):
                got.append(bytes(piece))
    finally:
        undo()
    assert b"".join(got) == data[10:]
    if backend.is_s3:
        assert calls == [f"bytes=10-{len(data) - 1}"]
    elif backend.name == "gcs":
        assert calls == [(10, 10 + 5 * MiB), (10 + 5 * MiB, 10 + 10 * MiB), (10 + 10 * MiB, 12 * MiB)]
    else:
        assert calls == []  # a local file is read directly


def test_empty_objects_round_trip_as_bytes_and_files(backend, tmp_path):
    u = backend.url("empty/by-bytes")
    backend.store.put_bytes(u, b"")
    assert backend.store.get_bytes(u) == b""
    assert backend.store.get_bytes(u, start=0) == b""
    assert backend.store.stat(u).size == 0
    src = tmp_path / "empty.bin"
    src.write_bytes(b"")
    fu = backend.url("empty/by-file")
    assert backend.store.upload_file(str(src), fu) == 0
    dst = tmp_path / "empty-out.bin"
    assert backend.store.download_file(fu, str(dst)) == 0
    assert dst.read_bytes() == b""
    sizes = {e.url: e.size for e in backend.store.list(backend.url("empty/"), delimiter=None)}
    assert sizes == {u: 0, fu: 0}


ODD_KEYS = ["unicode/ünïcødé 名前 ✓.bin", "spaces/with  two spaces/and one.txt", "chars/plus+percent%20amp&eq=hash#.bin"]


def test_unicode_and_special_characters_in_keys_round_trip_and_list_back_verbatim(backend):
    for key in ODD_KEYS:
        u = backend.url(key)
        backend.store.put_bytes(u, key.encode())
        assert backend.store.get_bytes(u) == key.encode(), key
        assert backend.store.stat(u).size == len(key.encode()), key
        listed = [e.url for e in backend.store.list(backend.url(key.split("/")[0] + "/"), delimiter=None)]
        assert listed == [u], key
        backend.store.delete(u)
        assert not backend.store.exists(u), key


# ---------------------------------------------------------------- listing and deleting many keys
N_MANY = 1500


def _many_keys(backend: Backend, folder: str) -> dict[str, bytes]:
    # 1,200 objects directly in the folder and 300 one level below: with a delimiter
    # that is 1,500 entries too (1,200 objects + 300 prefixes), so both modes span pages.
    keys = [f"{folder}/k{i:04d}" for i in range(1200)] + [f"{folder}/d{i:03d}/x" for i in range(300)]
    return {backend.url(k): b"" for k in keys}


def _count_s3_calls(backend: Backend, operation: str):
    """A list that grows by one per S3 ``operation`` request the store makes (S3 only)."""
    calls: list[int] = []
    backend.s3_client().meta.events.register(f"before-call.s3.{operation}", lambda **kw: calls.append(1))
    return calls


@pytest.mark.slow  # 1,500 objects per backend: 4-8 s each
def test_1500_keys_are_listed_across_all_pages_then_deleted_by_prefix_in_batches(backend):
    # One population serves both halves: creating 1,500 objects is the slow part on
    # every server, and the delete half needs exactly what the list half checked.
    items = _many_keys(backend, "many")
    _put_many(backend.store, items)
    keep = backend.url("many-sibling/keep")  # shares the string prefix "many"
    backend.store.put_bytes(keep, b"keep")
    if backend.is_s3:
        list_calls = _count_s3_calls(backend, "ListObjectsV2")
        delete_calls = _count_s3_calls(backend, "DeleteObjects")

    # list without a delimiter: every object, over more than one page
    flat = list(backend.store.list(backend.url("many/"), delimiter=None))
    assert len(flat) == N_MANY
    assert {e.url for e in flat} == set(items)
    assert not any(e.is_prefix for e in flat)

    # with a delimiter: 1,200 objects and 300 folded prefixes, over more than one page
    folded = list(backend.store.list(backend.url("many/"), delimiter="/"))
    assert len(folded) == N_MANY
    prefixes = {e.url for e in folded if e.is_prefix}
    objects = {e.url for e in folded if not e.is_prefix}
    assert prefixes == {backend.url(f"many/d{i:03d}/") for i in range(300)}
    assert all(p.endswith("/") for p in prefixes)
    assert objects == {backend.url(f"many/k{i:04d}") for i in range(1200)}
    if backend.is_s3:
        assert len(list_calls) == 4  # two pages (1,000 + 500) per listing

    # delete_prefix: everything under the folder, nothing beside it
    assert backend.store.delete_prefix(backend.url("many")) == N_MANY
    if backend.is_s3:
        assert len(delete_calls) == 2  # DeleteObjects takes at most 1,000 keys a call
    assert list(backend.store.list(backend.url("many/"), delimiter=None)) == []
    assert backend.store.get_bytes(keep) == b"keep"


# ---------------------------------------------------------------- large (multipart) uploads
@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """200 MiB of random bytes on disk, and its SHA-256."""
    path = tmp_path_factory.mktemp("big") / "big.bin"
    with open(path, "wb") as f:
        for _ in range(BIG_SIZE // (8 * MiB)):
            f.write(os.urandom(8 * MiB))
    return str(path), _sha256_file(str(path))


@pytest.mark.slow  # 200 MiB up and down per backend
def test_200_mib_multipart_upload_round_trips_with_identical_checksum(backend, big_file, tmp_path):
    path, digest = big_file
    u = backend.url("big/big.bin")
    store = backend.store_with(multipart_threshold=64 * MiB, part_size=16 * MiB)  # below BIG_SIZE: multipart
    progress: list[int] = []
    assert store.upload_file(path, u, progress=progress.append) == BIG_SIZE
    assert sum(progress) == BIG_SIZE
    assert store.stat(u).size == BIG_SIZE
    if backend.is_s3:
        # s3transfer went multipart: the ETag of a multipart object ends in -<parts>
        assert _etag(backend, u).endswith(f"-{-(-BIG_SIZE // (16 * MiB))}")
    elif backend.name == "gcs":
        # a resumable upload in part_size chunks: progress arrives once per chunk
        assert len(progress) == -(-BIG_SIZE // (16 * MiB))
    out = tmp_path / "big-out.bin"
    assert store.download_file(u, str(out)) == BIG_SIZE
    assert _sha256_file(str(out)) == digest



def _etag(backend, u: str) -> str:
    return backend.s3_client().head_object(Bucket=parse_url(u).bucket, Key=parse_url(u).key)["ETag"].strip('"')


def test_s3_default_sends_a_checkpoint_sized_file_in_one_put_and_larger_ones_in_64_mib_parts(backend, tmp_path):
    if not backend.is_s3:
        pytest.skip(f"{backend.name}: S3's default part sizes only (GCS keeps 64 MiB / 16 MiB: one chunk in memory per upload)")
    assert (backend.store.multipart_threshold, backend.store.part_size) == (512 * MiB, 64 * MiB)
    path = tmp_path / "shard.bin"
    path.write_bytes(_payload(80 * MiB))  # above the old 64 MiB threshold
    u = backend.url("default/shard.bin")
    backend.store.upload_file(str(path), u)
    assert "-" not in _etag(backend, u)  # one PutObject (a multipart ETag ends in -<parts>)
    small = backend.store_with(multipart_threshold=64 * MiB)  # part_size stays the S3 default
    small.upload_file(str(path), u)
    assert _etag(backend, u).endswith("-2")  # 80 MiB in 64 MiB parts

# ---------------------------------------------------------------- conditional create
def test_conditional_create_raced_by_two_writers_has_exactly_one_winner(backend):
    for round_ in range(5):
        u = backend.url(f"race/marker-{round_}.json")
        barrier = threading.Barrier(2)
        outcome: dict[int, str] = {}
        payload = {i: f'{{"writer": {i}, "round": {round_}}}'.encode() * 50 for i in (0, 1)}

        def write(i: int) -> None:
            barrier.wait()
            try:
                backend.store.put_bytes(u, payload[i], if_absent=True)
                outcome[i] = "won"
            except AlreadyExists:
                outcome[i] = "lost"

        threads = [threading.Thread(target=write, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(outcome.values()) == ["lost", "won"], f"round {round_}: {outcome}"
        winner = next(i for i, o in outcome.items() if o == "won")
        assert backend.store.get_bytes(u) == payload[winner]


def test_conditional_create_of_an_existing_object_raises_already_exists_and_keeps_it(backend, tmp_path):
    u = backend.url("cond/obj")
    backend.store.put_bytes(u, b"first", if_absent=True)
    with pytest.raises(AlreadyExists) as ei:
        backend.store.put_bytes(u, b"second", if_absent=True)
    assert u in str(ei.value)
    assert isinstance(ei.value, FileExistsError)
    src = tmp_path / "third"
    src.write_bytes(b"third")
    with pytest.raises(AlreadyExists):
        backend.store.upload_file(str(src), u, if_absent=True)
    assert backend.store.get_bytes(u) == b"first"


# ---------------------------------------------------------------- stat, exists, missing things
def test_stat_and_exists_describe_an_object(backend):
    u = backend.url("st/obj")
    before = time.time()
    backend.store.put_bytes(u, b"12345")
    info = backend.store.stat(u)
    assert info.url == u and info.size == 5
    assert info.mtime is not None and abs(info.mtime - before) < 300
    assert backend.store.exists(u)
    assert not backend.store.exists(backend.url("st/other"))
    assert not backend.store.exists(backend.url("st"))  # a folder is not an object


def test_missing_objects_raise_not_found_naming_the_url(backend, tmp_path):
    u = backend.url("nope/missing.bin")
    for call in (backend.store.get_bytes, backend.store.stat):
        with pytest.raises(NotFound) as ei:
            call(u)
        assert u in str(ei.value)
        assert isinstance(ei.value, FileNotFoundError)
        assert not isinstance(ei.value, BucketNotFound)
    with pytest.raises(NotFound):
        backend.store.download_file(u, str(tmp_path / "d" / "missing.bin"))
    assert not os.path.exists(tmp_path / "d" / "missing.bin")
    assert os.listdir(tmp_path / "d") == []  # no partial file left behind
    backend.store.delete(u)  # deleting a missing object is not an error
    assert list(backend.store.list(backend.url("nope/"))) == []


def test_missing_bucket_raises_bucket_not_found(backend):
    if backend.bucket is None:
        pytest.skip("local folders have no buckets (a missing folder lists as empty)")
    scheme = parse_url(backend.bucket).scheme
    missing = f"{scheme}://missing-{uuid.uuid4().hex[:12]}"
    u = missing + "/some/key"
    calls = [
        lambda: backend.store.get_bytes(u),
        lambda: list(backend.store.list(missing + "/some/")),
        lambda: backend.store.check_bucket(missing + "/some"),
        lambda: backend.store.delete(u),
    ]
    if not backend.creates_buckets_on_write:
        calls.append(lambda: backend.store.put_bytes(u, b"x"))
    for call in calls:
        with pytest.raises(BucketNotFound) as ei:
            call()
        assert missing.split("://")[1] in str(ei.value)
    with pytest.raises(NotFound):  # S3's HEAD has no body to say which is missing: NotFound at least
        backend.store.stat(u)


# ---------------------------------------------------------------- credentials
def test_wrong_credentials_raise_access_denied_without_leaking_the_secret(backend, monkeypatch):
    if backend.name != "seaweedfs":
        pytest.skip({
            "local": "local folders have no credentials to get wrong",
            "moto": "moto server accepts any credentials",
            "gcs": "fake-gcs-server accepts any credentials (missing ADC is tested in test_gcs.py)",
        }[backend.name])
    sw = backend.server
    u = backend.url("creds/obj")
    backend.store.put_bytes(u, b"secret data")

    bogus = "bogus-" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bogus)
    clear_cache()
    with pytest.raises(AccessDenied) as ei:
        open_store(backend.root).get_bytes(u)
    msg = f"{ei.value} {ei.value!r} {ei.value.__cause__!r} {ei.value.__context__!r}"
    assert u in str(ei.value)
    assert bogus not in msg and sw.secret_key not in msg

    # a read-only identity may read but not write
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", sw.ro_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", sw.ro_secret_key)
    clear_cache()
    ro = open_store(backend.root)
    assert ro.get_bytes(u) == b"secret data"
    with pytest.raises(AccessDenied) as ei:
        ro.put_bytes(backend.url("creds/new"), b"x")
    assert sw.ro_secret_key not in f"{ei.value} {ei.value!r}"
    assert isinstance(ei.value, PermissionError)


# ---------------------------------------------------------------- URLs
def _bad_url(backend: Backend) -> str:
    if backend.bucket is None:
        return "file:/no/double/slash"  # local: scheme with a single slash
    scheme = parse_url(backend.bucket).scheme
    return f"{scheme}://Not_A_Valid_Bucket/key"


def test_malformed_urls_raise_invalid_url_from_store_calls(backend):
    bad = _bad_url(backend)
    for call in (backend.store.get_bytes, backend.store.stat, backend.store.delete, lambda u: list(backend.store.list(u))):
        with pytest.raises(InvalidURL):
            call(bad)


def test_urls_of_another_scheme_raise_invalid_url(backend):
    other = "gs://some-bucket/key" if backend.is_s3 else "s3://some-bucket/key"
    with pytest.raises(InvalidURL):
        backend.store.get_bytes(other)
    with pytest.raises(InvalidURL):
        backend.store.put_bytes(other, b"x")


@pytest.mark.parametrize(
    "bad",
    [
        "s3:/bucket/key",  # one slash
        "s3://",  # no bucket
        "gs:///key",  # empty bucket
        "s3://Upper_Case/key",  # invalid bucket name
        "gs://ab/key",  # bucket name too short
        "s3://bucket//key",  # empty path segment
        "",  # nothing
    ],
)
def test_malformed_urls_raise_invalid_url_from_parse_url_and_open_store(bad):
    with pytest.raises(InvalidURL):
        parse_url(bad)
    with pytest.raises(InvalidURL):
        open_store(bad).get_bytes(bad)


@pytest.mark.parametrize("url", ["ftp://bucket/key", "azure://container/blob", "hdfs://nn/path"])
def test_unknown_schemes_raise_invalid_url_naming_the_known_ones(url):
    with pytest.raises(InvalidURL) as ei:
        open_store(url)
    assert "s3://" in str(ei.value) and "gs://" in str(ei.value)


# ---------------------------------------------------------------- unsafe deletes
def test_delete_prefix_refuses_a_bucket_root(backend):
    root = backend.bucket + "/" if backend.bucket else "/"
    with pytest.raises(UnsafeDelete) as ei:
        backend.store.delete_prefix(root)
    assert "force=True" in str(ei.value)


def test_delete_prefix_refuses_a_prefix_shallower_than_min_delete_depth_unless_forced(backend):
    shallow = backend.url("shallow")
    u = backend.url("shallow/a/b")
    backend.store.put_bytes(u, b"x")
    store = backend.store_with(min_delete_depth=urls.depth(shallow) + 1)
    with pytest.raises(UnsafeDelete):
        store.delete_prefix(shallow)
    assert backend.store.exists(u)
    assert store.delete_prefix(shallow, force=True) == 1
    assert not backend.store.exists(u)


def test_delete_prefix_of_a_bucket_root_with_force_empties_the_bucket(backend):
    if backend.bucket is None:
        pytest.skip("the root of a local 'bucket' is the filesystem root: never delete it in a test")
    a, b = backend.bucket + "/x", backend.bucket + "/y/z"
    backend.store.put_bytes(a, b"1")
    backend.store.put_bytes(b, b"2")
    assert backend.store.delete_prefix(backend.bucket, force=True) == 2
    assert list(backend.store.list(backend.bucket + "/", delimiter=None)) == []


# ---------------------------------------------------------------- multipart upload listing
def test_incomplete_multipart_uploads_are_listed_and_aborted_under_a_prefix(backend):
    if not backend.is_s3:
        # local folders and GCS have no listable incomplete uploads
        assert backend.store.list_multipart_uploads(backend.url("mpu/")) == []
        assert backend.store.abort_multipart_uploads(backend.url("mpu/")) == []
        return
    client = backend.s3_client()
    p = parse_url(backend.url("mpu/obj.bin"))
    upload_id = client.create_multipart_upload(Bucket=p.bucket, Key=p.key)["UploadId"]
    other = client.create_multipart_upload(Bucket=p.bucket, Key="elsewhere/obj.bin")["UploadId"]

    pending = backend.store.list_multipart_uploads(backend.url("mpu/"))
    assert [(x.url, x.upload_id) for x in pending] == [(backend.url("mpu/obj.bin"), upload_id)]
    assert pending[0].initiated is not None
    # (moto reports a fixed initiation time in 2010, so "now" is taken relative to it)
    too_young = pending[0].initiated + 60
    assert backend.store.abort_multipart_uploads(backend.url("mpu/"), older_than=3600, now=too_young) == []
    aborted = backend.store.abort_multipart_uploads(backend.url("mpu/"))
    assert [x.upload_id for x in aborted] == [upload_id]
    assert backend.store.list_multipart_uploads(backend.url("mpu/")) == []
    remaining = client.list_multipart_uploads(Bucket=p.bucket).get("Uploads", [])
    assert [u["UploadId"] for u in remaining] == [other]


# ---------------------------------------------------------------- pickling
def test_a_pickled_store_works_in_the_copy(backend):
    u = backend.url("pickle/obj")
    backend.store.put_bytes(u, b"before pickling")  # the original's client exists now
    copy = pickle.loads(pickle.dumps(backend.store))
    assert type(copy) is type(backend.store) and copy is not backend.store
    assert copy.options == backend.store.options
    assert copy.get_bytes(u) == b"before pickling"
    copy.put_bytes(u, b"written by the copy")
    assert backend.store.get_bytes(u) == b"written by the copy"
