"""Unpickling DCP's ``.metadata`` without letting a checkpoint run code.

Stock DCP unpickles ``.metadata`` with plain ``pickle``; a file from a bucket
could then execute anything on load. We unpickle with an allowlist: DCP's own
metadata dataclasses, torch's dtype/Size/layout objects and plain containers.
"""

from __future__ import annotations

import io
import pickle

from ..errors import CorruptCheckpoint

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "layout"),
    ("torch", "strided"),
    ("torch", "sparse_coo"),
    ("torch", "memory_format"),
    ("torch", "contiguous_format"),
    ("torch", "channels_last"),
    ("torch", "preserve_format"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("torch.distributed.tensor.placement_types", "Shard"),
    ("torch.distributed.tensor.placement_types", "Replicate"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED or (module.startswith(_ALLOWED_MODULE_PREFIXES) and not name.startswith("_load")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def loads_metadata(data: bytes, *, url: str):
    """Unpickle DCP metadata with the allowlist. Raises CorruptCheckpoint."""
    try:
        return _SafeUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise CorruptCheckpoint(f"DCP metadata {url} refused: {e}; it may be tampered with or written by an unknown tool") from None
    except Exception as e:  # noqa: BLE001 - any decode failure means the file is unusable
        raise CorruptCheckpoint(f"DCP metadata {url} cannot be read ({type(e).__name__}: {e}); it may be truncated") from None
