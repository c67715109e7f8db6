"""Ceilings on what one read from a checkpoint may allocate.

They are far above what honest checkpoints need (a marker lists each object once
and each DCP item's byte range; DCP's ``.metadata`` of a 70B model on 1024 ranks
is tens of MiB), and low enough that a crafted size cannot exhaust a host. A
manifest that declares more is refused before anything is read.
"""

MiB = 1024 * 1024
GiB = 1024 * MiB

MAX_MARKER_BYTES = 256 * MiB
MAX_METADATA_BYTES = 1 * GiB
MAX_TRAIN_STATE_BYTES = 4 * GiB

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
