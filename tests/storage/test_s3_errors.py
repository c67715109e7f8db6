"""What S3 connection errors say: the object URL and the endpoint, never user info."""

from __future__ import annotations

import botocore.exceptions as bex

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
