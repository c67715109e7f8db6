"""Train state, DCP byte items and DCP tensor items: plain data only.

Each is a ``torch.save`` archive read by cloudckpt's own allowlist unpickler
(``trainstate``), never by ``pickle`` or ``torch.load``: plain containers and
scalars, tensors built only from the bytes of their zip records, numpy's RNG state
by its exact shape and dtype. See ``trainstate`` for what is admitted and how the
bounds hold while parsing.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsafeCheckpoint
from . import trainstate


def load_plain(data, *, url: str, what: str = "train state") -> Any:
    """The plain data held by ``data`` (a ``torch.save`` archive: bytes, a memoryview
    or a binary file), on the CPU. Raises UnsafeCheckpoint naming ``url`` and what was
    refused; nothing of it runs."""
    return trainstate.load(data, url=url, what=what)


def load_tensor(f, *, url: str, fqn: str, map_location: Any = "cpu") -> torch.Tensor:
    """The one tensor of a DCP tensor item (``f``: bytes, a memoryview or a binary
    file); ``map_location="meta"``: its dtype, shape, strides and storage size only,
    nothing of its bytes read. Raises UnsafeCheckpoint naming ``url`` and ``fqn``."""
    what = f"tensor {fqn!r}"
    meta = map_location == "meta"
    t = trainstate.load(f, url=url, what=what, meta=meta)
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsafeCheckpoint(f"{url}: refused to load the {what}: the item holds a {type(t).__name__}, not a tensor")
    return t if meta or map_location in (None, "cpu") else t.to(map_location)
