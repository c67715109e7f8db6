"""A save's global planning done by owners of the keys, not by one rank: no rank
receives every rank's plan.

The call order (every rank calls :func:`plan_by_owners` with its own local plan,
``DefaultSavePlanner.create_local_plan()``'s):

1. (all ranks) each item of the local plan becomes a small record (key, chunk offsets
   and sizes, properties, the tensor's size, its position in the plan, its flattened
   path), sent to the owner of its key (:func:`owner_of`: a CRC32 of the key modulo the
   world size): one all-to-all (``Coordinator.all_to_all_objects``).
2. (owners) for each key it owns an owner checks what DCP's global planner checks:
   the same properties and size on every rank, every chunk inside the tensor, no two
   chunks overlapping (a replicated chunk is the same chunk, held by several ranks),
   the chunks covering the tensor; it chooses one writer for each chunk held by several
   ranks, deterministically from its holders (``writer="lowest"``: the lowest rank, as
   ``DefaultSavePlanner(dedup_save_to_lowest_rank=True)``; ``"spread"``: a holder
   picked by a hash of the key and offsets, so replicated items spread over the ranks
   with no exchange of loads), and makes the key's ``Metadata`` entries (chunks in
   DCP's order: writer rank, then position in its plan). Any owner's failure is
   raised on every rank (``Coordinator.agree``).
3. (all ranks) the owners tell each writer which of its items it writes and each
   one's index hint (the chunk's position, as DCP's global plan rewrites it): one more
   all-to-all of small records.

A rank receives the records of the keys it owns and the decisions about its own items:
about ``1/R`` of the job's records, never the whole. Its result, :class:`OwnedPlan`,
holds what it writes and the Metadata entries it owns: with its own write results they
make its ``.metadata`` fragment (:func:`fragment_of`, dcp/assemble.py).

Inside ``dcp.save``: :class:`OwnersSavePlanner` runs the above in DCP's local plan
step and hands DCP an empty plan, so its coordinator makes no Metadata: the caller runs
``dcp.save(..., use_collectives=False)`` (DCP's gathers of plans and of write results
would carry nothing; DCP ends with one barrier), its storage writer keeps its write
results and its errors (raised on every rank after the save) and writes no
``.metadata`` in ``finish``: after the save every rank passes
``fragment_of(planner.owned, its results)`` to ``assemble_store.assemble_in_store``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
import zlib
from bisect import bisect_right, insort
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from .._torch_compat import element_size
from ..checkpoint.layout import shard_writer
from ..dist import Coordinator
from ..errors import ShapeMismatch
from .assemble import fragment
from .index import dtype_name, header_from_layouts, layout_key

WRITERS = ("lowest", "spread")
#: Largest pickled payload one rank sends another in one exchange (the records of a share of the keys).
PAYLOAD_LIMIT = 1 << 30


def owner_of(fqn: str, world_size: int) -> int:
    """The rank that owns key ``fqn`` (the same in every process: not Python's ``hash``)."""
    return zlib.crc32(fqn.encode()) % world_size


@dataclass
class OwnedPlan:
    """One rank's result: ``plan`` holds the items it writes (each tensor item's index
    hint set as DCP's global plan sets it); ``state_dict_metadata`` and ``planner_data``
    the Metadata entries of the keys it owns; ``sent`` / ``received`` the bytes of
    records it sent and received in the two exchanges."""

    plan: SavePlan
    state_dict_metadata: dict
    planner_data: dict
    sent: int = 0
    received: int = 0


# a record: (fqn, is_bytes, chunk offsets, chunk sizes, properties, tensor size, position, flattened path)
def _records(plan: SavePlan, world: int) -> list[list[tuple]]:
    """The plan's records, by owner. Equal properties are one object (pickled once a
    payload: the records of a 70B model's 2,892 keys carry one TensorProperties, not one
    each), as are equal tensor sizes."""
    paths = plan.planner_data if isinstance(plan.planner_data, dict) else {}
    out: list[list[tuple]] = [[] for _ in range(world)]
    same: dict = {}
    for pos, item in enumerate(plan.items):
        fqn = item.index.fqn
        td = item.tensor_data
        if item.type == WriteItemType.BYTE_IO:
            rec = (fqn, True, None, None, None, None, pos, paths.get(fqn))
        else:
            p = td.properties
            props = same.setdefault((p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory), p)
            size = tuple(td.size)
            rec = (fqn, False, tuple(td.chunk.offsets), tuple(td.chunk.sizes), props, same.setdefault(size, size), pos,
                   paths.get(fqn))
        out[owner_of(fqn, world)].append(rec)
    return out


def _overlap(a: tuple, b: tuple) -> bool:
    (ao, asz), (bo, bsz) = a, b
    return all(x < y + m and y < x + n for x, n, y, m in zip(ao, asz, bo, bsz, strict=True))


def _check_chunks(fqn: str, size: tuple, chunks: list[tuple], world: int) -> None:
    """Raise ShapeMismatch unless every chunk (offsets, sizes) is inside ``size``, no two
    overlap (a sweep along one dimension: the one whose chunk starts differ most, the
    longest of those; along a dimension every chunk spans, as a row-sharded tensor's
    columns, every chunk would meet every other: R x R checks) and, with more than one
    rank, they cover it."""
    volume = 0
    for offsets, sizes in chunks:
        if len(offsets) != len(size) or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size,
                                                                                            strict=True)):
            raise ShapeMismatch(f"save: {fqn!r}: a chunk at {list(offsets)} of {list(sizes)} is outside the tensor "
                                f"of {list(size)}; a tensor under one key must have the same shape on every rank")
        volume += math.prod(sizes)
    if len(chunks) > 1 and size:
        d = max(range(len(size)), key=lambda k: (len({c[0][k] for c in chunks}), size[k]))
        active: list[tuple[int, int]] = []
        for k in sorted(range(len(chunks)), key=lambda k: (chunks[k][0][d], chunks[k][0])):
            start = chunks[k][0][d]
            del active[:bisect_right(active, (start, math.inf))]
            for _, j in active:
                if _overlap(chunks[k], chunks[j]) and math.prod(chunks[k][1]) and math.prod(chunks[j][1]):
                    raise ShapeMismatch(f"save: {fqn!r}: the chunks at {list(chunks[k][0])} and {list(chunks[j][0])} "
                                        "overlap; ranks must hold disjoint shards of a tensor (or the same one)")
            insort(active, (start + chunks[k][1][d], k))
    if world > 1 and size and volume != math.prod(size):
        raise ShapeMismatch(f"save: {fqn!r}: its chunks hold {volume} elements of the {math.prod(size)} of the "
                            f"tensor of {list(size)}; every element must be held by some rank")


