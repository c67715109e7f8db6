"""cloudckpt and the real OLMo-core (ai2-olmo-core 3.0.0, its own venv) on one save folder,
local and SeaweedFS, 1 and 2 ranks:

- OLMo-core's Trainer saves (a 1M-parameter OLMo2 on CPU, gloo; 2 ranks with FSDP):
  cloudckpt finds, lists (FORMAT olmo-core) and loads bit-exactly what OLMo-core itself
  reads back (model, optimizer, every rank's train state with numpy's RNG state), on
  1 rank and on 2; `adopt` then `verify` passes and OLMo-core still finds and loads it.
- A folder both wrote: cloudckpt steps (and the `latest` pointer an earlier cloudckpt
  left on them), then a newer OLMo-core step; cloudckpt resumes from the OLMo-core step, goes on saving,
  prunes and gcs without touching it; then OLMo-core reads the step cloudckpt wrote
  after it, bit-exactly.
- A crafted OLMo-style step with a hostile global in `.metadata` or in the train state
  is refused (UnsafeCheckpoint) by load, resume, verify and adopt, and nothing runs.

OLMo-core runs in .venv-olmo, built by scripts/setup_olmo_venv.sh (idempotent; a
failed install FAILS these tests with pip's log, it is part of the suite), through
tests/integrations/olmo/olmo_tool.py, each command a process forked from one server per
module that imported torch and olmo_core once (tests/integrations/olmo/forkserver.py).
SeaweedFS's AWS_* environment is passed on: OLMo-core's boto3 client reads
AWS_ENDPOINT_URL. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from cloudckpt import CheckpointConfig, Checkpointer
from cloudckpt.checkpoint import discovery, layout, pointer
from cloudckpt.checkpoint.layout import ADOPTED_MANIFEST
from cloudckpt.errors import UnsafeCheckpoint
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls
from cloudckpt.testing.multiprocess import run_ranks
from cloudckpt.testing.servers import free_port

from .olmo import cc_ranks
from .olmo.forkserver import OlmoServer
from .olmo.olmo_tool import _diff, _synthetic, _zeros_like, load_reference

pytestmark = pytest.mark.slow  # ~1 min on 2 cores (+ ~1 min for the venv on a fresh machine); CI runs slow tests

REPO = Path(__file__).resolve().parents[2]
TOOL = Path(__file__).parent / "olmo" / "olmo_tool.py"


@pytest.fixture(scope="session")
def olmo_python() -> str:
    """The python of .venv-olmo, installed once per machine (a minute or two: started in the
    background when the session collected these tests, tests/venv_builds.py; waited for here)."""
    from venv_builds import run_script

    t0 = time.monotonic()
    r = run_script("setup_olmo_venv.sh", timeout=1200)
    if r.returncode != 0:
        log = REPO / ".venv-olmo" / "setup.log"
        tail = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
        pytest.fail(f"scripts/setup_olmo_venv.sh failed (exit {r.returncode}) after {time.monotonic() - t0:.0f}s: "
                    f"OLMo-core could not be installed into .venv-olmo\n{r.stderr[-2000:]}\n--- {log} ---\n{tail}")
    return r.stdout.strip().splitlines()[-1]


def _env(tmp: Path) -> dict:
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH="", HF_HUB_OFFLINE="1",
                WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", CACHED_PATH_CACHE_ROOT=str(tmp / "cached_path"))


@pytest.fixture(scope="module")
def olmo_server(olmo_python, tmp_path_factory):
    """OLMo-core's python with torch and olmo_core imported once: each command below is a
    fork of it, a process of its own (tests/integrations/olmo/forkserver.py)."""
    tmp = tmp_path_factory.mktemp("olmo-server")
    server = OlmoServer(olmo_python, _env(tmp), log=str(tmp / "server.log"))
    yield server
    server.close()


def olmo(server: OlmoServer, *args: str, ranks: int = 1, tmp: Path, timeout: float = 240) -> dict:
    """Run olmo_tool.py in OLMo-core's venv (a fork of ``server``; 2 ranks as
    torch.distributed.run starts them); returns its JSON document, failing the test with
    its output when it did not succeed."""
    out = tmp / f"olmo-{time.monotonic_ns()}.json"
    rc, output = server.run([str(TOOL), "--out", str(out), *args], env=_env(tmp), cwd=str(tmp),
                            log=str(out.with_suffix(".log")), timeout=timeout, ranks=ranks,
                            master_port=free_port() if ranks > 1 else 0)
    res = json.loads(out.read_text()) if out.exists() else {"ok": False, "error": "no result written"}
    if rc != 0 or not res.get("ok"):
        shown = {k: v for k, v in res.items() if k != "traceback"}
        pytest.fail(f"OLMo-core {args[0]} failed (exit {rc}): {shown}\n{res.get('traceback', '')}"
                    f"\n--- output tail ---\n{output[-4000:]}")
    return res


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cloudckpt", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def olmo_local_run(olmo_server, tmp_path_factory) -> tuple[str, Path]:
    """OLMo-core's Trainer, 1 rank, 4 steps into a local folder, checkpoints every 2
    steps; and what OLMo-core itself reads back from its newest step (REF)."""
    tmp = tmp_path_factory.mktemp("olmo-local")
    folder = str(tmp / "run")
    olmo(olmo_server, "train", folder, "--work", str(tmp / "work"), tmp=tmp)
    olmo(olmo_server, "truth", f"{folder}/step4", str(tmp / "truth4.pt"), tmp=tmp)
    return folder, tmp / "truth4.pt"


def _load_bitexact(step: str, ref_path: Path, work: str, **load) -> tuple[list[str], dict]:
    ref = load_reference(ref_path)
    target = {"model": _zeros_like(ref["model"]), "optim": _zeros_like(ref["optim"])}
    with Checkpointer(work_dir=work) as ck:
        ts = ck.load(step, target, **load)
        info = ck.last_load_info
    return _diff(target, {"model": ref["model"], "optim": ref["optim"]}) + _diff(ts, ref["train"][0], "train"), info


@pytest.mark.parametrize("case", ["local-1rank", "s3-2ranks-fsdp"])
def test_olmo_core_steps_are_found_listed_and_loaded_bitexactly_then_adopted(case, olmo_server, olmo_local_run,
                                                                            request, tmp_path):
    if case == "local-1rank":
        folder, ref = olmo_local_run
    else:
        folder, ref = request.getfixturevalue("s3_bucket") + "/run", tmp_path / "truth4.pt"
        olmo(olmo_server, "train", folder, "--work", str(tmp_path / "work"), "--fsdp", ranks=2, tmp=tmp_path)
        olmo(olmo_server, "truth", f"{folder}/step4", str(ref), tmp=tmp_path)
    step = layout.step_dir(folder, 4)
    theirs = olmo(olmo_server, "check", folder, tmp=tmp_path)
    found = list(discovery.find_checkpoints(folder, with_markers=True))
    assert [s for s, _, _ in found] == sorted(s for s, _ in theirs["found"]) and 4 in [s for s, _, _ in found]
    assert {m.kind for _, _, m in found} == {"olmo-core"} and not any(m.verified for _, _, m in found)
    assert discovery.latest_checkpoint(folder) == step and discovery.dir_is_checkpoint(step)
    assert discovery.read_marker(step).world_size == (1 if case == "local-1rank" else 2)
    r = cli("list", folder, "--json-pretty")  # one document (--json is JSON Lines)
    assert r.returncode == 0, r.stderr
    assert {row["format"] for row in json.loads(r.stdout)["steps"]} == {"olmo-core"}
    assert "olmo-core" in cli("list", folder).stdout.splitlines()[1]

    bad, info = _load_bitexact(step, ref, str(tmp_path / "w"))  # 2 ranks -> 1: resharding
    assert bad == [] and info.writer == "olmo-core" and info.verified is False
    assert _load_bitexact(step, ref, str(tmp_path / "w"), pre_download=True)[0] == []
    if case != "local-1rank":  # and on 2 ranks, each with its own train state
        assert run_ranks(2, cc_ranks.load_and_compare, step, str(ref), str(tmp_path / "w2")) == [[], []]

    r = cli("verify", step)
    assert r.returncode == 1 and "no manifest" in r.stdout and "parse as a load parses them" in r.stdout, r.stdout
    if case == "local-1rank":  # the module's run is shared: adopt a copy
        shutil.copytree(folder, tmp_path / "copy")
        folder, step = str(tmp_path / "copy"), str(tmp_path / "copy" / "step4")
    r = cli("adopt", step, "--yes")
    assert r.returncode == 0 and "adopted" in r.stdout, r.stdout + r.stderr
    assert open_store(step).exists(urls.join(step, ADOPTED_MANIFEST))
    r = cli("verify", step)
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    assert discovery.read_marker(step).kind == "olmo-core+manifest"
    assert _load_bitexact(step, ref, str(tmp_path / "w"))[0] == []
    after = olmo(olmo_server, "check", folder, "--steps", step, tmp=tmp_path)  # OLMo-core after adopt
    assert after["latest"] == step and after["is_checkpoint"][step]
    assert sorted(s for s, _ in after["found"]) == sorted(s for s, _ in theirs["found"])
    # its strict marker parse (find_checkpoints(ephemeral=...)) answers as before: its marker is untouched
    assert after["persistent"] == theirs["persistent"], after.get("persistent_error")
    if case == "local-1rank":  # (on S3, OLMo-core 3.0.0 cannot filter by ephemeral at all: see the mixed test)
        assert 4 in after["persistent"]


class _OlmoShaped(torch.nn.Module):
    """Parameters at OLMo-core's names and shapes (what its Transformer has), zeros."""

    def __init__(self, shapes: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in shapes.items():
            mod = self
            *path, leaf = name.split(".")
            for p in path:
                if not hasattr(mod, p):
                    mod.add_module(p, torch.nn.Module())
                mod = getattr(mod, p)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t)))


