"""A save that dies at every request boundary of the commit: after its k-th request to
the store (the lock, each object, each rank's manifest part, the ``latest`` pointer's
"pending" and final writes, the marker, the lock's release), for every k, no further
request of the save reaches the store, as if the process were killed there (its
cleanup cannot run either). Whatever k, judged by the independent oracle:

- the step is committed (its marker, its parts and every object they list verify) or
  it is not (no marker of ours), never half;
- ``latest_checkpoint`` is the newest committed step, and the ``latest`` pointer never
  names, as final, a step that is not committed;
- the next save of the step (another job, the dead one's lock stale) commits, and the
  step loads bit-exactly, unless the dead save had committed it (then CheckpointExists).

Local folders and SeaweedFS (S3), one process (the requests of 2 ranks are the same
kinds, counted by tests/faults/test_commit_order.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import pointer
from cloudckpt.errors import CheckpointExists
from cloudckpt.storage import StorageOptions, clear_cache, open_store

from . import checks

# the store methods that send a request (reads included: a process can die waiting for one)
REQUESTS = ("put_bytes", "put_bytes_if_match", "get_bytes", "get_bytes_versioned", "open_range", "upload_file",
            "upload_fileobj", "download_fileobj", "download_file", "stat", "exists", "list", "walk", "delete",
            "delete_many", "delete_prefix", "check_bucket")
NUMEL = 4096


class Died(BaseException):
    """The process is gone: not an Exception, so nothing in the library handles it."""


class Crash:
    """Let ``budget`` requests of ``store`` through, then refuse every later one."""

    def __init__(self, store, budget: int):
        self.store, self.budget, self.sent = store, budget, 0
        self.lock = threading.Lock()
        self.names: list[str] = []
        for name in REQUESTS:
            real = getattr(store, name)
            setattr(store, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def call(*a, **kw):
            with self.lock:
                if self.sent >= self.budget:
                    raise Died(f"died before {name}")
                self.sent += 1
                self.names.append(name)
            return real(*a, **kw)
        return call

    def undo(self) -> None:
        for name in REQUESTS:
            self.store.__dict__.pop(name, None)


@pytest.fixture(params=["local", "s3"])
def folder(request, tmp_path):
    clear_cache()
    yield str(tmp_path / "run") if request.param == "local" else request.getfixturevalue("s3_bucket") + "/run"
    clear_cache()


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((NUMEL,), float(step)), "b": torch.arange(8.0) + step},
            "optim": {"m": torch.full((NUMEL // 2,), -float(step))}}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(NUMEL), "b": torch.zeros(8)}, "optim": {"m": torch.zeros(NUMEL // 2)}}


def _save(folder: str, step: int, work: str, **kw) -> None:
    with Checkpointer(work_dir=work, **kw) as ck:
        ck.save(checks.step_dir(folder, step), _state(step), {"step": step})


def _dies(store, k: int, save) -> bool:
    """Run ``save`` with ``store`` answering only its first ``k`` requests: whether the
    save died (the crash, or a library error it surfaced through); it fails the test on
    any other error."""
    crash = Crash(store, k)
    try:
        save()
        return False
    except Died:
        return True
    except BaseException as e:  # noqa: BLE001 - the crash surfaced through a library error: named below
        assert isinstance(e.__context__, Died) or "died before" in str(e), f"k={k}: {type(e).__name__}: {e}"
        return True
    finally:
        crash.undo()


def _requests_of_a_save(folder: str, tmp_path) -> int:
    store = open_store(folder, StorageOptions())
    spy = Crash(store, 10**9)
    try:
        _save(folder, 1, str(tmp_path / "w0"))
    finally:
        spy.undo()
    assert spy.sent > 5 and "put_bytes" in spy.names, spy.names
    return spy.sent


def test_a_save_killed_after_any_request_leaves_a_committed_step_or_none(folder, tmp_path, secret_scan):
    total = _requests_of_a_save(folder, tmp_path)  # step 1: committed, the base every crash must keep
    store = open_store(folder, StorageOptions())
    step1, step2 = checks.step_dir(folder, 1), checks.step_dir(folder, 2)
    outcomes = []
    for k in range(total + 2):  # one more than a save needs: the save completes
        died = _dies(store, k, lambda w=str(tmp_path / f"w{k}"): _save(folder, 2, w))
        committed = checks.committed_steps(folder)
        assert 1 in committed and checks.verify_step(step1) == [], f"k={k}: step 1 damaged"
        assert set(committed) <= {1, 2}
        if 2 in committed:
            assert checks.verify_step(step2) == [], f"k={k}: step 2 committed but partial"
        assert Checkpointer.latest_checkpoint(folder) == checks.step_dir(folder, max(committed)), f"k={k}"
        p = pointer.read(folder)
        assert p is None or p[1] or p[0] in committed, f"k={k}: the pointer names step {p[0]} as final, not committed"
        outcomes.append((k, died, 2 in committed))
        # another job saves step 2 now (the dead save's lock, if any, is stale to it)
        if 2 in committed:
            with pytest.raises(CheckpointExists):
                _save(folder, 2, str(tmp_path / f"again{k}"), stale_lock_seconds=0)
        else:
            _save(folder, 2, str(tmp_path / f"again{k}"), stale_lock_seconds=0)
        sd = _zeros()
        with Checkpointer(work_dir=str(tmp_path / f"load{k}")) as ck:
            assert ck.load(step2, sd) == {"step": 2}
        assert torch.equal(sd["model"]["w"], _state(2)["model"]["w"]) and checks.verify_step(step2) == []
        store.delete_prefix(step2)  # the next k starts from step 1 alone (and no pointer: it never goes back)
        store.delete(pointer.pointer_url(folder))
    assert outcomes[0][1] and not outcomes[0][2], "dying before the first request commits nothing"
    assert not outcomes[-1][1] and outcomes[-1][2], "with every request answered, the save commits"
    assert any(c for _, d, c in outcomes if d), "a save dying after its marker (before the pointer or the lock's " \
                                                "release) is committed"


def _loads_as(step_url: str, tmp: str) -> int | None:
    """Which save's state the committed step ``step_url`` holds (the step number it was
    saved with: 1 or 2 below), loading it bit for bit; None when nothing is committed."""
    sd = _zeros()
    with Checkpointer(work_dir=tmp) as ck:
        got = ck.load(step_url, sd)["step"]
    assert torch.equal(sd["model"]["w"], _state(got)["model"]["w"]) and torch.equal(
        sd["optim"]["m"], _state(got)["optim"]["m"]), "the step loads bit for bit as the save that wrote it"
    return got


def test_replacing_a_step_killed_after_any_request_leaves_the_old_step_or_the_new(folder, tmp_path, secret_scan):
    """``save_overwrite`` of a committed step, killed after each of its requests: the step
    number always has a committed step, the old one or the new one (never neither, never
    a mix): the new objects go under a root of their own and the marker is swapped in one
    conditional request. The next replace (another job, the dead one's lock stale) commits."""
    store = open_store(folder, StorageOptions())
    dir = checks.step_dir(folder, 5)

    def old_step() -> None:  # step 5 holds the state of "step 1", as a save wrote it
        with Checkpointer(work_dir=str(tmp_path / "base")) as ck:
            ck.save(dir, _state(1), {"step": 1})

    def replace(work: str, **kw) -> None:
        with Checkpointer(work_dir=work, save_overwrite=True, **kw) as ck:
            ck.save(dir, _state(2), {"step": 2})

    old_step()
    spy = Crash(store, 10**9)
    try:
        replace(str(tmp_path / "count"))
    finally:
        spy.undo()
    total = spy.sent
    assert "put_bytes_if_match" in spy.names and "delete_prefix" not in spy.names[:spy.names.index(
        "put_bytes_if_match")], "the old step is not deleted before the new marker replaces its marker"
    outcomes = []
    for k in range(total + 1):
        store.delete_prefix(dir)
        old_step()
        died = _dies(store, k, lambda w=str(tmp_path / f"w{k}"): replace(w))
        assert checks.committed_steps(folder) == [5], f"k={k}: the step number lost its committed step"
        assert checks.verify_step(dir) == [], f"k={k}: the committed step is partial"
        held = _loads_as(dir, str(tmp_path / f"load{k}"))
        outcomes.append((k, died, held))
        replace(str(tmp_path / f"again{k}"), stale_lock_seconds=0)  # another job replaces it now
        assert _loads_as(dir, str(tmp_path / f"reload{k}")) == 2 and checks.verify_step(dir) == []
    assert outcomes[0] == (0, True, 1), "dying before the first request keeps the old step"
    assert outcomes[-1] == (total, False, 2), "with every request answered, the new step replaces the old"
    assert {h for _, d, h in outcomes if d} == {1, 2}, "a replace dies before and after its swap, both tried"
