"""A rank's load planning from a checked header: the chunks its shards overlap, the
ranks whose parts it reads, and the DCP ``Metadata`` holding only what it reads."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..._torch_compat import StorageInfo
from .decode import Header, _bad, _owner, _shown

Wanted = dict[str, "list[tuple[tuple[int, ...], tuple[int, ...]]] | None"]  # key -> local boxes (None: a value)


def select(header: Header, wanted: Wanted) -> tuple[dict[str, list[int]], set[int]]:
    """For each tensor of ``wanted`` (key -> this rank's boxes ``(offsets, sizes)``)
    stored in chunks, the chunks its boxes overlap (as DCP's planner would find them),
    and the ranks whose index parts hold them. A key the header lacks, or a box of
    another rank (dimension count) than saved, selects nothing: the planner reports it."""
    needs: dict[str, list[int]] = {}
    owners: set[int] = set()
    memo: dict[tuple, list[int]] = {}
    for fqn, boxes in wanted.items():
        t = header.tensors.get(fqn)
        if t is None or t.layout < 0 or not boxes:
            continue
        lay = header.layouts[t.layout]
        picked: set[int] = set()
        for off, sz in boxes:
            if len(off) != lay.ndim:
                continue
            key = (t.layout, off, sz)
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = lay.pick(off, sz)
            picked.update(hit)
        if picked:
            ks = sorted(picked)
            needs[fqn] = ks
            if lay.items is None:
                owners.update(lay.owners_of(ks))
    return needs, owners


def writers_read(header: Header, needs: dict[str, list[int]], wanted: Wanted) -> set[int]:
    """The ranks whose shard files hold an item this rank reads (``select``'s chunks,
    the whole tensors and values it loads): the manifest parts whose CRC32Cs it checks."""
    out: set[int] = set()
    for fqn, ks in needs.items():
        out.update(header.layouts[header.tensors[fqn].layout].owners_of(ks))
    for fqn in wanted:
        t = header.tensors.get(fqn)
        item = t.item if t is not None else header.values.get(fqn)
        if item is not None:
            out.add(_owner(item[0]))
    return out


def build_metadata(header: Header, needs: dict[str, list[int]], parts: dict[int, dict], wanted: Wanted) -> Metadata:
    """DCP ``Metadata`` holding every key of the checkpoint (so missing and left-behind
    keys are judged as with the full metadata) and, for storage, only the chunks and
    values this rank reads. Raises CorruptCheckpoint if an owner's part lacks a chunk."""
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for fqn, t in header.tensors.items():
        chunks = []
        if t.layout < 0:
            if fqn in wanted:
                offs = torch.Size([0] * len(t.size))
                chunks.append(ChunkStorageMetadata(offsets=offs, sizes=torch.Size(t.size)))
                storage[MetadataIndex(fqn, offs)] = StorageInfo(*t.item)
        else:
            lay = header.layouts[t.layout]
            ks = needs.get(fqn, [])
            for k, owner, lo, sizes in zip(ks, lay.owners_of(ks), *lay.boxes(ks), strict=True):
                sizes = tuple(sizes)
                got = (sizes, *lay.items[k]) if lay.items is not None else parts[owner].get((fqn, tuple(lo)))
                if got is None or got[0] != sizes:
                    raise _bad(header.url, f"the index part of rank {owner} lacks the chunk of {_shown(fqn)} at "
                                           f"offsets {lo} of sizes {list(sizes)} that the header gives it")
                offs = torch.Size(lo)
                chunks.append(ChunkStorageMetadata(offsets=offs, sizes=torch.Size(sizes)))
                storage[MetadataIndex(fqn, offs)] = StorageInfo(*got[1:])
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), torch.Size(t.size), chunks)
    for fqn, item in header.values.items():
        sdm[fqn] = BytesStorageMetadata()
        if fqn in wanted:
            storage[MetadataIndex(fqn)] = StorageInfo(*item)
    md = Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage)
    if header.dcp_version is not None:
        md.version = header.dcp_version
    return md


def wanted_boxes(flat_state_dict: dict[str, Any]) -> Wanted:
    """Key -> this rank's boxes of each tensor of a flattened state dict (DTensor,
    ShardedTensor or plain tensor, as DCP's planner computes them), None for a value."""
    from ..._torch_compat import chunk_list

    out: Wanted = {}
    for fqn, obj in flat_state_dict.items():
        if not isinstance(obj, torch.Tensor) and not hasattr(obj, "__create_chunk_list__"):
            out[fqn] = None
            continue
        mesh = getattr(obj, "device_mesh", None)
        if mesh is not None and mesh.get_coordinate() is None:
            out[fqn] = []  # a DTensor on a submesh this rank is not part of: DCP reads nothing
            continue
        out[fqn] = [(tuple(c.offsets), tuple(c.sizes)) for c in chunk_list(obj)]
    return out
