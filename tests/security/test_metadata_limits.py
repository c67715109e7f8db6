"""The bounds on DCP ``.metadata`` (untrusted/unpickle.py) and on the items it points at
(dcp/items.py), one by one, at their edges: the last accepted value and the first
refused one. The end-to-end tries through every reader are tests/security/hostile_metadata.py
(run by test_hostile.py); the inputs here that crashed or hung the process before the
fix run in the sandbox, so a regression is reported as a crash, not a dead test run."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from cloudckpt._torch_compat import StorageInfo
from cloudckpt.dcp.items import check_item_tensor, decode_item_tensor
from cloudckpt.errors import CorruptCheckpoint, UnsafeCheckpoint
from cloudckpt.untrusted import loads_metadata, validate_metadata
from cloudckpt.untrusted.limits import MAX_KEY_DEPTH, MAX_SAME_HASH, MAX_TENSOR_DIMS

from . import hostile_metadata as hm
from .sandbox import REFUSED


# ----------------------------------------------------------------- building metadata
def _md(tensors: dict[str, tuple[list[int], list[tuple[list[int], list[int]]]]], *, itemsize: int = 4,
        planner_data=None) -> tuple[Metadata, dict[str, int]]:
    """Metadata of float32 ``{fqn: (size, [(offsets, sizes), ...])}``, each chunk with its
    own item (exactly its bytes) laid out one after another in one file."""
    sdm, sd, pos = {}, {}, 0
    for fqn, (size, chunks) in tensors.items():
        cs = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks]
        sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
                                         chunks=cs)
        for c in cs:
            n = itemsize
            for d in c.sizes:
                n *= d
            sd[MetadataIndex(fqn, c.offsets)] = StorageInfo("__0_0.distcp", pos, n)
            pos += n
    return Metadata(state_dict_metadata=sdm, storage_data=sd, planner_data=planner_data), {"__0_0.distcp": pos}


def _ok(tensors, **kw) -> None:
    md, files = _md(tensors, **kw)
    back = loads_metadata(pickle.dumps(md, protocol=4), url="t", files=files)
    assert back.state_dict_metadata == md.state_dict_metadata and back.storage_data == md.storage_data


def _refused(tensors, match: str, **kw) -> str:
    md, files = _md(tensors, **kw)
    with pytest.raises(UnsafeCheckpoint, match=match) as ei:
        loads_metadata(pickle.dumps(md, protocol=4), url="t", files=files)
    return str(ei.value)


def _raw(fill: dict[str, bytes] | None = None, tail: bytes = b"", planner_data=None) -> bytes:
    md, _ = _md({"w": ([4], [([0], [4])])}, planner_data=planner_data)
    return hm.crafted(md, fill=fill, tail=tail)


# ----------------------------------------------------------------- chunks
@pytest.mark.parametrize("name,tensors", [
    ("one chunk", {"w": ([8, 4], [([0, 0], [8, 4])])}),
    ("rows", {"w": ([8, 4], [([0, 0], [4, 4]), ([4, 0], [4, 4])])}),
    ("columns", {"w": ([8, 4], [([0, 0], [8, 1]), ([0, 1], [8, 3])])}),
    ("2x2 grid, given out of order", {"w": ([4, 4], [([2, 2], [2, 2]), ([0, 0], [2, 2]), ([2, 0], [2, 2]),
                                                      ([0, 2], [2, 2])])}),
    ("not a grid", {"w": ([4, 4], [([0, 0], [2, 4]), ([2, 0], [2, 1]), ([2, 1], [2, 3])])}),
    ("uneven 3-D", {"w": ([3, 2, 5], [([0, 0, 0], [2, 2, 5]), ([2, 0, 0], [1, 2, 2]), ([2, 0, 2], [1, 2, 3])])}),
    ("empty chunks beside full ones", {"w": ([3], [([0], [3]), ([3], [0])])}),
    ("scalar", {"w": ([], [([], [])])}),
    ("no elements", {"w": ([0, 5], [([0, 0], [0, 5])])}),
    (f"{MAX_TENSOR_DIMS} dims", {"w": ([1] * MAX_TENSOR_DIMS, [([0] * MAX_TENSOR_DIMS, [1] * MAX_TENSOR_DIMS)])}),
])
def test_honest_chunk_layouts_load(name, tensors):
    _ok(tensors)


@pytest.mark.parametrize("name,tensors,match", [
    ("same offsets twice", {"w": ([8], [([0], [4]), ([0], [4])])}, "two chunks of 'w' start at offsets"),
    ("overlap covering the count", {"w": ([8], [([0], [4]), ([2], [4])])}, "overlap"),
    ("2-D overlap", {"w": ([4, 4], [([0, 0], [4, 2]), ([0, 1], [4, 2])])}, "overlap"),
    ("grid overlap", {"w": ([4, 4], [([0, 0], [2, 2]), ([2, 2], [2, 2]), ([0, 2], [2, 2]), ([1, 1], [2, 2])])},
     "overlap"),
    ("a gap", {"w": ([8], [([0], [4])])}, "hold 4 elements"),
    ("outside", {"w": ([8], [([0], [4]), ([6], [4])])}, "lies outside"),
    ("too many dims",
     {"w": ([1] * (MAX_TENSOR_DIMS + 1), [([0] * (MAX_TENSOR_DIMS + 1), [1] * (MAX_TENSOR_DIMS + 1))])},
     "torch.Size takes at most 64"),
])
def test_chunks_must_be_distinct_disjoint_inside_and_cover_the_tensor(name, tensors, match):
    _refused(tensors, match)


def test_a_chunk_needs_an_item_of_its_size_so_a_tensor_is_never_larger_than_its_bytes():
    md, files = _md({"w": ([1 << 34], [([0], [1 << 18])])})  # a 1 MiB item "covering" 64 GiB: refused by the count
    with pytest.raises(UnsafeCheckpoint, match="hold 262144 elements"):
        validate_metadata(md, url="t", files=files)
    md, files = _md({"w": ([1 << 20], [([0], [1 << 20])])})
    md.storage_data[MetadataIndex("w", torch.Size([0]))].length = 100
    with pytest.raises(UnsafeCheckpoint, match="claims 4194304 bytes, its item holds 100"):
        validate_metadata(md, url="t", files=files)


@pytest.mark.parametrize("layout", ["rows", "columns", "grid"])
def test_the_overlap_check_costs_a_few_steps_per_chunk_for_the_layouts_sharding_makes(layout):
    """Counted in the budget's steps (every step of the check is charged), not seconds."""
    n = 4096
    chunks = {"rows": [([i, 0], [1, 2]) for i in range(n)], "columns": [([0, i], [2, 1]) for i in range(n)],
              "grid": [([i, j], [1, 1]) for i in range(64) for j in range(64)]}[layout]
    size = {"rows": [n, 2], "columns": [2, n], "grid": [64, 64]}[layout]
    md, files = _md({"w": (size, chunks)})
    validate_metadata(md, url="t", files=files, budget=12 * n)
    with pytest.raises(UnsafeCheckpoint, match="more entries than its size allows"):
        validate_metadata(md, url="t", files=files, budget=4 * n)  # the count is not vacuous


