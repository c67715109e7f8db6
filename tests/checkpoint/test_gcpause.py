"""The cyclic GC is paused during blocking saves and loads (not async saves) and restored after."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import rank_writer
from cloudckpt.collector import collector_paused
from cloudckpt.dcp import planned_load


@pytest.fixture(autouse=True)
def _gc_enabled_after():
    assert gc.isenabled()
    yield
    gc.enable()  # a failing test must not leave the rest of the suite without a collector


def test_paused_inside_and_restored_after_even_on_error():
    with pytest.raises(RuntimeError):
        with collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_nested_and_concurrent_pauses_enable_only_when_the_last_one_leaves():
    inner_entered, release = threading.Event(), threading.Event()

    def other_thread():
        with collector_paused():
            inner_entered.set()
            release.wait(10)

    with collector_paused():
        t = threading.Thread(target=other_thread)
        t.start()
        assert inner_entered.wait(10)
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled(), "the other thread's pause is still open"
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_a_collector_the_user_disabled_stays_disabled():
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def _spy(monkeypatch, name: str) -> list[bool]:
    """Whether the collector was on whenever DCP's save, or the load (planned on each rank:
    dcp/planned_load.py), ran."""
    seen: list[bool] = []
    module = rank_writer.dcp if name == "save" else planned_load
    name = "save" if name == "save" else "read"
    real = getattr(module, name)

    def spy(*a, **kw):
        seen.append(gc.isenabled())
        return real(*a, **kw)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_blocking_save_and_load_pause_the_collector_async_save_does_not(tmp_path, monkeypatch):
    saves, loads = _spy(monkeypatch, "save"), _spy(monkeypatch, "load")
    root = tmp_path / "ckpt"
    state = {"model": {"w": torch.arange(64, dtype=torch.float32)}}
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(str(root / "step1"), state, {"t": 1})
        assert gc.isenabled()
        target = {"model": {"w": torch.zeros(64)}}
        assert ck.load(str(root / "step1"), target) == {"t": 1}
        assert gc.isenabled()
        assert torch.equal(target["model"]["w"], state["model"]["w"])
        ck.save_async(str(root / "step2"), state, {"t": 2}).result(timeout=60)
    assert saves == [False, True], "blocking save paused; the async save's background thread did not"
    assert loads == [False]
    assert gc.isenabled()
