"""The DCP index written: the header (on the coordinator, from DCP's global
``Metadata``) and each rank's part (from its write plan and results), in the format
``decode`` reads."""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from .decode import _DTYPES, FORMAT, VERSION, _owner

HEADER_VERSION = 2  # what a save writes (decode.HEADER_VERSIONS: what a load reads)
_SHARED = object()  # header_bytes's own entry in its cache
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def part_items(plan_items: Iterable[Any], results: Iterable[Any]) -> list[list]:
    """This rank's index entries: ``[key, chunk offsets, chunk sizes, file, offset,
    length]`` for each item it wrote of a tensor chunk that is not the whole tensor
    (``plan_items``: the rank's WriteItems; ``results``: their WriteResults)."""
    chunks = {}
    for it in plan_items:
        td = getattr(it, "tensor_data", None)
        if td is None:
            continue
        if tuple(td.chunk.sizes) == tuple(td.size) and not any(td.chunk.offsets):
            continue  # stored whole: the header holds its item
        chunks[(it.index.fqn, tuple(td.chunk.offsets))] = td.chunk
    out = []
    for wr in results:
        c = chunks.get((wr.index.fqn, tuple(wr.index.offset or ())))
        if c is None:
            continue
        sd = wr.storage_data
        out.append([wr.index.fqn, list(c.offsets), list(c.sizes), sd.relative_path, int(sd.offset), int(sd.length)])
    out.sort(key=lambda e: (e[0], e[1]))
    return out


def part_bytes(rank: int, items: list[list]) -> bytes:
    return json.dumps({"format": FORMAT, "version": VERSION, "rank": int(rank), "items": items},
                      separators=(",", ":")).encode()


def header_bytes(metadata: Metadata, cache: dict | None = None, *, compact: bool = True) -> bytes:
    """The header of a step from DCP's global ``Metadata`` (on the coordinator, once
    its ``storage_data`` is set: in the writer's ``finish``).

    Finding each chunk's layout touches every chunk of every sharded tensor (R x T);
    ``cache`` (a dict kept across saves) keeps each tensor's layout while DCP hands the
    same chunk list again (its plan caching reuses the global metadata), so a repeated
    save costs O(T) here. ``compact``: a layout that is a grid is written as its cuts
    (:func:`_layout_doc`); False writes every layout as boxes (both forms are read)."""
    storage = metadata.storage_data
    cache = {} if cache is None else cache
    shared = cache.setdefault(_SHARED, {})  # layout keys, interned, and their docs: across saves
    interned: dict[tuple, tuple] = shared.setdefault("keys", {})
    docs_of: dict[tuple, tuple] = shared.setdefault("docs", {})
    layouts: dict[int, int] = {}  # id of an interned key -> layout id
    keys: list[tuple] = []
    users: dict[int, list] = {}  # layout id -> the tensors that use it
    tensors, values = [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            info = storage[MetadataIndex(fqn)]
            values.append([fqn, info.relative_path, int(info.offset), int(info.length)])
            continue
        size = list(md.size)
        chunks = md.chunks
        dtype = dtype_name(md.properties.dtype, fqn)
        hit = cache.get(fqn)
        if hit is not None and hit[0] is chunks and hit[1] == len(chunks):
            whole, key = hit[2], hit[3]
        else:
            # stored whole: one chunk is the whole tensor (the others, if any, are empty: an FSDP
            # shard of a tensor with fewer rows than ranks); its writer's part leaves it out too
            whole = next((c for c in chunks if list(c.sizes) == size and not any(c.offsets)), None)
            key = None
            if whole is None:
                flat: list[int] = []
                owners = []
                owner_of: dict[str, int] = {}
                for c in chunks:
                    flat.extend(c.offsets)
                    flat.extend(c.sizes)
                    rel = storage[MetadataIndex(fqn, c.offsets)].relative_path
                    o = owner_of.get(rel)
                    if o is None:
                        o = owner_of[rel] = _owner(rel)
                    owners.append(o)
                key = (len(size), tuple(flat), tuple(owners))
                key = interned.setdefault(key, key)
            cache[fqn] = (chunks, len(chunks), whole, key)
        if whole is not None:
            info = storage[MetadataIndex(fqn, whole.offsets)]
            tensors.append([fqn, dtype, size, -1, [info.relative_path, int(info.offset), int(info.length)]])
            continue
        lid = layouts.setdefault(id(key), len(layouts))
        if lid == len(keys):
            keys.append(key)
        users.setdefault(lid, []).append((fqn, chunks))
        tensors.append([fqn, dtype, size, lid, None])
    shared["keys"] = {k: k for k in keys}  # only the layouts of this save stay interned
    docs, orders = [], []
    for key in keys:
        got = docs_of.get((id(key), compact))
        if got is None or got[0] is not key:
            got = docs_of[(id(key), compact)] = (key, *_layout_doc(*key, compact))
        docs.append(dict(got[1]))  # a copy: the items of a one-tensor layout are added to it
        orders.append(got[2])
    shared["docs"] = {(id(k), compact): docs_of[(id(k), compact)] for k in keys}
    for lid, used in users.items():
        if len(used) == 1:  # a layout of one tensor (its own shape, or a replicated tensor cut in pieces)
            fqn, chunks = used[0]
            items = []
            for k in orders[lid] if orders[lid] is not None else range(len(chunks)):
                info = storage[MetadataIndex(fqn, chunks[k].offsets)]
                items.append([info.relative_path, int(info.offset), int(info.length)])
            docs[lid]["items"] = items
    return _dumped(getattr(metadata, "version", None), docs, tensors, values)


def _dumped(dcp_version: Any, docs: list, tensors: list, values: list) -> bytes:
    doc = {"format": FORMAT, "version": HEADER_VERSION, "dcp_version": dcp_version,
           "layouts": docs, "tensors": tensors, "values": values}
    return json.dumps(doc, separators=(",", ":")).encode()


def dtype_name(dtype: Any, fqn: str) -> str:
    """The header's name of ``dtype`` (ValueError for one the index cannot name)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"{fqn!r}: dtype {dtype} has no name in the DCP index")
    return name


def layout_key(size: Any, chunks: list, writers: list[int]) -> tuple:
    """A sharded tensor's layout as :func:`header_bytes` keys it: ``(ndim, offsets and
    sizes of every chunk, flattened, the rank that wrote each)``, chunks in DCP's order."""
    flat: list[int] = []
    for c in chunks:
        flat.extend(c.offsets)
        flat.extend(c.sizes)
    return (len(size), tuple(flat), tuple(writers))


