"""What S3 connection errors say: the object URL and the endpoint, never user info."""

from __future__ import annotations

import botocore.exceptions as bex
import pytest

from cloudckpt.errors import Transient
from cloudckpt.storage.s3 import translate


def test_a_connection_error_names_the_endpoint_without_user_info():
    e = bex.EndpointConnectionError(endpoint_url="http://AKIDUSER:s3cr3t@minio.internal:9000/bucket/key")
    out = translate(e, "s3://bucket/key", "get")
    assert isinstance(out, Transient)
    assert "reaching http://minio.internal:9000 " in str(out)
    assert "s3://bucket/key" in str(out)
    assert "s3cr3t" not in str(out) and "AKIDUSER" not in str(out)


def test_a_connection_error_without_an_endpoint_still_names_the_url():
    out = translate(bex.ConnectionClosedError(endpoint_url=""), "s3://bucket/key", "put")
    assert isinstance(out, Transient) and "s3://bucket/key" in str(out) and "reaching" not in str(out)


def test_a_malformed_endpoint_in_a_connection_error_is_left_out():
    out = translate(bex.EndpointConnectionError(endpoint_url="http://host:notaport/"), "s3://bucket/key", "get")
    assert isinstance(out, Transient) and "reaching" not in str(out) and "s3://bucket/key" in str(out)


# ---------------------------------------------------------------- the operation deadline
class _SlowErrors:
    """A ``before-send`` hook: every request waits ``delay`` s, then gets ``status``
    instead of reaching the server."""

    BODIES = {500: b"<Error><Code>InternalError</Code><Message>x</Message></Error>",
              503: b"<Error><Code>SlowDown</Code><Message>x</Message></Error>"}

    def __init__(self, status: int, delay: float):
        self.status, self.delay, self.sent = status, delay, 0

    def __call__(self, request, **kw):
        import time

        from botocore.awsrequest import AWSResponse

        self.sent += 1
        time.sleep(self.delay)
        body = self.BODIES[self.status]

        class Raw:
            def stream(self, **kw):
                yield body

        return AWSResponse(request.url, self.status, {}, Raw())


@pytest.mark.parametrize("status,error,least", [(500, "Timeout", 3), (503, "Throttled", 1)])
def test_sdk_retries_stop_at_the_operation_deadline_not_at_max_attempts(moto_bucket, status, error, least):
    """Each attempt takes 0.3 s and fails retryably: with operation_timeout=1 botocore is
    refused its retry once a second has passed (about 4 attempts, not 8; fewer after
    SlowDown, whose backoffs are up to 1 s, 2 s, ...), and the error is typed (Timeout,
    or Throttled for SlowDown) and names the deadline."""
    import time

    from cloudckpt import errors
    from cloudckpt.storage import StorageOptions, open_store

    store = open_store(moto_bucket, StorageOptions(operation_timeout=1.0, max_attempts=8))
    hook = _SlowErrors(status, 0.3)
    store.client.meta.events.register("before-send.s3.HeadObject", hook)
    t0 = time.monotonic()
    with pytest.raises(getattr(errors, error)) as ei:
        store.stat(moto_bucket + "/k")
    took = time.monotonic() - t0
    # a retry starts only before the deadline: one attempt and one backoff (throttles: <= 2 s here) past it
    assert least <= hook.sent <= 5 and took < 1.0 + 0.3 + 2.0 + 0.5, (hook.sent, took)
    assert "operation_timeout=1s" in str(ei.value) and moto_bucket + "/k" in str(ei.value)


# ---------------------------------------------------------------- deletes of hostile keys
# DeleteObjects sends its keys in an XML body, which cannot carry most control
# characters: a batch holding one fails whole (MalformedXML). Such keys go alone
# through DeleteObject; what cannot be deleted is one typed error naming the keys.
NASTY_KEYS = ["ctl\x01x", "esc\x1b[31m", "cr\rx", "nl\nx", "c1\x85y", "tab\tz", "del\x7f", "bidi\u202ex", "plain"]


def test_keys_with_control_characters_are_deleted_and_counted(s3_bucket):
    from cloudckpt.storage import open_store

    store = open_store(s3_bucket)
    bucket = s3_bucket[len("s3://"):]
    for k in NASTY_KEYS:  # through boto3: a key with a newline is not a URL cloudckpt takes as input
        store.client.put_object(Bucket=bucket, Key=f"run/step1/{k}", Body=b"x")
    store.client.put_object(Bucket=bucket, Key="run/step10/keep", Body=b"x")
    assert len(list(store.walk(f"{s3_bucket}/run/step1/"))) == len(NASTY_KEYS)
    assert store.delete_prefix(f"{s3_bucket}/run/step1") == len(NASTY_KEYS)
    assert list(store.walk(f"{s3_bucket}/run/step1/")) == []
    assert [o.url for o in store.walk(f"{s3_bucket}/run/")] == [f"{s3_bucket}/run/step10/keep"]


def test_keys_a_delete_refuses_are_one_typed_error_naming_them_escaped(s3_bucket, monkeypatch):
    from cloudckpt.errors import AccessDenied, DeleteFailed
    from cloudckpt.storage import open_store

    store = open_store(s3_bucket)
    bucket = s3_bucket[len("s3://"):]
    keys = [f"run/step2/{i}" for i in range(5)] + ["run/step2/esc\x1b[2J"]
    for k in keys:
        store.client.put_object(Bucket=bucket, Key=k, Body=b"x")
    real = store.client.delete_objects
    refused = {"run/step2/3"}

    def partial(**kw):  # the store refuses one key of the batch (an object lock, a policy on one key...)
        kw["Delete"]["Objects"] = [o for o in kw["Delete"]["Objects"] if o["Key"] not in refused]
        r = real(**kw)
        r.setdefault("Errors", []).extend({"Key": k, "Code": "InvalidObjectState", "Message": "locked"}
                                          for k in refused)
        return r

    monkeypatch.setattr(store.client, "delete_objects", partial)
    real_delete = store.client.delete_object
    monkeypatch.setattr(store.client, "delete_object", lambda **kw: (_ for _ in ()).throw(
        bex.ClientError({"Error": {"Code": "InvalidRequest", "Message": "no"}}, "DeleteObject"))
        if "\x1b" in kw["Key"] else real_delete(**kw))
    with pytest.raises(DeleteFailed) as ei:
        store.delete_prefix(f"{s3_bucket}/run/step2")
    e = ei.value
    assert sorted(e.failed) == sorted([f"{s3_bucket}/run/step2/3", f"{s3_bucket}/run/step2/esc\x1b[2J"])
    assert e.deleted == 4
    assert "\x1b" not in str(e) and "esc\\x1b[2J" in str(e) and "2 object(s) were not deleted (4 were)" in str(e)
    assert sorted(o.url for o in store.walk(f"{s3_bucket}/run/step2/")) == sorted(e.failed)
    # a failure that is not about one key stops the delete at once, as itself
    monkeypatch.setattr(store.client, "delete_objects", lambda **kw: (_ for _ in ()).throw(
        bex.ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "DeleteObjects")))
    with pytest.raises(AccessDenied):
        store.delete_many([f"{s3_bucket}/run/step2/3"])
