"""Train state and DCP byte items: torch's weights-only unpickler, plus numpy's
RNG state admitted by exact name.

``torch.load(weights_only=True)`` admits tensors, plain containers and scalars.
Trainers also keep numpy's RNG state (``np.random.get_state()``: a tuple holding a
``uint32`` array) in their train state (OLMo-core does), so these globals are
added with ``torch.serialization.safe_globals``, by exact name, only for the
duration of one of our loads (under a lock: the mechanism is process-wide):

- numpy's array constructor (``numpy.core.multiarray._reconstruct`` and its numpy 2
  name ``numpy._core.multiarray._reconstruct``), replaced by ``_reconstruct``, which
  builds only a plain ``ndarray`` and only of a plain dtype: a crafted shape cannot
  allocate more than the file holds, since ``ndarray.__setstate__`` then needs the
  bytes;
- ``numpy.ndarray`` and ``numpy.dtype`` and the dtype classes of numbers and bools.

Anything else is refused with UnsafeCheckpoint naming the global.
"""

from __future__ import annotations

import io
import re
import threading
from typing import Any

import torch

from ..errors import UnsafeCheckpoint

_lock = threading.Lock()
_MAX_ELEMENTS = 1 << 31


def _numpy_globals() -> list:
    try:
        import numpy as np
    except ImportError:  # numpy is optional: without it no such state can exist here
        return []

    def _reconstruct(subtype, shape, dtype):
        if subtype is not np.ndarray:
            raise UnsafeCheckpoint(f"numpy array of type {subtype!r} refused")
        if not isinstance(dtype, (bytes, str)) or len(dtype) > 8:
            raise UnsafeCheckpoint("numpy array with a bad dtype refused")
        if type(shape) is not tuple or any(type(d) is not int or d < 0 for d in shape) or len(shape) > 32:
            raise UnsafeCheckpoint("numpy array with a bad shape refused")
        n = 1
        for d in shape:
            n *= d
        if n > _MAX_ELEMENTS:
            raise UnsafeCheckpoint(f"numpy array of {n} elements refused")
        return np.ndarray.__new__(np.ndarray, shape, np.dtype(dtype))

    out: list = [np.ndarray, np.dtype]
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out.append((_reconstruct, f"{mod}._reconstruct"))
    for name in ("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64",
                 "Float16", "Float32", "Float64"):
        cls = getattr(getattr(np, "dtypes", None), f"{name}DType", None)
        if cls is not None:
            out.append(cls)
    return out


_EXTRA = _numpy_globals()


def load_plain(data, *, url: str, what: str = "train state") -> Any:
    """``torch.load(weights_only=True)`` of ``data`` (bytes or a file object) onto the
    CPU, admitting numpy's RNG state. Raises UnsafeCheckpoint naming the global it
    refused (nothing of it runs) or CorruptCheckpoint-derived errors for bad bytes."""
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        with _lock, torch.serialization.safe_globals(_EXTRA):
            return torch.load(f, map_location="cpu", weights_only=True)
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{url}: refused to load the {what}: {e}") from None
    except Exception as e:  # noqa: BLE001 - anything the weights-only unpickler refuses
        raise UnsafeCheckpoint(
            f"{url}: refused to load the {what} ({type(e).__name__}: {_short(e)}): it is not plain data "
            "(weights_only=True), so loading it could run code; nothing of it was run"
        ) from None


def _short(e: Exception) -> str:
    text = re.sub(r"\s+", " ", str(e))
    m = re.search(r"(Unsupported global: GLOBAL \S+|global \S+|GLOBAL \S+)", text)
    text = m.group(1) if m else text
    return text if len(text) <= 200 else text[:197] + "..."


def load_tensor(f, *, url: str, fqn: str, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` of one DCP tensor item, without the extras
    (and without the lock: tensor items load concurrently). Raises UnsafeCheckpoint."""
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - anything the weights-only unpickler refuses or cannot read
        raise UnsafeCheckpoint(f"{url}: refused to load the tensor {fqn!r} ({type(e).__name__}: {_short(e)}); "
                               "nothing of it was run") from None
