"""Checkpoint folders not named ``step{N}`` (Lightning's ``epoch=0-step=8.ckpt`` and
``last.ckpt``), described in the shape of :func:`~cloudckpt.ops.steps.list_steps`, so
that ``cloudckpt list`` and ``latest`` treat a Lightning checkpoint folder like a run.

Cost: one LIST of the folder, one marker GET per subfolder (concurrently), and with
``include_uncommitted`` one recursive LIST of each uncommitted checkpoint folder.
"""

from __future__ import annotations

import re

from ..checkpoint import named
from ..storage import Location, Where
from .steps import StepListing, StepRow, _contents

_STEP_IN_NAME = re.compile(r"(?:^|[-_])step=(\d+)")  # Lightning's default "epoch={epoch}-step={step}"


def list_named(folder: Where, *, include_uncommitted: bool = False, ephemeral: bool | None = None) -> StepListing:
    """The checkpoint folders directly under ``folder``, by step (the marker's), then
    commit time. ``step_dirs`` is 0 (not such a folder) unless at least one subfolder
    has a marker. Uncommitted folders (``include_uncommitted``) are rows only when their
    name carries the step (``…step=N…``). Raises storage errors."""
    loc = Location.of(folder)
    probes = named.probe_subfolders(loc)
    if not any(m is not None or problem for _, m, problem in probes):
        return StepListing(loc.url, 0, [])
    rows: list[StepRow] = []
    warnings: list[str] = []
    counted = 0
    for dir, m, problem in probes:
        if m is not None:
            counted += 1
            if ephemeral is None or m.ephemeral == ephemeral:
                rows.append(StepRow(m.step, dir, "committed", marker=m))
            continue
        if problem:
            warnings.append(f"{dir} is not counted: {problem}")
        step = _STEP_IN_NAME.search(dir.rsplit("/", 1)[-1])
        if step is None:
            continue
        counted += 1
        if include_uncommitted:
            count, size, newest = _contents(loc.at(dir))
            if count:
                rows.append(StepRow(int(step.group(1)), dir, "unreadable" if problem else "incomplete", error=problem,
                                    object_count=count, size_bytes=size, newest_mtime=newest))
    rows.sort(key=lambda r: (r.step, r.created_unix or 0.0, r.url))
    return StepListing(loc.url, counted, rows, warnings)


def latest_named(folder: Where) -> tuple[int, str] | None:
    """``(step, url)`` of the newest committed checkpoint folder directly under ``folder``
    (the rule of ``lightning.last_checkpoint``), or None."""
    found = named.newest(folder)
    return (found[1].step, found[0]) if found else None
