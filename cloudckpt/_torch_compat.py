"""Every private torch API cloudckpt uses, in one place.

Torch may rename or drop any of these in a release without notice. Each entry names
the torch versions it was checked against (the signature and behaviour cloudckpt
relies on); when torch is upgraded, check each one and update its line, or replace
it here with a local copy or a public API. Nothing else in cloudckpt imports a
private torch name: it imports it from here.

(The process-group API of torch.distributed is not here: only ``cloudckpt.dist``
touches it.)
"""

from __future__ import annotations

from typing import Any

# ---------------------------------------------------------------------- plain torch
# checked: 2.13. ``_element_size(dtype)``: bytes per element of a dtype (RuntimeError
# for a non-dtype). Used by the DCP writer to size a chunk without a tensor.
from torch._utils import _element_size as element_size

# ---------------------------------------------------------------------- torch.distributed helpers
# checked: 2.13. ``narrow_tensor_by_index(tensor, offsets, sizes)``: the view of
# ``tensor`` at ``offsets`` of ``sizes`` (narrowed only where a size is smaller than
# the tensor's), as DCP's own reader narrows a loaded item.
from torch.distributed._shard._utils import narrow_tensor_by_index

# checked: 2.13. ``_copy_state_dict(state_dict, copy_state_dict, non_blocking=...)``:
# copies every tensor of a state dict into the matching tensor of a preallocated one
# (async saving's staging copy, checkpoint/async_save.py).
from torch.distributed._state_dict_utils import _copy_state_dict as copy_state_dict

# ---------------------------------------------------------------------- torch.distributed.checkpoint (DCP)
# checked: 2.13. ``unflatten_state_dict(state_dict, mapping)``: DCP's flat keys back
# into the nested dicts they were flattened from (``mapping``: key -> path), as DCP's
# load does (integrations/torchtitan.py).
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

# checked: 2.13. ``set_element(root_dict, path, value)``: sets a value at a flattened
# state dict's path, creating the containers on the way (the load planner's
# load_bytes, dcp/load_guard.py).
from torch.distributed.checkpoint._traverse import set_element

# checked: 2.13. ``_split_by_size_and_type(bins, items)``: DCP's own split of write
# items into ``bins`` files of similar size (tensors by size, byte items spread).
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type as split_by_size_and_type

# checked: 2.13. The storage info dataclass (relative_path, offset, length,
# transform_descriptors) DCP pickles into ``.metadata``'s storage_data; the metadata
# unpickler admits it by name (untrusted/unpickle.py).
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

# checked: 2.13. The enum TensorProperties pickles its memory format through; the
# metadata unpickler admits it by identity (untrusted/unpickle.py).
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as MEM_FORMAT_ENCODING

# checked: 2.13. ``_stateful_to_state_dict(state_dict)``: a state dict with every
# Stateful value replaced by its ``state_dict()``, as DCP's save does first (async
# saving stages that, checkpoint/async_save.py).
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict as stateful_to_state_dict

# checked: 2.13. What a pickled ``torch.layout`` calls to come back
# (``_get_layout("torch.strided")``: TensorProperties.layout in DCP's ``.metadata``);
# the metadata unpickler admits it by identity (untrusted/unpickle.py).
from torch.serialization import _get_layout as get_layout


def write_files(writer, planner, file_queue):
    """Write the files of ``file_queue`` (``(path, file name, write items)`` tuples)
    with DCP's FileSystemWriter machinery: the torch Future of its WriteResults.

    checked: 2.13. ``_FileSystemWriter._write_data(planner, file_queue)``: the private
    method ``write_data`` calls once it has split the plan into files; the DCP writer
    (dcp/writer.py) splits the plan itself (more, smaller files) and calls it."""
    return writer._write_data(planner, file_queue)


import dataclasses  # noqa: E402 - with the planner below

from torch.distributed.checkpoint import DefaultSavePlanner  # noqa: E402 - with the planner below
from torch.distributed.checkpoint.metadata import Metadata  # noqa: E402 - with the planner below

# An item held by several ranks whose bytes exceed both this and 1/8 of a rank's mean
# share is written in pieces (rows), so no one rank writes a large replicated tensor.
MIN_PIECE_BYTES = 1 << 20
SMALL_SHARED_BYTES = 4096  # a shared item this small is written by its lowest holder (balanced_dedup)