def _writer(fqn: str, offsets: Any, holders: list[int], how: str) -> int:
    if how == "lowest" or len(holders) == 1:
        return holders[0]
    return holders[zlib.crc32(f"{fqn}|{offsets}".encode()) % len(holders)]


class SharedItemsTooLarge(Exception):
    """An owner found a chunk held by several ranks larger than the planning's
    ``shared_limit``: such a chunk is better written in pieces by its holders, balanced
    by bytes (``_torch_compat.balanced_dedup``, which needs every plan), than whole by
    one holder. Raised on every rank before anything is written."""


def _decide(received: list[list[tuple]], world: int, how: str, shared_limit: int | None = None,
            small: int = 0) -> tuple[dict, dict, list[list[tuple]]]:
    """The owner's work on every record sent to it: (its Metadata entries, its
    planner_data entries, for each rank the (position, index hint) of the items it writes).
    Raises ShapeMismatch, or SharedItemsTooLarge (``shared_limit`` bytes)."""
    by_key: dict[str, list[tuple[int, tuple]]] = {}
    for rank, recs in enumerate(received):
        for rec in recs:
            by_key.setdefault(rec[0], []).append((rank, rec))
    sdm: dict = {}
    paths: dict = {}
    writes: list[list[tuple]] = [[] for _ in range(world)]
    for fqn, held in by_key.items():
        path = next((rec[7] for _, rec in held if rec[7] is not None), None)
        if path is not None:
            paths[fqn] = path
        kinds = {rec[1] for _, rec in held}
        if len(kinds) != 1:
            raise ShapeMismatch(f"save: {fqn!r} is a tensor on some ranks and another value on others "
                                f"(ranks {sorted(r for r, _ in held)})")
        if True in kinds:  # a value pickled to bytes, the same on every holder: one writer
            holders = sorted({r for r, _ in held})
            w = _writer(fqn, None, holders, "lowest" if small else how)
            writes[w].append((next(rec[6] for r, rec in held if r == w), None))
            sdm[fqn] = BytesStorageMetadata()
            continue
        _, first = held[0]
        for r, rec in held:
            if (rec[4] is not first[4] and rec[4] != first[4]) or rec[5] != first[5]:
                raise ShapeMismatch(f"save: {fqn!r} is {list(first[5])} {first[4].dtype} on rank {held[0][0]} but "
                                    f"{list(rec[5])} {rec[4].dtype} on rank {r}; a tensor under one key must have the "
                                    "same shape, dtype and layout on every rank")
        chunks: dict[tuple, list[tuple[int, tuple]]] = {}
        for r, rec in held:
            same = chunks.setdefault(rec[2], [])
            if same and same[0][1][3] != rec[3]:
                raise ShapeMismatch(f"save: {fqn!r}: ranks {same[0][0]} and {r} hold chunks at {list(rec[2])} of "
                                    f"different sizes ({list(same[0][1][3])}, {list(rec[3])})")
            same.append((r, rec))
        _check_chunks(fqn, first[5], [(o, hs[0][1][3]) for o, hs in chunks.items()], world)
        esize = element_size(first[4].dtype)
        if shared_limit is not None:
            big = next((hs for hs in chunks.values() if len({r for r, _ in hs}) > 1
                        and math.prod(hs[0][1][3]) * esize > shared_limit), None)
            if big is not None:
                raise SharedItemsTooLarge(f"save: {fqn!r}: a chunk of {math.prod(big[0][1][3]) * esize} bytes is held "
                                          f"by ranks {sorted({r for r, _ in big})[:8]}; over {shared_limit} bytes, "
                                          "its holders write it in pieces, planned from every rank's plan")
        chosen = []  # (writer, position in its plan, offsets, sizes)
        for offsets, hs in chunks.items():
            tiny = math.prod(hs[0][1][3]) * esize <= small
            w = _writer(fqn, offsets, sorted({r for r, _ in hs}), "lowest" if tiny else how)
            chosen.append((w, next(rec[6] for r, rec in hs if r == w), offsets, hs[0][1][3]))
        chosen.sort(key=lambda c: (c[0], c[1]))  # DCP's order: the writers' plans, rank by rank
        for hint, (w, pos, _, _) in enumerate(chosen):
            writes[w].append((pos, hint))
        sizes: dict[tuple, torch.Size] = {}  # the chunks of one size share their torch.Size
        sdm[fqn] = TensorStorageMetadata(first[4], torch.Size(first[5]), [
            ChunkStorageMetadata(torch.Size(o), sizes.get(s) or sizes.setdefault(s, torch.Size(s)))
            for _, _, o, s in chosen])
    return sdm, paths, writes


