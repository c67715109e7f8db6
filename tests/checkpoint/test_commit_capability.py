"""The stale-lock takeover asks the store's declared ``conditional_replace`` capability
(the ClassVar on ObjectStore classes) before it tries a compare-and-swap: on a store
without it, an abandoned lock is refused with a typed error that names the lock and
what to do, and no conditional request is sent (none would work)."""

from __future__ import annotations

import json
import os
import time

import pytest

from cloudckpt.checkpoint import layout
from cloudckpt.checkpoint.commit import StepCommit
from cloudckpt.checkpoint.step import StepRef
from cloudckpt.errors import SaveInProgress
from cloudckpt.storage import open_store
from cloudckpt.storage.base import ObjectStore
from cloudckpt.storage.local import LocalStore


def _lock(step_dir: str, age: float) -> bytes:
    body = json.dumps({"save_id": "dead-job", "host": "gone", "pid": 1, "created_unix": time.time() - age,
                       "world_size": 1}).encode()
    open_store(step_dir).put_bytes(os.path.join(step_dir, layout.LOCK), body)
    return body


@pytest.fixture
def no_cas(monkeypatch):
    """LocalStore as a backend without the capability: declared False, and its conditional
    calls are the base class's (which raise); every call to them is recorded."""
    asked: list[str] = []
    monkeypatch.setattr(LocalStore, "conditional_replace", False)
    for name in ("get_bytes_versioned", "put_bytes_if_match"):
        base = getattr(ObjectStore, name)
        monkeypatch.setattr(LocalStore, name, lambda self, url, *a, _base=base, **kw: asked.append(url)
                            or _base(self, url, *a, **kw))
    return asked


def _commit(step_dir: str, **kw) -> StepCommit:
    return StepCommit(StepRef.of(step_dir, step=3), save_id="new-job", world_size=1, stale_lock_seconds=60, **kw)


def test_a_stale_lock_on_a_store_without_conditional_replace_is_refused_not_taken_over(tmp_path, no_cas):
    step = str(tmp_path / "run" / "step3")
    body = _lock(step, age=3600)
    with pytest.raises(SaveInProgress) as e:
        _commit(step).prepare()
    msg = str(e.value)
    assert os.path.join(step, layout.LOCK) in msg and "conditional_replace is False" in msg and "delete" in msg
    assert no_cas == []  # the capability was asked, not tried
    with open(os.path.join(step, layout.LOCK), "rb") as f:
        assert f.read() == body  # the lock is untouched


def test_save_overwrite_does_not_take_a_lock_over_without_conditional_replace_either(tmp_path, no_cas):
    step = str(tmp_path / "run" / "step3")
    _lock(step, age=1)
    with pytest.raises(SaveInProgress, match="cannot replace an object conditionally"):
        _commit(step, save_overwrite=True).prepare()
    assert no_cas == []


def test_a_fresh_lock_without_conditional_replace_is_still_a_save_in_progress(tmp_path, no_cas):
    step = str(tmp_path / "run" / "step3")
    _lock(step, age=1)
    with pytest.raises(SaveInProgress, match="is in progress"):
        _commit(step).prepare()
    assert no_cas == []


def test_a_free_step_is_locked_and_committed_without_conditional_replace(tmp_path, no_cas):
    step = str(tmp_path / "run" / "step3")
    c = _commit(step)
    c.prepare()
    assert c.locked and os.path.exists(os.path.join(step, layout.LOCK))
    c.commit(c.marker((), (), ephemeral=False))
    assert os.path.exists(layout.marker_url(step)) and not os.path.exists(os.path.join(step, layout.LOCK))


def test_the_same_stale_lock_is_taken_over_where_the_store_can(tmp_path):
    step = str(tmp_path / "run" / "step3")
    _lock(step, age=3600)
    c = _commit(step)
    c.prepare()
    assert c.locked
    with open(os.path.join(step, layout.LOCK)) as f:
        assert json.load(f)["save_id"] == "new-job"
