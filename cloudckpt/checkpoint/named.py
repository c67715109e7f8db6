"""Checkpoint folders that are not named ``step{N}``: Lightning's ``epoch=0-step=8.ckpt``
and ``last.ckpt`` (written by ``cloudckpt.integrations.lightning``), or any folder a
caller saved with ``Checkpointer.save(dir, …)``. Such a folder is committed, like a
step folder, if and only if its marker parses; its step is the marker's.

Cost: one LIST of the folder (delimiter ``/``), then one marker GET per subfolder,
concurrently. The newest is the highest step, then the newest commit time (the
marker's ``created``): Lightning saves ``last.ckpt`` right after the top-k
checkpoint of the same step, so ``last.ckpt`` wins that tie.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError, NotACheckpoint
from ..storage import Location, Where
from . import discovery
from .marker import Marker

log = logging.getLogger(__name__)

MARKER_READ_THREADS = 16


def subfolders(folder: Where) -> list[str]:
    """The URLs (no trailing slash) of the folders directly under ``folder``, from one LIST."""
    loc = Location.of(folder)
    return sorted(e.url.rstrip("/") for e in loc.store.list(loc.prefix, delimiter="/") if e.is_prefix)


def probe(dir: Location) -> tuple[Marker | None, str | None]:
    """``(marker, None)`` when committed, ``(None, None)`` when there is no marker,
    ``(None, reason)`` when the marker cannot be read or is refused. Storage errors propagate."""
    try:
        return discovery.read_header(dir), None
    except NotACheckpoint:
        return None, None
    except CheckpointError as e:
        return None, str(e)


def probe_subfolders(folder: Where) -> list[tuple[str, Marker | None, str | None]]:
    """``(url, marker, problem)`` for every folder directly under ``folder``, as :func:`probe`."""
    loc = Location.of(folder)
    dirs = subfolders(loc)
    with ThreadPoolExecutor(max_workers=MARKER_READ_THREADS) as pool:
        probes = list(pool.map(lambda d: probe(loc.at(d)), dirs))
    return [(d, m, problem) for d, (m, problem) in zip(dirs, probes, strict=True)]


def committed(folder: Where) -> list[tuple[str, Marker]]:
    """The committed checkpoint folders directly under ``folder``, oldest first (by step,
    then commit time). Folders with an unreadable marker are skipped with a warning."""
    out = []
    for d, m, problem in probe_subfolders(folder):
        if problem:
            log.warning("skipping %s: %s", d, problem)
        elif m is not None:
            out.append((d, m))
    out.sort(key=lambda dm: (dm[1].step, dm[1].created_unix, dm[0]))
    return out


def newest(folder: Where) -> tuple[str, Marker] | None:
    """The newest committed checkpoint folder directly under ``folder`` (highest step,
    then newest commit) with its marker, or None."""
    found = committed(folder)
    return found[-1] if found else None
