"""The ``latest`` pointer: never behind, never backwards, safe under races; discovery costs
2 requests in the common case (LIST, marker of the newest step) and never lets the pointer hide
a newer step (tests/checkpoint/test_foreign_steps.py)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout, pointer
from cloudckpt.errors import CorruptCheckpoint
from cloudckpt.storage import open_store


def _save(ck, folder, step):
    ck.save(layout.step_dir(folder, step), {"w": torch.full((4,), float(step))}, {"step": step})


def test_latest_checkpoint_costs_two_requests(s3_bucket, tmp_path):
    folder = s3_bucket + "/run"
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    for step in (1, 2, 3):
        _save(ck, folder, step)
    store = open_store(folder)
    calls: list[str] = []
    store.client.meta.events.register("before-send.s3", lambda request, **kw: calls.append(request.method))
    assert discovery.latest_checkpoint(folder) == layout.step_dir(folder, 3)
    with_pointer = len(calls)
    calls.clear()
    assert discovery.latest_checkpoint(folder, use_pointer=False) == layout.step_dir(folder, 3)
    assert with_pointer == 2, calls  # LIST of the step prefixes, GET step3/.metadata.json
    assert len(calls) == 2  # the same without reading the pointer


def test_pointer_never_moves_backwards_and_falls_back_when_it_cannot_vouch(any_root, tmp_path):
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    _save(ck, any_root, 5)
    _save(ck, any_root, 9)
    assert pointer.read(any_root) == (9, False)
    # an older save (e.g. an overwrite of step 5) does not move it back
    Checkpointer(work_dir=str(tmp_path / "w"), save_overwrite=True).save(layout.step_dir(any_root, 5),
                                                                         {"w": torch.ones(4)})
    assert pointer.read(any_root) == (9, False)
    assert not pointer.advance(any_root, 7, pending=True)
    # a save of step 12 that died between "pending" and its marker: readers list instead
    assert pointer.advance(any_root, 12, pending=True)
    assert discovery.latest_checkpoint(any_root) == layout.step_dir(any_root, 9)
    # step 9 pruned (pointer names a deleted step): readers list too
    open_store(any_root).delete(layout.marker_url(layout.step_dir(any_root, 9)))
    pointer.advance(any_root, 9, pending=False)
    assert discovery.latest_checkpoint(any_root) == layout.step_dir(any_root, 5)


def test_a_crash_after_the_marker_but_before_the_final_pointer_still_finds_the_newest(tmp_path):
    folder = str(tmp_path / "run")
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    _save(ck, folder, 1)
    real = pointer.advance

    def die_on_final(folder_, step, *, pending, **kw):
        if not pending:
            raise KeyboardInterrupt("process killed here")
        return real(folder_, step, pending=pending, **kw)

    pointer.advance = die_on_final
    try:
        with pytest.raises(KeyboardInterrupt):
            _save(ck, folder, 2)
    finally:
        pointer.advance = real
    assert pointer.read(folder) == (2, True)
    assert discovery.latest_checkpoint(folder) == layout.step_dir(folder, 2)


@pytest.mark.parametrize("backend", ["local", "s3", "gcs"])
def test_racing_pointer_updates_end_at_the_highest_step(backend, request, tmp_path):
    folder = {"local": lambda: str(tmp_path / "run"), "s3": lambda: request.getfixturevalue("s3_bucket") + "/run",
              "gcs": lambda: request.getfixturevalue("gcs_bucket") + "/run"}[backend]()
    steps = list(range(1, 25))
    random.Random(7).shuffle(steps)
    errors = []

    def writer(chunk):
        try:
            for s in chunk:
                pointer.advance(folder, s, pending=False, attempts=50)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(steps[i::6],)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pointer.read(folder) == (24, False)


PLANTED = {
    "infinity": b'{"step": Infinity}',
    "nan": b'{"step": NaN, "pending": false}',
    "huge-float": b'{"step": 1e400}',
    "long-int": b'{"step": ' + b"9" * 5000 + b"}",
    "negative": b'{"step": -3}',
    "above-2**63": b'{"step": 9223372036854775808}',
    "bool-step": b'{"step": true}',
    "string-step": b'{"step": "7"}',
    "float-step": b'{"step": 7.0}',
    "pending-string": b'{"step": 1, "pending": "no"}',
    "list": b"[1, 2, 3]",
    "deep": b'{"step": 1, "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    "deep-over-cap": b"[" * 100_000 + b"]" * 100_000,
    "deep-unbalanced": b"[" * 1_000_000,
    "not-utf8": b'{"step": 1, "x": "\xff"}',
    "empty": b"",
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_pointer_is_ignored_by_readers_and_replaced_by_the_next_save(case, any_root, tmp_path, caplog):
    store = open_store(any_root)
    url = pointer.pointer_url(any_root)
    store.put_bytes(url, PLANTED[case])
    with pytest.raises(CorruptCheckpoint):
        pointer.parse(PLANTED[case], url=url)
    assert pointer.read(any_root) is None
    assert "ignoring unreadable latest pointer" in caplog.text
    _save(Checkpointer(work_dir=str(tmp_path / "w")), any_root, 3)
    assert pointer.read(any_root) == (3, False)
    assert discovery.latest_checkpoint(any_root, use_pointer=True) == layout.step_dir(any_root, 3)


@pytest.mark.parametrize("backend", ["local", "s3", "gcs"])
def test_an_oversized_pointer_is_read_only_up_to_its_ceiling(backend, request, tmp_path):
    """A 64 MiB planted pointer: every read of it (readers and the save's conditional
    replace) stops at MAX_POINTER_BYTES + 1 bytes, and the save replaces it."""
    root = {"local": lambda: str(tmp_path / "run"), "s3": lambda: request.getfixturevalue("s3_bucket") + "/run",
            "gcs": lambda: request.getfixturevalue("gcs_bucket") + "/run"}[backend]()
    store = open_store(root)
    url = pointer.pointer_url(root)
    store.put_bytes(url, b'{"step": 1, "pad": "' + b"x" * (64 << 20) + b'"}')
    data, version = store.get_bytes_versioned(url, limit=pointer.MAX_POINTER_BYTES)
    assert len(data) == pointer.MAX_POINTER_BYTES + 1 and version
    read: list[int] = []
    real = type(store).get_bytes_versioned

    def spy(self, u, **kw):
        out = real(self, u, **kw)
        read.append(len(out[0]))
        return out

    type(store).get_bytes_versioned = spy
    try:
        assert pointer.read(root) is None
        assert pointer.advance(root, 4, pending=False)
    finally:
        type(store).get_bytes_versioned = real
    assert read == [pointer.MAX_POINTER_BYTES + 1]
    assert pointer.read(root) == (4, False)
    assert len(store.get_bytes(url)) < 200


def test_a_planted_pointer_with_the_highest_step_does_not_stop_saves(tmp_path):
    """The pointer never moves backwards, so a planted step 2**63-1 keeps it there;
    saves still commit and discovery (which lists) still finds them."""
    folder = str(tmp_path / "run")
    open_store(folder).put_bytes(pointer.pointer_url(folder), b'{"step": 9223372036854775807}')
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    _save(ck, folder, 1)
    _save(ck, folder, 2)
    assert pointer.read(folder) == (pointer.MAX_STEP, False)
    assert discovery.latest_checkpoint(folder) == layout.step_dir(folder, 2)