def header_from_layouts(dcp_version: Any, tensors: list, values: list, layouts: list[tuple[tuple, list | None]],
                        *, compact: bool = True) -> bytes:
    """The header from pieces gathered on the coordinator of a save planned by owners
    (dcp/owners.py: no rank holds the global Metadata): ``tensors`` as the header lists
    them (a sharded one's layout id indexes ``layouts``), ``values``, and each distinct
    layout's key (:func:`layout_key`) with its chunks' items in chunk order where only
    one tensor uses it (else None). The same document :func:`header_bytes` writes for
    the same step."""
    docs = []
    for key, items in layouts:
        doc, order = _layout_doc(*key, compact)
        doc = dict(doc)
        if items is not None:
            doc["items"] = [items[k] for k in (order if order is not None else range(len(items)))]
        docs.append(doc)
    return _dumped(dcp_version, docs, tensors, values)


def _layout_doc(nd: int, flat: tuple, owners: tuple, compact: bool) -> tuple[dict, list[int] | None]:
    """A layout as the header writes it, and the order of its chunks there (None: as given).

    A layout whose non-empty chunks form a grid (every combination of one interval per
    dimension, exactly once: FSDP's rows, tensor parallel's columns, both) is written
    as its ``cuts``, each dimension's chunk boundaries from 0 to the tensor's size,
    with the owners of the chunks in row-major order; owners that step evenly (rank
    ``k`` wrote chunk ``k``) are written as ``{"start", "step"}``, and cuts at even
    steps as ``{"every", "end"}`` (:func:`_cut_doc`). That is ``O(sum of cuts)``
    numbers instead of ``2 x ndim x chunks + chunks``, and constant in R for an even
    split. Empty chunks (an FSDP shard of a tensor with fewer rows than
    ranks) hold nothing to read and are left out. Anything else is written as boxes."""
    boxes = {"ndim": nd, "boxes": list(flat), "owners": list(owners)}
    n = len(owners)
    if not compact or n < 2 or nd == 0:
        return boxes, None
    arr = np.array(flat, dtype=np.int64).reshape(n, 2, nd)
    keep = np.flatnonzero(np.all(arr[:, 1, :] > 0, axis=1))
    lo, sz = arr[keep, 0, :], arr[keep, 1, :]
    cuts, idx = [], []
    for d in range(nd):
        starts = np.unique(lo[:, d])
        if not len(starts) or starts[0] != 0:
            return boxes, None
        c = np.append(starts, (lo[:, d] + sz[:, d]).max())
        i = np.searchsorted(starts, lo[:, d])
        if np.any(c[i + 1] - c[i] != sz[:, d]):  # every chunk spans exactly one interval
            return boxes, None
        cuts.append(c)
        idx.append(i)
    dims = tuple(len(c) - 1 for c in cuts)
    if math.prod(dims) != len(keep):
        return boxes, None
    lin = np.ravel_multi_index(idx, dims)
    order = np.argsort(lin, kind="stable")
    if np.any(lin[order] != np.arange(len(keep))):
        return boxes, None  # two chunks in one cell
    own = np.array(owners, dtype=np.int64)[keep][order]
    steps = np.diff(own)
    if len(own) > 1 and steps[0] >= 1 and np.all(steps == steps[0]):
        rule: Any = {"start": int(own[0]), "step": int(steps[0])}
    else:
        rule = own.tolist()
    return {"ndim": nd, "cuts": [_cut_doc(c) for c in cuts], "owners": rule}, keep[order].tolist()


def _cut_doc(c: np.ndarray) -> Any:
    """One dimension's cuts: ``{"every": s, "end": E}`` for ``0, s, 2s, ..., E`` (the last
    interval at most ``s``: ``torch.chunk``'s split, which FSDP and DTensor use), else the list."""
    gaps = np.diff(c)
    if len(gaps) > 2 and np.all(gaps[:-1] == gaps[0]) and gaps[-1] <= gaps[0]:
        return {"every": int(gaps[0]), "end": int(c[-1])}
    return c.tolist()
