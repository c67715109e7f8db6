"""Bucket names are checked by each scheme's naming rule, and the message says that rule
(S3: 3-63 characters; GCS: 3-63, up to 222 with dots, at most 63 between dots); local
paths are told from object-store URLs by ``url.local_path``; the example at the top of
checkpoint/manager.py passes the configuration's checks."""

from __future__ import annotations

import re

import pytest

from cloudckpt import CheckpointConfig
from cloudckpt.errors import ConfigError, InvalidURL
from cloudckpt.storage.url import local_path, parse_url

A63, A64 = "a" * 63, "a" * 64


@pytest.mark.parametrize("bucket,ok", [
    ("abc", True), (A63, True), ("my-bucket.v2", True), ("0day", True),
    ("my_bucket", True),  # S3-compatible stores (Ceph) allow underscores: left to the store
    ("ab", False), (A64, False), (".".join([A63, "b"]), False),  # over 63 with dots too
    ("Upper", False), ("-start", False), ("end-", False), ("a..b", False), ("a b", False), ("a!b", False),
])
def test_s3_bucket_names(bucket, ok):
    _check("s3", bucket, ok, "3-63")


@pytest.mark.parametrize("bucket,ok", [
    ("abc", True), (A63, True), ("my_bucket-1", True),
    (".".join([A63, A63, A63, "a" * 30]), True),  # 222 characters with dots
    (".".join([A63, A63, A63, "a" * 31]), False),  # 223
    ("ab", False), (A64, False), (".".join([A63, A64]), False), ("a..b", False), ("Upper", False),
])
def test_gcs_bucket_names(bucket, ok):
    _check("gs", bucket, ok, "up to 222 characters")


def _check(scheme: str, bucket: str, ok: bool, rule: str) -> None:
    url = f"{scheme}://{bucket}/run"
    if ok:
        assert parse_url(url).bucket == bucket
        return
    with pytest.raises(InvalidURL) as ei:
        parse_url(url)
    msg = str(ei.value)
    assert f"invalid bucket name {bucket!r}" in msg and f"{scheme}:// bucket names are" in msg and rule in msg


def test_the_s3_message_states_the_limits_the_check_applies():
    """The numbers in the message are the ones the check enforces: its shortest and longest names pass."""
    with pytest.raises(InvalidURL) as ei:
        parse_url("s3://x/run")
    low, high = map(int, re.search(r"(\d+)-(\d+)", str(ei.value)).groups())
    assert parse_url(f"s3://{'a' * low}/k") and parse_url(f"s3://{'a' * high}/k")
    for n in (low - 1, high + 1):
        with pytest.raises(InvalidURL):
            parse_url(f"s3://{'a' * n}/k")


def test_the_alias_schemes_follow_their_backends_rule():
    with pytest.raises(InvalidURL, match="s3a:// bucket names are 3-63"):
        parse_url(f"s3a://{A64}/k")
    assert parse_url(f"gcs://{'.'.join([A63, A63])}/k").scheme == "gcs"


@pytest.mark.parametrize("url,path", [
    ("/data/run", "/data/run"), ("./run", "./run"), ("file:///data/run", "/data/run"), ("run/step1", "run/step1"),
    ("s3://bucket/run", None), ("gs://bucket/run", None), ("https://host/run/step1", None),
])
def test_local_path_tells_a_local_folder_from_an_object_store_url(url, path):
    assert local_path(url) == path


def test_local_path_refuses_a_malformed_url():
    with pytest.raises(InvalidURL):
        local_path("s3:/bucket/run")


def test_the_manager_example_is_a_valid_configuration():
    """The example at the top of checkpoint/manager.py, run through the configuration's checks."""
    import cloudckpt.checkpoint.manager as manager

    m = re.search(r"mgr = (CheckpointConfig\(.*\))\.build\(\)", manager.__doc__)
    assert m, "the example moved: update this test"
    config = eval(m.group(1), {"CheckpointConfig": CheckpointConfig})  # our own docstring
    assert config.save_folder.startswith("s3://") and parse_url(config.save_folder).bucket
    with pytest.raises(ConfigError, match="invalid bucket name 'b'"):  # what the example said before
        CheckpointConfig(save_folder="s3://b/run")
