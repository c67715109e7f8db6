"""The ``latest`` pointer: Megatron's tracker file, done safely.

``{save_folder}/latest`` is a small JSON object naming the newest step cloudckpt
committed, for tools and people that read a tracker file. Discovery does not trust it
to skip the listing: another tool (OLMo-core) commits steps without moving it, so
``latest_checkpoint`` always lists the folder's step prefixes (LIST + GET marker: the
same two requests the pointer path cost) and reads the pointer only to log when a
foreign step is newer than it (``discovery.latest_checkpoint``).

How it stays correct:

- Rank 0 advances the pointer to ``{"step": N, "pending": true}`` *before* writing
  step N's marker, and to ``{"step": N}`` after. So the pointer never lags behind the
  newest committed step, even if the job dies between the two writes: a reader that
  finds "pending N" checks N's marker; if it exists, N is the newest; if not (the save
  failed or is still running), the reader falls back to listing.
- Every write is conditional (S3 ``If-Match``/``If-None-Match``, GCS generation match,
  local compare-and-rename under a lock) and never moves the pointer to a lower step,
  so an older or slower save never overwrites a newer pointer; a lost race re-reads.
  A backend that cannot replace conditionally (``ObjectStore.conditional_replace`` is
  False) keeps no pointer.
- A reader of the pointer alone must check the marker of the step it names ("pending"
  or a pruned, deleted or overwritten step has none) and list when it is missing.
- Anyone who can write the folder can plant a pointer. It is read with a ceiling
  (``MAX_POINTER_BYTES``: at most that plus one byte, by readers and by every save)
  and parsed with ``untrusted.loads_json`` (depth, finite numbers, short integers);
  a step must be a JSON integer in ``[0, 2**63)`` and ``pending`` true or false. A
  reader ignores anything else with a warning; a save replaces it (conditionally,
  as always), so a planted pointer never stops the saves of a run.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..errors import AlreadyExists, CloudCkptError, CorruptCheckpoint, NotFound, PreconditionFailed
from ..storage import Location, Where
from ..storage import url as urls
from ..untrusted import loads_json
from . import layout

log = logging.getLogger(__name__)
MAX_POINTER_BYTES = 64 * 1024  # ours is under 200 bytes
POINTER_MAX_DEPTH = 4  # ours is one flat object
MAX_STEP = (1 << 63) - 1


def pointer_url(folder: str) -> str:
    return urls.join(folder, layout.LATEST_POINTER)


def parse(data: bytes, *, url: str) -> tuple[int, bool]:
    """``(step, pending)`` from the pointer's bytes. Raises CorruptCheckpoint (larger
    than MAX_POINTER_BYTES, not JSON within untrusted.loads_json's bounds, not an
    object with an integer ``step`` in ``[0, 2**63)`` and a boolean ``pending``)."""
    d: Any = loads_json(data, url=url, what="latest pointer", limit=MAX_POINTER_BYTES, max_depth=POINTER_MAX_DEPTH)
    if type(d) is not dict:
        raise CorruptCheckpoint(f"{url}: the latest pointer is not a JSON object; a save replaces it")
    step, pending = d.get("step"), d.get("pending", False)
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise CorruptCheckpoint(f"{url}: the latest pointer's step is not an integer between 0 and {MAX_STEP}; "
                                "a save replaces it")
    if type(pending) is not bool:
        raise CorruptCheckpoint(f"{url}: the latest pointer's pending is not true or false; a save replaces it")
    return step, pending


def read(folder: Where) -> tuple[int, bool] | None:
    """``(step, pending)`` from the pointer, or None when missing or unreadable (a
    warning says why). Reads at most MAX_POINTER_BYTES + 1 bytes. Raises storage
    errors other than NotFound."""
    loc = Location.of(folder)
    url = pointer_url(loc.url)
    try:
        return parse(loc.store.get_bytes(url, start=0, end=MAX_POINTER_BYTES + 1), url=url)
    except NotFound:
        return None
    except CorruptCheckpoint as e:
        log.warning("ignoring unreadable latest pointer: %s", e)
        return None


def advance(folder: Where, step: int, *, pending: bool, attempts: int = 8) -> bool:
    """Move the pointer to ``step`` unless it already names a higher step (or the same
    step, final, when ``pending``). Returns True if written; False, with no request, on
    a store without conditional replace (``ObjectStore.conditional_replace``: every
    write of the pointer is conditional, so such a folder keeps none). Raises storage
    errors."""
    loc = Location.of(folder)
    url, store = pointer_url(loc.url), loc.store
    if not store.conditional_replace:
        return False
    body = json.dumps({"step": int(step), "pending": pending, "dir": f"step{int(step)}",
                       "updated_unix": time.time()}).encode()
    for _ in range(attempts):
        try:
            data, version = store.get_bytes_versioned(url, limit=MAX_POINTER_BYTES)
            try:
                cur_step, cur_pending = parse(data, url=url)
            except CorruptCheckpoint as e:
                log.warning("replacing an unreadable latest pointer: %s", e)
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


def best_effort_clear(folder: Where) -> None:
    loc = Location.of(folder)
    try:
        loc.store.delete(pointer_url(loc.url))
    except CloudCkptError as e:
        log.warning("could not remove the latest pointer of %s: %s", folder, e)
