"""The first save after a resume is planned from the loaded step: no rank gathers the
job's plans (checkpoint/structure.py).

On real gloo ranks against SeaweedFS: a job saves step 1 (DTensor shards, a replicated
tensor large enough to be cut into pieces, a small replicated one, a plain value, and a
tensor with fewer rows than ranks, so that one rank's shard is empty); a new job loads
it and saves step 2. The ranks agree by all_reduces that every state has the loaded
structure and every write result stayed in place: DCP runs with no collective and rank
0 receives no rank's plan, tag or result; the step's ``.metadata`` is a copy of the loaded one made
in the store, and step 2 loads bit for bit with ours and with stock ``dcp.load`` from a
downloaded folder. A value whose bytes grew moves the write results: the ``.metadata``
is then built from the loaded one. A state whose structure changed falls back to a
first save (planned by owners, dcp/owners.py, who decline here: the replicated tensor
is written in pieces balanced from every rank's plan), and that step
loads too (test_first_save_owners.py: a state the owners plan)."""

from __future__ import annotations

import os

import pytest
import torch

from cloudckpt.testing.multiprocess import run_ranks

ROWS, COLS, TENSORS = 4, 8, 24
BIG = 600_000  # float32 elements of the replicated tensor: 2.4 MB, cut into row pieces by the balanced save


