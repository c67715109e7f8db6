"""A job's true first save is planned by owners (dcp/owners.py): no rank gathers every
rank's plan or write results, and DCP's ``.metadata`` is assembled in the store from
every rank's fragment (checkpoint/rank_writer.py).

On real gloo ranks against SeaweedFS, one run a world size: 2 ranks save step 1 fresh
(sharded, uneven, column-sharded and replicated DTensors, a plain tensor every rank
holds, plain values); DCP gathers no plan (it runs with no collective). Saves that
fail (a piece's upload, the complete, a rank's fragment, one rank's shard files) raise
on every rank and leave nothing visible at
step 2 and no pending upload; the job's next save, planned from step 1's structure
(no plan gathered either), commits, and so does one whose value grew (its write results
moved: rank 0 writes ``.metadata`` from step 1's with them).
3 ranks load step 1 (resharded) bit for bit and save step 4 fresh (another world size:
planned by owners again). One process then loads steps 1 and 4 with ours, and stock
``dcp.load`` reads the downloaded folders; each assembled ``.metadata`` unpickles to
the ``Metadata`` stock ``dcp.save`` writes for the same state, field by field (the
storage entries name other files: which rank writes a replicated item differs)."""

from __future__ import annotations

import os
import pickle

import torch

from cloudckpt.testing.multiprocess import run_ranks

from .test_first_save_resume import _PlanGather

FULL = {  # every tensor's full value: the same whatever the world size
    "model.layer0.w": torch.arange(72.0).reshape(12, 6),  # Shard(0), even on 2 and 3 ranks
    "model.layer1.w": torch.arange(72.0, 93.0).reshape(7, 3),  # Shard(0), uneven
    "model.layer2.w": torch.arange(4.0) - 9,  # (1, 4) Shard(0): one rank holds it all, the others empty chunks
    "model.cols": torch.arange(10.0).reshape(2, 5) * 3,  # Shard(1), uneven
    "model.bias": torch.arange(5.0) + 0.5,  # Replicate(): every rank holds it whole
    "optim.moment": torch.arange(6.0) * 2,  # a plain tensor every rank holds
}


NAMES = ["a", "b"]
GROWN = ["a" * 5000, "b"]  # a value whose bytes grew: every later item of its file moves


def _state(world: int, *, zero: bool = False, names: list = NAMES) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = {k: torch.zeros_like(v) if zero else v.clone() for k, v in FULL.items()}
    full["model.layer2.w"] = full["model.layer2.w"].reshape(1, 4)
    places = {"model.layer0.w": Shard(0), "model.layer1.w": Shard(0), "model.layer2.w": Shard(0),
              "model.cols": Shard(1), "model.bias": Replicate()}
    model = {k.split(".", 1)[1]: distribute_tensor(full[k], mesh, [p]) for k, p in places.items()}
    return {"model": model, "optim": {"moment": full["optim.moment"], "step": 0 if zero else 12,
                                      "names": [] if zero else list(names)}}


def _full(sd: dict) -> dict:
    from torch.distributed.tensor import DTensor

    out = {f"model.{k}": (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd["model"].items()}
    out["model.layer2.w"] = out["model.layer2.w"].reshape(4)
    out["optim.moment"] = sd["optim"]["moment"]
    return out


def _exact(sd: dict, names: list = NAMES) -> bool:
    got = _full(sd)
    return all(torch.equal(got[k], v) for k, v in FULL.items()) and sd["optim"]["step"] == 12 \
        and sd["optim"]["names"] == names


def _failing(rank: int, how: str):
    """A context in which this rank's part of the assembly fails as ``how`` says."""
    import contextlib

    from cloudckpt.checkpoint import rank_writer
    from cloudckpt.dcp.writer import UploadingWriter
    from cloudckpt.storage.s3 import S3Store

    def boom(*a, **k):
        raise RuntimeError(f"injected: {how} fails on rank {rank}")

    target = {"put_piece": (S3Store, "put_piece", 0), "complete": (S3Store, "_complete_assembly", 0),
              "fragment": (rank_writer, "fragment_of", 1), "write": (UploadingWriter, "_write_plan", 1)}[how]
    if rank != target[2]:
        return contextlib.nullcontext()
    return _patched(target[0], target[1], boom)


class _patched:
    def __init__(self, owner, name, value):
        self.owner, self.name, self.value = owner, name, value

    def __enter__(self):
        self.old = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.old)


