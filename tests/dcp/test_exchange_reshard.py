"""Resharding through the read-once exchange (issue 33): steps saved on 4 gloo ranks
loaded on 2, and saved on 2 loaded on 4, with DTensor layouts (SeaweedFS; the bucket's
bytes counted by bench/exchange.py's CountingS3 in each rank).

Layouts (``_state``): ``ddp`` (every tensor Replicate on a 1-D mesh), ``fsdp``
(Shard(0) on a 1-D mesh), ``hsdp`` (a 2 x (world / 2) mesh: Replicate over the replica
groups, Shard(0) within one). Each load is bit-exact and the bucket serves the step's
data bytes once, whether the ranks need the same stored chunks (DDP, HSDP's replica
groups) or different parts of one stored chunk (4 Shard(0) ranks loading chunks
that 2 ranks saved).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.exchange import counting, snapshot
from cloudckpt.dcp.exchange import TINY
from cloudckpt.testing.multiprocess import run_ranks

SHAPES = {f"t{i}": (64, 128) for i in range(6)}  # 32 KiB each
TIMEOUT = 30.0


def _full(zero: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(33)
    return {k: (torch.zeros(s) if zero else torch.randn(s, generator=g)) for k, s in SHAPES.items()}


def _state(layout: str, world: int, zero: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if layout == "hsdp":
        mesh, placements = init_device_mesh("cpu", (2, world // 2)), [Replicate(), Shard(0)]
    else:
        mesh, placements = init_device_mesh("cpu", (world,)), [Replicate() if layout == "ddp" else Shard(0)]
    model = {k: distribute_tensor(v, mesh, placements) for k, v in _full(zero).items()}
    return {"model": model, "step": torch.tensor(0 if zero else 7)}


def run(rank, world, root, work, saves, loads):
    """Save each ``(name, layout)`` of ``saves`` on this world; then load each ``(name,
    layout)`` of ``loads`` with the exchange: bit-exact?, this rank's bucket data bytes."""
    from cloudckpt import Checkpointer

    counting()
    ck = Checkpointer(work_dir=work, collective_timeout=TIMEOUT)
    for name, layout in saves:
        ck.save(f"{root}/{name}/step1", _state(layout, world), {"rank": rank})
    out = {}
    for name, layout, *plain in loads:
        # ("plain"): without the exchange, to see the counting tell them apart
        ck.options = dataclasses.replace(ck.options, load_exchange=not plain)
        target = _state(layout, world, zero=True)
        ck.coord.all_gather(None)  # every rank is here: count this load alone
        before = snapshot()["data_bytes"]
        ck.load(f"{root}/{name}/step1", target)
        read = snapshot()["data_bytes"] - before
        want = _full()
        exact = all(torch.equal(target["model"][k].full_tensor(), want[k]) for k in want) \
            and int(target["step"]) == 7
        out[f"{name}->{layout}@{world}{' plain' if plain else ''}"] = {"bitexact": exact, "data_bytes": read}
    ck.close()
    return out


def _env() -> dict:
    from tests.checkpoint.test_checkpointer import _env as env

    return env()


def _data_bytes(step: str) -> int:
    from tests.dcp.test_exchange import _data_bytes as data_bytes

    return data_bytes(step)


@pytest.fixture(scope="module")
def resharded(seaweed, tmp_path_factory):
    from tests.dcp.test_exchange import bucket_and_tmp

    root, tmp = bucket_and_tmp(seaweed, tmp_path_factory, "reshard")
    # 4 ranks save; 2 ranks load those and save their own; 4 ranks load the 2-rank steps
    run_ranks(4, run, root, str(tmp / "a"), [("ddp4", "ddp"), ("hsdp4", "hsdp")], [], env=_env(), timeout=180)
    two = run_ranks(2, run, root, str(tmp / "b"), [("ddp2", "ddp"), ("fsdp2", "fsdp")],
                    [("ddp4", "ddp"), ("hsdp4", "ddp"), ("hsdp4", "fsdp"), ("ddp4", "ddp", "plain")], env=_env(),
                    timeout=180)
    four = run_ranks(4, run, root, str(tmp / "c"), [],
                     [("ddp2", "ddp"), ("fsdp2", "hsdp"), ("fsdp2", "fsdp")], env=_env(), timeout=180)
    data = {name: _data_bytes(f"{root}/{name}/step1") for name in ("ddp4", "hsdp4", "ddp2", "fsdp2")}
    return two, four, data


CASES = [
    (2, "ddp4->ddp@2"),  # 4 replicas saved, 2 replicas load: each needs everything
    (2, "hsdp4->ddp@2"),  # 2 stored shards (+ the step), each needed whole by both ranks
    (2, "hsdp4->fsdp@2"),  # each rank needs one stored shard: nothing shared but the step
    (4, "ddp2->ddp@4"),
    (4, "fsdp2->hsdp@4"),  # each stored chunk needed by the 2 ranks of its shard
    (4, "fsdp2->fsdp@4"),  # each stored chunk holds the rows of 2 ranks: both need all its bytes
]


@pytest.mark.parametrize("world,case", CASES)
def test_resharded_load_is_bitexact_and_the_bucket_serves_each_byte_once(resharded, world, case):
    two, four, data = resharded
    reports = two if world == 2 else four
    name = case.split("->")[0]
    assert data[name] > 0
    assert all(r[case]["bitexact"] for r in reports), [r[case] for r in reports]
    read = [r[case]["data_bytes"] for r in reports]
    # each stored byte once (the step, under TINY bytes, by each rank: no exchange for a few bytes)
    assert data[name] <= sum(read) <= data[name] + (world - 1) * TINY, (read, data[name])
    assert min(read) > 0, read  # every rank takes a share of the reading


def test_without_the_exchange_each_rank_reads_its_copy(resharded):
    two, _, data = resharded
    case = "ddp4->ddp@2 plain"
    assert all(r[case]["bitexact"] for r in two)
    assert sum(r[case]["data_bytes"] for r in two) == 2 * data["ddp4"]  # the counting sees both copies
