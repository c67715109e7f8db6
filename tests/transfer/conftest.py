"""Fixtures of the transfer-engine tests."""

from __future__ import annotations

import os

import pytest

from cloudckpt.storage.registry import clear_cache, open_store

from .fakes import FaultyStore


@pytest.fixture
def faulty():
    """A fresh in-memory FaultyStore behind ``faulty://bucket/...`` URLs."""
    clear_cache()
    store = open_store("faulty://bucket/x")
    assert isinstance(store, FaultyStore)
    yield store
    store.release()
    clear_cache()


@pytest.fixture
def make_files(tmp_path):
    """``make_files(n, size)`` -> list of (path, bytes) of random content."""

    def make(n: int, size: int, prefix: str = "f") -> list[tuple[str, bytes]]:
        out = []
        for i in range(n):
            data = os.urandom(size)
            p = tmp_path / f"{prefix}{i}.bin"
            p.write_bytes(data)
            out.append((str(p), data))
        return out

    return make


class FakeClock:
    """A clock tests move by hand; ``sleep`` advances it and records the delays."""

    def __init__(self, t: float = 1000.0):
        self.t = t
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


@pytest.fixture
def clock():
    return FakeClock()