def _state(world_size: int, *, zero: bool, bump: float = 0.0, wider: bool = False, value: str = "seven") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    rank = mesh.get_rank()
    cols = COLS + (1 if wider else 0)
    model = {}
    for t in range(TENSORS):
        local = torch.zeros(ROWS, cols) if zero else torch.full((ROWS, cols), t * 100.0 + rank + bump)
        model[f"layer{t}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                       shape=torch.Size((world_size * ROWS, cols)), stride=(cols, 1))
    # fewer rows than ranks: the last rank's shard is empty (a chunk no layout of the index holds)
    rows = 1 if rank < world_size - 1 else 0
    local = torch.zeros(rows, cols) if zero else torch.full((rows, cols), 50.0 + rank + bump)
    model["tiny.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                              shape=torch.Size((world_size - 1, cols)), stride=(cols, 1))
    big = torch.zeros(BIG // 100, 100) if zero else torch.arange(float(BIG)).reshape(-1, 100) + bump
    small = torch.zeros(3) if zero else torch.tensor([1.0, 2.0, 3.0]) + bump
    return {"model": model, "extra": {"big": big, "small": small, "count": "" if zero else value}}


def _values_ok(sd: dict, rank: int, *, bump: float, value: str) -> bool:
    ok = all(torch.equal(sd["model"][f"layer{t}.weight"].to_local(), torch.full((ROWS, COLS), t * 100.0 + rank + bump))
             for t in range(TENSORS))
    tiny = sd["model"]["tiny.weight"]
    rows = 1 if rank < tiny.device_mesh.size() - 1 else 0
    ok &= torch.equal(tiny.to_local(), torch.full((rows, COLS), 50.0 + rank + bump))
    ok &= torch.equal(sd["extra"]["big"], torch.arange(float(BIG)).reshape(-1, 100) + bump)
    ok &= torch.equal(sd["extra"]["small"], torch.tensor([1.0, 2.0, 3.0]) + bump)
    return ok and sd["extra"]["count"] == value


class _PlanGather:
    """What rank 0 receives in DCP's plan step (its ``gather_object`` calls inside
    ``_DistWrapper.reduce_scatter``), and how many gathers DCP made there."""

    def __init__(self):
        import torch.distributed as tdist

        self.tdist, self.real = tdist, tdist.gather_object
        self.largest, self.calls = 0, 0

    def __enter__(self):
        import pickle
        import sys

        def spy(*a, **kw):
            out = self.real(*a, **kw)
            f, frames = sys._getframe(1), []
            while f is not None and len(frames) < 12:
                frames.append(f.f_code.co_name)
                f = f.f_back
            if "reduce_scatter" in frames:
                self.calls += 1
                got = kw.get("object_gather_list", a[1] if len(a) > 1 else None)
                if got:
                    self.largest = max(self.largest, max(len(pickle.dumps(o)) for o in got))
            return out

        self.tdist.gather_object = spy
        return self

    def __exit__(self, *exc):
        self.tdist.gather_object = self.real


def fresh_save(rank, world_size, url, work):
    from cloudckpt import Checkpointer

    with Checkpointer(work_dir=work) as ck, _PlanGather() as g:
        ck.save(f"{url}/step1", _state(world_size, zero=False))
    return {"largest": g.largest, "calls": g.calls}


def resume_and_save(rank, world_size, url, work, *, bump=1.0, wider=False, value="seven"):
    """A new job: load step 1, change the values (and the structure, with ``wider``), save steps 2 and 3."""
    from cloudckpt import Checkpointer

    with Checkpointer(work_dir=work) as ck:
        sd = _state(world_size, zero=True)
        ck.load(f"{url}/step1", sd)
        loaded_ok = _values_ok(sd, rank, bump=0.0, value="seven")
        new = _state(world_size, zero=False, bump=bump, wider=wider, value=value)
        with _PlanGather() as g, _PartReads() as reads:
            ck.save(f"{url}/step2", new)
            ck.save(f"{url}/step3", new)  # a later save keeps the loaded step's plan
    return {"loaded_ok": loaded_ok, "largest": g.largest, "calls": g.calls, "part_reads": reads.n}


class _PartReads:
    """How many DCP index parts this process reads from the store."""

    def __enter__(self):
        from cloudckpt.checkpoint import committed

        self.mod, self.real, self.n = committed, committed.read_checked, 0

        def counting(*a, **kw):
            self.n += kw.get("what") == "DCP index part"
            return self.real(*a, **kw)

        committed.read_checked = counting
        return self

    def __exit__(self, *exc):
        self.mod.read_checked = self.real


def load_back(rank, world_size, url, bump, value):
    from cloudckpt import Checkpointer

    with Checkpointer(work_dir=os.path.join(os.environ["TMPDIR_LOAD"], f"r{rank}")) as ck:
        ok = True
        for name in ("step2", "step3"):
            sd = _state(world_size, zero=True)
            ck.load(f"{url}/{name}", sd)
            ok &= _values_ok(sd, rank, bump=bump, value=value)
    return ok


def _stock_load(folder: str, bump: float, value: str, world_size: int) -> None:
    """Stock DCP, one process, reads the downloaded step whole (every shard assembled)."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": {**{f"layer{t}.weight": torch.zeros(world_size * ROWS, COLS) for t in range(TENSORS)},
                    "tiny.weight": torch.zeros(world_size - 1, COLS)},
          "extra": {"big": torch.zeros(BIG // 100, 100), "small": torch.zeros(3), "count": ""}}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(folder, "model_and_optim")), no_dist=True)
    for t in range(TENSORS):
        want = torch.cat([torch.full((ROWS, COLS), t * 100.0 + r + bump) for r in range(world_size)])
        assert torch.equal(sd["model"][f"layer{t}.weight"], want), t
    want = torch.cat([torch.full((1, COLS), 50.0 + r + bump) for r in range(world_size - 1)])
    assert torch.equal(sd["model"]["tiny.weight"], want)
    assert torch.equal(sd["extra"]["big"], torch.arange(float(BIG)).reshape(-1, 100) + bump)
    assert torch.equal(sd["extra"]["small"], torch.tensor([1.0, 2.0, 3.0]) + bump)
    assert sd["extra"]["count"] == value


def _metadata_etag(bucket: str, key: str) -> str:
    import boto3

    return boto3.client("s3").head_object(Bucket=bucket[len("s3://"):], Key=key)["ETag"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_first_save_after_a_resume_gathers_no_plans_and_loads_bit_exact(s3_bucket, tmp_path, world_size):
    from cloudckpt.ops import download

    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    env["TMPDIR_LOAD"] = str(tmp_path / "load")
    url = f"{s3_bucket}/run"
    fresh = run_ranks(world_size, fresh_save, url, str(tmp_path / "w1"), env=env)
    resumed = run_ranks(world_size, resume_and_save, url, str(tmp_path / "w2"), env=env)
    assert all(r["loaded_ok"] for r in resumed)
    # a first save: planned by owners, who decline (the 2.4 MB replicated tensor is written in balanced
    # pieces) before DCP gathers anything (it runs with no collective there), then every plan gathered
    assert fresh[0]["calls"] == 1 and fresh[0]["largest"] > 5_000, fresh[0]
    # both saves agree by all_reduces: DCP runs with no collective, rank 0 gathers no plan or tag
    assert resumed[0]["calls"] == 0 and resumed[0]["largest"] == 0, resumed[0]
    assert all(r["part_reads"] == 0 for r in resumed), resumed  # each rank's own part: the one the load read
    # the .metadata of the loaded step, copied in the store: the same bytes (the same MD5 ETag)
    assert _metadata_etag(s3_bucket, "run/step2/model_and_optim/.metadata") == \
        _metadata_etag(s3_bucket, "run/step1/model_and_optim/.metadata")
    assert all(run_ranks(world_size, load_back, url, 1.0, "seven", env=env))
    for name in ("step2", "step3"):
        download(f"{url}/{name}", str(tmp_path / "dl" / name))
        _stock_load(str(tmp_path / "dl" / name), 1.0, "seven", world_size)


def test_a_value_that_grew_moves_the_results_and_the_metadata_is_rebuilt_from_the_loaded_one(s3_bucket, tmp_path):
    from cloudckpt.ops import download

    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    env["TMPDIR_LOAD"] = str(tmp_path / "load")
    url = f"{s3_bucket}/run"
    run_ranks(2, fresh_save, url, str(tmp_path / "w1"), env=env)
    big = "x" * 5000  # longer than "seven": rank 0's value item moves every later item of its file
    resumed = run_ranks(2, _resume_value, url, str(tmp_path / "w2"), big, env=env)
    assert resumed[0]["largest"] < 400, resumed[0]  # still no plan gathered
    assert _metadata_etag(s3_bucket, "run/step2/model_and_optim/.metadata") != \
        _metadata_etag(s3_bucket, "run/step1/model_and_optim/.metadata")
    assert all(run_ranks(2, load_back, url, 1.0, big, env=env))
    download(f"{url}/step2", str(tmp_path / "dl" / "step2"))
    _stock_load(str(tmp_path / "dl" / "step2"), 1.0, big, 2)


def _resume_value(rank, world_size, url, work, value):
    return resume_and_save(rank, world_size, url, work, value=value)


def _resume_wider(rank, world_size, url, work):
    return resume_and_save(rank, world_size, url, work, wider=True)


def load_wider(rank, world_size, url):
    from cloudckpt import Checkpointer

    with Checkpointer(work_dir=os.path.join(os.environ["TMPDIR_LOAD"], f"r{rank}")) as ck:
        sd = _state(world_size, zero=True, wider=True)
        ck.load(f"{url}/step2", sd)
        return all(torch.equal(sd["model"][f"layer{t}.weight"].to_local(), torch.full((ROWS, COLS + 1),
                                                                                    t * 100.0 + rank + 1.0))
                   for t in range(TENSORS))


def test_a_changed_structure_falls_back_to_a_first_save(s3_bucket, tmp_path):
    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    env["TMPDIR_LOAD"] = str(tmp_path / "load")
    url = f"{s3_bucket}/run"
    run_ranks(2, fresh_save, url, str(tmp_path / "w1"), env=env)
    resumed = run_ranks(2, _resume_wider, url, str(tmp_path / "w2"), env=env)
    # a rank's state differs (an all_reduce of a byte); the owners declined (the replicated tensor;
    # DCP gathers nothing there); every plan gathered; step 3 from DCP's plan cache
    assert resumed[0]["calls"] == 2 and resumed[0]["largest"] > 5_000, resumed[0]
    assert all(run_ranks(2, load_wider, url, env=env))


def _resume_one_rank_whole(rank, world_size, url, work, whole_rank, planned=False):
    """A new job loads step 1; rank ``whole_rank`` keeps no structure of it (as when it
    could not read it), the other ranks do; then both save steps 2 and 3. ``planned``:
    the job had saved with DCP's plan cache before (no save of it is planned by owners)."""
    from cloudckpt import Checkpointer

    with Checkpointer(work_dir=work) as ck:
        sd = _state(world_size, zero=True)
        ck.load(f"{url}/step1", sd)
        ck._writer._planned = planned
        if rank == whole_rank:
            ck._writer._loaded = None
        new = _state(world_size, zero=False, bump=1.0)
        with _PlanGather() as g:
            ck.save(f"{url}/step2", new)
            ck.save(f"{url}/step3", new)
    return {"largest": g.largest, "calls": g.calls}


@pytest.mark.parametrize("whole_rank, planned", [(0, False), (1, False), (1, True)])
def test_ranks_that_disagree_on_the_loaded_structure_all_save_as_a_first_save(s3_bucket, tmp_path, whole_rank,
                                                                               planned):
    from cloudckpt.ops import download

    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    env["TMPDIR_LOAD"] = str(tmp_path / "load")
    url = f"{s3_bucket}/run"
    run_ranks(2, fresh_save, url, str(tmp_path / "w1"), env=env)
    got = run_ranks(2, _resume_one_rank_whole, url, str(tmp_path / "w2"), whole_rank, planned, env=env)
    # one byte all_reduced says they disagree: step 2 planned by owners, who decline (the replicated
    # tensor; DCP gathers nothing there), then from every plan (with ``planned``: from every plan at
    # once, DCP's collectives on every rank); step 3 from DCP's plan cache
    assert got[0]["calls"] == 2 and got[0]["largest"] > 5_000, got[0]
    assert all(run_ranks(2, load_back, url, 1.0, "seven", env=env))
    download(f"{url}/step3", str(tmp_path / "dl" / "step3"))
    _stock_load(str(tmp_path / "dl" / "step3"), 1.0, "seven", 2)