def plan_by_owners(coord: Coordinator, local_plan: SavePlan, *, writer: str = "spread",
                   limit: int = PAYLOAD_LIMIT, shared_limit: int | None = None, small: int = 0) -> OwnedPlan:
    """Every rank: the global planning of a save by owners (the module docstring), from
    this rank's ``local_plan``. ``small``: a value held by several ranks, and a chunk of
    at most ``small`` bytes, goes to its lowest holder whatever ``writer`` says
    (``balanced_dedup``'s rule: a loading rank finds a job's scalars in rank 0's files and
    manifest part, not in every rank's). Raises on every rank what any owner found
    (ShapeMismatch naming the key; SharedItemsTooLarge: a chunk held by several ranks
    over ``shared_limit`` bytes, None: no limit), CollectiveError or PeerLost."""
    if writer not in WRITERS:
        raise ValueError(f"writer={writer!r}: use one of {WRITERS}")
    world = coord.world_size
    received = coord.all_to_all_objects(_records(local_plan, world), "send the save plan's records to their owners",
                                        limit=limit)
    sent, got = coord.exchanged
    sdm, paths, writes = coord.agree("owners check the save plan",
                                     lambda: _decide(received, world, writer, shared_limit, small))
    mine = coord.all_to_all_objects(writes, "tell each rank what it writes", limit=limit)
    sent2, got2 = coord.exchanged
    hints = dict(p for per_owner in mine for p in per_owner)
    items = []
    for pos, item in enumerate(local_plan.items):
        if pos not in hints:
            continue
        if hints[pos] is not None:
            item = dataclasses.replace(item, index=MetadataIndex(item.index.fqn, item.index.offset, hints[pos]))
        items.append(item)
    plan = dataclasses.replace(local_plan, items=items)
    return OwnedPlan(plan, sdm, paths, sent + sent2, got + got2)


