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