def _item_bytes(item) -> int:
    """Bytes an item writes: its chunk's for a tensor (DCP's ``tensor_storage_size``
    counts the whole tensor for every shard), 1 for a pickled object (size unknown)."""
    td = item.tensor_data
    if td is None:
        return 1
    n = element_size(td.properties.dtype)
    for s in td.chunk.sizes:
        n *= s
    return n


def _pieces(item, cap: int | None) -> list:
    """``item`` cut along its first dimension into row ranges of at most about
    ``cap`` bytes (one piece, ``item`` itself: ``cap`` None, or the item is smaller).
    Pieces are SHARD items: DCP's metadata then holds the tensor as several chunks, as
    it does a sharded tensor's."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItemType

    nbytes = _item_bytes(item)
    td = item.tensor_data
    if td is None or cap is None or nbytes <= cap or len(td.chunk.sizes) == 0 or td.chunk.sizes[0] < 2:
        return [item]
    rows = td.chunk.sizes[0]
    n = min(rows, -(-nbytes // cap))
    out, start = [], 0
    for j in range(n):
        k = rows // n + (j < rows % n)
        offsets = torch.Size([td.chunk.offsets[0] + start, *td.chunk.offsets[1:]])
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([k, *td.chunk.sizes[1:]]))
        out.append(dataclasses.replace(item, type=WriteItemType.SHARD, index=MetadataIndex(item.index.fqn, offsets),
                                       tensor_data=dataclasses.replace(td, chunk=chunk)))
        start += k
    return out


def balanced_dedup(all_plans: list, min_piece: int = MIN_PIECE_BYTES) -> list:
    """One writer per item held by several ranks (DDP's tensors, HSDP's shards held by
    every replica group, a replicated scalar), the writing shared by bytes. Items held
    by one rank are its own; a shared item of at most SMALL_SHARED_BYTES goes to its
    lowest holder; a shared tensor larger than ``min_piece`` and than 1/8 of
    a rank's mean share is cut into row pieces of about that size; then the shared
    items and pieces, largest first (ties by name and offset), each go to the least
    loaded of their holders (ties: the lowest rank). Depends only on the plans'
    contents, so a repeated save with the same plans plans the same.

    DCP 2.13's own ``dedup_save_plans`` walks the items in the order rank 0's plan
    lists them, sizes each shard as its whole tensor and never cuts an item, so a large
    item late in the state dict (an untied output layer) lands on one rank on top of an
    even share, and an embedding larger than a rank's share is written by one rank."""
    import dataclasses

    holders: dict = {}
    first: dict = {}
    uniform: dict = {}  # index -> every holder describes the same chunk of the same tensor
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            was = first.setdefault(item.index, item)
            if was is not item:  # a second holder
                uniform[item.index] = uniform.get(item.index, True) and was.tensor_data == item.tensor_data
    if len(holders) == sum(len(p.items) for p in all_plans):
        return list(all_plans)  # no item held twice: every rank writes its own
    world = max(len(all_plans), 1)
    cap = max(min_piece, sum(_item_bytes(i) for i in first.values()) // (8 * world))
    load = [0] * len(all_plans)
    writer: dict = {}  # item or piece index -> the rank that writes it
    cut: dict = {}  # index of a shared item -> its pieces, where it was cut
    shared = []
    for index, ranks in holders.items():
        if len(ranks) == 1:
            writer[index] = ranks[0]
            load[ranks[0]] += _item_bytes(first[index])
            continue
        pieces = _pieces(first[index], cap if uniform.get(index, True) else None)
        if len(pieces) > 1:
            cut[index] = pieces
        shared += [(piece, ranks) for piece in pieces]
    shared.sort(key=lambda p: (-_item_bytes(p[0]), p[0].index.fqn, tuple(p[0].index.offset or ())))
    for piece, ranks in shared:
        # a tiny shared item (an optimizer's step, a scalar) goes to its lowest holder: a
        # loading rank then finds them all in one rank's files and manifest part, not in
        # the parts of hundreds of ranks (what it costs in balance: bytes)
        small = _item_bytes(piece) <= SMALL_SHARED_BYTES
        rank = min(ranks) if small else min(ranks, key=lambda r: (load[r], r))
        writer[piece.index] = rank
        load[rank] += _item_bytes(piece)
    # each plan keeps its own order and its own items, a cut item's pieces where it was
    return [dataclasses.replace(plan, items=[p for item in plan.items for p in cut.get(item.index, (item,))
                                             if writer[p.index] == rank])
            for rank, plan in enumerate(all_plans)]


class CoordinatorMetadata(Metadata):
    """DCP's global ``Metadata`` of a save, held by the coordinator only.

    checked: 2.13. ``state_dict_saver._save_state_dict`` ends with
    ``_DistWrapper.all_reduce("write", write_data, finish_checkpoint)``, which broadcasts
    what ``finish_checkpoint`` returns, the global Metadata (every item of every rank:
    1.6 GB at 4,096 ranks of a 70B model), to every rank at every save, first or
    repeated: each rank then unpickles and holds the whole job's metadata, which no rank
    but the coordinator uses. Pickled, an object of this class is an empty Metadata, so
    the broadcast carries a few bytes; on the coordinator it is the same object (DCP's
    plan cache keeps it; the writer pickles a stock copy into ``.metadata``,
    :func:`stock_metadata`)."""

    def __reduce__(self):
        return (Metadata, ({},))


def stock_metadata(md: Metadata) -> Metadata:
    """checked: 2.13. ``md`` as a plain DCP ``Metadata`` (the class stock readers
    unpickle, ``dataclasses.fields(Metadata)``), the same fields."""
    return Metadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(Metadata)})