def fragment_of(owned: OwnedPlan, write_results: list) -> bytes:
    """This rank's ``.metadata`` fragment (dcp/assemble.py): the entries of the keys it
    owns and the storage entries of the items it wrote (DCP's WriteResults)."""
    return fragment(state_dict_metadata=owned.state_dict_metadata, planner_data=owned.planner_data,
                    storage_data=[(wr.index, wr.storage_data) for wr in write_results])


def index_header(coord: Coordinator, owned: OwnedPlan, write_results: list, *, dcp_version: Any,
                 limit: int = PAYLOAD_LIMIT) -> bytes | None:
    """Every rank, after the save's writes: the DCP index header (dcp/index/) of a save
    planned by owners; its bytes on the coordinator, None elsewhere. Raises on every
    rank what any rank met (CollectiveError, PeerLost).

    1. (all ranks) each rank sends where it wrote each item (key, chunk offsets, file,
       offset, length) to the owner of its key: one all-to-all of small records;
    2. (owners -> coordinator) each owner's header entries of its keys: a tensor stored
       whole and a value with its item, a sharded tensor with the id of its layout among
       the owner's distinct layouts, and each such layout's digest
       (``Coordinator.gather_some``: O(keys) records in all, from the owners only; a
       rank that owns no key sends its length, 0);
    3. (coordinator -> all ranks) for each distinct layout of the job, the first owner
       that has it sends it, with its chunks' items where only one tensor uses it (a
       broadcast of the asks: two integers a distinct layout, nothing a rank);
    4. (owners -> coordinator) those layouts, point to point from the owners asked; the
       coordinator writes the header (``index.header_from_layouts``).

    The coordinator receives the header's own size (``T + layouts x R``), never a chunk
    list per tensor, and no rank holds the global Metadata."""
    world = coord.world_size
    places: list[list[tuple]] = [[] for _ in range(world)]
    for wr in write_results:
        sd = wr.storage_data
        places[owner_of(wr.index.fqn, world)].append(
            (wr.index.fqn, _offsets(wr.index.offset), sd.relative_path, int(sd.offset), int(sd.length)))
    got = coord.all_to_all_objects(places, "send where each item was written to the owner of its key", limit=limit)
    where = {(fqn, off): [rel, o, n] for recs in got for fqn, off, rel, o, n in recs}
    del got, places
    kept: list[list] = []  # this owner's distinct layouts: [key, items in chunk order]

    def mine() -> tuple | None:
        got = _header_records(owned, where, kept)
        return got if any(got) else None  # a rank that owns no key sends nothing but its length

    records = coord.gather_some("the owners' entries of the DCP index header", mine)
    chosen: dict = {}

    def choose() -> dict[int, list[int]]:  # the asked owners' asks only (one a distinct layout of the job)
        chosen.update(_choose_layouts(records))
        return chosen["asks"]

    asks = coord.on_coordinator("which owner sends each layout of the DCP index header", choose)
    sent = _layouts_to_coordinator(coord, asks, kept, limit)
    if sent is None:
        return None
    gid = chosen["gid"]
    layouts: list = [None] * len(gid)
    for r, per_owner in sent.items():
        for k, key, items in per_owner:
            layouts[gid[records[r][2][k]]] = (key, items)
    tensors, values = [], []
    for tens, vals, digests in (x for x in records if x is not None):
        tensors += [t if t[3] < 0 else [*t[:3], gid[digests[t[3]]], None] for t in tens]
        values += vals
    return header_from_layouts(dcp_version, tensors, values, layouts)


