"""The DCP index (cloudckpt/dcp/index/): built from DCP's own Metadata, it gives a
rank the same read items DCP's planner finds with the whole metadata, for the saved
layout and for resharded ones; crafted headers and parts are typed errors."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from cloudckpt._torch_compat import StorageInfo
from cloudckpt.dcp import index
from cloudckpt.errors import CloudCkptError, CorruptCheckpoint, UnsafeCheckpoint

URL = "s3://b/run/step1/index/header.json"


def job(R: int, *, rows: int = 8, cols: int = 3, tensors: int = 3, grid: bool = False):
    """DCP Metadata of an R-rank save: ``tensors`` tensors of [R*rows, cols] sharded on
    dim 0 (or, ``grid``, on a 2 x R/2 grid), a replicated bias (written by rank 0), a
    0-d step and a value; plus each rank's index part items, as the writer makes them."""
    sdm, storage = {}, {}
    parts: dict[int, list] = {r: [] for r in range(R)}
    offsets = {r: 0 for r in range(R)}

    def put(r, fqn, offs, sizes, n):
        rel = f"__{r}_0.distcp"
        storage[MetadataIndex(fqn, torch.Size(offs))] = StorageInfo(rel, offsets[r], n)
        offsets[r] += n
        return rel, offsets[r] - n

    for t in range(tensors):
        fqn = f"model.layers.{t}.w"
        size = [R * rows, cols] if not grid else [2 * rows, (R // 2) * cols]
        chunks = []
        for r in range(R):
            if grid:
                offs, sizes = [(r % 2) * rows, (r // 2) * cols], [rows, cols]
            else:
                offs, sizes = [r * rows, 0], [rows, cols]
            chunks.append(ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
            rel, at = put(r, fqn, offs, sizes, rows * cols * 4 + 100)
            parts[r].append([fqn, offs, sizes, rel, at, rows * cols * 4 + 100])
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)
    sdm["model.bias"] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([cols]),
                                              [ChunkStorageMetadata(torch.Size([0]), torch.Size([cols]))])
    put(0, "model.bias", [0], [cols], 200)
    sdm["optim.step"] = TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([]),
                                              [ChunkStorageMetadata(torch.Size([]), torch.Size([]))])
    put(R - 1, "optim.step", [], [], 150)
    sdm["optim.lr"] = BytesStorageMetadata()
    storage[MetadataIndex("optim.lr")] = StorageInfo("__0_0.distcp", offsets[0], 90)
    md = Metadata(state_dict_metadata=sdm, storage_data=storage)
    return md, parts


def writers(md) -> int:
    """The ranks of a job's shard files (the marker's part count for a real step)."""
    return 1 + max(int(i.relative_path.split("_")[2]) for i in md.storage_data.values())


def header_of(md, *, compact: bool = True) -> index.Header:
    return index.parse_header(index.header_bytes(md, compact=compact), url=URL, writers=writers(md))


def parts_of(parts) -> dict[int, dict]:
    return {r: index.parse_part(index.part_bytes(r, items), url=f"part{r}", rank=r) for r, items in parts.items()}


def reads(md: Metadata, wanted) -> set:
    """What DCP's own resharding planner reads for ``wanted`` against ``md``."""
    out = set()
    for fqn, boxes in wanted.items():
        m = md.state_dict_metadata[fqn]
        if isinstance(m, BytesStorageMetadata):
            i = md.storage_data[MetadataIndex(fqn)]
            out.add((fqn, None, (i.relative_path, i.offset, i.length)))
            continue
        local = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        for ri in create_read_items_for_chunk_list(fqn, m, local):
            info = md.storage_data[ri.storage_index]
            out.add((fqn, tuple(ri.storage_index.offset), tuple(ri.dest_offsets), tuple(ri.lengths),
                     (info.relative_path, info.offset, info.length)))
    return out


def via_index(md, parts, wanted, *, compact: bool = True):
    h = header_of(md, compact=compact)
    needs, owners = index.select(h, wanted)
    small = index.build_metadata(h, needs, {r: p for r, p in parts_of(parts).items() if r in owners}, wanted)
    return small, owners


def rank_wanted(R, r, *, rows=8, cols=3, tensors=3, grid=False, values=True):
    w = {}
    for t in range(tensors):
        if grid:
            w[f"model.layers.{t}.w"] = [((r % 2) * rows, (r // 2) * cols), (rows, cols)]
        else:
            w[f"model.layers.{t}.w"] = [((r * rows, 0), (rows, cols))]
    if grid:
        w = {k: [tuple(v)] for k, v in w.items()}
    w["model.bias"] = [((0,), (cols,))]
    w["optim.step"] = [((), ())]
    if values:
        w["optim.lr"] = None
    return w


@pytest.mark.parametrize("compact", [True, False], ids=["cuts", "boxes"])
@pytest.mark.parametrize("grid", [False, True])
def test_a_rank_with_the_saved_layout_reads_what_dcp_would_from_its_own_part_only(grid, compact):
    R = 8
    md, parts = job(R, grid=grid)
    for r in range(R):
        wanted = rank_wanted(R, r, grid=grid)
        small, owners = via_index(md, parts, wanted, compact=compact)
        assert owners == {r}
        assert reads(small, wanted) == reads(md, wanted)
        assert set(small.state_dict_metadata) == set(md.state_dict_metadata)  # every key: leftovers judged as before


@pytest.mark.parametrize("compact", [True, False], ids=["cuts", "boxes"])
@pytest.mark.parametrize("new_R", [1, 3, 5, 16])
def test_resharded_loads_read_what_dcp_would_and_only_the_parts_they_overlap(new_R, compact):
    R, rows, cols = 8, 8, 3
    md, parts = job(R, rows=rows, cols=cols)
    total = R * rows
    for r in range(new_R):
        lo, hi = total * r // new_R, total * (r + 1) // new_R
        wanted = {f"model.layers.{t}.w": [((lo, 0), (hi - lo, cols))] for t in range(3)}
        wanted["model.bias"] = [((0,), (cols,))]
        small, owners = via_index(md, parts, wanted, compact=compact)
        assert owners == {s for s in range(R) if s * rows < hi and lo < (s + 1) * rows}
        assert reads(small, wanted) == reads(md, wanted)


def test_a_tensor_with_fewer_rows_than_ranks_is_stored_whole_beside_empty_chunks():
    """FSDP gives rank 0 the one row of a [1, 32] weight and rank 1 an empty chunk: the
    writer of the whole chunk leaves it out of its part, so the header holds its item."""
    md, _ = job(2, tensors=1)
    sdm = md.state_dict_metadata
    sdm["model.head"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([1, 32]), [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 32])),
        ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([0, 32]))])
    md.storage_data[MetadataIndex("model.head", torch.Size([0, 0]))] = StorageInfo("__0_0.distcp", 5000, 300)
    md.storage_data[MetadataIndex("model.head", torch.Size([1, 0]))] = StorageInfo("__1_0.distcp", 5000, 80)
    h = header_of(md)
    assert h.tensors["model.head"].layout == -1 and h.tensors["model.head"].item == ("__0_0.distcp", 5000, 300)
    for box in (((0, 0), (1, 32)), ((1, 0), (0, 32))):
        wanted = {"model.head": [box]}
        needs, owners = index.select(h, wanted)
        small = index.build_metadata(h, needs, {}, wanted)
        assert reads(small, wanted) == reads(md, wanted)


def test_a_column_shard_of_a_row_sharded_tensor_and_an_empty_shard():
    md, parts = job(4)
    wanted = {"model.layers.0.w": [((0, 1), (32, 1))], "model.layers.1.w": [((5, 0), (0, 3))]}
    small, owners = via_index(md, parts, wanted)
    assert owners == {0, 1, 2, 3}
    assert reads(small, wanted) == reads(md, wanted)


def test_each_layout_is_written_once_however_many_tensors_share_it():
    md, _ = job(64, tensors=50)
    doc = json.loads(index.header_bytes(md))
    assert len(doc["layouts"]) == 1 and len(doc["tensors"]) == 52
    assert "items" not in doc["layouts"][0]  # shared: its items are in the writers' parts
    assert len(index.header_bytes(md)) < 64 * 4 * 12 + 52 * 120 + 400


def test_the_layout_cache_is_used_for_the_same_chunk_lists_and_not_for_new_ones():
    md, _ = job(8)
    cache: dict = {}
    first = index.header_bytes(md, cache)
    assert index.header_bytes(md, cache) == first
    assert sum(isinstance(k, str) for k in cache) == 5  # every tensor: its layout or its whole chunk
    # a new save whose chunks moved: new lists, recomputed
    md2, _ = job(8, rows=4)
    assert index.header_bytes(md2, cache) == index.header_bytes(md2)


def test_a_layout_of_one_tensor_carries_its_items_and_its_loads_read_no_part():
    md, parts = job(8, tensors=1)
    doc = json.loads(index.header_bytes(md))
    assert len(doc["layouts"][0]["items"]) == 8
    for r in range(8):
        wanted = rank_wanted(8, r, tensors=1)
        h = header_of(md)
        needs, owners = index.select(h, wanted)
        assert owners == set() and needs
        small = index.build_metadata(h, needs, {}, wanted)
        assert reads(small, wanted) == reads(md, wanted)


def _doc(md, *, compact: bool = False) -> dict:
    return json.loads(index.header_bytes(md, compact=compact))


def _bytes(doc) -> bytes:
    return json.dumps(doc).encode()


def _crafted():
    md, _ = job(4)
    base = _doc(md)

    def edit(fn):
        d = json.loads(json.dumps(base))
        fn(d)
        return d

    lay = lambda d: d["layouts"][0]  # noqa: E731
    return {
        "overlapping chunks": edit(lambda d: lay(d)["boxes"].__setitem__(0, 1)),
        "a chunk past its tensor": edit(lambda d: lay(d)["boxes"].__setitem__(-4, 30)),
        "chunks not covering": edit(lambda d: lay(d)["boxes"].__setitem__(2, 7)),
        "an owner past 2^24": edit(lambda d: lay(d)["owners"].__setitem__(0, 1 << 30)),
        "boxes and owners disagree": edit(lambda d: lay(d)["owners"].pop()),
        "a huge offset": edit(lambda d: lay(d)["boxes"].__setitem__(0, 1 << 70)),
        "a negative size": edit(lambda d: d["tensors"][0].__setitem__(2, [-1, 3])),
        "a float size": edit(lambda d: d["tensors"][0].__setitem__(2, [32.0, 3])),
        "a dtype DCP does not write": edit(lambda d: d["tensors"][0].__setitem__(1, "qint8")),
        "a dtype that is not a name": edit(lambda d: d["tensors"][0].__setitem__(1, ["float32"])),
        "an item outside the shard files": edit(lambda d: d["tensors"][3].__setitem__(4, ["../../etc/passwd", 0, 10])),
        "an item in a nested path": edit(lambda d: d["tensors"][3].__setitem__(4, ["sub/__0_0.distcp", 0, 10])),
        "a value's item outside": edit(lambda d: d["values"][0].__setitem__(1, "/abs/__0_0.distcp")),
        "a layout id past the list": edit(lambda d: d["tensors"][0].__setitem__(3, 9)),
        "a key twice": edit(lambda d: d["tensors"].append(list(d["tensors"][0]))),
        "a key as value and tensor": edit(lambda d: d["values"].append([d["tensors"][0][0], "__0_0.distcp", 0, 1])),
        "an empty key": edit(lambda d: d["tensors"][0].__setitem__(0, "")),
        "a long key": edit(lambda d: d["tensors"][0].__setitem__(0, "k" * 5000)),
        "neither item nor layout": edit(lambda d: d["tensors"][3].__setitem__(4, None)),
        "both item and layout": edit(lambda d: d["tensors"][0].__setitem__(4, ["__0_0.distcp", 0, 1])),
        "dimension count of layout and tensor differ": edit(lambda d: d["tensors"][0].__setitem__(2, [32, 3, 1])),
        "65 dimensions": edit(lambda d: d["tensors"][3].__setitem__(2, [1] * 65)),
        "another format": edit(lambda d: d.__setitem__("format", "x")),
        "another version": edit(lambda d: d.__setitem__("version", 3)),
        "no layouts": edit(lambda d: d.pop("layouts")),
        "tensors not a list": edit(lambda d: d.__setitem__("tensors", {})),
        "an extra layout field": edit(lambda d: lay(d).__setitem__("x", 1)),
        "zero ndim": edit(lambda d: lay(d).__setitem__("ndim", 0)),
    }


@pytest.mark.parametrize("compact", [True, False], ids=["cuts", "boxes"])
def test_crafted_layout_items_are_typed_errors(compact):
    md, _ = job(4, tensors=1)
    base = _doc(md, compact=compact)
    for name, fn in {
        "items of another rank's file": lambda d: d["layouts"][0]["items"][0].__setitem__(0, "__3_0.distcp"),
        "fewer items than chunks": lambda d: d["layouts"][0]["items"].pop(),
        "an item outside": lambda d: d["layouts"][0]["items"][1].__setitem__(0, "../__1_0.distcp"),
        "used by two tensors": lambda d: d["tensors"].append(["model.other", "float32", d["tensors"][0][2], 0, None]),
    }.items():
        d = json.loads(json.dumps(base))
        fn(d)
        with pytest.raises(CorruptCheckpoint, match="s3://b"):
            index.parse_header(_bytes(d), url=URL, writers=4)
        assert name


@pytest.mark.parametrize("name", sorted(_crafted()))
def test_a_crafted_header_is_a_typed_error_naming_it(name):
    with pytest.raises(CorruptCheckpoint, match="s3://b/run/step1/index/header.json"):
        index.parse_header(_bytes(_crafted()[name]), url=URL, writers=4)


@pytest.mark.parametrize("compact", [True, False], ids=["cuts", "boxes"])
def test_the_honest_header_parses(compact):
    md, _ = job(4)
    h = index.parse_header(_bytes(_doc(md, compact=compact)), url=URL, writers=4)
    assert len(h.keys()) == 6


def _part(r, items, **over):
    d = {"format": index.FORMAT, "version": index.VERSION, "rank": r, "items": items, **over}
    return json.dumps(d).encode()


def test_crafted_parts_are_typed_errors():
    md, parts = job(4)
    good = parts[1]
    assert index.parse_part(_part(1, good), url="p", rank=1)
    with pytest.raises(UnsafeCheckpoint, match="names rank '2', not 1"):
        index.parse_part(_part(2, good), url="p", rank=1)
    other = [list(good[0])]
    other[0][3] = "__2_0.distcp"
    with pytest.raises(UnsafeCheckpoint, match="a file of another rank"):
        index.parse_part(_part(1, other), url="p", rank=1)
    twice = [good[0], good[0]]
    with pytest.raises(CorruptCheckpoint, match="listed twice"):
        index.parse_part(_part(1, twice), url="p", rank=1)
    for bad in ([good[0][:5]], [[*good[0][:4], -1, 5]], [[good[0][0], [1, 2], [1], *good[0][3:]]], "x",
                [[good[0][0], good[0][1], good[0][2], "../__1_0.distcp", 0, 1]]):
        with pytest.raises(CorruptCheckpoint):
            index.parse_part(_part(1, bad), url="p", rank=1)


def test_an_owner_part_that_lacks_a_chunk_the_header_gives_it_is_a_typed_error():
    md, parts = job(4)
    h = header_of(md)
    wanted = rank_wanted(4, 2)
    needs, owners = index.select(h, wanted)
    p = parts_of(parts)
    del p[2][("model.layers.1.w", (16, 0))]
    with pytest.raises(CorruptCheckpoint, match="index part of rank 2 lacks the chunk"):
        index.build_metadata(h, needs, p, wanted)
    p = parts_of(parts)
    p[2][("model.layers.1.w", (16, 0))] = ((4, 3), *p[2][("model.layers.1.w", (16, 0))][1:])  # other sizes
    with pytest.raises(CorruptCheckpoint, match="lacks the chunk"):
        index.build_metadata(h, needs, p, wanted)


_HONEST = {c: _bytes(_doc(job(4)[0], compact=c)) for c in (True, False)}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_headers_are_parsed_or_refused_with_a_typed_error(data):
    b = bytearray(_HONEST[data.draw(st.booleans())])
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] = data.draw(st.sampled_from(b'0123456789-[]{},":.eEax '))
    try:
        h = index.parse_header(bytes(b), url=URL, writers=4)
    except CloudCkptError:
        return
    # what parses is usable: selecting for any rank's boxes does not fail untyped
    for r in range(4):
        try:
            index.select(h, rank_wanted(4, r))
        except CloudCkptError:
            pass