def test_a_layout_that_takes_quadratic_work_to_check_stops_at_the_budget():
    """A staircase: column i is split at row i, so every chunk is open at once along the
    rows. Disjoint and covering, but checking it costs n^2 steps: within the default
    budget for a few hundred chunks, refused (typed) when the budget is linear."""
    n = 300
    chunks = [([i, i], [n - i, 1]) for i in range(n)] + [([0, i], [i, 1]) for i in range(1, n)]
    md, files = _md({"w": ([n, n], chunks)})
    validate_metadata(md, url="t", files=files)
    with pytest.raises(UnsafeCheckpoint, match="more entries than its size allows"):
        validate_metadata(md, url="t", files=files, budget=12 * len(chunks))


# ----------------------------------------------------------------- numbers
def test_numbers_are_checked_before_they_are_multiplied_or_printed():
    md, files = _md({"w": ([4], [([0], [4])])})
    info = md.storage_data[MetadataIndex("w", torch.Size([0]))]
    for field, value in (("offset", 10**4800), ("length", 10**4800), ("offset", -1), ("length", 1 << 63),
                         ("offset", 1.0)):
        saved = getattr(info, field)
        setattr(info, field, value)
        with pytest.raises(UnsafeCheckpoint, match=r"byte range that is not two ints in \[0, 2\^63\)") as ei:
            validate_metadata(md, url="t", files=files)
        assert "4800" not in str(ei.value) and len(str(ei.value)) < 300
        setattr(info, field, saved)
    md.state_dict_metadata["w"].size = torch.Size([-4])
    with pytest.raises(UnsafeCheckpoint, match="size of 'w' is not"):
        validate_metadata(md, url="t", files=files)


