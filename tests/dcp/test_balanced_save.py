"""Balanced save of replicated items (issue 33): the ranks holding a replicated item
share its writing (``_torch_compat.balanced_dedup``), by bytes, deterministically, with
DCP's plan cache still hit on a repeated save.

Real gloo ranks save a Llama-shaped state (``bench/balanced_save.py``) in a DDP-style
layout (every tensor on the 4 ranks) and a 2x2 HSDP-style one (2 replica groups of 2
shards), once with DCP 2.13's own dedup and then with cloudckpt's; every step is
loaded back and compared bit-exactly, a piece-written step also by stock DCP's
``FileSystemReader`` and resharded into the other layout."""

from __future__ import annotations

import random

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import MetadataIndex

from bench import balanced_save as bench
from cloudckpt._torch_compat import MIN_PIECE_BYTES, _item_bytes, balanced_dedup
from cloudckpt.testing.multiprocess import run_ranks

SHAPE = bench.SHAPES["test"]  # embedding and output layer 4 MiB each: larger than a rank's share of the weights


def _plans(flat_per_rank: list[dict]) -> list:
    return [create_default_local_save_plan(flat, rank == 0) for rank, flat in enumerate(flat_per_rank)]


def _written(plans) -> list[int]:
    return [sum(_item_bytes(i) for i in p.items) for p in plans]


def _volume(chunks) -> int:
    n = 0
    for c in chunks:
        v = 1
        for s in c.sizes:
            v *= s
        n += v
    return n


def test_every_byte_is_written_once_within_a_quarter_of_the_mean_and_the_plan_does_not_depend_on_item_order():
    flat = bench.full_state(SHAPE, 0, "weights")
    private = {f"rank{r}.only": torch.zeros(1000 * (r + 1)) for r in range(4)}  # held by one rank: stays there
    per_rank = [dict(flat, **{f"rank{r}.only": private[f"rank{r}.only"]}) for r in range(4)]
    plans = _plans(per_rank)
    out = balanced_dedup(plans)
    written = _written(out)
    assert max(written) <= 1.25 * sum(written) / 4, written
    # what DCP's own dedup does with the same plans (the reason for all this)
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    stock = _written(dedup_save_plans(plans))
    assert max(stock) > 1.5 * sum(stock) / 4, stock
    # each tensor's pieces cover it exactly once, each written by one rank
    chunks: dict[str, list] = {}
    for p in out:
        for item in p.items:
            chunks.setdefault(item.index.fqn, []).append(item.tensor_data.chunk)
    for fqn, tensor in {**flat, **private}.items():
        assert _volume(chunks[fqn]) == tensor.numel(), fqn
        rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks[fqn])
        assert rows[0][0] == 0 and rows[-1][1] == tensor.shape[0], fqn
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False)), (fqn, rows)
    for r in range(4):
        assert [i.index.fqn for i in out[r].items if i.index.fqn.startswith("rank")] == [f"rank{r}.only"]
    # the 4 MiB embedding was cut (pieces of at least MIN_PIECE_BYTES), small tensors were not
    assert len(chunks["model.embed_tokens.weight"]) == 4
    assert min(_item_bytes(i) for p in out for i in p.items if i.index.fqn == "model.lm_head.weight") >= MIN_PIECE_BYTES
    assert len(chunks["model.norm.weight"]) == 1
    # the same plans with their items in another order: the same writers
    rng = random.Random(0)
    shuffled = []
    for p in plans:
        items = list(p.items)
        rng.shuffle(items)
        shuffled.append(type(p)(items, p.storage_data, p.planner_data))

    def assignment(result):
        return {(i.index.fqn, tuple(i.index.offset)): r for r, p in enumerate(result) for i in p.items}

    assert assignment(balanced_dedup(shuffled)) == assignment(out)
    assert assignment(balanced_dedup(plans)) == assignment(out)


def test_a_scalar_and_a_pickled_value_held_everywhere_are_written_once():
    flat = {"step": torch.tensor(3.0), "lr": 0.1, "w": torch.ones(8, 8)}
    out = balanced_dedup(_plans([flat] * 4))
    names = sorted(i.index.fqn for p in out for i in p.items)
    assert names == ["lr", "step", "w"]
    assert MetadataIndex("w", torch.Size([0, 0])) in {i.index for p in out for i in p.items}  # 256 bytes: not cut


def save_load_and_reshard(rank, world_size, folder, work_dir):
    """bench.rank_main's saves (stock, then balanced; 2 reps each) and bit-exact loads,
    then the balanced DDP weights step loaded into the HSDP layout and with pre-download."""
    from cloudckpt import Checkpointer

    out = bench.rank_main(rank, world_size, {"shape": "test", "reps": 2, "url": folder, "work_dir": work_dir,
                                             "cases": [["ddp", "weights"], ["ddp", "train"], ["hsdp", "train"]]})
    step = f"{folder}/ddp-weights-balanced/step2"
    bad = {}
    for layout, pre in (("hsdp", False), ("ddp", True)):
        ck = Checkpointer(work_dir=work_dir, pre_download=pre)
        sd = bench.state_dict(layout, rank, world_size, SHAPE, seed=1, kind="weights", zero=True)
        ck.load(step, sd)
        ck.close()
        bad[(layout, pre)] = bench.bit_exact(bench.flatten(sd), bench.full_state(SHAPE, 1, "weights"))
    out["resharded"] = bad
    return out