def test_select_and_build_stay_small_for_a_rank_of_a_large_job():
    """R = 2,048: a rank selects its own chunk of each tensor and builds a Metadata of
    one chunk per tensor, reading one part."""
    R = 2048
    md, parts = job(R, tensors=4, rows=2)
    h = header_of(md)
    r = random.Random(0).randrange(R)
    wanted = rank_wanted(R, r, rows=2, tensors=4)
    needs, owners = index.select(h, wanted)
    assert owners == {r} and all(len(v) == 1 for v in needs.values())
    small = index.build_metadata(h, needs, {r: parts_of({r: parts[r]})[r]}, wanted)
    assert sum(len(m.chunks) for m in small.state_dict_metadata.values() if hasattr(m, "chunks")) == 4 + 2


# ============================================================================ the grid form
def _layout_of(md, fqn="model.layers.0.w", compact=True) -> dict:
    d = json.loads(index.header_bytes(md, compact=compact))
    t = next(t for t in d["tensors"] if t[0] == fqn)
    return d["layouts"][t[3]]


def test_an_even_split_is_written_as_cuts_with_owners_by_rule_and_its_size_does_not_grow_with_ranks():
    lay = _layout_of(job(8)[0])
    assert lay["cuts"] == [{"every": 8, "end": 64}, [0, 3]]
    assert lay["owners"] == {"start": 0, "step": 1}
    sizes = {R: len(index.header_bytes(job(R, tensors=4, rows=2)[0])) for R in (64, 4096)}
    assert sizes[4096] - sizes[64] < 16  # the digits of the larger numbers
    grid = _layout_of(job(8, grid=True)[0])
    assert grid["cuts"] == [[0, 8, 16], {"every": 3, "end": 12}]
    # rank r holds cell (r % 2, r // 2): row-major cell k = (i, j) is rank 2 j + i
    assert grid["owners"] == [0, 2, 4, 6, 1, 3, 5, 7]


