"""DCP's ``.metadata`` made of fragments (cloudckpt/dcp/assemble.py) is the Metadata stock
DCP writes, field by field: stock ``dcp.save`` runs on 4 real gloo ranks for each layout
(DDP's replicated tensors, FSDP's dim-0 shards, HSDP, TP-like 2-D, uneven shards with
an empty one), its ``.metadata`` is split among owners by a hash of each key, and the
fragments, joined in any order of owners, unpickle (``pickle``, the house's untrusted
unpickler) to the same Metadata; stock DCP converts the folder with the assembled
``.metadata`` to the same tensors as with its own."""

from __future__ import annotations

import os
import pickle
import random
import shutil
import zlib

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt.dcp.assemble import SHARED, SLOTS, fragment, header, metadata_bytes
from cloudckpt.testing.multiprocess import run_ranks

LAYOUTS = ("ddp", "fsdp", "hsdp", "tp2d", "uneven")


def _values(shape, seed: int) -> torch.Tensor:
    return (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape) * 0.5 + seed)


def build_state(layout: str, world: int) -> dict:
    """The state dict of ``layout`` on this rank (every rank calls it: DTensors need all).
    Each holds tensors of several shapes, a plain tensor every rank holds (replicated),
    and values that are not tensors (DCP's byte items; nested: planner_data's paths)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if layout in ("hsdp", "tp2d"):
        mesh = init_device_mesh("cpu", (2, world // 2))
        placements = [Replicate(), Shard(0)] if layout == "hsdp" else [Shard(0), Shard(1)]
    else:
        mesh = init_device_mesh("cpu", (world,))
        placements = [{"ddp": Replicate(), "fsdp": Shard(0), "uneven": Shard(0)}[layout]]
    shapes = [(7, 3), (3, 5), (1, 4)] if layout == "uneven" else [(8, 6), (4, 4), (6,) if layout != "tp2d" else (6, 2)]
    model = {f"layer{k}.w": distribute_tensor(_values(s, k), mesh, placements) for k, s in enumerate(shapes)}
    if layout == "uneven":  # a second placement of the same mesh: column shards, 5 columns on 4 ranks
        model["cols"] = distribute_tensor(_values((2, 5), 9), mesh, [Shard(1)])
    return {"model": model, "optim": {"step": 12, "lr": 0.5, "names": ["a", "b"], "moment": _values((5,), 7)},
            "rng": torch.arange(6, dtype=torch.int64)}


def _save_all(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    for layout in LAYOUTS:
        dcp.save(build_state(layout, world), checkpoint_id=os.path.join(root, layout))


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> str:
    """Stock DCP's folders, one per layout, saved by 4 real gloo ranks."""
    root = str(tmp_path_factory.mktemp("stock"))
    run_ranks(4, _save_all, root)
    return root


def owner_of(fqn: str, owners: int) -> int:
    return zlib.crc32(fqn.encode()) % owners


def split(md: Metadata, owners: int) -> list[bytes]:
    """Each owner's fragment of ``md``: the entries of the keys it owns (by fqn)."""
    shares = [([], [], []) for _ in range(owners)]
    for fqn, v in md.state_dict_metadata.items():
        shares[owner_of(fqn, owners)][0].append((fqn, v))
    for fqn, v in (md.planner_data or {}).items():
        shares[owner_of(fqn, owners)][1].append((fqn, v))
    for idx, v in md.storage_data.items():
        shares[owner_of(idx.fqn, owners)][2].append((idx, v))
    return [fragment(state_dict_metadata=s, planner_data=p, storage_data=d) for s, p, d in shares]


def _fields(md: Metadata) -> dict:
    return {name: getattr(md, name) for name in ("state_dict_metadata", "planner_data", "storage_data",
                                                 "storage_meta", "version")}


@pytest.mark.parametrize("owners", [1, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fragments_of_owners_in_any_order_unpickle_to_stock_dcps_metadata_field_by_field(stock, layout, owners):
    from cloudckpt.untrusted import loads_metadata

    with open(os.path.join(stock, layout, ".metadata"), "rb") as f:
        md = pickle.load(f)
    frags = split(md, owners)
    assert sum(1 for f in frags if f) == len({owner_of(k, owners) for k in md.state_dict_metadata})
    random.Random(owners).shuffle(frags)
    data = metadata_bytes(frags, planner_data=md.planner_data is not None, storage_meta=md.storage_meta,
                          version=md.version)
    files = {n: os.path.getsize(os.path.join(stock, layout, n)) for n in os.listdir(os.path.join(stock, layout))
             if n.endswith(".distcp")}
    for got in (pickle.loads(data), loads_metadata(data, url=f"assembled/{layout}/.metadata", files=files)):
        assert type(got) is Metadata
        assert _fields(got) == _fields(md)
        for fqn, entry in md.state_dict_metadata.items():  # the chunk lists in DCP's order, not only equal sets
            assert getattr(got.state_dict_metadata[fqn], "chunks", None) == getattr(entry, "chunks", None), fqn
        assert got == md
    # what the layouts hold: replicated, sharded and uneven keys, empty chunks, byte items
    chunks = {fqn: len(e.chunks) for fqn, e in md.state_dict_metadata.items() if hasattr(e, "chunks")}
    expect = {"ddp": 1, "fsdp": 4, "hsdp": 2, "tp2d": 4, "uneven": 4}[layout]
    assert chunks["model.layer0.w"] == expect and chunks["rng"] == 1
    assert md.planner_data["optim.names"] == ("optim", "names")


def test_stock_dcp_reads_a_folder_whose_metadata_was_assembled_as_it_reads_its_own(stock, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for layout in LAYOUTS:
        mine = tmp_path / layout
        shutil.copytree(os.path.join(stock, layout), mine)
        md = pickle.loads((mine / ".metadata").read_bytes())
        (mine / ".metadata").write_bytes(metadata_bytes(split(md, 3), storage_meta=md.storage_meta,
                                                        version=md.version))
        dcp_to_torch_save(os.path.join(stock, layout), tmp_path / f"{layout}-stock.pt")
        dcp_to_torch_save(mine, tmp_path / f"{layout}-mine.pt")
        a = torch.load(tmp_path / f"{layout}-stock.pt", weights_only=True)
        b = torch.load(tmp_path / f"{layout}-mine.pt", weights_only=True)
        assert a.keys() == b.keys() and a["optim"]["step"] == 12
        for key in ("model", "optim"):
            for k, v in a[key].items():
                assert (torch.equal(v, b[key][k]) if isinstance(v, torch.Tensor) else v == b[key][k]), (layout, k)


def test_a_fragment_memoises_nothing_and_reads_only_the_headers_slots():
    """A fragment writes no memo slot and reads only the header's: the three dicts and
    the shared names (SHARED), each of which the header puts exactly once."""
    import pickletools

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    size = torch.Size([4, 4])
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
                                  [ChunkStorageMetadata(torch.Size([0, 0]), size)])
    frag = fragment(state_dict_metadata={"a": entry, "b": entry}, planner_data={"a": ("a",)})
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(frag + b".")]  # the STOP ends what genops reads
    assert not [arg for name, arg in ops if "PUT" in name or name == "MEMOIZE"]
    gets = {arg for name, arg in ops if "GET" in name}
    assert gets <= set(range(len(SLOTS) + len(SHARED))) and {0, 1} <= gets and len(gets) > 5
    puts = [arg for op, arg, _ in pickletools.genops(header() + b"b.") if op.name == "BINPUT"]
    assert sorted(puts) == list(range(len(SLOTS) + len(SHARED)))
    assert fragment() == b""