def test_ddp_and_hsdp_saves_write_within_a_quarter_of_the_mean_and_load_back_bitexactly(tmp_path):
    folder = str(tmp_path / "run")
    ranks = run_ranks(4, save_load_and_reshard, folder, str(tmp_path / "work"))
    for r in ranks:
        assert r["mismatches"] == {}, r["mismatches"]
        assert all(v == [] for v in r["resharded"].values()), r["resharded"]
    rows = {(row["layout"], row["kind"], row["mode"]): row for row in bench.summarize(ranks, 4)}
    for (layout, kind, mode), row in rows.items():
        written = row["per_rank"]
        if mode == "balanced":
            assert max(written) <= 1.25 * sum(written) / 4, (layout, kind, written)
            assert min(written) > 0, (layout, kind, written)
        # the second save of the same structure: every rank sent an empty local plan,
        # rank 0 built no global plan (DCP's cache), and wrote the same bytes per rank
        assert row["repeat_saves_plan_cached"], (layout, kind, mode)
        assert row["first_save_global_plans"] == 1, (layout, kind, mode)
        assert row["same_bytes_every_rep"], (layout, kind, mode)
    # the layouts exercise the imbalance: DCP's own dedup writes over 1.25x the mean in DDP
    for kind in ("weights", "train"):
        written = rows[("ddp", kind, "stock")]["per_rank"]
        assert max(written) > 1.25 * sum(written) / 4, (kind, written)


def test_a_step_written_in_pieces_loads_with_stock_dcp(tmp_path):
    """A replicated tensor written by several ranks is several chunks in DCP's
    ``.metadata``: stock ``dcp.load`` with ``FileSystemReader`` reads it back."""
    import torch.distributed.checkpoint as dcp

    folder = str(tmp_path / "run")
    run_ranks(4, _save_weights, folder, str(tmp_path / "work"))
    reader = dcp.FileSystemReader(f"{folder}/step1/model_and_optim")
    md = reader.read_metadata()
    assert len(md.state_dict_metadata["model.embed_tokens.weight"].chunks) == 4
    want = bench.full_state(SHAPE, 0, "weights")
    sd = {"model": {k[len("model."):]: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    assert bench.bit_exact({f"model.{k}": v for k, v in sd["model"].items()}, want) == []


def _save_weights(rank, world_size, folder, work_dir):
    from cloudckpt import Checkpointer

    ck = Checkpointer(work_dir=work_dir)
    ck.save(f"{folder}/step1", bench.state_dict("ddp", rank, world_size, SHAPE, seed=0, kind="weights"), {"rank": rank})
    ck.close()


def test_an_item_whose_holders_disagree_on_its_shape_is_written_whole_by_one_of_them():
    """Not a replicated tensor (DCP keeps one rank's copy, as it does): never cut,
    and the writer's own item describes it."""
    per_rank = [{"buf": torch.zeros(1 << 18, 2 + r), "w": torch.zeros(1 << 19)} for r in range(4)]
    plans = _plans(per_rank)
    out = balanced_dedup(plans)
    bufs = [(r, i) for r, p in enumerate(out) for i in p.items if i.index.fqn == "buf"]
    assert len(bufs) == 1
    rank, item = bufs[0]
    assert item == next(i for i in plans[rank].items if i.index.fqn == "buf")
    assert len([i for p in out for i in p.items if i.index.fqn == "w"]) == 2  # 2 MiB, identical everywhere: cut


def test_a_piece_outside_the_ranks_tensor_is_refused_not_written():
    """A plan that asks a rank for rows its tensor does not have (never made by
    balanced_dedup, whose pieces come from identical items) stops the save, typed."""
    import dataclasses

    import pytest
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from cloudckpt._torch_compat import _pieces, caching_save_planner
    from cloudckpt.errors import ShapeMismatch

    planner = caching_save_planner("unit-test-piece")
    planner.set_up_planner({"w": torch.arange(16.0).reshape(8, 2)}, is_coordinator=True)
    planner.create_local_plan()
    (item,) = planner.plan.items
    first, second = _pieces(item, 32)
    assert torch.equal(planner.resolve_data(second), torch.arange(8.0, 16.0).reshape(4, 2))
    outside = dataclasses.replace(second, tensor_data=dataclasses.replace(
        second.tensor_data, chunk=ChunkStorageMetadata(offsets=torch.Size([6, 0]), sizes=torch.Size([4, 2]))))
    with pytest.raises(ShapeMismatch, match="rows 6..10"):
        planner.resolve_data(outside)
