"""The pieces of a save without a gather of plans, put together as a save would call
them, on 4 real gloo ranks: each rank plans locally, ``owners.plan_by_owners`` (the
replicated items spread over their holders), writes its items with stock DCP's
``FileSystemWriter`` under its own prefix (``__{rank}_``, no global step), makes its
fragment (``owners.fragment_of``), and ``assemble_store.assemble_in_store`` joins
``.metadata`` in the folder. Stock ``dcp.load`` on the same ranks and stock
``dcp_to_torch_save`` in one process read it back bit for bit; its Metadata has the keys,
properties and chunks stock ``dcp.save`` writes for the same state. The same inside
stock ``dcp.save`` (``owners.OwnersSavePlanner`` and a writer that keeps its results):
DCP's own gathers then carry a few bytes a rank."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from cloudckpt.testing.multiprocess import run_ranks

from .test_assemble import build_state

LAYOUTS = ("ddp", "fsdp", "hsdp", "tp2d", "uneven")


def _locals(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: _locals(v) for k, v in value.items()}
    if isinstance(value, DTensor):
        return value.to_local().clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def _zeroed(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: _zeroed(v) for k, v in value.items()}
    if isinstance(value, (DTensor, torch.Tensor)):
        return torch.zeros_like(value)
    return value


def _keeping_writer(folder: str):
    """Stock FileSystemWriter that keeps its write results (DCP's gather gets none) and
    writes no .metadata (the ranks assemble it after the save)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.futures import Future

    class Keeping(FileSystemWriter):
        results: list = []

        def write_data(self, plan, planner):
            done = super().write_data(plan, planner)
            done.wait()
            self.results = done.value()
            out: Future = Future()
            out.set_result([])
            return out

        def finish(self, metadata, results) -> None:
            pass

    return Keeping(folder)


def _dcp_save_with_owners(rank: int, world: int, root: str) -> dict:
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from cloudckpt.dcp import index
    from cloudckpt.dcp.assemble import TRAILER, header
    from cloudckpt.dcp.assemble_store import assemble_in_store
    from cloudckpt.dcp.owners import OwnersSavePlanner, fragment_of, index_header
    from cloudckpt.dist import Coordinator
    from cloudckpt.storage import open_store

    coord = Coordinator(timeout=120)
    out = {}
    gathers: list = []  # gathers of objects while the index header is made (each pads to the largest payload)
    gather_object = tdist.gather_object
    for layout in LAYOUTS:
        folder = os.path.join(root, layout)
        state = build_state(layout, world)
        planner, writer = OwnersSavePlanner(coord), _keeping_writer(folder)
        dcp.save(state, storage_writer=writer, planner=planner, process_group=coord.group)
        url = os.path.join(folder, ".metadata")
        assemble_in_store(coord, open_store(url), url, fragment_of(planner.owned, writer.results),
                          header=header(version=CURRENT_DCP_VERSION), trailer=TRAILER)
        tdist.gather_object = lambda *a, _at=layout, **kw: gathers.append(_at) or gather_object(*a, **kw)
        try:
            built = index_header(coord, planner.owned, writer.results, dcp_version=CURRENT_DCP_VERSION)
        finally:
            tdist.gather_object = gather_object
        target = _zeroed(build_state(layout, world))
        dcp.load(target, checkpoint_id=folder)
        headers = None
        if rank == 0:  # the owners' header, and the one the global Metadata gives (index.header_bytes)
            with open(url, "rb") as f:
                headers = (_canonical(built), _canonical(index.header_bytes(pickle.load(f))))
        out[layout] = (_same(_locals(state), _locals(target)), planner.gathered, len(writer.results), headers,
                       gathers.count(layout))
    return out


def _canonical(raw: bytes) -> dict:
    """A header's content whatever the order of its tensors, values and layouts."""
    doc = json.loads(raw)
    ids = {i: json.dumps(x, sort_keys=True) for i, x in enumerate(doc["layouts"])}
    tensors = sorted([t[0], t[1], t[2], ids[t[3]] if t[3] >= 0 else None, t[4]] for t in doc["tensors"])
    return {**doc, "tensors": tensors, "values": sorted(doc["values"]), "layouts": sorted(ids.values())}


def test_inside_stock_dcp_save_the_owners_planner_gathers_a_few_bytes_a_rank_and_the_step_loads(tmp_path):
    ranks = run_ranks(4, _dcp_save_with_owners, str(tmp_path))
    for layout in LAYOUTS:
        assert all(r[layout][0] for r in ranks), layout  # loaded back bit for bit on every rank
        assert sum(r[layout][2] for r in ranks) > 0
        gathered = ranks[0][layout][1]
        assert 0 < gathered < 100 * 4, (layout, gathered)  # DCP's gather of plans: empty plans only
        ours, from_metadata = ranks[0][layout][3]
        assert ours == from_metadata, layout  # the owners' index header is the global Metadata's
        assert ours["tensors"] and (layout != "fsdp" or ours["layouts"]), layout
        assert all(r[layout][3] is None for r in ranks[1:])
        # no gather of objects: the owners' entries come by gather_some (a length a rank, then the owners'
        # values), the layouts (R chunks each) point to point from the owners asked; gather_object would
        # pad every rank's payload to the largest, R x R bytes at R ranks
        assert all(r[layout][4] == 0 for r in ranks), (layout, [r[layout][4] for r in ranks])


def _save_and_load(rank: int, world: int, root: str) -> dict:
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    from cloudckpt.dcp.assemble import TRAILER, header
    from cloudckpt.dcp.assemble_store import assemble_in_store
    from cloudckpt.dcp.owners import fragment_of, plan_by_owners
    from cloudckpt.dist import Coordinator
    from cloudckpt.storage import open_store

    coord = Coordinator(timeout=120)
    out = {}
    for layout in LAYOUTS:
        folder = os.path.join(root, layout, "ours")
        state = build_state(layout, world)
        dcp.save(state, checkpoint_id=os.path.join(root, layout, "stock"))  # for the comparison
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, None, rank == 0)
        owned = plan_by_owners(coord, planner.create_local_plan(), writer="spread")
        writer = FileSystemWriter(folder)
        writer.set_up_storage_writer(rank == 0, rank=rank)
        plan = writer.prepare_local_plan(dataclasses.replace(owned.plan, storage_data=_StoragePrefix(f"__{rank}_")))
        plan = planner.finish_plan(plan)
        results = writer.write_data(plan, planner).wait()
        url = os.path.join(folder, ".metadata")
        assemble_in_store(coord, open_store(url), url, fragment_of(owned, results), header=header(),
                          trailer=TRAILER)
        target = _zeroed(build_state(layout, world))
        dcp.load(target, checkpoint_id=folder)
        out[layout] = (_locals(state), _locals(target), sum(1 for _ in plan.items))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("owned"))
    return root, run_ranks(4, _save_and_load, root)


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_save_planned_by_owners_and_assembled_in_the_folder_loads_with_stock_dcp(saved, layout, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, ranks = saved
    for state, loaded, _ in (r[layout] for r in ranks):  # on the same ranks: bit for bit
        assert _same(state, loaded)
    assert sum(r[layout][2] for r in ranks) > 0
    if layout == "ddp":  # the replicated tensors are written by more than one rank
        assert sum(1 for r in ranks if r[layout][2]) > 1
    dcp_to_torch_save(os.path.join(root, layout, "ours"), tmp_path / "ours.pt")
    dcp_to_torch_save(os.path.join(root, layout, "stock"), tmp_path / "stock.pt")
    assert _same(torch.load(tmp_path / "stock.pt", weights_only=True), torch.load(tmp_path / "ours.pt",
                                                                                 weights_only=True))
    with open(os.path.join(root, layout, "ours", ".metadata"), "rb") as f:
        ours = pickle.load(f)
    with open(os.path.join(root, layout, "stock", ".metadata"), "rb") as f:
        stock = pickle.load(f)
    assert ours.planner_data == stock.planner_data
    assert ours.state_dict_metadata.keys() == stock.state_dict_metadata.keys()
    for fqn, entry in stock.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(entry)
        if hasattr(entry, "chunks"):
            assert (mine.properties, mine.size) == (entry.properties, entry.size)
            assert sorted(map(str, mine.chunks)) == sorted(map(str, entry.chunks))
    assert {(i.fqn, tuple(i.offset or ())) for i in ours.storage_data} == \
        {(i.fqn, tuple(i.offset or ())) for i in stock.storage_data}
