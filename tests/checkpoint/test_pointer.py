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
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls


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
    Checkpointer(work_dir=str(tmp_path / "w"), save_overwrite=True).save(layout.step_dir(any_root, 5), {"w": torch.ones(4)})
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
