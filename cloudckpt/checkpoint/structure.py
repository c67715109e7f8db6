"""The structure of the step a job loaded, kept for its saves: the first save after a
resume (and each later one while the structure holds) is planned from it, with no
gather of plans on any rank.

A load leaves every rank the step's checked DCP index header (every key's dtype and
size, each sharded tensor's chunk layout and the rank that wrote each chunk) and, for a
restart with the saved world size, its own index part (where its chunks lie). A rank
whose state has that structure (the same keys, dtypes and sizes; each of its tensors'
chunks tiled by the layout's chunks; every chunk the loaded step gives it held here)
writes what it wrote then: its final plan follows from the header
(:meth:`LoadedStructure.final_plan`), and the byte positions its items had
(``expected``) tell whether its write results are the loaded step's. When every rank's
are, DCP's ``.metadata`` and the index header of the new step are the loaded step's,
byte for byte: rank 0 copies the one inside the store and writes the other from the
bytes the load handed it. The ranks agree in DCP's own plan step, which then carries a
few bytes a rank (``_torch_compat.ResumedSavePlanner``); a rank that finds its state
changed makes every rank fall back to a full save (never a silently wrong step).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from . import layout
from .layout import shard_writer as _owner

Plan = tuple  # (final write items, {MetadataIndex: (file, offset, length) in the loaded step})


class LoadedStructure:
    """One rank's view of the step it loaded (``committed``: the load's CommittedStep),
    for its next saves; :meth:`of` returns None for a step it cannot serve (another
    world size, no DCP index, no manifest)."""

    def __init__(self, committed: Any, rank: int):
        self.committed = committed
        self.rank = rank
        self.header = committed.header()
        self.header_bytes = committed.header_bytes()
        self.usable = True  # False once the coordinator cannot place .metadata from it (every rank then saves whole)
        self._part: dict | None = None
        self._owned: dict[int, int] = {}  # layout id -> chunks this rank wrote
        self._metadata: Any = None  # the coordinator: the loaded .metadata, once a save needed it
        entry = committed.marker.object(layout.DCP_METADATA) if rank == 0 else None
        # the coordinator: where a .metadata with the loaded bytes is ((url, version) newest first), its size, CRC32C
        self.metadata_sources = [(committed.step.metadata_url, None)] if entry is not None else []
        self.metadata_entry = entry

    @classmethod
    def of(cls, committed: Any, rank: int, world_size: int) -> "LoadedStructure | None":
        m = committed.marker
        if not m.verified or m.world_size != world_size or committed.header_bytes() is None:
            return None
        if rank == 0 and m.object(layout.DCP_METADATA) is None:
            return None
        return cls(committed, rank)

    def placed(self, url: str, version: str | None) -> None:
        """The coordinator placed a copy of the loaded ``.metadata`` at ``url``: copy from it next."""
        self.metadata_sources = [(url, version), *[s for s in self.metadata_sources if s[0] != url]][:2]

    def metadata(self) -> Any:
        """The coordinator: the loaded step's whole DCP ``Metadata`` (read, checked and
        unpickled once), for a save whose write results moved."""
        if self._metadata is None:
            self._metadata = self.committed.metadata()
        return self._metadata

    def _own_part(self) -> dict:
        if self._part is None:
            self._part = self.committed.index_part(self.rank) or {}
        return self._part

    def _owned_chunks(self) -> int:
        """Chunks, whole tensors and values the loaded step gives this rank to write."""
        h, n = self.header, 0
        for t in h.tensors.values():
            if t.layout < 0:
                n += _owner(t.item[0]) == self.rank
            else:
                got = self._owned.get(t.layout)
                if got is None:
                    got = self._owned[t.layout] = len(h.layouts[t.layout].chunks_of(self.rank))
                n += got
        return n + sum(_owner(item[0]) == self.rank for item in h.values.values())

    def final_plan(self, items: list) -> "Plan | str":
        """This rank's write items as the loaded step placed them (its own, and the
        pieces of shared tensors it wrote then), with each one's position in the loaded
        step; or why the state here does not have the loaded step's structure."""
        if not self.usable:
            return "the coordinator could not place the loaded step's .metadata"
        h, rank = self.header, self.rank
        try:
            part = self._own_part()
        except Exception as e:  # noqa: BLE001 - a part we cannot read: a full save, said why
            return f"its index part of the loaded step could not be read ({type(e).__name__}: {e})"
        out: list = []
        expected: dict = {}
        for it in items:
            fqn, td = it.index.fqn, it.tensor_data
            if td is None:
                item = h.values.get(fqn) if it.type == WriteItemType.BYTE_IO else None
                if item is None:
                    return f"{fqn!r} is not a value of the loaded step"
                if _owner(item[0]) == rank:
                    out.append(it)
                    expected[it.index] = tuple(item)
                continue
            why = self._tensor_items(it, part, out, expected)
            if why:
                return why
        if len(out) != self._owned_chunks():
            return "the loaded step gives this rank chunks that its state does not hold"
        return out, expected

    def _tensor_items(self, it: Any, part: dict, out: list, expected: dict) -> str | None:
        h, rank = self.header, self.rank
        fqn, td = it.index.fqn, it.tensor_data
        t = h.tensors.get(fqn)
        off, sz = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
        if t is None or t.dtype != td.properties.dtype or tuple(t.size) != tuple(td.size):
            return f"{fqn!r} is not a tensor of that dtype and size in the loaded step"
        if not math.prod(sz):
            return f"{fqn!r} has an empty chunk here"
        if t.layout < 0:  # stored whole
            if any(off) or sz != tuple(t.size):
                return f"{fqn!r} was stored whole; this rank holds a chunk of it"
            if _owner(t.item[0]) == rank:
                out.append(it)
                expected[it.index] = tuple(t.item)
            return None
        lay = h.layouts[t.layout]
        ks = lay.pick(off, sz)
        los, sizes = lay.boxes(ks) if ks else ([], [])
        covered = 0
        for k, lo, s, owner in zip(ks, los, sizes, lay.owners_of(ks) if ks else [], strict=True):
            lo, s = tuple(lo), tuple(s)
            if any(a < b or a + n > b + m for a, n, b, m in zip(lo, s, off, sz, strict=True)):
                return f"{fqn!r}: a chunk of the loaded step straddles this rank's chunk"
            covered += math.prod(s)
            if owner != rank:
                continue
            if (lo, s) == (off, sz):
                piece = it
            elif lo[1:] == off[1:] and s[1:] == sz[1:]:  # rows of it (the balanced save's pieces)
                chunk = ChunkStorageMetadata(offsets=torch.Size(lo), sizes=torch.Size(s))
                piece = dataclasses.replace(it, type=WriteItemType.SHARD, index=MetadataIndex(fqn, torch.Size(lo)),
                                            tensor_data=dataclasses.replace(td, chunk=chunk))
            else:
                return f"{fqn!r}: the loaded step cut it otherwise than by rows"
            got = (s, *lay.items[k]) if lay.items is not None else part.get((fqn, lo))
            if got is None or tuple(got[0]) != s:
                return f"{fqn!r}: its index part lacks the chunk at {list(lo)}"
            out.append(piece)
            expected[piece.index] = tuple(got[1:])
        if covered != math.prod(sz):
            return f"{fqn!r}: the loaded step's chunks do not tile this rank's chunk"
        return None


__all__ = ["LoadedStructure"]
