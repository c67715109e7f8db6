"""Ceilings on what one read from a checkpoint may allocate.

They are far above what honest checkpoints need (a marker lists each object once
and each rank's manifest part in ~30 bytes; DCP's ``.metadata`` of a 70B model on
1024 ranks is ~0.4 GB), and low enough that a crafted size cannot exhaust a host. A
manifest that declares more is refused before anything is read.

DCP's ``.metadata`` grows with ranks x tensors (1.6 GB for a 70B model with AdamW on
4,096 ranks), so its ceiling follows the step (``metadata_limit``): 1 GiB, or the
bytes of the step's other files if more. ``read_metadata`` reads it with no more than
the size the step's manifest (or listing) declares, in windows, so that what is
allocated is what the store actually holds, however large the declared size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import UnsafeCheckpoint
from ..units import GiB, MiB
from .reads import read_capped, read_checked

MAX_MARKER_BYTES = 256 * MiB
"""Our writer's marker at ``marker.MAX_WORLD_SIZE`` ranks, every field at its largest,
is about 44 MiB (tests/checkpoint/test_marker_compact.py computes it)."""
MAX_METADATA_BYTES = 1 * GiB
"""The floor of ``metadata_limit``: a DCP ``.metadata`` of up to 1 GiB is read whatever
the step declares of its other files."""
MAX_TRAIN_STATE_BYTES = 4 * GiB
READ_WINDOW = 64 * MiB
"""``read_metadata`` asks for at most this many bytes per request: a store that
allocates a requested range up front (a local file's ``read(n)``) allocates no more."""

# DCP ``.metadata``: shapes and nesting (untrusted/unpickle.py)
MAX_TENSOR_DIMS = 64
"""Dimensions of a tensor, a chunk or a ``torch.Size`` (torch's own CPU ops stop well
before; honest tensors have at most a handful). Checked before any element count is
multiplied, so a count is at most 64 x 63 bits."""
MAX_DIM = (1 << 63) - 1
"""Each dimension, offset, byte offset and length: an int64, as torch stores them."""
MAX_KEY_DEPTH = 32
"""Nesting of a value used as a dict key or set member while unpickling (hashing a
tuple nested 10^6 deep overflows the C stack): checked before it is hashed."""
MAX_PLAIN_DEPTH = 64
"""Nesting of ``planner_data`` and ``storage_meta`` values."""
MAX_SAME_HASH = 16
"""Keys of one unpickled dict or set sharing one hash value (hash flooding: each
insert compares with every earlier key of that hash)."""


def metadata_limit(described: int = 0) -> int:
    """The most bytes a step's DCP ``.metadata`` may hold: ``MAX_METADATA_BYTES`` (1 GiB),
    or ``described`` (the bytes of the step's other files: the shards it indexes, the
    train state, the manifest parts) when that is more. An honest ``.metadata`` is a
    small fraction of the data it describes (about 1/500 for a 70B model with AdamW on
    4,096 ranks, 1/130 on 16,384), so it never comes near; a crafted one must be backed
    by a step that large, and is read only as far as the store holds it."""
    return max(MAX_METADATA_BYTES, int(described))


class _Declared(NamedTuple):
    size: int
    crc32c: str | None


class _Windowed:
    """A store whose ``get_bytes(url, start=0, end=n)`` asks for ``READ_WINDOW`` bytes at a
    time and stops at the first short answer (the object's end): what is allocated is
    what the object holds plus one window, whatever ``n`` is."""

    def __init__(self, store: Any):
        self.store = store

    def get_bytes(self, url: str, *, start: int | None = None, end: int | None = None) -> bytes:
        start = start or 0
        if end is None or end - start <= READ_WINDOW:
            return self.store.get_bytes(url, start=start, end=end)
        pieces, at = [], start
        while at < end:
            want = min(READ_WINDOW, end - at)
            piece = self.store.get_bytes(url, start=at, end=at + want)
            pieces.append(piece)
            at += len(piece)
            if len(piece) < want:
                break
        return b"".join(pieces)


def read_metadata(store: Any, url: str, *, size: int | None = None, crc32c: str | None = None, described: int = 0,
                  verify: bool = True) -> bytes:
    """The bytes of a step's DCP ``.metadata`` at ``url``: ``size`` (and ``crc32c``) as the
    step's manifest or listing declares them, checked (``read_checked``; no more than
    ``size + 1`` bytes read), or without a declared size read whole up to the ceiling
    (``read_capped``). The ceiling is ``metadata_limit(described)``; a declared size above
    it is refused before any request. Reads go through ``_Windowed``: however large the
    declared size, what is allocated is what the store holds.
    Raises UnsafeCheckpoint (over the ceiling), CorruptCheckpoint (missing, a size or
    CRC32C other than declared), storage errors."""
    limit = metadata_limit(described)
    if size is None:
        return read_capped(_Windowed(store), url, limit=limit, what="DCP metadata")
    if size > limit:
        raise UnsafeCheckpoint(
            f"{url}: the step declares its DCP metadata at {size} bytes, more than the {limit}-byte ceiling for a step "
            f"whose other files hold {described} bytes (the larger of 1 GiB and those bytes); the step's marker is "
            "damaged or crafted: restore the step, or load another one (`load_step=N`; `cloudckpt list` shows them)")
    return read_checked(_Windowed(store), url, _Declared(size, crc32c), limit=limit, what="DCP metadata",
                        verify=verify)