def test_owners_that_do_not_step_evenly_are_listed():
    md, parts = job(4)
    for t in range(3):  # the chunks written by the ranks in another order
        fqn = f"model.layers.{t}.w"
        for c in md.state_dict_metadata[fqn].chunks:
            info = md.storage_data[MetadataIndex(fqn, c.offsets)]
            r = int(info.relative_path.split("_")[2])
            md.storage_data[MetadataIndex(fqn, c.offsets)] = StorageInfo(f"__{(r * 3) % 4}_0.distcp", info.offset,
                                                                          info.length)
    assert _layout_of(md)["owners"] == [0, 3, 2, 1]
    h = header_of(md)
    assert index.select(h, {"model.layers.0.w": [((8, 0), (8, 3))]})[1] == {3}


def test_an_irregular_layout_is_written_as_boxes_and_reads_what_dcp_would():
    """Rows 0-4 whole, rows 4-8 cut in two columns: not a grid."""
    md, _ = job(3, tensors=1)
    fqn = "model.odd"
    chunks = [((0, 0), (4, 3), 0), ((4, 0), (4, 1), 1), ((4, 1), (4, 2), 2)]
    md.state_dict_metadata[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 3]),
                                                        [ChunkStorageMetadata(torch.Size(o), torch.Size(z))
                                                         for o, z, _ in chunks])
    for o, _z, r in chunks:
        md.storage_data[MetadataIndex(fqn, torch.Size(o))] = StorageInfo(f"__{r}_0.distcp", 9000, 40)
    assert "boxes" in _layout_of(md, fqn)
    h = header_of(md)
    for box in (((0, 0), (8, 3)), ((3, 1), (2, 1)), ((5, 0), (3, 3))):
        wanted = {fqn: [box]}
        needs, owners = index.select(h, wanted)
        assert reads(index.build_metadata(h, needs, {}, wanted), wanted) == reads(md, wanted)


