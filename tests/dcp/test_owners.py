"""Owner-based planning of a save (cloudckpt/dcp/owners.py) on real gloo ranks (3 and 4):
what each rank writes and the Metadata entries the owners make equal stock DCP's
global plan (``DefaultSavePlanner(dedup_save_to_lowest_rank=True)``, its plans
gathered on every rank here for the comparison) for DDP, FSDP, HSDP, TP-like 2-D and
uneven layouts; with ``writer="spread"`` every item is written once by one of its
holders; owners refuse what DCP's planner refuses, on every rank; no rank receives
much more than its share of the records."""

from __future__ import annotations

import pytest
import torch

from cloudckpt.testing.multiprocess import RankFailed, run_ranks

from .test_assemble import LAYOUTS, build_state


def _key(item) -> tuple:
    td = item.tensor_data
    chunk = None if td is None else (tuple(td.chunk.offsets), tuple(td.chunk.sizes))
    return item.index.fqn, tuple(item.index.offset or ()), item.index.index, int(item.type.value), chunk


def _many(world: int) -> dict:
    """240 tensors of one shape, half replicated, half row-sharded: what balances by hash."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {f"layers.{k}.w": distribute_tensor(torch.ones(12, 4), mesh, [Replicate() if k % 2 else Shard(0)])
            for k in range(240)}


def _plans(rank: int, world: int, layouts: tuple) -> dict:
    from torch.distributed.checkpoint import DefaultSavePlanner

    from cloudckpt.dcp.owners import plan_by_owners
    from cloudckpt.dist import Coordinator

    coord = Coordinator(timeout=120)
    out = {}
    for layout in layouts:
        state = _many(world) if layout == "many" else build_state(layout, world)
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        planner.set_up_planner(state, None, rank == 0)
        local = planner.create_local_plan()
        plans, md = planner.create_global_plan(coord.all_gather(local))  # stock DCP's, for the comparison
        out[layout, "stock"] = ([_key(i) for i in plans[rank].items], md.state_dict_metadata, md.planner_data)
        for how in ("lowest", "spread"):
            owned = plan_by_owners(coord, local, writer=how)
            out[layout, how] = ([_key(i) for i in owned.plan.items], owned.state_dict_metadata, owned.planner_data,
                                owned.received)
    # Coordinator.all_to_all_objects: an empty list travels as no bytes; anything else as it is
    sent = [[] if r % 2 else [rank, r] for r in range(world)]
    sent[rank] = () if rank % 2 else sent[rank]  # an empty tuple is not an empty list: it travels
    out["a2a"] = (coord.all_to_all_objects(sent, "test", limit=1 << 20), coord.exchanged)
    return out


@pytest.fixture(scope="module")
def four() -> list:
    return run_ranks(4, _plans, LAYOUTS + ("many",))


@pytest.fixture(scope="module")
def three() -> list:
    return run_ranks(3, _plans, ("ddp", "fsdp", "uneven"))


def _merged(ranks: list, key) -> tuple[dict, dict]:
    sdm, paths = {}, {}
    for r in ranks:
        assert not set(sdm) & set(r[key][1])  # each key has one owner
        sdm.update(r[key][1])
        paths.update(r[key][2])
    return sdm, paths


@pytest.mark.parametrize("layout", LAYOUTS + ("many",))
def test_owners_plan_what_stock_dcp_plans_with_the_lowest_writer_on_four_ranks(four, layout):
    _check_lowest(four, layout)


@pytest.mark.parametrize("layout", ("ddp", "fsdp", "uneven"))
def test_owners_plan_what_stock_dcp_plans_with_the_lowest_writer_on_three_ranks(three, layout):
    _check_lowest(three, layout)


def _check_lowest(ranks: list, layout: str) -> None:
    stock_sdm, stock_paths = ranks[0][layout, "stock"][1:]
    for r in ranks:  # each rank writes the items stock DCP's global plan gives it, index hints included
        assert r[layout, "lowest"][0] == r[layout, "stock"][0]
    sdm, paths = _merged(ranks, (layout, "lowest"))
    assert sdm == stock_sdm and paths == stock_paths
    for fqn, entry in stock_sdm.items():  # chunks in DCP's order
        assert getattr(sdm[fqn], "chunks", None) == getattr(entry, "chunks", None)


@pytest.mark.parametrize("layout", LAYOUTS + ("many",))
def test_spread_writers_write_each_item_once_from_a_rank_that_holds_it(four, layout):
    stock = sorted(k[:2] + k[3:] for r in four for k in r[layout, "stock"][0])
    spread = sorted(k[:2] + k[3:] for r in four for k in r[layout, "spread"][0])
    assert spread == stock  # the same items, each once (hints aside: the writers differ)
    sdm, paths = _merged(four, (layout, "spread"))
    stock_sdm = four[0][layout, "stock"][1]
    assert sdm.keys() == stock_sdm.keys() and paths == four[0][layout, "stock"][2]
    for fqn, entry in stock_sdm.items():
        if hasattr(entry, "chunks"):
            assert (sdm[fqn].properties, sdm[fqn].size) == (entry.properties, entry.size)
            assert sorted(map(str, sdm[fqn].chunks)) == sorted(map(str, entry.chunks))
    if layout == "ddp":  # replicated tensors: written by more than one rank
        assert sum(1 for r in four if r[layout, "spread"][0]) > 1


def test_all_to_all_objects_sends_no_bytes_for_an_empty_list(four):
    import pickle

    for me, r in enumerate(four):
        got, (out, inn) = r["a2a"]
        want = [() if p == me and p % 2 else ([] if me % 2 else [p, me]) for p in range(4)]
        assert got == want and [type(x) for x in got] == [type(x) for x in want], (me, got)
        mine = [() if me % 2 and p == me else ([] if p % 2 else [me, p]) for p in range(4)]
        assert out == sum(len(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)) for x in mine if x != []), (me, out)
        assert inn == sum(len(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)) for x in want if x != []), (me, inn)


def test_no_rank_receives_much_more_than_its_share_of_the_records(four):
    got = [r["many", "lowest"][3] for r in four]
    assert max(got) < 1.5 * sum(got) / len(got), got


def _refused(rank: int, world: int, case: str) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from cloudckpt.dcp.owners import plan_by_owners
    from cloudckpt.dist import Coordinator

    def item(fqn, offsets, sizes, size, dtype=torch.float32):
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        return WriteItem(MetadataIndex(fqn, torch.Size(offsets)), WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk, TensorProperties(dtype=dtype), torch.Size(size)))

    rows = {"overlap": [(0, 3), (2, 2)], "gap": [(0, 2), (3, 1)], "outside": [(0, 2), (2, 3)]}
    if case in rows:
        start, n = rows[case][rank]
        items = [item("w", (start, 0), (n, 4), (4, 4))]
    elif case == "dtype":
        items = [item("w", (0, 0), (4, 4), (4, 4), torch.float32 if rank == 0 else torch.bfloat16)]
    else:
        raise ValueError(case)
    plan_by_owners(Coordinator(timeout=60), SavePlan(items), writer="lowest")


@pytest.mark.parametrize("case, why", [("overlap", "overlap"), ("gap", "every element must be held"),
                                       ("outside", "outside the tensor"), ("dtype", "same shape, dtype")])
def test_owners_refuse_what_dcps_planner_refuses_on_every_rank(case, why):
    with pytest.raises(RankFailed) as ei:
        run_ranks(2, _refused, case)
    assert set(ei.value.failures) == {0, 1}
    assert all("ShapeMismatch" in tb and why in tb for tb in ei.value.failures.values())


def test_one_process_plans_what_stock_dcp_plans_alone():
    from torch.distributed.checkpoint import DefaultSavePlanner

    from cloudckpt.dcp.owners import plan_by_owners
    from cloudckpt.dist import Coordinator

    state = {"model": {"w": torch.ones(4, 3), "b": torch.zeros(2)}, "step": 3}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, True)
    local = planner.create_local_plan()
    plans, md = planner.create_global_plan([local])
    owned = plan_by_owners(Coordinator(local=True), local)
    assert [_key(i) for i in owned.plan.items] == [_key(i) for i in plans[0].items]
    assert owned.state_dict_metadata == md.state_dict_metadata and owned.planner_data == md.planner_data


def test_the_overlap_sweep_of_row_shards_of_a_wide_tensor_is_linear_in_the_chunks(monkeypatch):
    """A Shard(0) tensor wider than tall (Llama-3-70B's ``wk`` of 1,024 x 8,192, ``w2`` of
    8,192 x 28,672) on 4,096 ranks: 1,024 one-row chunks and the empty chunk of the ranks
    past the rows. The owner's sweep runs along the rows, where the chunks' starts differ,
    so each chunk meets the few that share its rows (along the columns every chunk spans,
    it met every other: half a million checks here, 134 M for ``w2`` at 16,384 ranks).
    An overlap is still found."""
    from cloudckpt.dcp import owners
    from cloudckpt.errors import ShapeMismatch

    checks = []
    overlap = owners._overlap
    monkeypatch.setattr(owners, "_overlap", lambda a, b: checks.append(1) or overlap(a, b))
    size = (1024, 8192)
    chunks = [((r, 0), (1, 8192)) for r in range(1024)] + [((1024, 0), (0, 8192))]
    owners._check_chunks("wk", size, chunks, 4096)
    assert len(checks) <= 2 * len(chunks)
    with pytest.raises(ShapeMismatch, match="overlap"):
        owners._check_chunks("wk", size, chunks[:700] + [((699, 0), (2, 8192))] + chunks[701:], 4096)


def test_a_payload_of_records_carries_one_properties_object_per_kind():
    """An owner unpickles R payloads of records (16,384 at 16,384 ranks): equal tensor
    properties are one object in a rank's records, pickled once a payload, not once a key."""
    import pickle

    from torch.distributed.checkpoint import DefaultSavePlanner

    from cloudckpt.dcp import owners

    state = {f"w{k}": torch.zeros(4, 4) for k in range(50)} | {"h": torch.zeros(2, dtype=torch.float16)}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, True)
    (recs,) = owners._records(planner.create_local_plan(), 1)
    assert len(recs) == 51 and len({id(r[4]) for r in recs}) == 2  # float32 and float16
    assert {r[4].dtype for r in pickle.loads(pickle.dumps(recs))} == {torch.float32, torch.float16}
    assert len(pickle.dumps(recs)) < 51 * 100
