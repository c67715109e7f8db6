"""StorageOptions checks every field with one rule table (cloudckpt/rules.py), like the
other settings classes: a bad value is a ConfigError naming the option and what to use."""

from __future__ import annotations

import dataclasses

import pytest

from cloudckpt.errors import ConfigError
from cloudckpt.storage import StorageOptions
from cloudckpt.storage.base import STORAGE_RULES


def test_every_field_has_a_rule():
    assert set(STORAGE_RULES) == {f.name for f in dataclasses.fields(StorageOptions)}


@pytest.mark.parametrize("kw,message", [
    ({"addressing_style": "sideways"}, "addressing_style='sideways' is not allowed: use 'path', 'virtual' or 'auto'"),
    ({"part_size": 1}, "part_size=1 is not allowed: use an integer >= 5242880"),
    ({"max_attempts": 0}, "max_attempts=0 is not allowed: use a positive integer"),
    ({"max_pool_connections": True}, "max_pool_connections=True is not allowed: use a positive integer"),
    ({"read_timeout": 0}, "read_timeout=0 is not allowed: use a finite number of seconds > 0"),
    ({"operation_timeout": float("inf")}, "operation_timeout=inf is not allowed"),
    ({"sign_payload": 1}, "sign_payload=1 is not allowed: use true or false"),
    ({"min_delete_depth": -1}, "min_delete_depth=-1 is not allowed: use an integer >= 0"),
    ({"region": 5}, "region=5 is not allowed: use a string, or None for the SDK's default"),
    ({"endpoint_url": "127.0.0.1:9000"}, "has no scheme"),
])
def test_a_bad_value_is_a_config_error_naming_the_option(kw, message):
    with pytest.raises(ConfigError, match="storage option ") as e:
        StorageOptions(**kw)
    assert message in str(e.value)


def test_the_defaults_and_usual_values_pass():
    StorageOptions()
    StorageOptions(endpoint_url="http://127.0.0.1:9000", region="us-east-1", addressing_style="path",
                   part_size=64 << 20, multipart_threshold=None, sign_payload=True, min_delete_depth=0)
