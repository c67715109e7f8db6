"""A load does what stock DCP does with the same state dict (issue 44, item 7).

Each layout DCP users hand over is saved with cloudckpt, then loaded on the same ranks
both with stock ``dcp.load`` (``FileSystemReader`` on the step's ``model_and_optim``)
and with ``Checkpointer.load`` (streaming and pre_download, the read-once exchange on
and off), into targets built the same way; the results are compared bit for bit with
each other and with the values saved, in the same test:

- ``dtensor``: a DTensor of uneven chunks (7 rows on 2 ranks), loaded resharded (Shard(1));
- ``sharded_multi``: a ShardedTensor saved whole on rank 0, loaded with several local
  shards per rank (uneven: 3, 3, 3, 1 rows): each rank's plan reads the same stored
  item several times (what ``coalesce`` used to turn into a false CorruptCheckpoint);
- ``sharded_uneven``: uneven chunks over all ranks, loaded with the placements swapped,
  plus a replicated tensor every rank loads (what the exchange shares);
- ``nested``: nested dicts and lists of tensors and plain values;
- ``stateful``: a ``Stateful`` value (its ``load_state_dict`` gets what DCP hands it);
every top-level mapping is a ``RecordingDict``, whose own ``__setitem__`` logs each
assignment: a load must assign top-level values as DCP does (``state_dict[key] = value``
for each non-Stateful value, in the same order).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from cloudckpt.testing.multiprocess import run_ranks

LAYOUTS = ("dtensor", "sharded_multi", "sharded_uneven", "nested", "stateful")
WAYS = ("stream", "stream+exchange", "pre_download", "pre_download+exchange")


class RecordingDict(dict):
    """A state dict mapping with its own ``__setitem__``: logs each assignment."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.assigned: list[str] = []

    def __setitem__(self, key, value):
        self.assigned.append(key)
        super().__setitem__(key, value)


class App:
    """A ``Stateful`` (DCP's protocol: state_dict / load_state_dict)."""

    def __init__(self, fill: bool):
        self.t = _values((5, 6), 3) if fill else torch.zeros(5, 6)
        self.n = 11 if fill else 0
        self.loaded: dict | None = None

    def state_dict(self):
        return {"t": self.t, "n": self.n}

    def load_state_dict(self, sd):
        self.loaded = dict(sd)
        self.t, self.n = sd["t"], sd["n"]


def _values(shape, seed: int) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 1.5 + seed).contiguous()


def _sharded(full: torch.Tensor, placements: list[str], fill: bool):
    from torch.distributed._shard.sharded_tensor import empty as st_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    st = st_empty(ChunkShardingSpec(dim=0, placements=[f"{p}/cpu" for p in placements]), *full.shape)
    for shard in st.local_shards():
        m = shard.metadata
        part = full[m.shard_offsets[0]: m.shard_offsets[0] + m.shard_sizes[0]]
        shard.tensor.copy_(part if fill else torch.zeros_like(part))
    return st


def build(layout: str, rank: int, world: int, *, saved: bool, fill: bool) -> RecordingDict:
    """The state of ``layout``: as saved (``saved``) or as loaded into (the target
    layout); filled with the saved values (``fill``) or zeros."""
    if layout == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        full = _values((7, 5), 1)
        w = distribute_tensor(full if fill else torch.zeros_like(full), mesh, [Shard(0 if saved else 1)])
        return RecordingDict(model=RecordingDict(w=w), bias=_values((3,), 2) if fill else torch.zeros(3))
    if layout == "sharded_multi":
        full = _values((10, 4), 3)
        placements = ["rank:0"] if saved else [f"rank:{r}" for r in range(world) for _ in range(2 if world > 1 else 3)]
        return RecordingDict(st=_sharded(full, placements, fill))
    if layout == "sharded_uneven":
        full = _values((7, 3), 4)
        order = list(range(world)) if saved else list(reversed(range(world)))
        rep = _values((32, 32), 5)  # 4 KiB, every rank: the exchange shares it
        return RecordingDict(st=_sharded(full, [f"rank:{r}" for r in order], fill),
                             rep=rep if fill else torch.zeros_like(rep))
    if layout == "nested":
        a, b, c = _values((4, 4), 6), _values((2, 3), 7), _values((9,), 8)
        z = torch.zeros_like
        return RecordingDict(
            model=RecordingDict(a=a if fill else z(a), inner={"b": b if fill else z(b), "k": 3 if fill else 0}),
            lst=[c if fill else z(c), "name" if fill else ""], step=7 if fill else 0)
    if layout == "stateful":
        return RecordingDict(app=App(fill), extra=_values((2, 2), 9) if fill else torch.zeros(2, 2))
    raise ValueError(layout)