_HINTS = "cloudckpt: the plan this rank sent, with DCP's index hints"
_RESUMED = "cloudckpt: planned from the loaded step"


class _CoordinatorPlanner:
    """A save planner whose global Metadata stays on the coordinator (CoordinatorMetadata),
    and whose global plan goes back to a rank as index hints where it is the rank's own
    local plan (part of ``caching_save_planner``'s entry: DCP 2.13's
    ``create_default_global_save_plan`` returns each rank's items as
    ``dataclasses.replace(item, index=<index with its hint>)`` (the same ``tensor_data``
    object), in the order of the rank's plan: a final plan holding exactly the rank's
    items (no dedup removed or cut one: FSDP's, tensor parallel's shards) is sent back as
    its hints (an int an item) instead of every item pickled again, and ``finish_plan``
    puts the hints on the plan the rank sent; DCP's plan cache on the coordinator keeps
    the whole global plan, made inside ``create_global_plan``)."""

    def create_global_plan(self, all_plans):
        tagged = [r for r, p in enumerate(all_plans) if isinstance(p.planner_data, tuple) and p.planner_data
                  and p.planner_data[0] == _RESUMED]
        if tagged:  # they plan from a loaded step, this coordinator does not: every rank saves again, whole
            raise ResumeMismatch(f"rank(s) {tagged[:8]} planned from the loaded step, the coordinator did not")
        plans, md = super().create_global_plan(all_plans)
        md.__class__ = CoordinatorMetadata  # the same object (DCP's plan cache compares it by identity)
        return [_as_hints(sent, plan) for sent, plan in zip(all_plans, plans, strict=True)], md

    def finish_plan(self, new_plan):
        data = new_plan.planner_data
        if isinstance(data, tuple) and len(data) == 2 and data[0] == _HINTS:
            sent = self.plan  # DefaultSavePlanner.create_local_plan's
            if len(data[1]) != len(sent.items):
                raise RuntimeError(f"the coordinator sent {len(data[1])} index hints for {len(sent.items)} items")
            items = [dataclasses.replace(it, index=dataclasses.replace(it.index, index=h))
                     for it, h in zip(sent.items, data[1], strict=True)]
            new_plan = dataclasses.replace(sent, items=items, storage_data=new_plan.storage_data)
        return super().finish_plan(new_plan)


def _as_hints(sent, plan):
    """``plan`` as the index hints of its items, if it holds exactly the items ``sent``
    (the plan the rank sent, with its planner data); else ``plan`` itself."""
    if not (sent.usable and plan.usable) or len(sent.items) != len(plan.items) or \
            plan.planner_data is not sent.planner_data:
        return plan
    for a, b in zip(sent.items, plan.items, strict=True):
        if a.type != b.type or a.tensor_data is not b.tensor_data or a.bytes_io_data is not b.bytes_io_data or \
                a.index.fqn != b.index.fqn or a.index.offset != b.index.offset:
            return plan
    return dataclasses.replace(plan, items=[], planner_data=(_HINTS, [b.index.index for b in plan.items]))


class _DcpDedupSavePlanner(_CoordinatorPlanner, DefaultSavePlanner):
    """DCP's own dedup (for comparison), its global Metadata kept on the coordinator."""


