"""The ObjectStore conformance suite: one set of tests every storage backend passes.

A backend is tested by subclassing :class:`ObjectStoreConformance` in a pytest module
and giving a ``root`` fixture: a fresh, empty folder URL for each test, with the
environment set so that ``open_store(root)`` reaches the store (a server on
127.0.0.1, a temp folder). Every test then runs against that backend, unchanged::

    import pytest
    from cloudckpt.testing.conformance import ObjectStoreConformance

    class TestMyStore(ObjectStoreConformance):
        @pytest.fixture
        def root(self, my_bucket):          # your fixture: "myscheme://bucket"
            return my_bucket + "/root"

What a backend cannot observe from outside (how many requests a listing took, how
many parts an object was uploaded in, incomplete uploads, credentials) comes from
hooks and class attributes; their defaults assert only what every backend shares.
Needs pytest (``pip install 'cloudckpt[test]'``). Call
``pytest.register_assert_rewrite("cloudckpt.testing.conformance")`` in your
``conftest.py`` for pytest's detailed assertion messages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import pytest

from ..errors import (
    AccessDenied,
    AlreadyExists,
    BucketNotFound,
    InvalidURL,
    NotFound,
    PreconditionFailed,
    StorageError,
    Transient,
    UnsafeDelete,
)
from ..storage import ObjectStore, StorageOptions, clear_cache, open_store
from ..storage import url as urls
from ..storage.url import parse_url
from ..units import MiB

BIG_SIZE = 200 * MiB
N_MANY = 1500

__all__ = ["Credentials", "ObjectStoreConformance", "StoreUnderTest"]


@dataclass
class StoreUnderTest:
    """The store of one test: ``root`` is a fresh folder URL, ``store`` serves it."""

    root: str
    store: ObjectStore

    @property
    def bucket(self) -> Optional[str]:
        """``scheme://bucket`` of the root; None for local folders."""
        p = parse_url(self.root)
        return None if p.scheme == "file" else f"{p.scheme}://{p.bucket}"

    def url(self, *parts: str) -> str:
        return urls.join(self.root, *parts)

    def store_with(self, **options) -> ObjectStore:
        """The store for the root with these StorageOptions (cached per options)."""
        return open_store(self.root, StorageOptions(**options))


