"""The ``latest`` pointer: Megatron's tracker file, done safely.

``{save_folder}/latest`` is a small JSON object naming the newest committed step, so
``latest_checkpoint`` costs two requests (GET pointer, GET that step's marker) instead
of a LIST of the folder.

How it stays correct:

- Rank 0 advances the pointer to ``{"step": N, "pending": true}`` *before* writing
  step N's marker, and to ``{"step": N}`` after. So the pointer never lags behind the
  newest committed step, even if the job dies between the two writes: a reader that
  finds "pending N" checks N's marker; if it exists, N is the newest; if not (the save
  failed or is still running), the reader falls back to listing.
- Every write is conditional (S3 ``If-Match``/``If-None-Match``, GCS generation match,
  local compare-and-rename under a lock) and never moves the pointer to a lower step,
  so an older or slower save never overwrites a newer pointer; a lost race re-reads.
- A reader falls back to listing whenever the pointer is missing, unparseable, names
  a step without a marker (failed, in progress, pruned or deleted), or the backend has
  no conditional replace.
"""

from __future__ import annotations

import json
import logging
import time

from ..errors import AlreadyExists, CloudCkptError, NotFound, PreconditionFailed
from ..storage import StorageOptions, open_store
from ..storage import url as urls
from . import layout

log = logging.getLogger(__name__)


def pointer_url(folder: str) -> str:
    return urls.join(folder, layout.LATEST_POINTER)


def read(folder: str, *, storage_options: StorageOptions | None = None) -> tuple[int, bool] | None:
    """``(step, pending)`` from the pointer, or None when missing or unreadable."""
    url = pointer_url(folder)
    try:
        d = json.loads(open_store(url, storage_options).get_bytes(url))
        return int(d["step"]), bool(d.get("pending", False))
    except NotFound:
        return None
    except (ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable latest pointer %s (%s)", url, e)
        return None


def advance(folder: str, step: int, *, pending: bool, storage_options: StorageOptions | None = None,
            attempts: int = 8) -> bool:
    """Move the pointer to ``step`` unless it already names a higher step (or the same
    step, final, when ``pending``). Returns True if written. Raises storage errors."""
    url = pointer_url(folder)
    store = open_store(url, storage_options)
    body = json.dumps({"step": int(step), "pending": pending, "dir": f"step{int(step)}", "updated_unix": time.time()}).encode()
    for _ in range(attempts):
        try:
            data, version = store.get_bytes_versioned(url)
            try:
                cur = json.loads(data)
                cur_step, cur_pending = int(cur["step"]), bool(cur.get("pending", False))
            except (ValueError, KeyError, TypeError):
                cur_step, cur_pending = -1, True  # unreadable: overwrite it
        except NotFound:
            version, cur_step, cur_pending = None, -1, True
        if cur_step > step or (cur_step == step and (pending or not cur_pending)):
            return False
        try:
            if version is None:
                store.put_bytes(url, body, if_absent=True)
            else:
                store.put_bytes_if_match(url, body, version)
            return True
        except (AlreadyExists, PreconditionFailed):
            continue  # another writer got there first: re-read and compare again
    log.warning("could not advance %s to step %d after %d attempts (contention)", url, step, attempts)
    return False


def try_latest(folder: str, *, storage_options: StorageOptions | None = None) -> str | None:
    """The step folder the pointer vouches for (its marker parses), else None."""
    from .discovery import _try_marker

    p = read(folder, storage_options=storage_options)
    if p is None:
        return None
    dir = layout.step_dir(folder, p[0])
    return dir if _try_marker(dir, storage_options) is not None else None


def best_effort_clear(folder: str, *, storage_options: StorageOptions | None = None) -> None:
    try:
        open_store(folder, storage_options).delete(pointer_url(folder))
    except CloudCkptError as e:
        log.warning("could not remove the latest pointer of %s: %s", folder, e)