def _layouts_to_coordinator(coord: Coordinator, asks: dict[int, list[int]], kept: list,
                            limit: int) -> dict | None:
    """Step 4 of :func:`index_header`: each owner asked for layouts sends them to the
    coordinator point to point; the coordinator returns ``{rank: its list}`` of the
    asked ranks (None elsewhere). Not a gather of objects: torch's pads every rank's
    payload to the largest, and a layout holds R chunks (R x R on the coordinator and
    the wire). An owner that cannot build its payload sends its error, which the
    coordinator raises."""
    if not coord.is_coordinator:
        if coord.rank not in asks:
            return None
        try:
            mine: tuple = (True, _asked_layouts(asks[coord.rank], kept))
        except Exception as e:
            coord.send_bytes(pickle.dumps((False, f"{type(e).__name__}: {e}")), 0)
            raise
        coord.send_bytes(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL), 0)
        return None
    out: dict = {0: _asked_layouts(asks[0], kept)} if 0 in asks else {}
    for r in sorted(asks):
        if r == 0:
            continue
        ok, got = pickle.loads(coord.recv_bytes(r, limit=limit))
        if not ok:
            raise RuntimeError(f"save: rank {r} could not send the layouts of the DCP index header it was asked "
                               f"for ({got}); a cloudckpt bug")
        out[r] = got
    return out


def _asked_layouts(asked: list[int], kept: list) -> list:
    """``(layout id, its key, its items where one tensor uses it)`` of each layout asked for."""
    return [(k, kept[k][0], kept[k][1] if single else None) for k, single in zip(asked[::2], asked[1::2], strict=True)]


def _offsets(offset: Any) -> tuple | None:
    return None if offset is None else tuple(int(x) for x in offset)