def save_two(rank, world, url, work, stock_dir):
    """2 ranks: step 1 fresh; step 2 failing in the assembly three ways; step 3, the job's next save."""
    import torch.distributed.checkpoint as dcp

    from cloudckpt import Checkpointer
    from cloudckpt.errors import SaveFailed

    dcp.save(_state(world), checkpoint_id=stock_dir)  # stock DCP, for the comparison
    failed = {}
    with Checkpointer(work_dir=os.path.join(work, "a")) as ck:
        with _PlanGather() as first:
            ck.save(f"{url}/step1", _state(world))
        kept = ck._writer._loaded is not None  # step 1's structure, for the job's next saves
        for how in ("put_piece", "complete", "fragment", "write"):
            with Checkpointer(work_dir=os.path.join(work, how)) as other, _failing(rank, how):
                try:
                    other.save(f"{url}/step2", _state(world))
                except SaveFailed as e:
                    failed[how] = str(e)
        with _PlanGather() as later:
            ck.save(f"{url}/step3", _state(world))
            ck.save(f"{url}/step5", _state(world, names=GROWN))  # results moved: .metadata rebuilt on rank 0
        with _failing(rank, "write"):  # planned from step 5's structure, DCP uncollective: rank 1's write fails
            try:
                ck.save(f"{url}/step6", _state(world, names=GROWN))
            except SaveFailed as e:
                failed["kept write"] = str(e)
    return {"first": first.largest, "later": later.largest, "failed": failed, "kept": kept}


def load_and_save_three(rank, world, url, work, stock_dir):
    """3 ranks: step 1 loaded (resharded), then step 4 saved: a first save at this world size."""
    import torch.distributed.checkpoint as dcp

    from cloudckpt import Checkpointer

    dcp.save(_state(world), checkpoint_id=stock_dir)
    with Checkpointer(work_dir=work) as ck:
        sd = _state(world, zero=True)
        ck.load(f"{url}/step1", sd)
        ok = _exact(sd)
        with _PlanGather() as g:
            ck.save(f"{url}/step4", _state(world))
    return {"loaded": ok, "gathered": g.largest}


def _same_metadata(ours_path: str, stock_path: str) -> None:
    with open(ours_path, "rb") as f:
        ours = pickle.load(f)
    with open(stock_path, "rb") as f:
        stock = pickle.load(f)
    assert type(ours) is type(stock)
    assert ours.planner_data == stock.planner_data
    assert ours.version == stock.version
    assert ours.state_dict_metadata.keys() == stock.state_dict_metadata.keys()
    for fqn, entry in stock.state_dict_metadata.items():
        assert ours.state_dict_metadata[fqn] == entry, fqn  # type, properties, size, chunks in DCP's order
    assert {(i.fqn, tuple(i.offset or ())) for i in ours.storage_data} == \
        {(i.fqn, tuple(i.offset or ())) for i in stock.storage_data}


def _load_alone(url: str, work: str, names: list = NAMES) -> bool:
    from cloudckpt import Checkpointer

    sd = {"model": {k.split(".", 1)[1]: torch.zeros_like(v) for k, v in FULL.items() if k.startswith("model.")},
          "optim": {"moment": torch.zeros(6), "step": 0, "names": []}}
    sd["model"]["layer2.w"] = torch.zeros(1, 4)
    with Checkpointer(work_dir=work, distributed=False) as ck:
        ck.load(url, sd)
    return _exact(sd, names)


def _stock_load(folder: str, names: list) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {"model": {k.split(".", 1)[1]: torch.zeros_like(v) for k, v in FULL.items() if k.startswith("model.")},
          "optim": {"moment": torch.zeros(6), "step": 0, "names": []}}
    sd["model"]["layer2.w"] = torch.zeros(1, 4)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(folder, "model_and_optim")), no_dist=True)
    assert _exact(sd, names)