@pytest.mark.parametrize("dims,ok", [([1 << 62], True), ([(1 << 63) - 1], True), ([-1], False),
                                     ([1] * MAX_TENSOR_DIMS, True), ([1] * (MAX_TENSOR_DIMS + 1), False)])
def test_torch_size_is_refused_while_unpickling_past_64_dims_or_outside_int64(dims, ok):
    frag = hm._global("torch", "Size") + b"(" + b"".join(pickle.dumps(d, protocol=2)[2:-1] for d in dims) + b"t\x85R"
    data = _raw({"__X__": frag}, planner_data={"x": "__X__"})
    if ok:
        assert loads_metadata(data, url="t").planner_data["x"] == torch.Size(dims)
    else:
        with pytest.raises(UnsafeCheckpoint, match="torch.Size takes at most 64 ints"):
            loads_metadata(data, url="t")


def test_refusals_show_names_escaped_and_shortened():
    msg = _refused({"\x1b[31m" + "a" * 5000: ([8], [([0], [4]), ([0], [4])])}, "two chunks")
    assert "\x1b" not in msg and "\\x1b[31m" in msg and len(msg) < 400


# ----------------------------------------------------------------- while unpickling: depth, hashing, work
@pytest.mark.parametrize("depth,ok", [(MAX_KEY_DEPTH, True), (MAX_KEY_DEPTH + 1, False)])
def test_a_key_is_measured_before_it_is_hashed(depth, ok):
    data = _raw({"__K__": hm.deep_tuple(depth)}, planner_data={"__K__": 1})
    if ok:
        key = next(iter(loads_metadata(data, url="t").planner_data))
        for _ in range(depth):
            (key,) = key
        assert key == 0
    else:
        with pytest.raises(UnsafeCheckpoint, match=f"nested more than {MAX_KEY_DEPTH} deep"):
            loads_metadata(data, url="t")


@pytest.mark.parametrize("n,ok", [(MAX_SAME_HASH, True), (MAX_SAME_HASH + 1, False)])
def test_keys_sharing_one_hash_are_bounded(n, ok):
    keys = b"".join(pickle.dumps(k * ((1 << 61) - 1), protocol=2)[2:-1] + b"K\x00" for k in range(1, n + 1))
    data = _raw({"__F__": b"}(" + keys + b"u"}, planner_data={"f": "__F__"})
    if ok:
        assert len(loads_metadata(data, url="t").planner_data["f"]) == n
    else:
        with pytest.raises(UnsafeCheckpoint, match="share a hash value"):
            loads_metadata(data, url="t")


def test_constructor_calls_on_a_memoised_argument_are_charged_to_the_budget():
    distinct = b"(" + b"".join(b"J" + i.to_bytes(4, "little") for i in range(100_000)) + b"l"
    once = hm.repeated_reduce("builtins", "set", distinct, times=1)
    assert loads_metadata(_raw(tail=once), url="t").state_dict_metadata  # one copy: within the budget
    with pytest.raises(UnsafeCheckpoint, match="more work than its size allows"):
        loads_metadata(_raw(tail=hm.repeated_reduce("builtins", "set", distinct, times=50)), url="t")


