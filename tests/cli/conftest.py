"""Fixtures of the CLI tests (helpers are in helpers.py)."""

from __future__ import annotations

import pytest

from cloudckpt.storage import clear_cache


@pytest.fixture(scope="module")
def stores(seaweed, fake_gcs):
    """Point this process and the CLI subprocesses at SeaweedFS (AWS_* env) and
    fake-gcs-server (STORAGE_EMULATOR_HOST) for the whole module."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**seaweed.env(), **fake_gcs.env()}.items():
            mp.setenv(k, v)
        clear_cache()
        yield {"seaweed": seaweed, "fake_gcs": fake_gcs}
        clear_cache()
