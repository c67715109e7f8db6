"""The ``latest`` pointer that earlier versions wrote: read, never written.

``{save_folder}/latest`` was a small JSON object naming the newest step cloudckpt
committed (Megatron's tracker file), advanced by rank 0 with a conditional write to
``{"step": N, "pending": true}`` before step N's marker and to ``{"step": N}`` after
it: 4 requests on every save. Saves no longer write it, because it cannot save
discovery anything without hiding steps (``bench/discovery.py``, figures in
``docs/protocol.md``): another tool (OLMo-core) commits steps without moving it, so
discovery must list the folder anyway, and a listing "after" the pointer's step is
neither short nor complete (step names are not zero-padded: S3/GCS order ``step10``
before ``step9``, and after ``step10000`` come ``step1001`` ... ``step9999``).

What is kept: a folder an older version wrote still has its pointer, and
``cloudckpt latest --pointer`` (``discovery.latest_checkpoint(use_pointer=True)``)
reads it and says when it names another step than the newest committed one. Nothing
decides from it, and nothing deletes it (it is one small object beside the steps).

Anyone who can write the folder can plant a pointer. It is read with a ceiling
(``MAX_POINTER_BYTES``: at most that plus one byte) and parsed with
``untrusted.loads_json`` (depth, finite numbers, short integers); a step must be a JSON
integer in ``[0, 2**63)`` and ``pending`` true or false, anything else is refused
(``CorruptCheckpoint``) and ignored by ``read`` with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import CorruptCheckpoint, NotFound
from ..storage import Location, Where
from ..storage import url as urls
from ..untrusted import loads_json
from . import layout

log = logging.getLogger(__name__)
MAX_POINTER_BYTES = 64 * 1024  # ours is under 200 bytes
POINTER_MAX_DEPTH = 4  # ours is one flat object
MAX_STEP = (1 << 63) - 1
_IGNORED = "it is ignored (cloudckpt no longer writes one; delete it if no tool of yours reads it)"


def pointer_url(folder: str) -> str:
    return urls.join(folder, layout.LATEST_POINTER)


def parse(data: bytes, *, url: str) -> tuple[int, bool]:
    """``(step, pending)`` from the pointer's bytes. Raises CorruptCheckpoint (larger
    than MAX_POINTER_BYTES, not JSON within untrusted.loads_json's bounds, not an
    object with an integer ``step`` in ``[0, 2**63)`` and a boolean ``pending``)."""
    d: Any = loads_json(data, url=url, what="latest pointer", limit=MAX_POINTER_BYTES, max_depth=POINTER_MAX_DEPTH)
    if type(d) is not dict:
        raise CorruptCheckpoint(f"{url}: the latest pointer is not a JSON object; {_IGNORED}")
    step, pending = d.get("step"), d.get("pending", False)
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise CorruptCheckpoint(f"{url}: the latest pointer's step is not an integer between 0 and {MAX_STEP}; "
                                f"{_IGNORED}")
    if type(pending) is not bool:
        raise CorruptCheckpoint(f"{url}: the latest pointer's pending is not true or false; {_IGNORED}")
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
