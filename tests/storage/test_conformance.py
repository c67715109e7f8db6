"""The ObjectStore conformance suite (cloudckpt/testing/conformance.py) against the
object-store backends on 127.0.0.1: SeaweedFS (S3, credentials enforced), moto server
(S3) and fake-gcs-server (GCS). The local folder runs it in test_conformance_local.py
(the example of docs/development.md). What differs between backends is the hooks
(request counts, part counts, incomplete uploads, credentials), never the assertions.
"""

from __future__ import annotations

import contextlib
import uuid

import pytest

from cloudckpt.storage import StorageOptions, open_store
from cloudckpt.storage.url import parse_url
from cloudckpt.testing.conformance import Credentials, MiB, ObjectStoreConformance
from cloudckpt.testing.servers import free_port

_S3_EVENTS = {"list": "before-call.s3.ListObjectsV2", "delete": "before-call.s3.DeleteObjects",
              "get": "before-parameter-build.s3.GetObject"}


def _range(params: dict) -> tuple[int, int]:
    first, _, last = params["Range"].removeprefix("bytes=").partition("-")
    return int(first), int(last) + 1


class S3Conformance(ObjectStoreConformance):
    """What an S3 store tells about its requests and parts (boto3 events, ETags)."""

    # A checkpoint shard file (~256 MiB) goes up in one PutObject, larger files in 64 MiB parts
    default_part_sizes = (512 * MiB, 64 * MiB)
    list_page_size = 1000  # ListObjectsV2
    delete_batch_size = 1000  # DeleteObjects

    @contextlib.contextmanager
    def count_requests(self, store, operation):
        calls: list = []
        event = _S3_EVENTS[operation]

        def count(params=None, **_):
            calls.append(_range(params) if operation == "get" else 1)

        store.client.meta.events.register(event, count)
        try:
            yield calls
        finally:
            store.client.meta.events.unregister(event, count)

    def uploaded_parts(self, backend, url):
        p = parse_url(url)
        etag = backend.store.client.head_object(Bucket=p.bucket, Key=p.key)["ETag"].strip('"')
        return int(etag.rpartition("-")[2]) if "-" in etag else 1  # a multipart ETag ends in -<parts>

    def start_incomplete_upload(self, backend, url):
        p = parse_url(url)
        return backend.store.client.create_multipart_upload(Bucket=p.bucket, Key=p.key)["UploadId"]

    def unreachable_store(self, backend):
        endpoint = f"http://127.0.0.1:{free_port()}"
        return open_store(backend.root, StorageOptions(endpoint_url=endpoint, max_attempts=1)), endpoint


class TestSeaweedFS(S3Conformance):
    creates_buckets_on_write = True  # for an admin identity

    @pytest.fixture
    def root(self, s3_bucket):
        return s3_bucket + "/root"

    @pytest.fixture
    def credentials(self, seaweed):
        def wrong(monkeypatch):
            bogus = "bogus-" + uuid.uuid4().hex
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bogus)
            return bogus

        def read_only(monkeypatch):
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.ro_access_key)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.ro_secret_key)
            return seaweed.ro_secret_key

        return Credentials(wrong, read_only, (seaweed.secret_key, seaweed.ro_secret_key))


class TestMoto(S3Conformance):
    no_credentials = "moto server accepts any credentials"

    @pytest.fixture
    def root(self, moto_bucket):
        return moto_bucket + "/root"


class TestGCS(ObjectStoreConformance):
    progress_per_part = True  # a resumable upload in part_size chunks
    # one chunk in memory per running upload: google-cloud-storage's sizes, not S3's
    default_part_sizes = (64 * MiB, 16 * MiB)
    no_credentials = "fake-gcs-server accepts any credentials (missing ADC is tested in test_gcs.py)"
    # checked: fake-gcs-server 1.x answers a compose (and a rewrite) with ifGenerationMatch=0
    # onto an existing object by replacing it; GCS answers 412, which gcs.py turns into AlreadyExists
    assembly_if_absent_ignored = "fake-gcs-server ignores ifGenerationMatch on compose (GCS enforces it)"

    @pytest.fixture
    def root(self, gcs_bucket):
        return gcs_bucket + "/root"
