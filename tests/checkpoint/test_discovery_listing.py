"""Discovery (``latest_checkpoint``, ``newest_usable``: what resume runs) gives the same
answer as a full listing that reads every marker (``find_checkpoints``), on every backend,
for folders with gaps, step numbers across digit boundaries (S3/GCS list ``step10`` before
``step9``), ephemeral steps, uncommitted folders above the newest step, junk names, and a
``latest`` pointer naming an older or an uncommitted step: no committed step is skipped."""

from __future__ import annotations

import json

import pytest

from cloudckpt.checkpoint import discovery, layout, pointer
from cloudckpt.checkpoint.commit import StepCommit
from cloudckpt.checkpoint.entries import ObjectEntry
from cloudckpt.checkpoint.step import StepRef
from cloudckpt.storage import open_store


def _commit_marker(root: str, step: int, *, ephemeral: bool = False) -> None:
    """A committed step as discovery sees it: the writer's own marker, written directly."""
    d = layout.step_dir(root, step)
    c = StepCommit(StepRef.of(d, step=step), save_id=f"t{step}", world_size=1)
    data = c.marker((), (ObjectEntry(layout.DCP_METADATA, 3, None),), ephemeral=ephemeral).to_bytes()
    open_store(root).put_bytes(layout.marker_url(d), data)


def _uncommitted(root: str, name: str) -> None:
    """A folder with objects and no marker: a save that died or is running."""
    store = open_store(root)
    store.put_bytes(f"{root}/{name}/model_and_optim/__0_0.distcp", b"x" * 8)
    store.put_bytes(f"{root}/{name}/{layout.LOCK}", b'{"save_id": "running", "created_unix": 1}')


def _by_full_listing(root: str, ephemeral: bool | None = None) -> str | None:
    found = list(discovery.find_checkpoints(root, ephemeral))
    return found[-1][1] if found else None


LAYOUTS = {
    # committed (step -> ephemeral), uncommitted folder names, pointer step (None: no pointer)
    "gaps": ({1: False, 2: False, 5: False, 100: False, 1000: False}, [], None),
    "digit-boundary": ({8: False, 9: False, 10: False}, [], 9),
    "newest-ephemeral": ({90: False, 95: True, 100: True}, [], 90),
    "uncommitted-above": ({7: False, 9: False}, ["step10", "step11", "step100"], 9),
    "pointer-names-uncommitted": ({3: False, 4: True}, ["step12"], 12),
    "junk-beside": ({99: False}, ["step0100", "step100.old", "Step100"], None),
    "zero": ({0: False}, ["step1"], None),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_discovery_equals_the_full_listing(name, any_root):
    committed, uncommitted, ptr = LAYOUTS[name]
    for step, eph in committed.items():
        _commit_marker(any_root, step, ephemeral=eph)
    for folder in uncommitted:
        _uncommitted(any_root, folder)
    if ptr is not None:
        open_store(any_root).put_bytes(pointer.pointer_url(any_root),
                                       json.dumps({"step": ptr, "pending": False}).encode())
    want = layout.step_dir(any_root, max(committed))
    assert _by_full_listing(any_root) == want
    assert discovery.latest_checkpoint(any_root) == want
    assert discovery.latest_checkpoint(any_root, use_pointer=True) == want
    assert discovery.newest_usable(any_root, skip_refused=False) == (want, [])
    # the ephemeral filters of a full listing agree with the markers written
    for eph in (True, False):
        steps = [s for s, e in committed.items() if e == eph]
        got = _by_full_listing(any_root, eph)
        assert got == (layout.step_dir(any_root, max(steps)) if steps else None), (eph, got)
