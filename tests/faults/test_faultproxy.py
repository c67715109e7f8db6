"""The fault proxy itself: each fault as a client sees it, rule selection, seeded rates,
and forwarding that keeps SigV4 signatures valid."""

from __future__ import annotations

import time

import boto3
import botocore.exceptions as bex
import pytest
from botocore.config import Config

from cloudckpt.testing.faultproxy import FaultProxy, Rule


@pytest.fixture
def proxied(seaweed):
    bucket = "proxy-" + str(int(time.time() * 1000))[-9:]
    seaweed.client().create_bucket(Bucket=bucket)
    with FaultProxy(seaweed.endpoint_url, seed=3) as proxy:
        def client(**cfg):
            return boto3.client("s3", endpoint_url=proxy.endpoint_url, aws_access_key_id=seaweed.access_key,
                                aws_secret_access_key=seaweed.secret_key, region_name="us-east-1",
                                config=Config(retries={"mode": "standard", "total_max_attempts": 1}, **cfg))
        yield proxy, client, bucket


def test_forwarding_keeps_signatures_valid_and_bodies_intact(proxied, seaweed):
    proxy, client, bucket = proxied
    c = client()
    data = bytes(range(256)) * 40_000  # 10 MB: streamed both ways
    c.put_object(Bucket=bucket, Key="big", Body=data)
    assert c.get_object(Bucket=bucket, Key="big")["Body"].read() == data
    bad = boto3.client("s3", endpoint_url=proxy.endpoint_url, aws_access_key_id=seaweed.access_key,
                       aws_secret_access_key="not-the-secret", region_name="us-east-1")
    with pytest.raises(bex.ClientError) as ei:
        bad.list_objects_v2(Bucket=bucket)
    assert ei.value.response["Error"]["Code"] == "SignatureDoesNotMatch", \
        "the store still checks what the client signed"
    assert proxy.injected() == {} and proxy.requests == 3


@pytest.mark.parametrize("fault,status,code", [("slowdown", 503, "SlowDown"), ("error500", 500, "InternalError"),
                                                ("throttle429", 429, "TooManyRequests")])
def test_error_faults_answer_with_the_stores_error_and_never_reach_it(proxied, fault, status, code):
    proxy, client, bucket = proxied
    proxy.add(Rule(fault, method="PUT", key=r"/k$", times=1))
    c = client()
    with pytest.raises(bex.ClientError) as ei:
        c.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert ei.value.response["Error"]["Code"] == code
    assert "Contents" not in c.list_objects_v2(Bucket=bucket), "the request never reached the store"
    c.put_object(Bucket=bucket, Key="k", Body=b"x")  # times=1: the next one goes through
    assert proxy.injected() == {fault: 1}


@pytest.mark.parametrize("when,applied", [("request", False), ("response", True)])
def test_resets_before_or_after_the_store_applied_the_request(proxied, when, applied):
    proxy, client, bucket = proxied
    proxy.add(Rule("reset", method="PUT", nth=1, when=when))
    c = client()
    with pytest.raises((bex.ConnectionClosedError, bex.EndpointConnectionError)):
        c.put_object(Bucket=bucket, Key="r", Body=b"x")
    assert ("Contents" in c.list_objects_v2(Bucket=bucket)) is applied


def test_truncate_stall_and_latency_on_downloads(proxied):
    proxy, client, bucket = proxied
    c = client(read_timeout=1)
    c.put_object(Bucket=bucket, Key="d", Body=b"z" * 100_000)
    proxy.add(Rule("truncate", method="GET", nth=1, after_bytes=1000),
              Rule("stall", method="GET", nth=2, after_bytes=10, hold=5),
              Rule("latency", method="GET", nth=3, delay=0.5))
    with pytest.raises(bex.ResponseStreamingError):
        c.get_object(Bucket=bucket, Key="d")["Body"].read()
    t0 = time.monotonic()
    with pytest.raises(bex.ReadTimeoutError):
        c.get_object(Bucket=bucket, Key="d")["Body"].read()
    assert time.monotonic() - t0 < 5, "the client's read timeout ended the stall, not the proxy's 5 s hold"
    t0 = time.monotonic()
    assert c.get_object(Bucket=bucket, Key="d")["Body"].read() == b"z" * 100_000
    assert time.monotonic() - t0 >= 0.5
    assert proxy.injected() == {"truncate": 1, "stall": 1, "latency": 1}


def test_seeded_rates_pick_the_same_requests_whatever_the_order(proxied, seaweed):
    _, client, bucket = proxied

    def decisions(seed, keys):
        with FaultProxy(seaweed.endpoint_url, seed=seed, rules=[Rule("slowdown", rate=0.3)]) as p:
            for k in keys:
                p._choose("GET", f"/{bucket}/{k}")
            return {e.target: e.fault for e in p.events}

    keys = [f"k{i}" for i in range(200)]
    a, b = decisions(1, keys), decisions(1, list(reversed(keys)))
    assert a == b, "same seed: same requests get a fault, in any arrival order"
    assert 30 < sum(1 for f in a.values() if f) < 90, "about 30%"
    assert decisions(2, keys) != a


def test_upstream_must_be_loopback():
    with pytest.raises(ValueError, match="127.0.0.1"):
        FaultProxy("http://example.com:80")
    with pytest.raises(ValueError, match="unknown fault"):
        Rule("explode")
