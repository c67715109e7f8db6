"""Megatron-core's ``.metadata``: its save keeps every rank's ``SavePlan`` in DCP's metadata
(``Metadata.all_local_plans``), which the allowlist unpickler (untrusted/unpickle.py)
reads as inert stand-ins and drops. What this proves, on crafted pickles: an honest
Megatron metadata loads with its plans gone; the plan classes are admitted nowhere else,
are never called, hashed, or given state other than their fields; their module gives
nothing else (no other class, no dotted name); ``WriteItemType`` takes a small int only;
and the bounds of the metadata unpickler still hold inside the plans (constructor copies
charged to the budget, deep nesting and huge ints refused or dropped without a crash, in
the sandbox)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from cloudckpt.errors import UnsafeCheckpoint
from cloudckpt.untrusted import loads_metadata

from . import hostile_metadata as hm
from .sandbox import OK, REFUSED
from .test_metadata_limits import _md

PLAN = "torch.distributed.checkpoint.planner"


def _item(fqn: str = "w") -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    return WriteItem(index=MetadataIndex(fqn, torch.Size([0])), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32),
                                                 size=torch.Size([4])))


def _megatron_md(plans=None, **kw):
    """A metadata as Megatron's save writes it: the honest one with ``all_local_plans``."""
    md, files = _md({"w": ([4], [([0], [4])])}, **kw)
    md.all_local_plans = [SavePlan([_item(), WriteItem(index=MetadataIndex("obj/shard_0_1"),
                                                       type=WriteItemType.BYTE_IO)])] if plans is None else plans
    return md, files


def test_megatron_metadata_with_its_save_plans_loads_and_the_plans_are_dropped():
    md, files = _megatron_md()
    back = loads_metadata(pickle.dumps(md, protocol=4), url="t", files=files)
    assert "all_local_plans" not in back.__dict__
    assert back.state_dict_metadata == md.state_dict_metadata and back.storage_data == md.storage_data
    # protocol 2 (another writer's default) too
    assert "all_local_plans" not in loads_metadata(pickle.dumps(md, protocol=2), url="t", files=files).__dict__


@pytest.mark.parametrize("where", ["planner_data value", "planner_data key", "storage_meta field"])
def test_a_save_plan_anywhere_but_all_local_plans_is_refused(where):
    md, files = _md({"w": ([4], [([0], [4])])})
    item = WriteItem(index=MetadataIndex("x"), type=WriteItemType.BYTE_IO)  # hashable in DCP: no tensor_data
    if where == "planner_data value":
        md.planner_data = {"x": item}
        match = "planner data holds a WriteItem"
    elif where == "planner_data key":
        md.planner_data = {item: 1}
        match = "WriteItem is used as a dict key"
    else:
        from torch.distributed.checkpoint.metadata import StorageMeta

        md.storage_meta = StorageMeta(modules=[SavePlan([])])
        match = "planner data holds a SavePlan"
    with pytest.raises(UnsafeCheckpoint, match=match):
        loads_metadata(pickle.dumps(md, protocol=4), url="t", files=files)


@pytest.mark.parametrize("plans,match", [
    ("not a list", "all_local_plans is not a list of SavePlans"),
    ([_item()], "all_local_plans is not a list of SavePlans"),
    ([{"items": []}], "all_local_plans is not a list of SavePlans"),
])
def test_all_local_plans_holds_only_save_plans(plans, match):
    md, files = _megatron_md(plans)
    with pytest.raises(UnsafeCheckpoint, match=match):
        loads_metadata(pickle.dumps(md, protocol=4), url="t", files=files)


def _plans_with(frag: bytes) -> bytes:
    """An honest Megatron metadata whose first plan's planner_data is the raw fragment ``frag``."""
    md, _ = _megatron_md([SavePlan([], planner_data="__X__")])
    return hm.crafted(md, fill={"__X__": frag})


@pytest.mark.parametrize("frag,match", [
    # a stand-in class called (REDUCE), or given a field it does not have, or its state twice
    (hm._global(PLAN, "WriteItem") + b")R", "calling .*WriteItem is not allowed"),
    (hm._global(PLAN, "SavePlan") + b")\x81}" + hm._str("__class__") + b"K\x01sb", "only its fields"),
    (hm._global(PLAN, "BytesIOWriteData") + b")\x81}b}b", "set twice"),
    # WriteItemType: one small int, nothing else
    (hm._global(PLAN, "WriteItemType") + b"(" + hm.huge_int() + b"tR", "small int"),
    (hm._global(PLAN, "WriteItemType") + b"(" + hm._str("SHARD") + b"tR", "small int"),
    # the module gives nothing else: not the planner classes, not a dotted name, not a module global
    (hm._global(PLAN, "LoadPlan") + b")\x81", "LoadPlan is not in the allowlist"),
    (hm._global(PLAN, "SavePlanner"), "SavePlanner is not in the allowlist"),
    (hm._global(PLAN, "os.system"), "os.system is not in the allowlist"),
    (hm._global(PLAN, "WriteItem.__init__"), "is not in the allowlist"),
    (hm._global(PLAN, "dataclass"), "dataclass is not in the allowlist"),
    # DCP's real classes are never built for a plan, so their hash never runs on a plan
    (b"\x8f(" + hm._global(PLAN, "WriteItem") + b")\x81\x90", "used as a dict key or set member"),
])
def test_inside_a_plan_only_the_stand_ins_fields_are_admitted(frag, match):
    with pytest.raises(UnsafeCheckpoint, match=match):
        loads_metadata(_plans_with(frag), url="t")


def test_constructor_copies_inside_a_plan_are_charged_to_the_budget():
    distinct = b"(" + b"".join(b"J" + i.to_bytes(4, "little") for i in range(100_000)) + b"l"
    md, _ = _megatron_md()
    assert loads_metadata(hm.crafted(md, tail=hm.repeated_reduce("builtins", "set", distinct, times=1)), url="t")
    with pytest.raises(UnsafeCheckpoint, match="more work than its size allows"):
        loads_metadata(hm.crafted(md, tail=hm.repeated_reduce("builtins", "set", distinct, times=50)), url="t")


# in the sandbox: a crash (C stack), a bomb or a hang would be reported as such
def deep_in_plan(**_) -> None:
    """A tuple nested 10^6 deep as a plan's planner_data: never hashed, dropped with the plans."""
    loads_metadata(_plans_with(hm.deep_tuple()), url="x")


def deep_key_in_plan(**_) -> None:
    """The same tuple as a dict key inside a plan: measured before it is hashed, refused."""
    loads_metadata(_plans_with(b"}" + hm.deep_tuple() + b"K\x01s"), url="x")


def size_bomb_in_plan(**_) -> None:
    """torch.Size(10^6 ints) built 2,000 times inside a plan: refused by its argument check."""
    loads_metadata(_plans_with(hm.repeated_reduce("torch", "Size", hm.int_tuple(10**6)) + b"N"), url="x")


@pytest.fixture
def sandbox(hostile_sandbox):
    return hostile_sandbox


@pytest.mark.parametrize("target,outcome", [("deep_in_plan", OK), ("deep_key_in_plan", REFUSED),
                                            ("size_bomb_in_plan", REFUSED)])
def test_nesting_and_bombs_inside_plans_neither_crash_nor_allocate_in_the_sandbox(target, outcome, sandbox):
    r = sandbox.run(f"tests.security.test_megatron_metadata:{target}", timeout=60)
    assert r.outcome == outcome, r
    if outcome == REFUSED:
        assert r.error == "cloudckpt.errors.UnsafeCheckpoint", r
