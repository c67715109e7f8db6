"""What only the GCS backend has: error translation, ADC/emulator client set-up, retry
reporting and the lost-response conditional create. Faults are injected with a
requests adapter mounted on the store's own HTTP session (fake-gcs-server on
127.0.0.1 answers everything else)."""

from __future__ import annotations

import io
import os

import pytest
import requests
import requests.adapters
from google.api_core import exceptions as gexc
from google.auth import exceptions as gauth_exc

from cloudckpt.errors import (
    AccessDenied,
    AlreadyExists,
    BucketNotFound,
    InvalidURL,
    NotFound,
    PreconditionFailed,
    StorageError,
    Throttled,
    Transient,
)
from cloudckpt.storage import StorageOptions
from cloudckpt.storage.gcs import GCSStore, translate

URL = "gs://some-bucket/run/step1/obj"


# ---------------------------------------------------------------- translation
@pytest.mark.parametrize(
    "exc,expected",
    [
        (gexc.Unauthorized("401"), AccessDenied),
        (gexc.Forbidden("caller does not have storage.objects.get access"), AccessDenied),
        (gexc.NotFound("No such object: some-bucket/run/step1/obj"), NotFound),
        (gexc.NotFound("The specified bucket does not exist."), BucketNotFound),
        (gexc.PreconditionFailed("conditionNotMet"), PreconditionFailed),
        (gexc.TooManyRequests("rate"), Throttled),
        (gexc.ServiceUnavailable("backend"), Throttled),
        (gexc.InternalServerError("oops"), Transient),
        (gexc.BadGateway("oops"), Transient),
        (gexc.GatewayTimeout("oops"), Transient),
        (gexc.BadRequest("Invalid object name"), InvalidURL),
        (gexc.BadRequest("something else"), StorageError),
        (requests.exceptions.ConnectionError("reset by peer"), Transient),
        (requests.exceptions.ReadTimeout("slow"), Transient),
        (ConnectionResetError("reset"), Transient),
        (gauth_exc.TransportError("metadata server unreachable"), Transient),
        (gauth_exc.RefreshError("invalid_grant"), AccessDenied),
        (gexc.RetryError("deadline", gexc.ServiceUnavailable("busy")), Throttled),
        (gexc.RetryError("deadline", requests.exceptions.ConnectionError("reset")), Transient),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__,
)
def test_translate_maps_google_errors_into_the_error_tree_with_the_url(exc, expected):
    err = translate(exc, URL, "get")
    assert type(err) is expected
    assert URL in str(err)


def test_translate_separates_throttling_from_other_server_errors():
    assert not isinstance(translate(gexc.InternalServerError("x"), URL, "put"), Throttled)
    assert isinstance(translate(gexc.ServiceUnavailable("x"), URL, "put"), Throttled)


def test_ambiguous_404_asks_whether_the_bucket_exists():
    bare = gexc.NotFound("Not Found")  # what emulators answer for both cases
    assert type(translate(bare, URL, "get", bucket_exists=lambda: False)) is BucketNotFound
    assert type(translate(bare, URL, "get", bucket_exists=lambda: True)) is NotFound


def test_missing_application_default_credentials_raise_access_denied_with_the_fix(monkeypatch, tmp_path):
    # GOOGLE_APPLICATION_CREDENTIALS naming a missing file fails inside google.auth
    # without any network call (no metadata-server probe).
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    store = GCSStore()
    with pytest.raises(AccessDenied) as ei:
        store.get_bytes(URL)
    msg = str(ei.value)
    assert URL in msg
    assert "gcloud auth application-default login" in msg and "GOOGLE_APPLICATION_CREDENTIALS" in msg


# ---------------------------------------------------------------- client set-up
def test_emulator_host_is_read_when_the_client_is_first_used(gcs_bucket, fake_gcs, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    store = GCSStore()  # created before the variable is set: nothing is read yet
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.endpoint_url.removeprefix("http://"))  # no scheme is fine
    store.put_bytes(gcs_bucket + "/lazy", b"ok")
    assert store.get_bytes(gcs_bucket + "/lazy") == b"ok"


def test_project_comes_from_the_options_then_the_env_then_a_placeholder(gcs_bucket, monkeypatch):
    assert GCSStore(StorageOptions(project="my-proj")).client.project == "my-proj"
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "env-proj")
    assert GCSStore().client.project == "env-proj"
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT")
    assert GCSStore().client.project == "cloudckpt-emulator"


