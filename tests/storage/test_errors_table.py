"""One status-to-error table (storage/errors_table.py) for S3, GCS and http(s): the same
status gives the same error from every backend, and the message keeps the URL (without
credentials), the answer and the backend's hint."""

from __future__ import annotations

import io

import botocore.exceptions as bex
import pytest
import requests
from google.api_core import exceptions as gexc

from cloudckpt.errors import AccessDenied, InvalidURL, NotFound, PreconditionFailed, StorageError, Throttled, Transient
from cloudckpt.storage import gcs, s3
from cloudckpt.storage.errors_table import STATUS_ERRORS, error_class
from cloudckpt.storage.http import HTTPStore

STATUSES = (400, 401, 403, 404, 405, 408, 409, 410, 412, 418, 429, 500, 501, 502, 503, 504, 507)


def _s3(status: int, code: str = "", message: str = "the store's words") -> BaseException:
    e = bex.ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
                        "GetObject")
    return s3.translate(e, "s3://bucket/run/obj", "get")


def _gcs(status: int, message: str = "the store's words") -> BaseException:
    return gcs.translate(gexc.from_http_status(status, message), "gs://bucket/run/obj", "get")


def _http(status: int, url: str = "https://127.0.0.1:9/run/obj") -> BaseException:
    r = requests.Response()
    r.status_code, r.raw = status, io.BytesIO(b"")
    with pytest.raises(StorageError) as ei:
        HTTPStore._check_status(r, url, "get")
    return ei.value


@pytest.mark.parametrize("status", STATUSES)
def test_a_status_is_the_same_error_from_every_backend(status):
    want = error_class(status)
    got = {"s3": _s3(status), "gcs": _gcs(status), "http": _http(status)}
    assert {name: type(e) for name, e in got.items()} == dict.fromkeys(got, want)
    for name, e in got.items():
        assert e.url in str(e) and str(status) in str(e), (name, str(e))


def test_the_table_says_what_the_backends_said_before_it():
    assert [error_class(s) for s in (401, 403, 404, 412, 429, 503, 500, 502, 409, 400)] == [
        AccessDenied, AccessDenied, NotFound, PreconditionFailed, Throttled, Throttled, Transient, Transient,
        Transient, StorageError]
    assert all(issubclass(c, StorageError) for c in STATUS_ERRORS.values())


@pytest.mark.parametrize("code,status,want", [
    ("NoSuchKey", 404, NotFound), ("NoSuchUpload", 404, NotFound), ("404", 404, NotFound),
    ("PreconditionFailed", 412, PreconditionFailed), ("SlowDown", 503, Throttled), ("429", 429, Throttled),
    ("ExpiredToken", 400, AccessDenied),  # a code that stands for its status whatever status came with it
    ("ConditionalRequestConflict", 409, Transient), ("InternalError", 500, Transient),
    ("InvalidBucketName", 400, InvalidURL), ("KeyTooLongError", 400, InvalidURL),
    ("MalformedXML", 400, StorageError),
])
def test_s3_error_codes_stand_for_their_status(code, status, want):
    e = _s3(status, code)
    assert type(e) is want and "s3://bucket/run/obj" in str(e) and code in str(e)


def test_an_unexpected_answer_keeps_the_stores_own_words():
    assert "unexpected answer (MalformedXML): the store's words" in str(_s3(400, "MalformedXML"))
    assert "unexpected answer (418): the store's words" in str(_gcs(418))


def test_each_backend_says_where_its_credentials_come_from():
    assert "AWS_PROFILE" in str(_s3(403, "AccessDenied"))
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(_gcs(403))
    assert "sends no credentials to http(s)://" in str(_http(401))
    assert "retries were exhausted" in str(_s3(503, "SlowDown")) and "retries were exhausted" in str(_gcs(429))


def test_a_retry_error_around_throttling_says_retries_were_exhausted_once():
    e = gcs.translate(gexc.RetryError("gave up", gexc.TooManyRequests("slow down")), "gs://bucket/k", "put")
    assert type(e) is Throttled and str(e).count("retries were exhausted") == 1


def test_an_http_error_never_repeats_the_credentials_in_the_url():
    e = _http(403, "https://user:s3cr3t@127.0.0.1:9/run/obj")
    assert type(e) is AccessDenied and "https://127.0.0.1:9/run/obj" in str(e)
    assert "s3cr3t" not in str(e) and "user" not in str(e) and "s3cr3t" not in str(e.url)


def test_an_answer_that_is_neither_an_error_nor_the_object_is_a_storage_error():
    e = _http(204)
    assert type(e) is StorageError and "unexpected answer (HTTP 204)" in str(e)