@pytest.mark.parametrize("frag,match", [
    (hm._global("collections", "OrderedDict") + b"(]t" + b"R", "OrderedDict takes no arguments"),
    (hm._global("torch", "device") + b"(" + hm._str("c" * 300) + b"tR", "short name"),
    (hm._global("pathlib", "PurePosixPath") + b"(" + hm._str("a" * 5000) + b"tR", "a path takes at most"),
    (hm._global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") + b"(" + hm.deep_tuple(10) + b"tR",
     "small int"),
    (hm._global("torch.serialization", "_get_layout") + b"(" + hm.deep_tuple(10) + b"tR", "short name"),
])
def test_each_constructor_gets_only_the_arguments_it_is_written_with(frag, match):
    with pytest.raises(UnsafeCheckpoint, match=match):
        loads_metadata(_raw({"__X__": frag}, planner_data={"x": "__X__"}), url="t")


def test_an_object_is_built_once():
    data = _raw()
    with pytest.raises(UnsafeCheckpoint, match="set twice"):
        loads_metadata(data[:-1] + hm._rebuild_first_index(data) + b".", url="t")


def test_a_value_the_checks_do_not_foresee_is_still_a_typed_refusal():
    md, files = _md({"w": ([4], [([0], [4])])})
    del md.storage_data[MetadataIndex("w", torch.Size([0]))].__dict__["relative_path"]
    with pytest.raises(UnsafeCheckpoint, match=r"could not be checked \(AttributeError\)"):
        validate_metadata(md, url="t", files=files)
    with pytest.raises(UnsafeCheckpoint, match=r"could not be checked \(AttributeError\)"):
        loads_metadata(pickle.dumps(md, protocol=4), url="t", files=files)


# the inputs that crashed (C stack) or hung the reader: run in the sandbox
def deep_key(**_) -> None:
    loads_metadata(b"\x80\x04}K\x00" + b"\x85" * 10**6 + b"K\x01s.", url="x")  # the reproduction


def deep_set_member(**_) -> None:
    loads_metadata(_raw({"__K__": hm.deep_tuple()}, planner_data={"s": {"__K__"}}), url="x")


def deep_index_fqn(**_) -> None:
    md, _ = _md({"w": ([4], [([0], [4])])})
    md.storage_data[MetadataIndex("__K__", torch.Size([0]))] = md.storage_data.pop(MetadataIndex("w", torch.Size([0])))
    loads_metadata(hm.crafted(md, fill={"__K__": hm.deep_tuple()}), url="x")


def flood(**_) -> None:
    keys = b"".join(pickle.dumps(k * ((1 << 61) - 1), protocol=2)[2:-1] + b"K\x00" for k in range(1, 100_001))
    loads_metadata(_raw({"__F__": b"}(" + keys + b"u"}, planner_data={"f": "__F__"}), url="x")


def size_bomb(**_) -> None:
    loads_metadata(_raw(tail=hm.repeated_reduce("torch", "Size", hm.int_tuple(10**6))), url="x")


def many_chunks_one_item(**_) -> None:
    md, files = _md({"w": ([4], [([0], [4])])})
    md.state_dict_metadata["w"].size = torch.Size([10**6])
    md.state_dict_metadata["w"].chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))] * 10**6
    loads_metadata(pickle.dumps(md, protocol=4), url="x", files=files)


@pytest.fixture
def sandbox(hostile_sandbox):
    return hostile_sandbox  # one zygote per test process (conftest.py)


@pytest.mark.parametrize("target", ["deep_key", "deep_set_member", "deep_index_fqn", "flood", "size_bomb",
                                    "many_chunks_one_item"])
def test_inputs_that_crashed_or_hung_the_reader_are_refused_in_the_sandbox(target, sandbox):
    r = sandbox.run(f"tests.security.test_metadata_limits:{target}", timeout=60)
    assert r.outcome == REFUSED and r.error == "cloudckpt.errors.UnsafeCheckpoint", r


# ----------------------------------------------------------------- items
def _saved(t) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


@pytest.mark.parametrize("make", [
    lambda: torch.empty(8, device="meta"),
    lambda: torch.zeros(8).to_sparse(),
    lambda: torch.quantize_per_tensor(torch.zeros(8), 0.1, 0, torch.qint8),
])
def test_an_item_must_be_a_dense_cpu_tensor(make):
    with pytest.raises(CorruptCheckpoint, match="DCP items are dense CPU tensors"):
        check_item_tensor(make(), url="u", fqn="w")


def test_an_item_that_cannot_be_decoded_is_a_typed_error():
    with pytest.raises(CorruptCheckpoint):
        decode_item_tensor(b"PK\x03\x04" + b"\x00" * 100, url="u", fqn="w")
    assert torch.equal(decode_item_tensor(_saved(torch.arange(4.0)), url="u", fqn="w"), torch.arange(4.0))


def test_a_bytes_item_keeps_working():
    md, files = _md({"w": ([4], [([0], [4])])})
    md.state_dict_metadata["n"] = BytesStorageMetadata()
    md.storage_data[MetadataIndex("n")] = StorageInfo("__0_0.distcp", files["__0_0.distcp"], 10)
    files["__0_0.distcp"] += 10
    loads_metadata(pickle.dumps(md, protocol=4), url="t", files=files)