def test_appstate_with_a_flattened_optimizer_resumes_an_olmo_core_step(olmo_local_run, tmp_path):
    """What docs/migration.md tells users: AppState with DCP's flatten_optimizer_state_dict=True
    (OLMo-core's optimizer layout) and an LR scheduler (which adds initial_lr, as OLMo-core's do)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from cloudckpt import AppState

    folder, ref_path = olmo_local_run
    ref = load_reference(ref_path)
    model = _OlmoShaped(ref["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ts = ck.load(layout.step_dir(folder, 4), AppState(model, opt, options=StateDictOptions(
            flatten_optimizer_state_dict=True)))
    assert _diff({k: v.detach() for k, v in model.state_dict().items()}, ref["model"]) == []
    names = [n for n, _ in model.named_parameters()]
    moments = {f"state.{names[i]}.{f}": t for i, st in opt.state_dict()["state"].items() for f, t in st.items()}
    assert _diff(moments, {k: v for k, v in ref["optim"].items() if k.startswith("state.")}) == []
    assert ts["global_step"] == 4 and _diff(ts, ref["train"][0]) == []


def _save_ours(folder: str, steps: list[int], work: str, **cfg) -> None:
    with CheckpointConfig(save_folder=folder, save_interval=10, work_dir=work, async_save=False, **cfg).build() as mgr:
        for s in steps:
            sd, ts = _synthetic(s)
            mgr.save(s, sd, ts)
        mgr.wait()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_folder_both_wrote_resumes_the_newest_step_and_olmo_core_reads_ours_after(backend, olmo_server, request,
                                                                                    tmp_path):
    folder = str(tmp_path / "run") if backend == "local" else request.getfixturevalue("s3_bucket") + "/run"
    work = str(tmp_path / "w")
    _save_ours(folder, [10, 20], work)
    olmo(olmo_server, "save", layout.step_dir(folder, 30), str(tmp_path / "ref30.pt"), "--seed", "30", tmp=tmp_path)
    assert pointer.read(folder) is None  # saves no longer write one
    # the pointer an earlier cloudckpt left on step 20: `latest --pointer` says the step found is newer
    open_store(folder).put_bytes(pointer.pointer_url(folder), b'{"step": 20, "pending": false}')

    r = cli("latest", folder, "--pointer")
    assert r.stdout.strip() == layout.step_dir(folder, 30) \
        and "newer than step20 named by the latest pointer" in r.stderr
    cfg = CheckpointConfig(save_folder=folder, save_interval=10, work_dir=work, async_save=False, max_checkpoints=1,
                           gc_grace_seconds=0, exact_resume=False)  # train state exactly as given: compared below
    ref30 = load_reference(tmp_path / "ref30.pt")
    with cfg.build() as mgr:
        target = _zeros_like(ref30["sd"])
        ts = mgr.resume(target)
        assert mgr.resumed_step == 30 and _diff(target, ref30["sd"]) == [] and _diff(ts, ref30["train"]) == []
        sd40, ts40 = _synthetic(40)
        mgr.save(40, sd40, ts40)  # no CheckpointExists, no overwrite: the run goes on after OLMo-core's step
        mgr.wait()  # background prune (max_checkpoints=1) and gc ran
    assert [s for s, _ in discovery.find_checkpoints(folder)] == [30, 40]  # ours at 10, 20 pruned; 30 kept
    assert "--include-foreign" in cli("prune", folder, "--keep-last", "1", "--yes").stdout
    assert cli("gc", folder, "--older-than", "1s", "--yes").returncode == 0
    listed = json.loads(cli("list", folder, "--json-pretty").stdout)["steps"]
    assert [(s["step"], s["format"]) for s in listed] == [(30, "olmo-core"), (40, "cloudckpt")]

    torch.save({"sd": sd40, "train": ts40}, tmp_path / "ref40.pt")
    step40 = layout.step_dir(folder, 40)
    theirs = olmo(olmo_server, "check", folder, "--steps", step40, "--load", step40, str(tmp_path / "ref40.pt"),
                  tmp=tmp_path)
    assert theirs["latest"] == step40 and theirs["loads"] == {step40: []} and theirs["is_checkpoint"][step40]
    assert sorted(s for s, _ in theirs["found"]) == [30, 40]
    # known limits of OLMo-core 3.0.0's find_checkpoints(ephemeral=...): locally it parses markers strictly
    # and rejects ours ("no attribute 'format'"); on S3 it cannot parse any marker (cached_path's file has
    # no .json suffix), its own included
    assert theirs["persistent"] is None
    assert ("format" if backend == "local" else "Unsupported config file type") in theirs["persistent_error"]


def _metadata_call(module: str, name: str) -> bytes:
    """A protocol-4 pickle that looks up ``module``/``name`` (STACK_GLOBAL) and calls it."""
    def u(s: str) -> bytes:
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b

    return b"\x80\x04" + u(module) + u(name) + b"\x93" + u("touch " + SENTINEL) + b"\x85R."


SENTINEL = "/tmp/cloudckpt-olmo-gadget-ran"


class _SystemCall:
    def __reduce__(self):
        return (os.system, ("touch " + SENTINEL,))


def _olmo_class_train_state() -> bytes:
    """A train state holding OLMo-core's own RNG dataclass (not plain data: refused by
    name even though OLMo-core wrote such classes), pickled under its real module name."""
    import io

    names = ["olmo_core", "olmo_core.train", "olmo_core.train.utils"]
    saved = {n: sys.modules.get(n) for n in names}
    mod = types.ModuleType("olmo_core.train.utils")

    class EnvRngStates:
        pass

    EnvRngStates.__module__, EnvRngStates.__qualname__ = mod.__name__, "EnvRngStates"
    mod.EnvRngStates = EnvRngStates
    try:
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        sys.modules["olmo_core.train.utils"] = mod
        buf = io.BytesIO()
        torch.save({"global_step": 4, "rng": EnvRngStates()}, buf)
        return buf.getvalue()
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


HOSTILE = {
    "metadata-dotted-through-olmo-module": ("model_and_optim/.metadata",
                                            lambda: _metadata_call("olmo_core.distributed.checkpoint.filesystem",
                                                                   "os.system")),
    "metadata-posix-system": ("model_and_optim/.metadata", lambda: _metadata_call("posix", "system")),
    "train-state-olmo-class": ("train/rank0.pt", _olmo_class_train_state),
    "train-state-system-call": ("train/rank0.pt", lambda: _torch_bytes({"global_step": 4, "x": _SystemCall()})),
}


def _torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_crafted_olmo_step_with_a_hostile_global_is_refused(case, backend, olmo_local_run, request, tmp_path,
                                                             capsys):
    src, _ = olmo_local_run
    folder = str(tmp_path / "run") if backend == "local" else request.getfixturevalue("s3_bucket") + "/run"
    step = layout.step_dir(folder, 4)
    store = open_store(folder)
    for p in Path(src, "step4").rglob("*"):
        if p.is_file():
            store.put_bytes(urls.join(step, p.relative_to(Path(src, "step4")).as_posix()), p.read_bytes())
    rel, make = HOSTILE[case]
    store.put_bytes(urls.join(step, rel), make())
    if os.path.exists(SENTINEL):
        os.unlink(SENTINEL)
    assert discovery.latest_checkpoint(folder) == step  # found (discovery parses no pickle) ...
    ref = load_reference(olmo_local_run[1])
    target = {"model": _zeros_like(ref["model"]), "optim": _zeros_like(ref["optim"])}
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck, pytest.raises(UnsafeCheckpoint) as e:
        ck.load(step, target)  # ... and refused when loaded
    assert ("system" in str(e.value)) or ("EnvRngStates" in str(e.value)), str(e.value)
    with CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w")).build() as mgr, \
            pytest.raises(UnsafeCheckpoint):
        mgr.resume({"model": _zeros_like(ref["model"]), "optim": _zeros_like(ref["optim"])})
    from cloudckpt.cli import main  # in-process here: the commands themselves are run as commands above

    capsys.readouterr()
    assert main(["verify", step]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and rel in out, out
    assert main(["adopt", step, "--yes"]) == 1
    assert "refused" in capsys.readouterr().err
    assert not store.exists(urls.join(step, ADOPTED_MANIFEST))
    assert not os.path.exists(SENTINEL)
