"""Pause Python's cyclic garbage collector during a blocking save or load.

A full collection walks every tracked object of the process (~345,000 in a
trainer that imported torch and boto3: ~0.17 s here), and whichever operation
happens to allocate past the collector's threshold pays for it. During a load
that is usually the unpickling of DCP's ``.metadata``, on every rank at the same
moment, before any byte is fetched. torch's own
``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` do
the same for the same reason (their ``_gc_context``).

While paused, objects are still freed by reference counting; only cycles wait.
Temporaries of the save or load that die before it ends never reach an older
generation, so they add nothing to a later collection; what the process owed
before is collected at the next collection after it (not skipped).

Thread-safe and re-entrant: the collector is disabled by the first caller and
enabled again by the last one to leave, and only if it was enabled before.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