def test_urls_naming_a_bucket_or_folder_are_not_objects(gcs_bucket):
    store = GCSStore()
    for bad in (gcs_bucket, gcs_bucket + "/folder/"):
        with pytest.raises(InvalidURL):
            store.put_bytes(bad, b"x")


def test_upload_from_a_non_seekable_stream_in_chunks(gcs_bucket):
    store = GCSStore(StorageOptions(multipart_threshold=1024 * 1024, part_size=5 * 1024 * 1024))
    data = os.urandom(12 * 1024 * 1024 + 5)

    class Pipe(io.RawIOBase):  # read-only, no tell/seek: like a pipe
        def __init__(self):
            self._b = io.BytesIO(data)

        def readable(self):
            return True

        def read(self, n=-1):
            return self._b.read(n)

        def tell(self):
            raise io.UnsupportedOperation("pipe")

    progress: list[int] = []
    store.upload_fileobj(Pipe(), gcs_bucket + "/piped", size=len(data), progress=progress.append)
    assert store.get_bytes(gcs_bucket + "/piped") == data
    assert len(progress) == 3 and sum(progress) == len(data)  # 5 MiB + 5 MiB + the rest


def test_chunked_conditional_create_asks_for_generation_0_and_maps_412_to_already_exists(gcs_bucket, fake_gcs):
    # fake-gcs-server ignores ifGenerationMatch on resumable uploads (it enforces it on
    # single-request ones), so what is checked here is what we send and how a 412 is
    # read; real GCS checks the precondition when the session starts and when it ends.
    store = GCSStore(StorageOptions(multipart_threshold=1024 * 1024, part_size=5 * 1024 * 1024))
    data = b"y" * (9 * 1024 * 1024)  # above the single-request size: a resumable upload
    sent: list[str] = []

    class Record(requests.adapters.HTTPAdapter):
        def send(self, request, **kw):
            sent.append(f"{request.method} {request.url}")
            return super().send(request, **kw)

    store.client._http.mount(fake_gcs.endpoint_url, Record())
    store.upload_fileobj(io.BytesIO(data), gcs_bucket + "/big-new", size=len(data), if_absent=True)
    assert store.get_bytes(gcs_bucket + "/big-new", start=len(data) - 3) == b"yyy"
    starts = [r for r in sent if r.startswith("POST") and "uploadType=resumable" in r]
    assert len(starts) == 1 and "ifGenerationMatch=0" in starts[0]
    assert sum(r.startswith("PUT") for r in sent) == 2  # 5 MiB + 4 MiB chunks

    _inject(store, fake_gcs.endpoint_url, FaultAdapter(status=412, n=1, method="POST"))
    with pytest.raises(AlreadyExists):
        store.upload_fileobj(io.BytesIO(data), gcs_bucket + "/big-new", size=len(data), if_absent=True)


def test_listing_keeps_the_gcs_alias_scheme_of_the_prefix(gcs_bucket):
    store = GCSStore()
    store.put_bytes(gcs_bucket + "/alias/obj", b"x")
    alias = gcs_bucket.replace("gs://", "gcs://", 1)
    assert [e.url for e in store.list(alias + "/alias/")] == [alias + "/alias/obj"]


# ---------------------------------------------------------------- retries (faults injected)
class FaultAdapter(requests.adapters.HTTPAdapter):
    """Answers the first ``n`` matching requests (``method``, a ``path`` in the URL)
    with ``status`` (after sending them to the server when ``lose_response``: the
    request lands, the answer is lost)."""

    def __init__(self, *, status: int, n: int, method: str | None = None, lose_response: bool = False,
                 path: str | None = None):
        super().__init__()
        self.status, self.left, self.method, self.lose, self.path = status, n, method, lose_response, path
        self.injected = 0
        self.requests: list[str] = []  # the requests answered with a fault

    def send(self, request, **kw):
        if self.left > 0 and (self.method is None or request.method == self.method) and \
                (self.path is None or self.path in request.url.split("?")[0]):
            self.left -= 1
            self.injected += 1
            self.requests.append(f"{request.method} {request.url}")
            if self.lose:
                super().send(request, **kw).close()
            r = requests.Response()
            r.status_code = self.status
            r.reason = "injected"
            r._content = b'{"error": {"code": %d, "message": "injected fault"}}' % self.status
            r.headers["Content-Type"] = "application/json"
            r.request, r.url = request, request.url
            return r
        return super().send(request, **kw)


def _inject(store: GCSStore, endpoint: str, adapter: FaultAdapter) -> FaultAdapter:
    store.client._http.mount(endpoint, adapter)
    return adapter