def test_empty_chunks_are_left_out_of_the_cuts_and_every_shard_reads_what_dcp_would():
    """FSDP of a [3, 5] weight over 4 ranks: a row each for ranks 0-2, an empty chunk for 3."""
    md, _ = job(4, tensors=1)
    fqn = "model.short"
    boxes = [((r, 0), (1, 5)) for r in range(3)] + [((3, 0), (0, 5))]
    md.state_dict_metadata[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([3, 5]),
                                                        [ChunkStorageMetadata(torch.Size(o), torch.Size(z))
                                                         for o, z in boxes])
    for r, (o, z) in enumerate(boxes):
        md.storage_data[MetadataIndex(fqn, torch.Size(o))] = StorageInfo(f"__{r}_0.distcp", 9000, 20 * z[0] + 10)
    lay = _layout_of(md, fqn)
    assert lay["cuts"] == [{"every": 1, "end": 3}, [0, 5]] and lay["owners"] == {"start": 0, "step": 1}
    h = header_of(md)
    for wanted in [{fqn: [b]} for b in boxes] + [{fqn: [((0, 0), (3, 5))]}, {fqn: [((1, 2), (0, 3))]}]:
        needs, owners = index.select(h, wanted)
        assert set(needs.get(fqn, [])) <= {0, 1, 2}  # three cells: the empty chunk is not one
        assert reads(index.build_metadata(h, needs, {}, wanted), wanted) == reads(md, wanted)


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_any_grid_reads_what_dcp_would_for_any_box(data):
    """Random cuts in 1-3 dimensions, owners shuffled or by rank, random boxes (empty
    ones too): the cuts form selects exactly the chunks DCP's planner reads."""
    nd = data.draw(st.integers(1, 3))
    cuts = [sorted(set([0, *data.draw(st.lists(st.integers(1, 11), max_size=4))])) for _ in range(nd)]
    size = [c[-1] + data.draw(st.integers(1, 3)) for c in cuts]
    cuts = [[*c, s] for c, s in zip(cuts, size, strict=True)]
    import itertools
    cells = list(itertools.product(*[range(len(c) - 1) for c in cuts]))
    owners = list(range(len(cells)))
    if data.draw(st.booleans()):
        data.draw(st.randoms(use_true_random=False)).shuffle(owners)
    fqn = "t"
    chunks, storage = [], {}
    for cell, r in zip(cells, owners, strict=True):
        o = [c[i] for c, i in zip(cuts, cell, strict=True)]
        z = [c[i + 1] - c[i] for c, i in zip(cuts, cell, strict=True)]
        chunks.append(ChunkStorageMetadata(torch.Size(o), torch.Size(z)))
        storage[MetadataIndex(fqn, torch.Size(o))] = StorageInfo(f"__{r}_0.distcp", 0, 4 * math_prod(z))
    md = Metadata(state_dict_metadata={fqn: TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                  torch.Size(size), chunks)},
                  storage_data=storage)
    h = header_of(md)
    assert h.layouts[0].cuts is not None if len(cells) > 1 else True
    for _ in range(4):
        lo = [data.draw(st.integers(0, s)) for s in size]
        z = [data.draw(st.integers(0, s - o)) for o, s in zip(lo, size, strict=True)]
        wanted = {fqn: [(tuple(lo), tuple(z))]}
        needs, _ = index.select(h, wanted)
        assert reads(index.build_metadata(h, needs, {}, wanted), wanted) == reads(md, wanted)


