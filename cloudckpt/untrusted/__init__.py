"""Reading checkpoint bytes that someone else may have written.

A step in a bucket or a shared folder may come from another job, another tool or
an attacker with write access. Everything cloudckpt reads from a checkpoint goes
through this package, for every caller (``Checkpointer.load`` in both modes, the
CLI, export, the integrations), so that the worst a checkpoint can do is hold
wrong weights:

- ``names``: every name taken from a marker or from DCP's ``.metadata`` is
  checked once, when it is parsed; local files get names we derive.
- ``unpickle``: DCP's ``.metadata`` is unpickled with an exact allowlist of
  ``(module, name)`` pairs and of what may be called or built, then checked
  against the manifest (sizes, counts, ranges) before anyone uses it.
- ``plain`` (``trainstate``, ``zipread``): train state and DCP items are
  ``torch.save`` archives read by cloudckpt's own allowlist unpickler (never
  ``pickle`` or ``torch.load``): plain data, tensors built only from their stored
  zip records, numpy's RNG state by exact shape and dtype; bounded while parsing.
- ``jsondoc``: small JSON documents (pointer, lock, run files, configs) with size,
  depth and number bounds checked before or while parsing.
- ``reads``: objects are read with a ceiling on their size, checked against their
  manifest entry before they are parsed.

Every refusal is an ``UnsafeCheckpoint`` (a ``CorruptCheckpoint``) naming the URL
and what was refused. See docs/security.md for the threat model.
"""

from .._lazy import lazy_exports
from .jsondoc import loads_json
from .limits import MAX_MARKER_BYTES, MAX_METADATA_BYTES, MAX_TRAIN_STATE_BYTES
from .names import check_name, local_name
from .reads import read_capped, read_checked

# these need torch: imported on first use, so that torch-free tools (the CLI's list) stay light
_LAZY = {"loads_metadata": ".unpickle", "validate_metadata": ".unpickle", "load_plain": ".plain",
         "load_tensor": ".plain"}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "MAX_MARKER_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_TRAIN_STATE_BYTES",
    "check_name",
    "load_plain",
    "load_tensor",
    "loads_json",
    "loads_metadata",
    "local_name",
    "read_capped",
    "read_checked",
    "validate_metadata",
]