@pytest.mark.parametrize("status,kind", [(503, "throttled"), (429, "throttled"), (500, "transient")])
def test_retried_requests_are_reported_to_retry_listeners_and_then_succeed(gcs_bucket, fake_gcs, status, kind):
    store = GCSStore()
    u = gcs_bucket + "/retried"
    store.put_bytes(u, b"payload")
    seen: list[str] = []
    store.add_retry_listener(seen.append)
    # only requests for this object are answered with faults: a CI run once saw a GET of
    # the test's bucket (projection=noAcl, a request this store never sends) take one of
    # the faults, retried by google's own default policy and so reported to nobody
    fault = _inject(store, fake_gcs.endpoint_url, FaultAdapter(status=status, n=2, path="/o/retried"))
    assert store.get_bytes(u) == b"payload"
    assert fault.injected == 2 and seen == [kind, kind], fault.requests
    fault.left = 1
    assert store.stat(u).size == 7  # JSON API calls retry too
    assert fault.injected == 3 and seen == [kind] * 3, fault.requests


def test_forbidden_is_not_retried(gcs_bucket, fake_gcs):
    store = GCSStore()
    u = gcs_bucket + "/forbidden"
    store.put_bytes(u, b"x")
    seen: list[str] = []
    store.add_retry_listener(seen.append)
    fault = _inject(store, fake_gcs.endpoint_url, FaultAdapter(status=403, n=5))
    with pytest.raises(AccessDenied):
        store.get_bytes(u)
    assert fault.injected == 1 and seen == []


def test_conditional_create_whose_response_was_lost_still_wins(gcs_bucket, fake_gcs):
    store = GCSStore()
    u = gcs_bucket + "/marker.json"
    # the create lands but its answer is a 503: the retry then meets our own object (412)
    fault = _inject(store, fake_gcs.endpoint_url, FaultAdapter(status=503, n=1, method="POST", lose_response=True))
    store.put_bytes(u, b'{"step": 1}', if_absent=True)
    assert fault.injected == 1
    assert store.get_bytes(u) == b'{"step": 1}'
    # someone else's object is still a conflict
    fault.left = 1
    with pytest.raises(AlreadyExists):
        store.put_bytes(u, b'{"step": 2}', if_absent=True)
    assert store.get_bytes(u) == b'{"step": 1}'


def test_delete_many_deletes_concurrently_and_stops_at_the_first_failure(gcs_bucket, fake_gcs):
    store = GCSStore()
    urls_ = [f"{gcs_bucket}/dm/{i:03d}" for i in range(40)]
    for u in urls_[:20]:
        store.put_bytes(u, b"x")
    assert store.delete_many(urls_[:20] + urls_[20:]) == 40  # the 20 missing ones are not errors
    assert list(store.list(gcs_bucket + "/dm/")) == []
    for u in urls_:
        store.put_bytes(u, b"x")
    _inject(store, fake_gcs.endpoint_url, FaultAdapter(status=403, n=1000, method="DELETE"))
    with pytest.raises(AccessDenied):
        store.delete_many(urls_)


def test_uploads_leave_the_callers_python_rng_alone(gcs_bucket):
    """google-cloud-storage draws multipart boundaries from ``random``; a save must not
    move the training script's RNG (exact resume compares it bit for bit)."""
    import random

    store = GCSStore(StorageOptions())
    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    for i in range(3):
        store.put_bytes(f"{gcs_bucket}/rng/{i}", b"x" * 100)
        store.upload_file(__file__, f"{gcs_bucket}/rng/file{i}")
    assert [random.random() for _ in range(3)] == expected


def test_names_with_control_characters_are_deleted_and_counted(gcs_bucket):
    """Each delete is its own request with the name percent-encoded in its URL: names
    that S3's XML batch cannot carry are no problem here (GCS names hold no CR/LF)."""
    store = GCSStore()
    names = ["ctl\x01x", "esc\x1b[31m", "c1\x85y", "tab\tz", "del\x7f", "bidi\u202ex", "plain"]
    for n in names:
        store.put_bytes(f"{gcs_bucket}/run/step1/{n}", b"x")
    store.put_bytes(f"{gcs_bucket}/run/step10/keep", b"x")
    assert store.delete_prefix(f"{gcs_bucket}/run/step1") == len(names)
    assert [o.url for o in store.walk(f"{gcs_bucket}/run/")] == [f"{gcs_bucket}/run/step10/keep"]