def math_prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _grid_doc(**layout) -> bytes:
    d = {"format": index.FORMAT, "version": index.HEADER_VERSION, "dcp_version": None,
         "layouts": [{"ndim": 1, "cuts": [[0, 4, 8]], "owners": {"start": 0, "step": 1}, **layout}],
         "tensors": [["w", "float32", [8], 0, None]], "values": []}
    return json.dumps({k: v for k, v in d.items() if v is not ...}).encode()


@pytest.mark.parametrize("case,layout,writers", [
    ("cuts not ascending", {"cuts": [[0, 4, 4, 8]], "owners": [0, 1, 2]}, 4),
    ("cuts not from 0", {"cuts": [[1, 4, 8]]}, 4),
    ("cuts ending before the size", {"cuts": [[0, 4, 7]]}, 4),
    ("cuts past the size", {"cuts": [[0, 4, 9]]}, 4),
    ("cuts of another dimension count", {"cuts": [[0, 4, 8], [0, 1]]}, 4),
    ("a float cut", {"cuts": [[0, 4.0, 8]]}, 4),
    ("a cut past 2^63", {"cuts": [[0, 4, 1 << 64]]}, 4),
    ("owners listed, too few", {"owners": [0]}, 4),
    ("owners by rule, more chunks than writers", {}, 1),
    ("owners by rule, no writers known", {}, 0),
    ("owners by rule, a step of 0", {"owners": {"start": 0, "step": 0}}, 4),
    ("owners by rule, past 2^24", {"owners": {"start": (1 << 24) - 1, "step": 1}}, 4),
    ("owners by rule, an extra field", {"owners": {"start": 0, "step": 1, "x": 1}}, 4),
    ("cuts every 0", {"cuts": [{"every": 0, "end": 8}]}, 4),
    ("cuts every 4 with an extra field", {"cuts": [{"every": 4, "end": 8, "x": 1}]}, 4),
    ("cuts every 4 ending before the size", {"cuts": [{"every": 4, "end": 7}]}, 4),
    ("cuts every 1 to 2^62, owners by rule", {"cuts": [{"every": 1, "end": 1 << 62}]}, 4),
    ("cuts every 1 to 2^62, owners listed", {"cuts": [{"every": 1, "end": 1 << 62}], "owners": [0, 1]}, 4),
    ("a grid of a billion chunks", {"cuts": [list(range(0, 1001)), list(range(0, 1001)), list(range(0, 1001))],
                                    "ndim": 3}, 4),
    ("items fewer than chunks", {"items": [["__0_0.distcp", 0, 16]]}, 4),
    ("an item in another rank's file", {"items": [["__0_0.distcp", 0, 16], ["__0_0.distcp", 16, 16]]}, 4),
])
def test_a_crafted_grid_is_a_typed_error(case, layout, writers):
    data = _grid_doc(**layout)
    with pytest.raises(CorruptCheckpoint, match="s3://b/run/step1/index/header.json"):
        index.parse_header(data, url=URL, writers=writers)
    assert case


