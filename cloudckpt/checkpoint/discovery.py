"""Finding committed checkpoints.

Cost: one paginated LIST of the save folder (delimiter ``/``), then markers read
only as needed: ``latest_checkpoint`` walks from the highest step down and stops
at the first committed one; ``find_checkpoints`` reads markers concurrently.
A folder counts only if it is named exactly ``step{N}`` and its marker parses;
a corrupt or foreign-version marker is skipped with a warning.

These functions are not collective: in a multi-rank job let one rank discover and
broadcast (the manager does).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from ..errors import BucketNotFound, CheckpointError, NotACheckpoint, NotFound
from ..storage import StorageOptions, open_store, resolve_local, resolve_step_dir
from ..storage import url as urls
from . import layout
from ..untrusted import MAX_MARKER_BYTES, read_capped
from .marker import Marker

log = logging.getLogger(__name__)


def read_marker(dir: str, *, storage_options: StorageOptions | None = None) -> Marker:
    """The parsed marker of a step folder. Raises NotACheckpoint (no marker),
    CorruptCheckpoint / IncompatibleCheckpoint / UnsafeCheckpoint (unreadable or
    refused marker), storage errors."""
    return read_marker_bytes(dir, storage_options=storage_options)[0]


def read_marker_bytes(dir: str, *, storage_options: StorageOptions | None = None) -> tuple[Marker, bytes]:
    """``read_marker`` and the marker's bytes as read (at most MAX_MARKER_BYTES)."""
    url = layout.marker_url(resolve_step_dir(dir))
    try:
        data = read_capped(open_store(url, storage_options), url, limit=MAX_MARKER_BYTES, what="commit marker")
    except BucketNotFound:
        raise
    except NotFound:
        raise NotACheckpoint(
            f"{dir} is not a committed checkpoint: it has no {layout.MARKER} (the save never finished, or the path is wrong); "
            "use `cloudckpt list` on the save folder to see committed steps"
        ) from None
    return Marker.from_bytes(data, url=url), data


def list_step_dirs(folder: str, *, storage_options: StorageOptions | None = None) -> list[tuple[int, str]]:
    """Every ``step{N}`` folder under ``folder`` (committed or not), ascending, from one LIST pass."""
    folder = resolve_local(folder)
    prefix = urls.as_prefix(folder)
    out = []
    for e in open_store(prefix, storage_options).list(prefix, delimiter="/"):
        if not e.is_prefix:
            continue
        step = layout.step_of_name(urls.basename(e.url))
        if step is not None:
            out.append((step, urls.join(folder, f"step{step}")))
    out.sort()
    return out


def _try_marker(dir: str, storage_options) -> Marker | None:
    try:
        return read_marker(dir, storage_options=storage_options)
    except NotACheckpoint:
        return None
    except CheckpointError as e:
        log.warning("skipping %s: %s", dir, e)
        return None


def find_checkpoints(
    folder: str, ephemeral: bool | None = None, *, storage_options: StorageOptions | None = None, with_markers: bool = False
) -> Iterator[tuple[int, str]]:
    """Committed checkpoints under ``folder`` as ``(step, dir)``, ascending by step
    (``(step, dir, marker)`` with ``with_markers``). ``ephemeral`` filters on the
    marker's flag (None: both)."""
    steps = list_step_dirs(folder, storage_options=storage_options)
    with ThreadPoolExecutor(max_workers=32) as pool:
        markers = list(pool.map(lambda sd: _try_marker(sd[1], storage_options), steps))
    for (step, dir), m in zip(steps, markers):
        if m is None or (ephemeral is not None and m.ephemeral != ephemeral):
            continue
        yield (step, dir, m) if with_markers else (step, dir)


def latest_checkpoint(folder: str, *, storage_options: StorageOptions | None = None, use_pointer: bool = True) -> str:
    """The newest committed step folder. Raises NotACheckpoint (a FileNotFoundError) if none.

    With ``use_pointer`` (default) the ``latest`` pointer is tried first (2 requests);
    when it is missing or cannot vouch for a committed step, one LIST pass is used.
    Local folders are resolved to their real path first (the local backend follows
    no links inside them); the step folder returned is under the resolved path."""
    folder = resolve_local(folder)
    if use_pointer:
        from . import pointer

        found = pointer.try_latest(folder, storage_options=storage_options)
        if found is not None:
            return found
    for step, dir in reversed(list_step_dirs(folder, storage_options=storage_options)):
        if _try_marker(dir, storage_options) is not None:
            return dir
    raise NotACheckpoint(f"no committed checkpoint in {folder}")


def dir_is_checkpoint(dir: str, *, storage_options: StorageOptions | None = None) -> bool:
    """True if ``dir`` is named ``step{N}`` and has a marker that parses."""
    if layout.step_of_name(urls.basename(dir)) is None:
        return False
    return _try_marker(dir, storage_options) is not None


def contains_checkpoint(folder: str, *, storage_options: StorageOptions | None = None) -> bool:
    try:
        latest_checkpoint(folder, storage_options=storage_options)
        return True
    except NotACheckpoint:
        return False
