"""cloudckpt under the real megatron-core (0.19.2, its own venv .venv-megatron), 2 gloo ranks on CPU:

- a sharded state dict (a dim-0 split ShardedTensor, a replicated float64 one, a
  ShardedTensorFactory, one ShardedObject per rank, common state) saved through
  ``cloudckpt.integrations.megatron.save`` to SeaweedFS is a committed step whose manifest
  lists Megatron's ``metadata.json``, and loads back bit for bit at 2 ranks, at 1 (2 -> 1)
  and saved at 1, at 2 (1 -> 2);
- no rank gathers every rank's plan: a first save is planned by owners, the next one and
  the first save after a load follow the step's structure (what rank 0 receives in DCP's
  plan step is counted);
- Megatron's own ``dist_checkpointing.load`` (its default strategy) reads our step after
  ``cloudckpt download`` (2 -> 2 and 2 -> 1), and its ``.metadata`` equals, entry for
  entry, the one Megatron's own save writes (also with ``keep_only_main_replica=False``);
  a folder Megatron's own ``dist_checkpointing.save`` wrote is imported by
  ``import_folder`` as a step that verifies;
- a tiny GPTModel (local layer spec) saved at tensor parallel 2 and loaded at 1 gives the
  same logits, saved at pipeline parallel 2 and loaded at 1 the same weights and logits
  (slow);
- a GPT training run (train_gpt.py: Megatron's DDP, optimizer and RNG tracker) SIGKILLed
  after a committed save resumes from SeaweedFS bit-exact;
- bad URLs and unusable stores fail both ranks together with one typed error; rank 1
  receives no global Metadata at the end of a save;
- Megatron's ``strict`` handling, ``load_sharded_metadata`` / ``load_tensors_metadata`` and
  its error types, as Megatron's own unit tests check them.

tests/integrations/megatron/mcore_tool.py runs each side, on a pool of 2 ranks that
imports Megatron once per session (megatron_pool.py; each command gets a new gloo
process group of its own world size); train_gpt.py is started one process per rank, as
torchrun does, and SIGKILLed. The venv is built by scripts/setup_megatron_venv.sh
(idempotent, ~2 min on a fresh machine); a failed install FAILS these tests with pip's log.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.testing.servers import free_port

from .megatron_pool import McorePool, PoolError
from .venvs import REPO, diff, load, venv_python

TRAIN = Path(__file__).parent / "megatron" / "train_gpt.py"


@pytest.fixture(scope="session")
def megatron_python() -> str:
    return venv_python("setup_megatron_venv.sh", ".venv-megatron", "megatron-core")


@pytest.fixture(scope="session")
def mcore_pool(megatron_python, seaweed, tmp_path_factory) -> McorePool:
    """2 ranks with Megatron imported, shared by every test of the session (megatron_pool.py)."""
    units = Path(__file__).parent / "megatron_units"  # bridge_tool, for the "bridge" command
    env = _env(**seaweed.env(), PYTHONPATH=os.pathsep.join([str(REPO), str(units)]))
    pool = McorePool(megatron_python, env, tmp_path_factory.mktemp("mcore-pool") / "pool.log")
    yield pool
    pool.close()


def _env(**extra: str) -> dict:
    return dict(os.environ, **{"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                               "PYTHONWARNINGS": "ignore", **extra})


class Ranks:
    """``train_gpt.py`` started as ``torchrun`` would: one process per rank (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0's output is read line by line."""

    def __init__(self, py: str, tmp: Path, name: str, *args: str, world: int = 2):
        port = str(free_port())
        self.logs = [tmp / f"{name}.rank{r}.log" for r in range(world)]
        self.procs = []
        for r, log in enumerate(self.logs):
            with open(log, "w") as f:  # the child keeps its own copy of the descriptor
                self.procs.append(subprocess.Popen([py, str(TRAIN), *args], stdout=f, stderr=subprocess.STDOUT,
                                                   env=_env(RANK=str(r), WORLD_SIZE=str(world),
                                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))

    def output(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")

    def _fail(self, why: str):
        self.kill()
        logs = "\n".join(f"--- rank {r} ---\n{self.output(r)[-4000:]}" for r in range(len(self.procs)))
        pytest.fail(f"{why}\n{logs}")

    def wait(self, timeout: float = 240) -> str:
        """Every rank's exit (each must succeed); rank 0's output."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._fail(f"train_gpt.py did not finish within {timeout}s")
        if any(p.returncode for p in self.procs):
            self._fail(f"train_gpt.py failed: exit codes {[p.returncode for p in self.procs]}")
        return self.output()

    def kill_after(self, line: str, timeout: float = 240) -> str:
        """SIGKILL every rank as soon as rank 0 has printed ``line``; rank 0's output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if line in self.output().splitlines():
                self.kill()
                assert [p.returncode for p in self.procs] == [-signal.SIGKILL] * len(self.procs), \
                    [p.returncode for p in self.procs]
                return self.output()
            if any(p.poll() is not None for p in self.procs):
                self._fail(f"a rank exited before printing {line!r}")
            time.sleep(0.05)
        self._fail(f"no {line!r} within {timeout}s")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)


def mcore(pool: McorePool, tmp_path: Path, *args: str, saved_world: int | None = None, timeout: float = 240) -> str:
    """``mcore_tool.py`` ARGS run on the pool of Megatron ranks; every rank must succeed.
    Returns what the ranks printed, rank 0's first."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = {} if saved_world is None else {"SAVED_WORLD": str(saved_world)}
    try:
        got = pool.run([*args, "--work", str(work)], env=env, timeout=timeout)
    except PoolError as e:
        pytest.fail(f"mcore_tool {' '.join(args)}: {e}")
    ranks = sorted(got["ranks"].items(), key=lambda kv: int(kv[0]))
    if not got["ok"]:
        outs = "\n".join(f"--- rank {r}: {a['status']} ---\n{a['out'][-4000:]}" for r, a in ranks)
        pytest.fail(f"mcore_tool {' '.join(args)} failed:\n{outs}\n--- the pool's log ---\n{pool.tail(3000)}")
    return "".join(a["out"] for _, a in ranks)


def test_megatron_sharded_state_saved_to_s3_loads_back_exactly_at_2_and_1_ranks(mcore_pool, s3_bucket, tmp_path):
    """... and no rank gathers every rank's plan: the first save is planned by owners (DCP
    runs with no collective there: rank 0 gathers no plan, where Megatron's planner brought
    it rank 1's whole plan), rank 1 receives no global Metadata at the end (its largest
    broadcast under 2 KB), and the same Checkpointer's next save follows the first one's
    structure (nothing gathered either: the ranks agree by all_reduces), as does the
    first save after a load (planned from the loaded step); every step loads."""
    url, again, resaved = (f"{s3_bucket}/run/iter_00000{n}" for n in (10, 11, 12))
    out = mcore(mcore_pool, tmp_path, "save", url, "--world", "2", "--extra", "200", "--again")
    for n in (0, 1):
        bcast = re.search(rf"^SAVE {n} RANK 1 LARGEST BROADCAST (\d+)$", out, re.M)
        plan = re.search(rf"^SAVE {n} RANK 0 LARGEST PLAN GATHERED (\d+) KEPT (\w+)$", out, re.M)
        assert bcast and plan, out[-2000:]
        # the first save is planned by owners, the next from its structure: DCP gathers nothing in either
        assert 0 < int(bcast.group(1)) < 2048 and int(plan.group(1)) == 0, (n, bcast.group(0), plan.group(0))
        assert plan.group(2) == "SavedStructure", plan.group(0)  # what the owners' path keeps for the next save
    for step in (url, again):
        r = subprocess.run([sys.executable, "-m", "cloudckpt", "verify", step], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    out = mcore(mcore_pool, tmp_path, "load", url, resaved, "--world", "2", "--extra", "200")
    plan = re.search(r"^SAVE AFTER LOAD RANK 0 LARGEST PLAN GATHERED (\d+) KEPT (\w+)$", out, re.M)
    assert "LOADED OK" in out and plan, out[-2000:]
    assert int(plan.group(1)) == 0 and plan.group(2) == "LoadedStructure", plan.group(0)
    for step in (url, again, resaved):
        assert "LOADED OK" in mcore(mcore_pool, tmp_path, "load", step, "--world", "1", "--extra", "200",
                                    saved_world=2)


def test_megatron_saved_at_1_rank_loads_resharded_at_2(mcore_pool, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run/iter_0000001"
    mcore(mcore_pool, tmp_path, "save", url, "--world", "1")
    assert "LOADED OK" in mcore(mcore_pool, tmp_path, "load", url, "--world", "2", saved_world=1)


def _same_metadata(ours_path: Path, stock_path: Path) -> None:
    """Our ``.metadata`` unpickles to the ``Metadata`` Megatron's own save writes for the
    same state, field by field: the same entries (type, properties, size, chunks in DCP's
    order), no planner data, the same version, the same items stored (their files may
    differ); and not Megatron's copy of every rank's plan (``all_local_plans``)."""
    import pickle

    ours, stock = (pickle.loads(p.read_bytes()) for p in (ours_path, stock_path))
    assert type(ours) is type(stock)
    assert ours.planner_data is None and stock.planner_data is None
    assert ours.version == stock.version
    assert sorted(ours.state_dict_metadata) == sorted(stock.state_dict_metadata)
    for fqn, entry in stock.state_dict_metadata.items():
        assert ours.state_dict_metadata[fqn] == entry, (fqn, ours.state_dict_metadata[fqn], entry)
    assert {(i.fqn, tuple(i.offset or ())) for i in ours.storage_data} == \
        {(i.fqn, tuple(i.offset or ())) for i in stock.storage_data}
    assert hasattr(stock, "all_local_plans") and not hasattr(ours, "all_local_plans")


def _download(url: str, dest: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "download", url, str(dest)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_megatron_own_loader_reads_our_step_after_download_and_its_metadata_is_megatrons(mcore_pool, s3_bucket,
                                                                                       tmp_path):
    """A step saved at 2 ranks (planned by owners, ``.metadata`` assembled in the store)
    is read by Megatron's own ``dist_checkpointing.load`` after ``cloudckpt download`` at 2
    ranks and at 1 (2 -> 1), bit for bit, and its ``.metadata`` is the one Megatron's own
    save writes for the same state (:func:`_same_metadata`). Saved with
    ``keep_only_main_replica=False`` (every rank plans the replicated tensor and the
    common state; Megatron's own planner refuses that setting), each replica is written
    once: the same ``.metadata`` entries, and it loads the same. Planned from every rank's
    plan gathered on rank 0 instead (DCP's global planning, how Megatron's saves were
    planned before), the same state's ``.metadata`` is equal in every field, where each
    item is stored included."""
    import pickle

    url, replicas, gathered = (f"{s3_bucket}/run/iter_00000{n}" for n in (20, 21, 22))
    stock = tmp_path / "stock"
    mcore(mcore_pool, tmp_path, "save", url, "--world", "2")
    mcore(mcore_pool, tmp_path, "save", replicas, "--world", "2", "--replicas")
    mcore(mcore_pool, tmp_path, "save", gathered, "--world", "2", "--gathered")
    mcore(mcore_pool, tmp_path, "save", str(stock), "--stock", "--world", "2")
    for step in (url, replicas, gathered):
        _download(step, tmp_path / "dl")
    ours, planned_on_0 = (pickle.loads((tmp_path / "dl" / s / "model_and_optim" / ".metadata").read_bytes())
                          for s in ("step20", "step22"))
    assert vars(ours) == vars(planned_on_0) and len(ours.storage_data) >= 8, (vars(ours), vars(planned_on_0))
    folder = tmp_path / "dl" / "step20" / "model_and_optim"  # the download keeps the step folder (named by its number)
    assert json.loads((folder / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                                  "sharded_backend_version": 1}
    for step in ("step20", "step21"):
        _same_metadata(tmp_path / "dl" / step / "model_and_optim" / ".metadata", stock / ".metadata")
    assert "LOADED OK" in mcore(mcore_pool, tmp_path, "load", str(folder), "--stock", "--world", "2")
    assert "LOADED OK" in mcore(mcore_pool, tmp_path, "load", str(folder), "--stock", "--world", "1",
                                saved_world=2)
    assert "LOADED OK" in mcore(mcore_pool, tmp_path, "load", str(tmp_path / "dl" / "step21" / "model_and_optim"),
                                "--stock", "--world", "2")


def test_megatron_own_save_is_imported_by_import_folder_as_a_verified_step(mcore_pool, s3_bucket, tmp_path):
    """A folder Megatron's own ``dist_checkpointing.save`` wrote (2 gloo ranks) becomes a
    committed step whose checksums verify (``import_folder`` is megatron_folders'
    ``import_iteration``, whose tests load such a step bit for bit)."""
    src = tmp_path / "stock"
    mcore(mcore_pool, tmp_path, "save", str(src), "--stock", "--world", "2")
    assert (src / "metadata.json").is_file() and (src / ".metadata").is_file()
    url = f"{s3_bucket}/imported/iter_0000005"
    assert f"IMPORTED {url}" in mcore(mcore_pool, tmp_path, "import", str(src), url)
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "verify", url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr


def test_megatron_gpt_training_killed_after_a_committed_save_resumes_from_s3_bit_exact(megatron_python, mcore_pool,
                                                                                      s3_bucket, tmp_path):
    """train_gpt.py: a tiny GPTModel at tensor parallel 2 on 2 gloo ranks, Megatron's DDP and
    optimizer, dropout drawing from Megatron's tensor-parallel RNG tracker, data from numpy's
    and python's RNGs. One run (2 processes of its own) is SIGKILLed right after its step 4
    is committed to SeaweedFS; the rerun of the same command (2 new processes) resumes from
    the bucket and its losses of steps 5 and 6, weights, optimizer state and every RNG
    state equal bit for bit those of a run that was never interrupted (run beside the
    killed one, on the pool's ranks: train_gpt's ``main`` seeds every RNG it uses)."""
    folder, work = f"{s3_bucket}/gpt-run", str(tmp_path / "work")
    common = ["--steps", "6", "--save-interval", "2", "--work", work]
    with concurrent.futures.ThreadPoolExecutor(1) as beside:
        whole = beside.submit(mcore, mcore_pool, tmp_path, "train", "--world", "2", "--train", "--save",
                              f"{s3_bucket}/whole", "--save-interval", "100", "--steps", "6", "--work", work,
                              "--out", str(tmp_path / "whole"))
        killed = Ranks(megatron_python, tmp_path, "killed", "--save", folder, *common, "--step-seconds", "1")
        out = killed.kill_after("COMMITTED 4")
        assert "rank 0 step 4 loss" in out and "step 5" not in out.split("COMMITTED 4")[0], out[-2000:]
        assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [2, 4]
        assert "rank 0 step 6 loss" in whole.result(), "the uninterrupted run did not reach step 6"
    out = Ranks(megatron_python, tmp_path, "resumed", "--save", folder, *common, "--out", str(tmp_path / "resumed")
                ).wait()
    assert "RESUMED 4" in out and "step 1 loss" not in out, out[-2000:]
    for r in range(2):
        a, b = load(tmp_path / "whole" / f"rank{r}.pt"), load(tmp_path / "resumed" / f"rank{r}.pt")
        assert sorted(b["losses"]) == [5, 6] and [a["losses"][s] for s in (5, 6)] == [b["losses"][s] for s in (5, 6)], \
            (a["losses"], b["losses"])
        assert len(a["optimizer"]["state"]) >= 20, "no optimizer state to compare"
        assert len(a["rng"]["tracker"]) >= 2, a["rng"]["tracker"].keys()
        assert not diff({k: a[k] for k in ("model", "optimizer", "rng")},
                        {k: b[k] for k in ("model", "optimizer", "rng")}), \
            diff({k: a[k] for k in ("model", "optimizer", "rng")}, {k: b[k] for k in ("model", "optimizer", "rng")})


@pytest.mark.slow  # ~60 s on 2 cores: Megatron's model code imports and builds in three runs
def test_megatron_gpt_saved_at_tensor_or_pipeline_parallel_2_loads_at_1_with_the_same_logits(mcore_pool,
                                                                                            s3_bucket, tmp_path):
    """A tiny GPTModel saved at tensor parallel 2 loads at 1 with the same logits (to
    1e-5: the split matmuls sum in another order). Saved with its two layers on two
    pipeline stages (stage 1's ``decoder.layers.0`` is layer 1), it loads at 1 with every
    weight equal bit for bit to the stage that saved it, and the logits of a fixed batch
    (the stages' forward, hidden states sent from stage 0 to 1) equal. One process loads
    both steps into the same model."""
    tp_url, pp_url = f"{s3_bucket}/gpt/iter_0000003", f"{s3_bucket}/gpt/iter_0000004"
    tp2, pp2, one = tmp_path / "tp2.pt", tmp_path / "pp2.pt", tmp_path / "one.pt"
    mcore(mcore_pool, tmp_path, "gpt-save", tp_url, "--world", "2", "--out", str(tp2))
    mcore(mcore_pool, tmp_path, "gpt-save", pp_url, "--world", "2", "--pp", "2", "--out", str(pp2))
    mcore(mcore_pool, tmp_path, "gpt-load", tp_url, pp_url, "--world", "1", "--out", str(one))
    saved, loaded = load(tp2), load(one)
    assert saved.shape == loaded.shape == (2, 8, 64)
    assert torch.allclose(saved, loaded, atol=1e-5, rtol=0), (saved - loaded).abs().max()

    saved, loaded = load(pp2), load(Path(f"{one}.2"))
    assert saved.shape == loaded.shape == (2, 8, 64) and torch.equal(saved, loaded), (saved - loaded).abs().max()
    stages = [load(Path(f"{pp2}.rank{r}")) for r in range(2)]
    whole = {k: v for k, v in load(Path(f"{one}.2.rank0")).items() if isinstance(v, torch.Tensor)}
    renamed = {k.replace("decoder.layers.0.", f"decoder.layers.{r}."): v
               for r, stage in enumerate(stages) for k, v in stage.items() if isinstance(v, torch.Tensor)}
    assert sorted(renamed) == sorted(whole) and "output_layer.weight" in whole, sorted(renamed.keys() ^ whole.keys())
    assert not diff(renamed, whole), diff(renamed, whole)


def test_megatron_bad_url_or_unusable_store_fails_every_rank_together_with_a_typed_error(mcore_pool, s3_bucket,
                                                                                       tmp_path):
    """On 2 gloo ranks, each within seconds and with the same error type on both ranks (no
    rank left waiting in a collective): a bucket that does not exist, a store that does
    not answer (Transient, from the first request), a store that does not answer one rank
    only (the other rank's uploads succeed: every rank still raises SaveFailed naming rank
    1, and nothing is committed), a step that does not exist, an unknown URL scheme, a
    folder without a step number. A rank left waiting in a collective would wait
    ``collective_timeout`` (600 s) and fail the run's time limit."""
    missing = "s3://cloudckpt-no-such-bucket-" + tmp_path.name.lower().replace("_", "-")[-20:]
    out = mcore(mcore_pool, tmp_path, "fail", s3_bucket, missing, "--world", "2", "--dead-port",
                str(free_port()), timeout=180)
    got: dict = {}
    for m in re.finditer(r"^CASE (\S+) rank (\d) ([\d.]+)s (\w+)(.*)$", out, re.M):
        got.setdefault(m.group(1), {})[int(m.group(2))] = (m.group(4), float(m.group(3)), m.group(5))
    want = {"missing-bucket": "BucketNotFound", "unreachable-store": "Transient",
            "one-rank-store-unreachable": "SaveFailed", "no-such-step": "MegatronNotACheckpoint",
            "unknown-scheme": "InvalidURL", "no-step-number": "ConfigError"}
    assert {name: {r: v[0] for r, v in ranks.items()} for name, ranks in got.items()} == \
        {name: {0: t, 1: t} for name, t in want.items()}, got
    assert max(s for ranks in got.values() for _, s, _ in ranks.values()) < 30, got
    assert "rank 1" in got["one-rank-store-unreachable"][0][2], got["one-rank-store-unreachable"]
    assert "127.0.0.1" in got["unreachable-store"][1][2], got["unreachable-store"]
    assert not Checkpointer.contains_checkpoint(f"{s3_bucket}/run")


MEGATRON_ERROR = ["CheckpointingException", "CollectiveError"]  # MegatronCheckFailed: both at once


def _strict_seen_by(rank: int, got: dict) -> None:
    """mcore_tool's ``strict`` cases as rank ``rank`` saw them (the test below)."""
    base, fewer = ["ObjA", "ObjB", "TenA", "TenB"], ["ObjA", "TenB"]
    ten_b = [10 * rank, 10 * rank + 1, 10 * rank + 2]

    def case(name: str) -> dict:
        assert name in got, (rank, name, sorted(got))
        return got[name]

    def loaded(name: str, keys: list) -> dict:
        c = case(name)
        assert "raised" not in c and c["keys"] == keys and c["TenB"] == ten_b, (rank, name, c)
        return c

    def raised(name: str, kinds: list, *words: str, absent: str = "") -> None:
        c = case(name)
        assert c.get("raised") == kinds, (rank, name, c)
        assert all(w in c["message"] for w in words) and (not absent or absent not in c["message"]), \
            (rank, name, words, c["message"])

    raised("unexpected ASSUME_OK_UNEXPECTED", ["CheckpointException", "MissingKeys"], "UnexpectedTenD")
    for mode in ("RAISE_UNEXPECTED", "RAISE_ALL"):
        raised(f"unexpected {mode}", MEGATRON_ERROR, "Unexpected keys", "UnexpectedTenD", "UnexpectedObjD",
               absent="Missing keys")
    for mode in ("LOG_UNEXPECTED", "LOG_ALL"):
        c = loaded(f"unexpected {mode}", base)
        assert "Unexpected keys" in c["logged"] and "UnexpectedTenD" in c["logged"], (rank, mode, c)
    for mode in ("RETURN_UNEXPECTED", "RETURN_ALL"):
        c = loaded(f"unexpected {mode}", base)
        assert (c["missing"], c["unexpected"]) == ([], ["UnexpectedObjD", "UnexpectedTenD"]), (rank, mode, c)
    loaded("unexpected IGNORE_ALL", base)

    for mode in ("ASSUME_OK_UNEXPECTED", "RAISE_UNEXPECTED", "LOG_UNEXPECTED", "IGNORE_ALL"):
        loaded(f"missing {mode}", fewer)
    raised("missing RAISE_ALL", MEGATRON_ERROR, "Missing keys", "TenA", "ObjB", absent="Unexpected keys")
    c = loaded("missing LOG_ALL", fewer)
    assert "Missing keys" in c["logged"] and "ObjB" in c["logged"], (rank, c)
    c = loaded("missing RETURN_UNEXPECTED", fewer)
    assert (c["missing"], c["unexpected"]) == ([], []), (rank, c)
    c = loaded("missing RETURN_ALL", fewer)
    assert (c["missing"], c["unexpected"]) == (["ObjB", "TenA"], []), (rank, c)

    assert case("load of the sharded metadata") == {"ObjA": [0, 1, 2, 3], "ObjB": [{"by": 0}, {"by": 1}],
                                                    "TenA": [0, 1], "TenB": [0, 1, 2, 10, 11, 12]}, rank
    raised("no such step", ["CheckpointingException", "NotACheckpoint"], "is not a distributed checkpoint")
    raised("global shape mismatch", MEGATRON_ERROR, "global shape mismatch", "TenB")
    raised("remove_sharded_tensors", ["ConfigError"], "never rewritten")
    # saved: arange(8) over 2 ranks; asked: 3 or 5 elements a rank; what lies beyond is zeros
    assert case("allow_shape_mismatch smaller") == [[0, 1, 2], [3, 4, 5]][rank], rank
    assert case("allow_shape_mismatch larger") == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 0]][rank], rank


def test_megatron_strict_handling_metadata_readers_and_error_types_behave_as_megatrons_own(mcore_pool, s3_bucket,
                                                                                           tmp_path):
    """What Megatron's own ``TestNonStrictLoad`` and ``test_load_error_msg`` check, on a
    cloudckpt step at 2 ranks (``mcore_tool.py strict``): each ``StrictHandling`` with two
    unexpected keys (a tensor and an object the step does not hold) and with two missing
    ones (held by the step, not asked for): ``RAISE_*`` fail every rank with an error that
    is Megatron's ``CheckpointingException`` and cloudckpt's CollectiveError, naming the
    keys; ``LOG_*`` log them and load; ``RETURN_*`` return them; the default
    (``ASSUME_OK_UNEXPECTED``) fails an unexpected key as Megatron's load does, with DCP's
    ``CheckpointException`` (and cloudckpt's MissingKeys). ``load_sharded_metadata`` /
    ``load_tensors_metadata`` list the step's keys on one process alone, and what they
    return loads; a step that does not exist is NotACheckpoint and
    ``CheckpointingException``; a global shape mismatch is ``CheckpointingException``,
    unless the target allows it (``allow_shape_mismatch``: the overlap is read, zeros
    elsewhere); ``remove_sharded_tensors`` is refused (a committed step is never rewritten)."""
    url = f"{s3_bucket}/strict/iter_0000030"
    out = mcore(mcore_pool, tmp_path, "strict", url, "--world", "2")
    seen = {int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(r"^STRICT (\d) (.*)$", out, re.M)}
    assert sorted(seen) == [0, 1], out[-3000:]
    for rank, got in seen.items():
        _strict_seen_by(rank, got)
    assert seen[0]["sharded metadata"] == {
        "keys": ["ObjA/shard_0_1", "ObjB/shard_0.0_1.2", "ObjB/shard_0.1_1.2", "TenA", "TenB",
                 "common_state/shard_0_1"],
        "base keys": ["ObjA", "ObjB", "TenA", "TenB", "common_state"]}, seen[0]["sharded metadata"]
    assert seen[0]["tensors metadata"] == {"TenA": [[2], "torch.int64"], "TenB": [[6], "torch.int64"]}, \
        seen[0]["tensors metadata"]