def test_a_first_save_is_planned_by_owners_assembled_in_the_store_and_loads_everywhere(s3_bucket, tmp_path):
    from cloudckpt import Checkpointer
    from cloudckpt.ops import download
    from cloudckpt.storage import open_store

    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    url = f"{s3_bucket}/run"
    two = run_ranks(2, save_two, url, str(tmp_path / "w2"), str(tmp_path / "stock2"), env=env)
    assert two[0]["first"] == 0, two[0]  # DCP gathers no plan: it runs with no collective
    assert all(r["kept"] for r in two)
    assert two[0]["later"] < 400, two[0]  # the job's next save: planned from step 1's structure, no plan
    # rank 1's shard files cannot be written ("write"): DCP runs with no collective there, yet rank 0
    # raises rank 1's error too, in the agreement that follows DCP's save
    for how in ("put_piece", "complete", "fragment", "write"):
        assert f"injected: {how} fails on rank" in two[0]["failed"].get(how, ""), (how, two[0]["failed"])
    assert "injected: write fails on rank 1" in two[0]["failed"].get("kept write", ""), two[0]["failed"]
    store = open_store(url)
    left = [e.url for e in store.list(f"{url}/step2/", delimiter=None) if not e.is_prefix]
    assert not left, f"a failed assembly left objects behind: {left}"
    assert not store.list_multipart_uploads(f"{url}/step2/")
    assert [s for s, _ in Checkpointer.find_checkpoints(url)] == [1, 3, 5]
    three = run_ranks(3, load_and_save_three, url, str(tmp_path / "w3"), str(tmp_path / "stock3"), env=env)
    assert all(r["loaded"] for r in three)  # 2 -> 3 ranks, bit for bit
    assert three[0]["gathered"] < 400, three[0]
    for name, stock, names in (("step1", "stock2", NAMES), ("step4", "stock3", NAMES), ("step3", "stock2", NAMES),
                               ("step5", "stock2", GROWN)):
        assert _load_alone(f"{url}/{name}", str(tmp_path / "one" / name), names), name  # -> 1 process
        download(f"{url}/{name}", str(tmp_path / "dl" / name))
        _stock_load(str(tmp_path / "dl" / name), names)
        _same_metadata(str(tmp_path / "dl" / name / "model_and_optim" / ".metadata"),
                       str(tmp_path / stock / ".metadata"))


def _die_mid_assembly(rank, world, url, work, report):
    """Step 1 committed; then a fresh job's save of step 2 in which rank 1 is killed as
    it sends its ``.metadata`` fragment to rank 0 (mid-assembly, the upload begun)."""
    import signal

    from cloudckpt import Checkpointer
    from cloudckpt.dist import Coordinator

    with Checkpointer(work_dir=os.path.join(work, "a"), collective_timeout=5) as ck:
        ck.save(f"{url}/step1", _state(world))
    with Checkpointer(work_dir=os.path.join(work, "b"), collective_timeout=5) as ck:
        if rank == 1:
            Coordinator.send_bytes = lambda self, data, dst: os.kill(os.getpid(), signal.SIGKILL)
        try:
            ck.save(f"{url}/step2", _state(world))
        except Exception as e:  # noqa: BLE001 - what the survivor raised is the finding
            with open(report, "w") as f:
                f.write(f"{type(e).__name__}: {e}")


def test_a_rank_killed_mid_assembly_leaves_no_step_and_the_committed_one_loads(s3_bucket, tmp_path):
    from cloudckpt import Checkpointer
    from cloudckpt.storage import open_store
    from cloudckpt.testing.multiprocess import RankFailed

    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    url, report = f"{s3_bucket}/run", str(tmp_path / "report")
    try:
        run_ranks(2, _die_mid_assembly, url, str(tmp_path / "w"), report, env=env, timeout=120)
    except RankFailed as e:
        assert list(e.failures) == [1] and "exit code -9" in e.failures[1], e.failures
    else:
        raise AssertionError("rank 1 was not killed")
    with open(report) as f:
        assert f.read().startswith("PeerLost"), "the survivor did not see its peer gone"
    assert [s for s, _ in Checkpointer.find_checkpoints(url)] == [1]  # step 2 never became visible
    store = open_store(url)
    assert not store.exists(f"{url}/step2/model_and_optim/.metadata")
    assert not store.list_multipart_uploads(f"{url}/step2/")  # rank 0 aborted the upload it began
    assert _load_alone(f"{url}/step1", str(tmp_path / "one"))  # nothing committed is lost