@dataclass
class Credentials:
    """How to get a backend's credentials wrong (for the ``credentials`` fixture).

    ``use_wrong(monkeypatch)`` / ``use_read_only(monkeypatch)`` change the environment
    and return the secret they set; ``secrets`` are the real ones. None of them may
    appear in an error message."""

    use_wrong: Callable[[pytest.MonkeyPatch], str]
    use_read_only: Callable[[pytest.MonkeyPatch], str]
    secrets: tuple[str, ...]


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` deterministic bytes that differ with ``seed``."""
    return hashlib.sha256(str(seed).encode()).digest() * (n // 32) + b"x" * (n % 32)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _put_many(store: ObjectStore, items: dict[str, bytes]) -> None:
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda kv: store.put_bytes(kv[0], kv[1]), items.items()))


_big_files: dict[str, tuple[str, str]] = {}


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

ODD_KEYS = ["unicode/ünïcødé 名前 ✓.bin", "spaces/with  two spaces/and one.txt",
            "chars/plus+percent%20amp&eq=hash#.bin"]


class ObjectStoreConformance:
    """Subclass with a ``root`` fixture; override hooks where the backend can say more."""

    #: Entries a listing request returns at most (S3: 1,000); checked where
    #: ``count_requests`` counts "list" requests.
    list_page_size: Optional[int] = None
    #: Keys one batch delete removes at most (S3: 1,000); checked where
    #: ``count_requests`` counts "delete" requests.
    delete_batch_size: Optional[int] = None
    #: Upload progress arrives once per part of a multipart upload (GCS's resumable upload).
    progress_per_part = False
    #: ``(multipart_threshold, part_size)`` a store uses when StorageOptions leave them
    #: unset; None: the backend writes files whole (local folders).
    default_part_sizes: Optional[tuple[int, int]] = None
    #: Writing to a missing bucket creates it (SeaweedFS, for an admin identity).
    creates_buckets_on_write = False
    #: Why the store under test does not enforce ``complete_assembly(if_absent=True)``
    #: (an emulator that ignores the condition); None: it enforces it.
    assembly_if_absent_ignored: Optional[str] = None

    # ------------------------------------------------------------ fixtures and hooks
    @pytest.fixture
    def root(self) -> str:
        raise NotImplementedError("a subclass of ObjectStoreConformance gives a `root` fixture: a fresh folder URL")

    @pytest.fixture
    def backend(self, root) -> StoreUnderTest:
        if parse_url(root).scheme == "file":
            os.makedirs(root, exist_ok=True)
        return StoreUnderTest(root, open_store(root))

    @pytest.fixture
    def credentials(self) -> Optional[Credentials]:
        """Override to test credential errors; None skips them (say why in ``no_credentials``)."""
        return None

    #: Why the credential tests do not apply (shown in the skip).
    no_credentials = "the conformance subclass gives no `credentials` fixture"

    @pytest.fixture
    def big_file(self, tmp_path_factory) -> tuple[str, str]:
        """200 MiB of random bytes on disk, and its SHA-256 (written once per session)."""
        key = str(tmp_path_factory.getbasetemp())
        if key not in _big_files:
            path = tmp_path_factory.mktemp("big") / "big.bin"
            with open(path, "wb") as f:
                for _ in range(BIG_SIZE // (8 * MiB)):
                    f.write(os.urandom(8 * MiB))
            _big_files[key] = (str(path), sha256_file(str(path)))
        return _big_files[key]

    @contextlib.contextmanager
    def count_requests(self, store: ObjectStore, operation: str) -> Iterator[Optional[list]]:
        """Within the block, a list that grows by one per ``operation`` request ``store``
        sends ("list": one listing page; "delete": one batch delete; "get": one read,
        appended as its ``(start, end)``); None where the backend cannot count them."""
        yield None

    def uploaded_parts(self, backend: StoreUnderTest, url: str) -> Optional[int]:
        """How many parts the object at ``url`` was uploaded in, where the store tells (S3's ETag)."""
        return None

    def start_incomplete_upload(self, backend: StoreUnderTest, url: str) -> Optional[str]:
        """Start a multipart upload of ``url`` and leave it incomplete; its upload id.
        None: the backend has no listable incomplete uploads."""
        return None

    def unreachable_store(self, backend: StoreUnderTest) -> Optional[tuple[ObjectStore, str]]:
        """A store for the root whose endpoint has nothing listening, and that endpoint."""
        return None

    def malformed_url(self, backend: StoreUnderTest) -> str:
        """A URL of this backend's scheme that ``parse_url`` rejects."""
        if backend.bucket is None:
            return "file:/no/double/slash"  # local: scheme with a single slash
        return f"{parse_url(backend.bucket).scheme}://Not_A_Valid_Bucket/key"

    # ------------------------------------------------------------ round trips
    def test_bytes_round_trip_returns_what_was_written(self, backend):
        data = payload(MiB + 7)
        u = backend.url("a/b/obj.bin")
        backend.store.put_bytes(u, data)
        assert backend.store.get_bytes(u) == data
        backend.store.put_bytes(u, b"replaced")
        assert backend.store.get_bytes(u) == b"replaced"

    def test_connect_builds_the_client_ahead_and_sends_no_request(self, backend):
        """``connect()`` (the checkpointer's warm-up on ranks waiting for rank 0) is
        idempotent, leaves the store usable, and does not touch the network: it succeeds
        against an endpoint where nothing listens (where the backend has endpoints)."""
        store = backend.store_with(connect_timeout=5.0)  # a new store: its client is not built yet
        store.connect()
        store.connect()
        u = backend.url("connected.bin")
        store.put_bytes(u, b"hello")
        assert store.get_bytes(u) == b"hello"
        dead = self.unreachable_store(backend)
        if dead is not None:
            dead_store, endpoint = dead
            dead_store.connect()
            with pytest.raises(Transient) as ei:  # the first request fails, naming the endpoint
                dead_store.get_bytes(u)
            assert f"reaching {endpoint}" in str(ei.value)

    def test_file_round_trip_reports_progress_and_leaves_no_partial_files(self, backend, tmp_path):
        src = tmp_path / "src.bin"
        data = payload(3 * MiB + 11, seed=1)
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

    def test_byte_range_reads_match_python_slicing(self, backend):
        data = bytes(range(100))
        u = backend.url("range.bin")
        backend.store.put_bytes(u, data)
        for (start, end), expect in RANGES:
            assert backend.store.get_bytes(u, start=start, end=end) == data[expect], f"start={start} end={end}"

    @pytest.mark.parametrize("pieces", [[1, 2, 3], [100], [40, 40, 40], [7] * 20])
    def test_open_range_reads_front_to_back_in_the_callers_pieces(self, backend, pieces):
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

    def test_open_range_of_a_missing_object_raises_not_found_naming_the_url(self, backend):
        u = backend.url("nope/missing-stream.bin")
        with pytest.raises(NotFound) as ei:
            with backend.store.open_range(u, 0, 10) as r:
                r.read(10)  # the chunked default fetches on the first read
        assert u in str(ei.value)

    def test_open_range_sends_one_request_for_a_streamed_range(self, backend):
        """A store that ``streams_ranges`` reads a range in many small pieces with one
        request (S3: one GET; local: the file), never through ``get_bytes``; the default
        (GCS) fetches ``part_size`` chunks with ``get_bytes``, one request per chunk."""
        data = os.urandom(12 * MiB)
        u = backend.url("stream-count.bin")
        backend.store.put_bytes(u, data)
        store = backend.store_with(part_size=5 * MiB)  # cached per options: every change below is undone
        chunked: list = []
        real = store.get_bytes
        store.get_bytes = lambda url, **kw: chunked.append((kw.get("start"), kw.get("end"))) or real(url, **kw)
        try:
            got = []
            with self.count_requests(store, "get") as gets, store.open_range(u, 10, len(data)) as r:
                while piece := r.read(64 * 1024):
                    got.append(bytes(piece))
        finally:
            vars(store).pop("get_bytes")
        assert b"".join(got) == data[10:]
        if store.streams_ranges:
            assert chunked == []
            if gets is not None:
                assert gets == [(10, len(data))]
        else:
            assert chunked == [(10, 10 + 5 * MiB), (10 + 5 * MiB, 10 + 10 * MiB), (10 + 10 * MiB, 12 * MiB)]

    def test_empty_objects_round_trip_as_bytes_and_files(self, backend, tmp_path):
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

    def test_unicode_and_special_characters_in_keys_round_trip_and_list_back_verbatim(self, backend):
        for key in ODD_KEYS:
            u = backend.url(key)
            backend.store.put_bytes(u, key.encode())
            assert backend.store.get_bytes(u) == key.encode(), key
            assert backend.store.stat(u).size == len(key.encode()), key
            listed = [e.url for e in backend.store.list(backend.url(key.split("/")[0] + "/"), delimiter=None)]
            assert listed == [u], key
            backend.store.delete(u)
            assert not backend.store.exists(u), key

    # ------------------------------------------------------------ listing and deleting many keys
    @pytest.mark.slow  # 1,500 objects per backend: 4-8 s each
    def test_1500_keys_are_listed_across_all_pages_then_deleted_by_prefix_in_batches(self, backend):
        # One population serves both halves: creating 1,500 objects is the slow part on
        # every server, and the delete half needs exactly what the list half checked.
        # 1,200 objects directly in the folder and 300 one level below: with a delimiter
        # that is 1,500 entries too (1,200 objects + 300 prefixes), so both modes span pages.
        keys = [f"many/k{i:04d}" for i in range(1200)] + [f"many/d{i:03d}/x" for i in range(300)]
        items = {backend.url(k): b"" for k in keys}
        _put_many(backend.store, items)
        keep = backend.url("many-sibling/keep")  # shares the string prefix "many"
        backend.store.put_bytes(keep, b"keep")
        with self.count_requests(backend.store, "list") as list_calls, \
                self.count_requests(backend.store, "delete") as delete_calls:
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
            if list_calls is not None and self.list_page_size:
                assert len(list_calls) == 2 * -(-N_MANY // self.list_page_size)  # pages per listing, two listings

            # delete_prefix: everything under the folder, nothing beside it
            assert backend.store.delete_prefix(backend.url("many")) == N_MANY
            if delete_calls is not None and self.delete_batch_size:
                assert len(delete_calls) == -(-N_MANY // self.delete_batch_size)
        assert list(backend.store.list(backend.url("many/"), delimiter=None)) == []
        assert backend.store.get_bytes(keep) == b"keep"

    # ------------------------------------------------------------ large (multipart) uploads
    @pytest.mark.slow  # 200 MiB up and down per backend
    def test_200_mib_multipart_upload_round_trips_with_identical_checksum(self, backend, big_file, tmp_path):
        path, digest = big_file
        u = backend.url("big/big.bin")
        store = backend.store_with(multipart_threshold=64 * MiB, part_size=16 * MiB)  # below BIG_SIZE: multipart
        progress: list[int] = []
        assert store.upload_file(path, u, progress=progress.append) == BIG_SIZE
        assert sum(progress) == BIG_SIZE
        assert store.stat(u).size == BIG_SIZE
        parts = -(-BIG_SIZE // (16 * MiB))
        if (told := self.uploaded_parts(backend, u)) is not None:
            assert told == parts
        if self.progress_per_part:
            assert len(progress) == parts
        out = tmp_path / "big-out.bin"
        assert store.download_file(u, str(out)) == BIG_SIZE
        assert sha256_file(str(out)) == digest

    def test_default_part_sizes_send_a_smaller_file_in_one_request_and_a_larger_one_in_parts(self, backend, tmp_path):
        if self.default_part_sizes is None:
            pytest.skip(f"{type(backend.store).__name__} writes files whole: no parts")
        threshold, part = self.default_part_sizes
        assert (backend.store.multipart_threshold, backend.store.part_size) == (threshold, part)
        size = part + 16 * MiB  # above one part, below the threshold
        assert size <= threshold
        path = tmp_path / "shard.bin"
        path.write_bytes(payload(size))
        u = backend.url("default/shard.bin")
        backend.store.upload_file(str(path), u)
        assert backend.store.stat(u).size == size
        if (parts := self.uploaded_parts(backend, u)) is not None:
            assert parts == 1  # one request
        small = backend.store_with(multipart_threshold=part)  # part_size stays the default
        small.upload_file(str(path), u)
        assert backend.store.stat(u).size == size
        if (parts := self.uploaded_parts(backend, u)) is not None:
            assert parts == 2

    # ------------------------------------------------------------ server-side copy
    def _copied(self, backend: StoreUnderTest, store: ObjectStore, data: bytes, name: str):
        """Put ``data`` at ``copy/<name>.src``, copy it to ``copy/<name>.dst`` with
        ``store``; check what every copy promises; returns (dst url, the progress calls)."""
        from ..transfer import crc32c_bytes

        src, dst = backend.url(f"copy/{name}.src"), backend.url(f"copy/{name}.dst")
        backend.store.put_bytes(src, data)
        progress: list[int] = []
        info = store.copy(src, dst, size=len(data), progress=progress.append)
        assert (info.url, info.size) == (dst, len(data))
        if info.crc32c is not None:
            assert info.crc32c == crc32c_bytes(data)
        assert sum(progress) == len(data) and all(n > 0 for n in progress), progress
        assert backend.store.get_bytes(dst) == data
        assert backend.store.get_bytes(src) == data, "the source is left as it was"
        assert backend.store.stat(dst).size == len(data)
        return dst, progress

    def test_copy_of_a_small_object_is_one_request_with_identical_bytes(self, backend):
        if not backend.store.copies_objects:
            pytest.skip(f"{type(backend.store).__name__} cannot copy (copies_objects is False)")
        dst, progress = self._copied(backend, backend.store, payload(MiB + 7, seed=3), "small")
        if (parts := self.uploaded_parts(backend, dst)) is not None:
            assert parts == 1  # one CopyObject
        dst, _ = self._copied(backend, backend.store, b"", "empty")
        assert backend.store.get_bytes(dst) == b""

    def test_copy_above_the_multipart_threshold_is_copied_in_parts(self, backend):
        """A copy larger than ``multipart_threshold`` goes in ``part_size`` parts where the
        store has parts (S3's UploadPartCopy: one CopyObject stops at 5 GiB)."""
        if not backend.store.copies_objects:
            pytest.skip(f"{type(backend.store).__name__} cannot copy (copies_objects is False)")
        store = backend.store_with(multipart_threshold=5 * MiB, part_size=5 * MiB)
        size = 12 * MiB + 5  # three parts: 5, 5 and 2 MiB + 5 bytes
        dst, progress = self._copied(backend, store, payload(size, seed=4), "parts")
        if (parts := self.uploaded_parts(backend, dst)) is not None:
            assert parts == 3
            assert sorted(progress) == sorted([5 * MiB, 5 * MiB, 2 * MiB + 5]), "progress once per part"

    def test_copy_replaces_an_existing_destination(self, backend):
        if not backend.store.copies_objects:
            pytest.skip(f"{type(backend.store).__name__} cannot copy (copies_objects is False)")
        backend.store.put_bytes(backend.url("copy/over.dst"), b"an older, longer object" * 100)
        self._copied(backend, backend.store, b"the new bytes", "over")

    def test_copy_of_an_object_onto_itself_changes_nothing(self, backend):
        if not backend.store.copies_objects:
            pytest.skip(f"{type(backend.store).__name__} cannot copy (copies_objects is False)")
        u = backend.url("copy/self.bin")
        backend.store.put_bytes(u, b"unchanged")
        info = backend.store.copy(u, u, size=9)
        assert (info.url, info.size) == (u, 9)
        assert backend.store.get_bytes(u) == b"unchanged"

    def test_copy_of_a_missing_source_raises_not_found_naming_it_and_writes_nothing(self, backend):
        if not backend.store.copies_objects:
            pytest.skip(f"{type(backend.store).__name__} cannot copy (copies_objects is False)")
        src, dst = backend.url("copy/missing.src"), backend.url("copy/missing.dst")
        backend.store.put_bytes(backend.url("copy/present"), b"x")  # the folder exists
        with pytest.raises(NotFound) as ei:
            backend.store.copy(src, dst, size=1)
        assert src in str(ei.value) and ei.value.url == src
        assert not isinstance(ei.value, BucketNotFound)
        assert not backend.store.exists(dst)

    def test_copy_of_a_source_of_another_size_raises_precondition_failed_and_writes_nothing(self, backend):
        if not backend.store.copies_objects:
            pytest.skip(f"{type(backend.store).__name__} cannot copy (copies_objects is False)")
        src, dst, kept = backend.url("copy/sized.src"), backend.url("copy/sized.dst"), backend.url("copy/kept.dst")
        backend.store.put_bytes(src, b"12345")
        backend.store.put_bytes(kept, b"keep me")
        for expected in (4, 6, 0):
            with pytest.raises(PreconditionFailed) as ei:
                backend.store.copy(src, dst, size=expected, progress=lambda n: pytest.fail("no byte moves"))
            assert src in str(ei.value) and f"{expected} expected" in str(ei.value)
            with pytest.raises(PreconditionFailed):
                backend.store.copy(src, kept, size=expected)
        assert not backend.store.exists(dst)
        assert backend.store.get_bytes(kept) == b"keep me"

    # ------------------------------------------------------------ conditional create
    def test_conditional_create_raced_by_two_writers_has_exactly_one_winner(self, backend):
        def write(u: str, payload: bytes, barrier: threading.Barrier, outcome: dict[int, str], i: int) -> None:
            barrier.wait()
            try:
                backend.store.put_bytes(u, payload, if_absent=True)
                outcome[i] = "won"
            except AlreadyExists:
                outcome[i] = "lost"

        for round_ in range(5):
            u = backend.url(f"race/marker-{round_}.json")
            barrier = threading.Barrier(2)
            outcome: dict[int, str] = {}
            data = {i: f'{{"writer": {i}, "round": {round_}}}'.encode() * 50 for i in (0, 1)}
            threads = [threading.Thread(target=write, args=(u, data[i], barrier, outcome, i)) for i in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert sorted(outcome.values()) == ["lost", "won"], f"round {round_}: {outcome}"
            winner = next(i for i, o in outcome.items() if o == "won")
            assert backend.store.get_bytes(u) == data[winner]

    def test_conditional_create_of_an_existing_object_raises_already_exists_and_keeps_it(self, backend, tmp_path):
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

    # ------------------------------------------------------------ stat, exists, missing things
    def test_stat_and_exists_describe_an_object(self, backend):
        u = backend.url("st/obj")
        before = time.time()
        backend.store.put_bytes(u, b"12345")
        info = backend.store.stat(u)
        assert info.url == u and info.size == 5
        assert info.mtime is not None and abs(info.mtime - before) < 300
        assert backend.store.exists(u)
        assert not backend.store.exists(backend.url("st/other"))
        assert not backend.store.exists(backend.url("st"))  # a folder is not an object

    def test_missing_objects_raise_not_found_naming_the_url(self, backend, tmp_path):
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

    def test_missing_bucket_raises_bucket_not_found(self, backend):
        if backend.bucket is None:
            pytest.skip("local folders have no buckets (a missing folder lists as empty)")
        missing = f"{parse_url(backend.bucket).scheme}://missing-{uuid.uuid4().hex[:12]}"
        u = missing + "/some/key"
        calls = [
            lambda: backend.store.get_bytes(u),
            lambda: list(backend.store.list(missing + "/some/")),
            lambda: backend.store.check_bucket(missing + "/some"),
            lambda: backend.store.delete(u),
        ]
        if not self.creates_buckets_on_write:
            calls.append(lambda: backend.store.put_bytes(u, b"x"))
        for call in calls:
            with pytest.raises(BucketNotFound) as ei:
                call()
            assert missing.split("://")[1] in str(ei.value)
        with pytest.raises(NotFound):  # S3's HEAD has no body to say which is missing: NotFound at least
            backend.store.stat(u)

    # ------------------------------------------------------------ credentials
    def test_wrong_credentials_raise_access_denied_without_leaking_the_secret(self, backend, credentials, monkeypatch):
        if credentials is None:
            pytest.skip(self.no_credentials)
        u = backend.url("creds/obj")
        backend.store.put_bytes(u, b"secret data")

        bogus = credentials.use_wrong(monkeypatch)
        clear_cache()
        with pytest.raises(AccessDenied) as ei:
            open_store(backend.root).get_bytes(u)
        msg = f"{ei.value} {ei.value!r} {ei.value.__cause__!r} {ei.value.__context__!r}"
        assert u in str(ei.value)
        assert bogus not in msg and not any(s in msg for s in credentials.secrets)

        # a read-only identity may read but not write
        ro_secret = credentials.use_read_only(monkeypatch)
        clear_cache()
        ro = open_store(backend.root)
        assert ro.get_bytes(u) == b"secret data"
        with pytest.raises(AccessDenied) as ei:
            ro.put_bytes(backend.url("creds/new"), b"x")
        assert ro_secret not in f"{ei.value} {ei.value!r}"
        assert isinstance(ei.value, PermissionError)

    # ------------------------------------------------------------ URLs
    def test_malformed_urls_raise_invalid_url_from_store_calls(self, backend):
        bad = self.malformed_url(backend)
        for call in (backend.store.get_bytes, backend.store.stat, backend.store.delete,
                     lambda u: list(backend.store.list(u))):
            with pytest.raises(InvalidURL):
                call(bad)

    def test_urls_of_another_scheme_raise_invalid_url(self, backend):
        other = "gs://some-bucket/key" if backend.store.scheme == "s3" else "s3://some-bucket/key"
        with pytest.raises(InvalidURL):
            backend.store.get_bytes(other)
        with pytest.raises(InvalidURL):
            backend.store.put_bytes(other, b"x")

    # ------------------------------------------------------------ unsafe deletes
    def test_delete_prefix_refuses_a_bucket_root(self, backend):
        root = backend.bucket + "/" if backend.bucket else "/"
        with pytest.raises(UnsafeDelete) as ei:
            backend.store.delete_prefix(root)
        assert "force=True" in str(ei.value)

    def test_delete_prefix_refuses_a_prefix_shallower_than_min_delete_depth_unless_forced(self, backend):
        shallow = backend.url("shallow")
        u = backend.url("shallow/a/b")
        backend.store.put_bytes(u, b"x")
        store = backend.store_with(min_delete_depth=urls.depth(shallow) + 1)
        with pytest.raises(UnsafeDelete):
            store.delete_prefix(shallow)
        assert backend.store.exists(u)
        assert store.delete_prefix(shallow, force=True) == 1
        assert not backend.store.exists(u)

    def test_delete_prefix_of_a_bucket_root_with_force_empties_the_bucket(self, backend):
        if backend.bucket is None:
            pytest.skip("the root of a local 'bucket' is the filesystem root: never delete it in a test")
        a, b = backend.bucket + "/x", backend.bucket + "/y/z"
        backend.store.put_bytes(a, b"1")
        backend.store.put_bytes(b, b"2")
        assert backend.store.delete_prefix(backend.bucket, force=True) == 2
        assert list(backend.store.list(backend.bucket + "/", delimiter=None)) == []

    # ------------------------------------------------------------ multipart upload listing
    def test_incomplete_multipart_uploads_are_listed_and_aborted_under_a_prefix(self, backend):
        upload_id = self.start_incomplete_upload(backend, backend.url("mpu/obj.bin"))
        if upload_id is None:  # no listable incomplete uploads (local folders, GCS)
            assert backend.store.list_multipart_uploads(backend.url("mpu/")) == []
            assert backend.store.abort_multipart_uploads(backend.url("mpu/")) == []
            return
        elsewhere = backend.url("elsewhere/obj.bin")
        other = self.start_incomplete_upload(backend, elsewhere)

        pending = backend.store.list_multipart_uploads(backend.url("mpu/"))
        assert [(x.url, x.upload_id) for x in pending] == [(backend.url("mpu/obj.bin"), upload_id)]
        assert pending[0].initiated is not None
        # (moto reports a fixed initiation time in 2010, so "now" is taken relative to it)
        too_young = pending[0].initiated + 60
        assert backend.store.abort_multipart_uploads(backend.url("mpu/"), older_than=3600, now=too_young) == []
        aborted = backend.store.abort_multipart_uploads(backend.url("mpu/"))
        assert [x.upload_id for x in aborted] == [upload_id]
        assert backend.store.list_multipart_uploads(backend.url("mpu/")) == []
        remaining = backend.store.list_multipart_uploads(backend.url("elsewhere/"))
        assert [(x.url, x.upload_id) for x in remaining] == [(elsewhere, other)]

    # ------------------------------------------------------------ assembly from pieces
    # storage/assembly.py: pieces uploaded by several processes (here: threads, each
    # with its own unpickled copy of the store and of the Assembly, as another rank
    # would have), one completes; nothing is at the URL before the complete.
    def _piece_sizes(self, store: ObjectStore, n: int, last: int = 1234) -> list[int]:
        return [max(store.min_piece_size, 64 * 1024)] * (n - 1) + [last]

    def _upload_pieces(self, store: ObjectStore, assembly, data: bytes, sizes: list[int]) -> list:
        """Every piece uploaded, in a shuffled order, from 4 threads each with their own
        copies of the store and the Assembly; their records."""
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        order = list(range(len(sizes)))
        order = order[1::2] + order[::2]  # not in index order

        def put(k: int):
            mine = pickle.loads(pickle.dumps(store))
            a = pickle.loads(pickle.dumps(assembly))
            return mine.put_piece(a, k, data[offsets[k]:offsets[k] + sizes[k]], offset=offsets[k])

        with ThreadPoolExecutor(4) as ex:
            return list(ex.map(put, order))

    @staticmethod
    def _assembling(backend: StoreUnderTest) -> ObjectStore:
        """The store, where it assembles objects (else the test is skipped, saying why)."""
        if not backend.store.assembles_objects:
            pytest.skip(f"{type(backend.store).__name__}.assembles_objects is False: assembly calls raise (tested "
                        "below)")
        return backend.store

    def _assemble(self, backend: StoreUnderTest, name: str, n: int) -> tuple[str, bytes, list]:
        store = self._assembling(backend)
        sizes = self._piece_sizes(store, n)
        data = payload(sum(sizes), seed=n)
        u = backend.url(name)
        assembly = store.begin_assembly(u)
        pieces = self._upload_pieces(store, assembly, data, sizes)
        assert [p.size for p in sorted(pieces, key=lambda p: p.index)] == sizes
        with pytest.raises(NotFound):  # nothing at the URL before the complete
            store.stat(u)
        assert u not in [e.url for e in store.list(backend.root + "/", delimiter=None)]
        info = store.complete_assembly(assembly, pieces)
        assert info.size == len(data) == store.stat(u).size
        return u, data, pieces

    def test_assembly_from_pieces_of_several_writers_appears_whole_only_at_the_complete(self, backend):
        u, data, _ = self._assemble(backend, "asm/obj.bin", 3)
        assert backend.store.get_bytes(u) == data
        # nothing else remains: no component, no temporary file, no incomplete upload
        assert [e.url for e in backend.store.list(backend.root + "/", delimiter=None)] == [u]
        assert backend.store.list_multipart_uploads(backend.url("asm/")) == []

    def test_assembly_of_more_pieces_than_one_compose_takes_is_nested_and_cleaned_up(self, backend):
        if backend.store.min_piece_size > MiB:
            pytest.skip(f"pieces are {backend.store.min_piece_size} bytes at least here: 70 of them would be "
                        "350 MiB; a multipart upload of 3 parts runs the same requests (the test above)")
        u, data, _ = self._assemble(backend, "asm/many.bin", 70)  # GCS: 32 + 32 + 6, then one compose of 3
        assert backend.store.get_bytes(u) == data
        assert [e.url for e in backend.store.list(backend.root + "/", delimiter=None)] == [u]

    def test_assembly_aborted_leaves_nothing_visible(self, backend):
        store = self._assembling(backend)
        u = backend.url("asm/aborted.bin")
        assembly = store.begin_assembly(u)
        sizes = self._piece_sizes(store, 2)
        self._upload_pieces(store, assembly, payload(sum(sizes)), sizes)
        pickle.loads(pickle.dumps(store)).abort_assembly(assembly)  # another process may abort
        store.abort_assembly(assembly)  # twice: not an error
        assert not store.exists(u)
        assert list(store.list(backend.root + "/", delimiter=None)) == []
        assert store.list_multipart_uploads(backend.url("asm/")) == []

    def test_assembly_complete_refuses_pieces_that_do_not_follow_each_other_and_sends_nothing(self, backend):
        store = self._assembling(backend)
        u = backend.url("asm/gap.bin")
        assembly = store.begin_assembly(u)
        sizes = self._piece_sizes(store, 3)
        pieces = sorted(self._upload_pieces(store, assembly, payload(sum(sizes)), sizes), key=lambda p: p.index)
        for bad in (pieces[:1] + pieces[2:], pieces + [pieces[0]], []):
            with pytest.raises(PreconditionFailed):
                store.complete_assembly(assembly, bad)
        if store.min_piece_size > 1:  # a piece under the store's minimum, not the last: refused here
            small = [dataclasses.replace(pieces[0], size=store.min_piece_size - 1)]
            with pytest.raises(PreconditionFailed, match="at least"):
                store.complete_assembly(assembly, small + [dataclasses.replace(pieces[1], offset=small[0].size)])
        assert not store.exists(u)
        store.complete_assembly(assembly, pieces)  # the assembly is still whole
        assert store.get_bytes(u) == payload(sum(sizes))

    def test_assembly_complete_if_absent_over_an_existing_object_raises_already_exists_and_keeps_it(self, backend):
        store = self._assembling(backend)
        if self.assembly_if_absent_ignored:
            pytest.skip(self.assembly_if_absent_ignored)
        u = backend.url("asm/taken.bin")
        store.put_bytes(u, b"first")
        assembly = store.begin_assembly(u)
        sizes = self._piece_sizes(store, 2)
        pieces = self._upload_pieces(store, assembly, payload(sum(sizes)), sizes)
        with pytest.raises(AlreadyExists):
            store.complete_assembly(assembly, pieces, if_absent=True)
        store.abort_assembly(assembly)
        assert store.get_bytes(u) == b"first"
        assert [e.url for e in store.list(backend.root + "/", delimiter=None)] == [u]

    def test_a_store_that_cannot_assemble_says_so_on_every_assembly_call(self, backend):
        from ..storage.assembly import Assembly, Piece

        store = backend.store
        if store.assembles_objects:
            assert store.min_piece_size >= 0 and (store.max_pieces is None or store.max_pieces > 1)
            return
        a = Assembly(backend.url("asm/x"), "t")
        for call in (lambda: store.begin_assembly(a.url), lambda: store.put_piece(a, 0, b"x", offset=0),
                     lambda: store.complete_assembly(a, [Piece(0, 0, 1)]), lambda: store.abort_assembly(a)):
            with pytest.raises(StorageError, match="assemble"):
                call()

    # ------------------------------------------------------------ pickling
    def test_a_pickled_store_works_in_the_copy(self, backend):
        u = backend.url("pickle/obj")
        backend.store.put_bytes(u, b"before pickling")  # the original's client exists now
        copy = pickle.loads(pickle.dumps(backend.store))
        assert type(copy) is type(backend.store) and copy is not backend.store
        assert copy.options == backend.store.options
        assert copy.get_bytes(u) == b"before pickling"
        copy.put_bytes(u, b"written by the copy")
        assert backend.store.get_bytes(u) == b"written by the copy"

    # ------------------------------------------------------------ the commit protocol
    # cloudckpt.checkpoint.commit drives the step's lock and marker through the
    # store alone: every backend runs the protocol here, without ranks.
    def _attempt(self, backend: StoreUnderTest, step: int = 1, **kw):
        from ..checkpoint.commit import StepCommit
        from ..checkpoint.step import StepRef

        return StepCommit(StepRef.of(backend.url("run", f"step{step}"), step=step), save_id=uuid.uuid4().hex,
                          world_size=2, **kw)

    def _entry(self, backend: StoreUnderTest, attempt, rel: str, data: bytes):
        from ..checkpoint.entries import ObjectEntry
        from ..transfer import crc32c_bytes

        backend.store.put_bytes(urls.join(attempt.dir, rel), data)
        return ObjectEntry(rel, len(data), crc32c_bytes(data))

    def test_commit_protocol_prepare_commit_writes_the_marker_last_and_releases_the_lock(self, backend):
        from ..checkpoint import discovery
        from ..checkpoint.layout import part_name
        from ..errors import CheckpointExists
        from ..storage import Location

        a = self._attempt(backend)
        a.prepare()
        assert a.locked and backend.store.exists(a.lock_url) and not backend.store.exists(a.marker_url)
        meta = self._entry(backend, a, "model_and_optim/.metadata", b"meta")
        parts = [a.publish_part(r, [self._entry(backend, a, f"train/rank{r}.pt", b"train state %d" % r),
                                    self._entry(backend, a, f"model_and_optim/__{r}_0.distcp", b"shard" * (r + 1))])
                 for r in (0, 1)]  # every rank: its part, before the agree step
        assert not discovery.dir_is_checkpoint(a.dir), "no marker yet: not a checkpoint"
        marker = a.commit(a.marker(parts, [meta], ephemeral=False))
        assert not backend.store.exists(a.lock_url), "the lock is released after the commit"
        got = discovery.read_marker(a.dir)  # every part read and checked against the marker
        assert got.save_id == a.save_id and got.step == 1 and got.total_bytes == marker.total_bytes
        assert got.object(part_name(1)).size == parts[1].size and got.object("train/rank1.pt").size == 13
        assert got.object_count == marker.object_count == 7
        only = discovery.StepManifest(Location.of(a.dir), discovery.read_header(a.dir))
        assert only.entry("model_and_optim/__1_0.distcp").size == 10 and only.parts_read == 1, "one part read"
        assert discovery.latest_checkpoint(backend.url("run")) == a.dir
        with pytest.raises(CheckpointExists, match="step1"):
            self._attempt(backend).prepare()

    def test_commit_protocol_a_fresh_lock_refuses_a_second_save_and_a_stale_one_is_taken_over(self, backend):
        from ..errors import SaveInProgress

        first = self._attempt(backend)
        first.prepare()
        self._entry(backend, first, "train/rank0.pt", b"left by the first attempt")
        with pytest.raises(SaveInProgress, match="in progress"):
            self._attempt(backend).prepare()
        second = self._attempt(backend, stale_lock_seconds=0.0)  # every lock is stale to it
        second.prepare()
        assert second.locked
        assert sorted(o.url for o in backend.store.walk(urls.as_prefix(second.dir))) == [second.lock_url], \
            "the abandoned attempt's objects are cleared; only the new lock stays"
        first.abort()  # the first attempt lost its lock: its abort removes nothing
        assert backend.store.exists(second.lock_url)

    @pytest.mark.parametrize("body", [b"[" * 30_000 + b"]" * 30_000, b'{"save_id": "x", "created_unix": Infinity}',
                                      b'{"save_id": "x", "created_unix": 1e999}', b"\xff\xfe not json",
                                      b'{"save_id": "' + b"9" * 5000 + b'", "created_unix": 1}', b"[]"])
    def test_commit_protocol_a_lock_that_is_not_ours_is_taken_over_as_abandoned(self, backend, body):
        a = self._attempt(backend)
        backend.store.put_bytes(a.lock_url, body)
        a.prepare()  # judged stale (unreadable), taken over with a compare-and-swap
        assert a.locked and a._lock_owner() == a.save_id

    def test_commit_protocol_an_oversized_lock_is_a_typed_error_read_no_further(self, backend):
        from ..errors import CorruptCheckpoint

        a = self._attempt(backend)
        backend.store.put_bytes(a.lock_url, b"{" + b" " * (2 * MiB) + b"}")
        with self.count_requests(backend.store, "get") as gets:
            with pytest.raises(CorruptCheckpoint, match="delete it") as ei:
                a.prepare()
        assert a.lock_url in str(ei.value)
        if gets is not None:
            assert all(end - start <= 64 * 1024 + 1 for start, end in gets), \
                f"reads stay under the lock ceiling: {gets}"

    def test_commit_protocol_abort_removes_the_attempt_and_a_lost_commit_answer_is_our_own(self, backend):
        from ..errors import CheckpointExists

        a = self._attempt(backend)
        a.prepare()
        self._entry(backend, a, "train/rank0.pt", b"x")
        a.abort()
        assert list(backend.store.walk(urls.as_prefix(a.dir))) == [] and not a.locked
        b = self._attempt(backend)
        b.prepare()
        marker = b.marker([b.publish_part(0, [self._entry(backend, b, "train/rank0.pt", b"y")])], [], ephemeral=True)
        backend.store.put_bytes(b.marker_url, marker.to_bytes())  # our create landed, its answer was lost
        assert b.commit(marker).save_id == b.save_id
        c = self._attempt(backend, save_overwrite=True)
        c.prepare()  # replaces the committed step (marker first)
        other = self._attempt(backend)
        backend.store.put_bytes(c.marker_url, other.marker([], [], ephemeral=False).to_bytes())  # another job committed
        with pytest.raises(CheckpointExists, match="another save"):
            c.commit(c.marker([], [], ephemeral=False))

    def test_commit_protocol_a_part_is_trusted_only_as_the_marker_describes_it(self, backend):
        from ..checkpoint import discovery
        from ..checkpoint.layout import part_name
        from ..checkpoint.parts import ManifestPart
        from ..errors import CorruptCheckpoint, SaveFailed, UnsafeCheckpoint

        a = self._attempt(backend)
        a.prepare()
        with pytest.raises(SaveFailed, match="rank 0"):  # refused at save time: our reader would refuse it
            a.publish_part(0, [self._entry(backend, a, "train/rank1.pt", b"not rank 0's")])
        ref = a.publish_part(1, [self._entry(backend, a, "train/rank1.pt", b"rank 1")])
        a.commit(a.marker([ref], [], ephemeral=False))
        url = urls.join(a.dir, part_name(1))
        honest = backend.store.get_bytes(url)
        backend.store.put_bytes(url, honest + b" ")  # one byte more than the marker says
        with pytest.raises(CorruptCheckpoint, match="manifest part"):
            discovery.read_marker(a.dir)
        # a part of another save, its bytes what the marker says: refused by what it names
        other = ManifestPart(step=1, rank=1, save_id="0" * 32, objects=()).to_bytes()
        backend.store.put_bytes(url, other)
        m = discovery.read_header(a.dir)
        with pytest.raises(UnsafeCheckpoint, match="another step, rank or save"):
            ManifestPart.from_bytes(other, url=url, ref=type(ref).of(1, other, ManifestPart(1, 1, "0" * 32, ())),
                                    step=m.step, save_id=m.save_id)