def test_a_grid_in_a_version_1_header_is_refused_and_a_version_1_boxes_header_still_reads():
    d = json.loads(_grid_doc())
    d["version"] = 1
    with pytest.raises(CorruptCheckpoint, match="not {ndim, boxes, owners"):
        index.parse_header(json.dumps(d).encode(), url=URL, writers=4)
    md, parts = job(4)
    old = json.loads(index.header_bytes(md, compact=False))
    old["version"] = 1
    h = index.parse_header(json.dumps(old).encode(), url=URL, writers=4)
    wanted = rank_wanted(4, 1)
    needs, owners = index.select(h, wanted)
    small = index.build_metadata(h, needs, parts_of(parts), wanted)
    assert owners == {1} and reads(small, wanted) == reads(md, wanted)


@pytest.mark.parametrize("compact", [True, False], ids=["cuts", "boxes"])
@pytest.mark.parametrize("grid", [False, True])
def test_check_part_finds_every_chunk_of_each_rank_and_refuses_a_part_that_lacks_one(grid, compact):
    # what `cloudckpt verify` checks rank by rank: each rank's chunks (owners by rule, listed, or boxes)
    R = 8
    md, parts = job(R, grid=grid)
    h = header_of(md, compact=compact)
    files = {f"__{r}_0.distcp": 10**6 for r in range(R)}
    got = parts_of(parts)
    for r in range(R):
        for lay in h.layouts:
            assert lay.chunks_of(r) == [k for k in range(lay.n) if lay.owners_of([k]) == [r]]
        assert index.check_part(h, r, got[r], files) == 3  # a chunk of each of the 3 sharded tensors
    index.check_items(h, files)
    index.check_owners(h, R)
    with pytest.raises(CorruptCheckpoint, match="rank 7, outside the 7 ranks"):
        index.check_owners(h, R - 1)
    first = next(iter(got[2]))
    with pytest.raises(CorruptCheckpoint, match="index part of rank 2 lacks the chunk"):
        index.check_part(h, 2, {k: v for k, v in got[2].items() if k != first}, files)
    with pytest.raises(CorruptCheckpoint, match="no index part"):
        index.check_part(h, 2, None, files)
    with pytest.raises(CorruptCheckpoint, match="not inside one of the step's shard files"):
        index.check_part(h, 2, got[2], {**files, "__2_0.distcp": 1})
    with pytest.raises(CorruptCheckpoint, match="not inside one of the step's shard files"):
        index.check_items(h, {})