def _header_records(owned: OwnedPlan, where: dict, kept: list) -> tuple[list, list, list]:
    """An owner's header entries of its keys (step 2 of :func:`index_header`): tensors
    (a sharded one's layout id indexes ``kept``, which this fills), values, and the
    digest of each layout in ``kept``."""
    def place(fqn: str, offsets: Any) -> list:
        got = where.get((fqn, _offsets(offsets)))
        if got is None:
            raise RuntimeError(f"save: no rank reported where it wrote {fqn!r} at {offsets}; the owners' plan gave "
                               "that item a writer (a cloudckpt bug)")
        return got

    tensors, values = [], []
    ids: dict[tuple, int] = {}
    for fqn, md in owned.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            values.append([fqn, *place(fqn, None)])
            continue
        size = list(md.size)
        dtype = dtype_name(md.properties.dtype, fqn)
        # stored whole: one chunk is the whole tensor (others, if any, are empty), as header_bytes finds it
        whole = next((c for c in md.chunks if list(c.sizes) == size and not any(c.offsets)), None)
        if whole is not None:
            tensors.append([fqn, dtype, size, -1, place(fqn, whole.offsets)])
            continue
        items = [place(fqn, c.offsets) for c in md.chunks]
        writers = []
        for rel, _, _ in items:
            w = shard_writer(rel)
            if w is None:
                raise RuntimeError(f"save: {fqn!r} was written to {rel!r}, not a shard file __{{rank}}_{{k}}.distcp")
            writers.append(w)
        key = layout_key(size, md.chunks, writers)
        lid = ids.setdefault(key, len(kept))
        if lid == len(kept):
            kept.append([key, items])
        tensors.append([fqn, dtype, size, lid, None])
    digests = [hashlib.blake2b(repr(key).encode(), digest_size=16).digest() for key, _ in kept]
    return tensors, values, digests


def _choose_layouts(records: list) -> dict:
    """The coordinator (step 3 of :func:`index_header`): each distinct layout's id (by
    digest, in the order the owners list them) and ``asks``: for each owner asked for
    layouts (only those: one at most a distinct layout of the job), ``[its layout id,
    1 if only one tensor uses it else 0, ...]`` of the layouts it is to send."""
    gid: dict[bytes, int] = {}
    provider: list[tuple[int, int]] = []
    uses: list[int] = []
    for r, rec in enumerate(records):
        if rec is None:
            continue
        tensors, _, digests = rec
        mine = Counter(t[3] for t in tensors if t[3] >= 0)
        for k, d in enumerate(digests):
            g = gid.setdefault(d, len(provider))
            if g == len(provider):
                provider.append((r, k))
                uses.append(0)
            uses[g] += mine[k]
    asks: dict[int, list[int]] = {}
    for g, (r, k) in enumerate(provider):
        asks.setdefault(r, []).extend([k, int(uses[g] == 1)])
    return {"gid": gid, "asks": asks}


class OwnersSavePlanner(DefaultSavePlanner):
    """DCP's DefaultSavePlanner with the global planning done by owners, inside
    ``dcp.save(..., planner=OwnersSavePlanner(coord), process_group=coord.group,
    use_collectives=False)``: ``create_local_plan`` runs :func:`plan_by_owners` (its
    collectives on ``coord``'s group, on every rank in DCP's local step) and hands DCP an
    empty plan; ``create_global_plan`` (every rank, on its own plan) returns the plans as
    they are with an empty Metadata; ``finish_plan`` gives each rank its owned plan under
    the storage prefix DCP's writer chose. ``owned`` (an :class:`OwnedPlan`) then holds
    this rank's Metadata entries for :func:`fragment_of`, ``local_plan`` this rank's
    local plan; ``gathered``, the bytes of the plans DCP's global step was handed
    (pickled: every rank's, where DCP runs with collectives)."""

    def __init__(self, coord: Coordinator, *, writer: str = "spread", shared_limit: int | None = None,
                 small: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.coord, self.writer, self.shared_limit, self.small = coord, writer, shared_limit, small
        self.owned: OwnedPlan | None = None
        self.local_plan: SavePlan | None = None
        self.gathered = 0

    def create_local_plan(self) -> SavePlan:
        self.local_plan = super().create_local_plan()
        self.owned = plan_by_owners(self.coord, self.local_plan, writer=self.writer, shared_limit=self.shared_limit,
                                    small=self.small)
        return SavePlan([])

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self.gathered = len(pickle.dumps(all_plans))
        return all_plans, Metadata(state_dict_metadata={})

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self.owned is None:
            raise RuntimeError("OwnersSavePlanner.finish_plan before create_local_plan")
        return super().finish_plan(dataclasses.replace(self.owned.plan, storage_data=new_plan.storage_data))