def canonical(value):
    """A comparable form of a loaded value: a DTensor's local shard and placements, a
    ShardedTensor's local shards with their offsets, tensors with their dtypes."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return ("dtensor", tuple(map(str, value.placements)), canonical(value.to_local()))
    if isinstance(value, ShardedTensor):
        return ("sharded", [(tuple(s.metadata.shard_offsets), canonical(s.tensor)) for s in value.local_shards()])
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.contiguous().view(torch.uint8).flatten().tolist()
                if value.numel() else [])
    if isinstance(value, App):
        return ("app", canonical(value.state_dict()))
    if isinstance(value, dict):
        return ("dict", {k: canonical(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return ("list", [canonical(v) for v in value])
    return ("value", value)


def _assigned(sd) -> dict:
    """The assignments the mappings saw, and the Stateful values whose load_state_dict ran."""
    return {"top": list(sd.assigned), "stateful": sorted(k for k, v in sd.items() if isinstance(v, App) and v.loaded),
            "inner": {k: list(v.assigned) for k, v in sd.items() if isinstance(v, RecordingDict)}}


def parity(rank, world, root, work):
    """Save every layout, then load it with stock DCP and with Checkpointer.load every
    way; report, per layout, what each load gave (canonical) and the bytes it read."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from cloudckpt import Checkpointer

    warnings.filterwarnings("ignore", category=FutureWarning)  # ShardedTensor is deprecated
    warnings.filterwarnings("ignore", category=UserWarning)
    ck = Checkpointer(work_dir=work, collective_timeout=60)
    out: dict = {}
    for layout in LAYOUTS:
        step = f"{root}/{layout}/step1"
        ck.save(step, build(layout, rank, world, saved=True, fill=True), {"rank": rank})
        want = canonical(build(layout, rank, world, saved=False, fill=True))
        stock = build(layout, rank, world, saved=False, fill=False)
        dcp.load(stock, storage_reader=dcp.FileSystemReader(os.path.join(step, "model_and_optim")))
        got = {"want": want, "stock": canonical(stock), "stock_assigned": _assigned(stock)}
        for way in WAYS:
            ck.options = dataclasses.replace(ck.options, load_exchange="exchange" in way)
            target = build(layout, rank, world, saved=False, fill=False)
            try:
                ck.load(step, target, pre_download=way.startswith("pre_download"))
            except Exception as e:  # noqa: BLE001 - reported to the test, which names the layout and way
                got[way] = {"raised": f"{type(e).__name__}: {e}"[:1500]}
                continue
            got[way] = {"value": canonical(target), "assigned": _assigned(target),
                        "bytes_read": ck.last_load_info.bytes_read}
        out[layout] = got
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def loads(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"parity{world}")
    return world, tmp, run_ranks(world, parity, str(tmp / "run"), str(tmp / "work"), timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_load_gives_what_stock_dcp_gives_bit_for_bit(loads, layout):
    world, _, reports = loads
    for rank, report in enumerate(reports):
        got = report[layout]
        assert got["stock"] == got["want"], f"stock DCP itself did not load {layout} on rank {rank}"
        for way in WAYS:
            r = got[way]
            assert "raised" not in r, f"{layout}, {way}, rank {rank} of {world}: {r.get('raised')}"
            assert r["value"] == got["stock"], f"{layout}, {way}, rank {rank} of {world}: differs from stock DCP"
            # top-level values assigned as DCP assigns them (the mapping's own __setitem__, same order)
            assert r["assigned"] == got["stock_assigned"], (layout, way, rank, r["assigned"], got["stock_assigned"])
            assert r["assigned"]["top"], "the recording mapping saw no assignment: the check could not fail"
        if layout == "stateful":
            assert got["stock_assigned"]["stateful"] == ["app"]  # load_state_dict ran (and the check can fail)


def test_an_item_a_plan_reads_several_times_is_read_once(loads):
    """``sharded_multi``: each rank's shards all come from one stored item. Without the
    exchange each rank reads it from storage once, whatever the number of its shards;
    with it (2 ranks, both need it) the job reads it once."""
    world, tmp, reports = loads
    model = os.path.join(tmp, "run", "sharded_multi", "step1", "model_and_optim")
    item = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model) if n.endswith(".distcp"))
    for way in ("stream", "pre_download"):
        per_rank = [r["sharded_multi"][way]["bytes_read"] for r in reports]
        assert all(0 < b <= item for b in per_rank), (way, per_rank, item)  # not once per local shard
    if world > 1:
        for way in ("stream", "pre_download"):
            alone = sum(r["sharded_multi"][way]["bytes_read"] for r in reports)
            shared = sum(r["sharded_multi"][f"{way}+exchange"]["bytes_read"] for r in reports)
            assert shared < alone, (way, shared, alone)