class _BalancedSavePlanner(_CoordinatorPlanner, DefaultSavePlanner):
    """DefaultSavePlanner deduplicating with ``balanced_dedup``; it writes a piece of a
    tensor (an item whose chunk is part of this rank's local chunk) as rows of it."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self._local_chunks: dict = {}  # fqn -> [(offsets, sizes)] of this rank's tensors
        for item in self.plan.items if self.plan is not None else ():
            if item.tensor_data is not None:
                self._local_chunks.setdefault(item.index.fqn, []).append(item.tensor_data.chunk)
        return plan

    def _dedup_save_plans(self, all_plans):
        return balanced_dedup(all_plans)

    def resolve_data(self, write_item):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        from .errors import ShapeMismatch

        td = write_item.tensor_data
        chunks = getattr(self, "_local_chunks", {}).get(write_item.index.fqn, ())
        if td is None or not chunks or td.chunk in chunks:
            return super().resolve_data(write_item)
        c = td.chunk
        for local in chunks:
            if (local.offsets[1:] == c.offsets[1:] and local.sizes[1:] == c.sizes[1:]
                    and local.offsets[0] <= c.offsets[0]
                    and c.offsets[0] + c.sizes[0] <= local.offsets[0] + local.sizes[0]):
                tensor = self.lookup_object(MetadataIndex(write_item.index.fqn, local.offsets))
                return self.transform_object(write_item, tensor.narrow(0, c.offsets[0] - local.offsets[0], c.sizes[0]))
        raise ShapeMismatch(f"save: {write_item.index.fqn!r}: the save plan gives this rank rows "
                            f"{c.offsets[0]}..{c.offsets[0] + c.sizes[0]} at {list(c.offsets)} of it to write, but its "
                            f"tensor here is {[list(x.sizes) for x in chunks]} at {[list(x.offsets) for x in chunks]}; "
                            "a tensor under one key must have the same shape on every rank that holds it")


class ResumeMismatch(Exception):
    """A rank's state does not have the structure of the step it loaded (or the
    coordinator cannot place that step's ``.metadata``): raised by
    :class:`ResumedSavePlanner` on the coordinator, in DCP's plan step, so every rank
    gets it and saves again with the full planning.

    checked: 2.13. An exception of the coordinator's ``create_global_plan`` reaches every
    rank from ``_DistWrapper.reduce_scatter`` as a ``CheckpointException`` whose
    ``failures`` hold it (rank_writer's ``_unwrap_dcp`` finds it there)."""


class ResumedSavePlanner(_BalancedSavePlanner):
    """A save planned from the step this job loaded or saved last (checkpoint/structure.py):
    no rank sends its plan, and DCP runs with no collective (``use_collectives=False``).
    ``final_plan(items)``: this rank's final write items and where each lay in the kept
    step, or why its state differs; ``coord``: the job's Coordinator.

    checked: 2.13. ``create_local_plan`` asks every rank whether its state differs (one
    all_reduce of a byte, ``coord.any_rank``) and raises ResumeMismatch on every rank if
    one does (each differing rank names its reason); else it returns an empty, unusable
    ``SavePlan`` tagged ok, which ``create_global_plan`` (every rank, on its own plan)
    checks and hands back empty (the storage writer's ``prepare_local_plan`` gave it the
    rank's file prefix) with an empty CoordinatorMetadata (the writer's ``finish_kept``
    places the kept step's ``.metadata`` after the save); ``finish_plan`` returns the
    rank's own final plan with that prefix."""

    def __init__(self, final_plan, coord: Any):
        super().__init__(enable_plan_caching=False)
        self._final_plan = final_plan
        self._coord = coord
        self.expected: dict | None = None  # {MetadataIndex: (file, offset, length)} in the loaded step
        self._items: list = []

    def create_local_plan(self):
        from torch.distributed.checkpoint.planner import SavePlan

        plan = super().create_local_plan()
        try:
            got = self._final_plan(plan.items)
        except Exception as e:  # noqa: BLE001 - never a save that fails at every try: a full save, said why
            got = f"planning from the loaded step failed: {type(e).__name__}: {e}"
        if self._coord.any_rank([isinstance(got, str)], "plan from the kept step")[0]:
            why = f"here: {got[:300]}" if isinstance(got, str) else "on another rank"
            raise ResumeMismatch(f"the state differs from the kept step ({why})")
        self._items, self.expected = got
        return SavePlan([], planner_data=(_RESUMED, None), usable=False)

    def create_global_plan(self, all_plans):
        from torch.distributed.checkpoint.planner import SavePlan

        bad = {r: p.planner_data[1] if isinstance(p.planner_data, tuple) else "no tag"
               for r, p in enumerate(all_plans) if not (isinstance(p.planner_data, tuple)
                                                         and p.planner_data == (_RESUMED, None))}
        if bad:
            shown = "; ".join(f"rank {r}: {why}" for r, why in sorted(bad.items())[:4])
            raise ResumeMismatch(f"the state differs from the loaded step on {len(bad)} rank(s) ({shown})")
        self.metadata = CoordinatorMetadata(state_dict_metadata={})
        # each plan keeps the file prefix the writer's prepare_local_plan gave it (``__{rank}_``)
        return [SavePlan([], storage_data=p.storage_data, usable=False) for p in all_plans], self.metadata

    def finish_plan(self, new_plan):
        self.plan = dataclasses.replace(new_plan, items=list(self._items), planner_data=None, usable=True)
        return self.plan


def caching_save_planner(key: str, balanced: bool = True):
    """A ``DefaultSavePlanner(enable_plan_caching=True)`` whose cached plans are kept
    under ``key``: a save whose local plans match the previous save's with the same key
    sends an empty plan to the coordinator and reuses the global plan and metadata.
    ``balanced``: items held by several ranks are written by the rank
    ``balanced_dedup`` picks (False: DCP's own dedup, kept under another key so
    neither reuses the other's cached plans; for comparison).

    checked: 2.13. ``DefaultSavePlanner._cached_plans_key``: the key of DCP's
    class-level plan caches; by default the class name, i.e. one cache for every save of
    the process, whatever its process group. Callers pass a key naming the group's world
    size and this rank's place in it, so saves over another group never reuse its plans.
    ``DefaultSavePlanner._dedup_save_plans(all_plans)``: called by the coordinator
    on every rank's local plan (the cached ones merged in) before it builds the
    global plan and metadata; with caching, a save whose local plans all match the
    cached ones does not call it and reuses the cached global plan."""
    planner = (_BalancedSavePlanner if balanced else _DcpDedupSavePlanner)(enable_plan_caching=True)
    planner._cached_plans_key = f"cloudckpt:{key}" if balanced else f"cloudckpt:{key}:dcp-dedup"
    return planner


__all__ = [
    "CoordinatorMetadata",
    "MEM_FORMAT_ENCODING",
    "ResumeMismatch",
    "ResumedSavePlanner",
    "StorageInfo",
    "caching_save_planner",
    "chunk_list",
    "copy_state_dict",
    "dtensor_like",
    "element_size",
    "flatten_for_load",
    "get_layout",
    "make_wrapper_subclass",
    "narrow_tensor_by_index",
    "set_element",
    "split_by_size_and_type",
    "stateful_to_state_dict",
    "stock_metadata",
    "unflatten_state_dict",
    "write_files",
]


# ---------------------------------------------------------------------- tensor subclasses
def make_wrapper_subclass(cls, size, *, dtype):
    """checked: 2.13. ``torch.Tensor._make_wrapper_subclass(cls, size, dtype=...)``: an
    instance of the tensor subclass ``cls`` with no storage of its own, of this size and
    dtype (integrations/megatron.py rebuilds Megatron's containers with their data's dtype)."""
    import torch

    return torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype)


# ---------------------------------------------------------------------- DTensor internals
def dtensor_like(local, like):
    """checked: 2.13. A DTensor with ``like``'s placement spec (``DTensor._spec``) over
    the local tensor ``local``, built without a collective or a copy (async saving's
    staging buffers, checkpoint/async_save.py)."""
    from torch.distributed.tensor import DTensor

    return DTensor.__new__(DTensor, local, like._spec, requires_grad=False)


# -------------------------------------------------------------- load planning (dcp/index/, dcp/planned_load.py)
def chunk_list(tensor):
    """checked: 2.13. ``planner_helpers._create_chunk_list(tensor)``: this rank's chunks
    (offsets, sizes) of a DTensor, ShardedTensor or plain tensor, as DCP's load planner
    computes them."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    return _create_chunk_list(tensor)


def flatten_for_load(state_dict):
    """checked: 2.13. The flat ``{key: value}`` DefaultLoadPlanner.set_up_planner makes of
    a state dict (``_flatten_sharded_tensors`` then ``flatten_state_dict``), without
    setting up a planner."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

    flat, _ = flatten_state_dict(_flatten_sharded_tensors(state_dict))
    return flat
