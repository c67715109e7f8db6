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

:class:`SavedStructure` does the same for a step this job saved with the planning done
by owners (dcp/owners.py): each rank keeps its local plan, the items it wrote and where,
and rank 0 the step's index header and ``.metadata`` entry, so the saves that follow
are planned from that step as from a loaded one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from . import layout
from .committed import CommittedStep
from .layout import shard_writer as _owner

Plan = tuple  # (final write items, {MetadataIndex: (file, offset, length) in the loaded step})


class _KeptStep:
    """What the coordinator needs of a kept step to give the next step its ``.metadata``:
    the manifest's entry for it, where a copy with its bytes is (``(url, version)``,
    newest first), and the step's DCP ``Metadata`` read once when results moved.
    ``usable`` turns False once the coordinator cannot place ``.metadata`` from it
    (every rank then plans its next save otherwise). ``committed``: the step's
    CommittedStep (needed on the coordinator only)."""

    def __init__(self, committed: Any, rank: int):
        self.committed = committed
        self.usable = True
        self._metadata: Any = None
        entry = committed.marker.object(layout.DCP_METADATA) if rank == 0 else None
        self.metadata_sources = [(committed.step.metadata_url, None)] if entry is not None else []
        self.metadata_entry = entry

    def placed(self, url: str, version: str | None) -> None:
        """The coordinator placed a copy of the step's ``.metadata`` at ``url``: copy from it next."""
        self.metadata_sources = [(url, version), *[s for s in self.metadata_sources if s[0] != url]][:2]

    def metadata(self) -> Any:
        """The coordinator: the step's whole DCP ``Metadata`` (read, checked and unpickled
        once), for a save whose write results moved."""
        if self._metadata is None:
            self._metadata = self.committed.metadata()
        return self._metadata


class LoadedStructure(_KeptStep):
    """One rank's view of the step it loaded (``committed``: the load's CommittedStep),
    for its next saves; :meth:`of` returns None for a step it cannot serve (another
    world size, no DCP index, no manifest)."""

    def __init__(self, committed: Any, rank: int):
        super().__init__(committed, rank)
        self.rank = rank
        self.header = committed.header()
        self.header_bytes = committed.header_bytes()
        self._part: dict | None = None
        self._owned: dict[int, int] = {}  # layout id -> chunks this rank wrote

    @classmethod
    def of(cls, committed: Any, rank: int, world_size: int) -> "LoadedStructure | None":
        m = committed.marker
        if not m.verified or m.world_size != world_size or committed.header_bytes() is None:
            return None
        if rank == 0 and m.object(layout.DCP_METADATA) is None:
            return None
        return cls(committed, rank)

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
                    lay = h.layouts[t.layout]
                    ks = lay.chunks_of(self.rank)
                    if lay.cuts is None and ks:  # boxes may list empty chunks: those count as empty items
                        ks = [s for s in lay.boxes(ks)[1] if math.prod(s)]
                    got = self._owned[t.layout] = len(ks)
                n += got
        return n + sum(_owner(item[0]) == self.rank for item in h.values.values())

    def _owned_empty(self) -> int:
        """Empty chunks this rank wrote in the loaded step (its part lists them; no layout does)."""
        return sum(1 for v in self._own_part().values() if not math.prod(v[0]))

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
        empty = sum(1 for it in out if it.tensor_data is not None and not math.prod(it.tensor_data.chunk.sizes))
        if len(out) - empty != self._owned_chunks() or empty != self._owned_empty():
            return "the loaded step gives this rank chunks that its state does not hold"
        return out, expected

    def _tensor_items(self, it: Any, part: dict, out: list, expected: dict) -> str | None:
        h, rank = self.header, self.rank
        fqn, td = it.index.fqn, it.tensor_data
        t = h.tensors.get(fqn)
        off, sz = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
        if t is None or t.dtype != td.properties.dtype or tuple(t.size) != tuple(td.size):
            return f"{fqn!r} is not a tensor of that dtype and size in the loaded step"
        if not math.prod(sz):  # no layout holds it: the rank whose part lists it wrote it (with no bytes)
            got = part.get((fqn, off))
            if got is not None and tuple(got[0]) == sz:
                out.append(it)
                expected[it.index] = tuple(got[1:])
            return None
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
            if not math.prod(s):  # an empty chunk overlaps nothing: its writer holds it as an empty item
                continue
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


class SavedStructure(_KeptStep):
    """The structure of a step that a save planned by owners committed, kept by each rank
    for the job's next saves as a loaded step's is (the same members the writer uses):
    a rank whose local plan is the one it made then writes the items it wrote then
    (:meth:`final_plan`), each expected where it was; rank 0 holds the step's index
    header and where its ``.metadata`` is. Nothing crosses ranks to make it; ranks that
    disagree on keeping it are found by the next save."""

    def __init__(self, step: Any, marker: Any, rank: int, local: list, final: list, results: list,
                 header_bytes: bytes | None):
        super().__init__(CommittedStep(step, marker) if rank == 0 else None, rank)
        if rank == 0 and (self.metadata_entry is None or header_bytes is None):
            raise ValueError("the step's marker lists no .metadata, or rank 0 holds no index header")
        self._key = _plan_key(local)
        self._final = list(final)
        self._expected = {wr.index: (wr.storage_data.relative_path, wr.storage_data.offset, wr.storage_data.length)
                          for wr in results}
        self.header_bytes = header_bytes

    def final_plan(self, items: list) -> "Plan | str":
        """This rank's write items of the kept step and where each lay, if ``items`` (its
        local plan now) are the ones it planned then; else why not."""
        if not self.usable:
            return "the coordinator could not place the saved step's .metadata"
        if _plan_key(items) != self._key:
            return "the state differs from the step this job saved by owners"
        return list(self._final), dict(self._expected)


def _plan_key(items: list) -> list:
    """What a local plan's items say of the state: keys, kinds, sizes, properties, chunks."""
    out = []
    for it in items:
        td = it.tensor_data
        out.append((it.index.fqn, None if it.index.offset is None else tuple(it.index.offset), it.type,
                    None if td is None else (tuple(td.size), td.properties, tuple(td.chunk.offsets),
                                             tuple(td.chunk.sizes))))
    return out


__all__ = ["LoadedStructure", "SavedStructure"]
