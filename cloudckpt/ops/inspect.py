"""What one committed step holds: its marker, the entries of its DCP metadata (from
the DCP index's header where the step has one, else ``.metadata``) and the top-level
keys of rank 0's train state, each read through
:class:`cloudckpt.checkpoint.committed.CommittedStep` (checked against the marker, then
parsed with the untrusted-input checks). Imports torch (the metadata holds torch types), but only
once the marker is read: a step that is not there is reported without it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..checkpoint import discovery, layout
from ..checkpoint.marker import Marker
from ..checkpoint.step import StepRef
from ..storage import Location, Where


@dataclass(frozen=True)
class StepReport:
    url: str
    marker: Marker
    has_metadata: bool  # the marker lists the DCP index's header or model_and_optim/.metadata
    tensors: list[dict]  # {key, dtype, shape, numel, size_bytes, chunks}, by key
    non_tensor_keys: list[str]
    train_state: dict | None  # {path, type, keys: [{key, type, value, summary}], ranks[, summary]}
    tensors_from: str = layout.DCP_METADATA  # the file the tensors were read from (the DCP index's header, or this)

    def to_json(self, now: float, *, chunks: bool = False) -> dict:
        summary = self.marker.summary()
        summary["age_seconds"] = round(now - self.marker.created_unix, 1)
        objects = [o.to_json() for o in self.marker.objects]
        if not chunks:
            for o in objects:
                o.pop("chunks", None)
        return {"url": self.url, "marker": summary, "tensors": self.tensors, "non_tensor_keys": self.non_tensor_keys,
                "train_state": self.train_state, "objects": objects}


_MAX_INT_DIGITS = 60  # a longer integer is described by its size (str() of a 5,000-digit one raises)


def _int_text(v: int) -> str | None:
    """``repr(v)``, or None when it would have more than ``_MAX_INT_DIGITS`` digits."""
    return repr(v) if v.bit_length() <= _MAX_INT_DIGITS * 3 else None


def key_text(k: Any) -> str:
    """A train-state key as text (keys are what the untrusted unpickler admitted: a
    long integer is named by its size instead of its digits)."""
    if isinstance(k, int) and not isinstance(k, bool) and _int_text(k) is None:
        return f"<int of {k.bit_length()} bits>"
    return k if isinstance(k, str) else repr(k)


def describe_value(v: Any) -> tuple[str, Any, str]:
    """(type name, JSON-able scalar or None, short text) of a train-state value."""
    tname = type(v).__name__
    if isinstance(v, int) and not isinstance(v, bool) and _int_text(v) is None:
        return tname, None, f"<{v.bit_length()}-bit integer>"
    if isinstance(v, float) and not math.isfinite(v):
        return tname, None, repr(v)  # not a JSON number
    if v is None or isinstance(v, (bool, int, float)):
        return tname, v, repr(v)
    if isinstance(v, str):
        return tname, v, repr(v if len(v) <= 60 else v[:57] + "...")
    shape = getattr(v, "shape", None)
    if shape is not None and hasattr(v, "dtype"):
        return tname, None, f"{str(v.dtype).replace('torch.', '')} {list(shape)}"
    if isinstance(v, (dict, list, tuple, set)):
        return tname, None, f"{len(v)} item(s)"
    return tname, None, ""


def _tensor(key: str, dtype: Any, size: Any, chunks: int) -> dict:
    numel = 1
    for d in size:
        numel *= int(d)
    return {"key": key, "dtype": str(dtype).replace("torch.", ""), "shape": [int(d) for d in size], "numel": numel,
            "size_bytes": numel * dtype.itemsize, "chunks": chunks}


def _tensors(c: Any) -> tuple[bool, list[dict], list[str], str]:
    """The tensors and other keys of the step ``c`` (a CommittedStep): from the DCP index
    header where the step has one (a fraction of ``.metadata``'s bytes, which grow with
    ranks x tensors: 1.6 GB at 4,096 ranks of a 70B model, ~27 GB of memory to unpickle),
    else from ``.metadata``."""
    header = c.header()  # checked as every reader checks it: what it says the step holds, it stores
    if header is not None:
        tensors = [_tensor(k, t.dtype, t.size, 1 if t.layout < 0 else header.layouts[t.layout].n)
                   for k, t in sorted(header.tensors.items())]
        return True, tensors, sorted(header.values), layout.INDEX_HEADER
    if c.metadata_bytes() is None:
        return False, [], [], layout.DCP_METADATA
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = c.metadata()
    tensors, others = [], []
    for key in sorted(md.state_dict_metadata):
        sm = md.state_dict_metadata[key]
        if not isinstance(sm, TensorStorageMetadata):
            others.append(key)
            continue
        tensors.append(_tensor(key, sm.properties.dtype, sm.size, len(sm.chunks)))
    return True, tensors, others, layout.DCP_METADATA


def _train_state(c: Any) -> dict | None:
    marker, rel = c.marker, layout.train_state_name(0)
    if marker.object(rel) is None:
        return None
    obj = c.train_state(0)
    keys = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            tname, value, text = describe_value(v)
            keys.append({"key": key_text(k), "type": tname, "value": value, "summary": text})
    tname, _, text = describe_value(obj)
    return {"path": rel, "type": tname, "keys": keys, "ranks": marker.world_size,
            **({} if isinstance(obj, dict) else {"summary": text})}


def inspect_step(step: Where) -> StepReport:
    """Describe the committed step ``step``. Raises NotACheckpoint (no marker),
    CorruptCheckpoint / UnsafeCheckpoint (metadata or train state refused),
    IncompatibleCheckpoint, storage errors."""
    ref = StepRef.of(step)
    marker = discovery.read_marker(ref.loc)  # a step that is not there is reported before torch is imported
    from ..checkpoint.committed import CommittedStep  # imports torch

    c = CommittedStep(ref, marker)
    has_md, tensors, others, source = _tensors(c)
    return StepReport(Location.of(step).url, marker, has_md, tensors, others, _train_state(c), source)
