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
