"""OLMo-core's real Trainer (ai2-olmo-core 3.0.0, .venv-olmo) checkpointing through
cloudckpt with ``TrainerConfig(checkpointer=CloudCheckpointerConfig())``:

- a 1M-parameter OLMo2 run on CPU saves to SeaweedFS and to fake-gcs-server through
  the Trainer's own CheckpointerCallback; it is SIGKILLed after a committed save and a
  new process resumes through ``Trainer.fit()``: the state right after the Trainer's load
  equals the state at the newest committed save (weights, AdamW moments and step counts,
  global step, data loader position) and the final state equals an uninterrupted run's,
  bit for bit; async saves (save_async=True) resume to the same final state;
- the steps are committed cloudckpt steps (verified manifests), and OLMo-core's own
  Checkpointer still finds them (``find_checkpoints``, ``latest_checkpoint``; not with
  its ``ephemeral=`` filter, which parses the marker strictly and refuses our fields).

The Trainer runs in tests/integrations/olmo/trainer_tool.py (see it), each run a process
forked from one server per module that imported torch and olmo_core once
(tests/integrations/olmo/forkserver.py); the venv comes from scripts/setup_olmo_venv.sh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery

from .olmo.forkserver import OlmoServer
from .venvs import REPO, diff, load, venv_python

pytestmark = pytest.mark.slow  # ~25 s on 2 cores (the venv is test_olmo_core.py's); CI runs slow tests

TOOL = Path(__file__).parent / "olmo" / "trainer_tool.py"


@pytest.fixture(scope="session")
def olmo_python() -> str:
    return venv_python("setup_olmo_venv.sh", ".venv-olmo", "OLMo-core")


def _env(tmp: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
                WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", CACHED_PATH_CACHE_ROOT=str(tmp / "cached_path"))


@pytest.fixture(scope="module")
def olmo_server(olmo_python, tmp_path_factory):
    """OLMo-core's python with torch and olmo_core imported once: each run below is a fork
    of it, a process of its own (tests/integrations/olmo/forkserver.py). cloudckpt is not
    preloaded: the trainer imports it from PYTHONPATH, and OLMo-core's own check at the
    end runs without it, as before."""
    tmp = tmp_path_factory.mktemp("olmo-server")
    server = OlmoServer(olmo_python, dict(_env(tmp), PYTHONPATH=""), log=str(tmp / "server.log"))
    yield server
    server.close()


def train(server: OlmoServer, folder: str, tmp: Path, out: str, *args: str) -> str:
    rc, output = server.run([str(TOOL), "train", folder, "--work", str(tmp / "work"), "--out", str(tmp / out), *args],
                            env=_env(tmp), cwd=str(tmp), log=str(tmp / f"{out}.log"), timeout=300)
    assert rc == 0 and "DONE" in output, f"trainer failed (exit {rc}):\n{output[-5000:]}"
    return output


@pytest.fixture(scope="module")
def reference(olmo_server, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run into a local folder: its final state."""
    tmp = tmp_path_factory.mktemp("olmo-ref")
    train(olmo_server, str(tmp / "run"), tmp, "ref")
    return tmp / "ref" / "final.pt"


def run_until_committed_then_kill(server: OlmoServer, argv: list[str], env: dict, tmp: Path, *, step: int,
                                  timeout: float = 180) -> str:
    """Start ``argv`` (a trainer that prints "COMMITTED {step}" once a save is committed)
    and SIGKILL it as soon as it has printed that line for ``step``; returns its output."""
    log = tmp / f"killed-{time.monotonic_ns()}.log"
    (pid,) = server.start(argv, env=env, cwd=str(tmp), log=str(log))
    deadline = time.monotonic() + timeout
    seen = ""
    try:
        while time.monotonic() < deadline:
            running = server.poll([pid]) == [None]
            seen = log.read_text(errors="replace") if log.exists() else ""
            if f"COMMITTED {step}" in (line.strip() for line in seen.splitlines()):
                os.kill(pid, signal.SIGKILL)
                codes, _ = server.wait([pid], 30)
                assert codes == [-signal.SIGKILL], f"exit {codes} instead of SIGKILL:\n{seen[-4000:]}"
                return seen
            if not running:
                break
            time.sleep(0.05)
        pytest.fail(f"no 'COMMITTED {step}' within {timeout}s (exit {server.poll([pid])}):\n{seen[-4000:]}")
    finally:
        if server.poll([pid]) == [None]:
            server.wait([pid], 0)  # killed at once


@pytest.mark.parametrize("store,mode", [("s3_bucket", "sync"), ("gcs_bucket", "sync"), ("s3_bucket", "async")])
def test_olmo_core_trainer_killed_after_a_committed_save_resumes_weights_optimizer_and_step(
        store, mode, olmo_server, reference, request, tmp_path):
    folder = request.getfixturevalue(store) + "/olmo-run"
    extra = ["--async"] if mode == "async" else []
    run_until_committed_then_kill(olmo_server, [str(TOOL), "train", folder, "--work", str(tmp_path / "work"), "--out",
                                                str(tmp_path / "a"), "--slow-after", "2", *extra], _env(tmp_path),
                                  tmp_path, step=2)
    committed = [s for s, _ in Checkpointer.find_checkpoints(folder)]
    assert 2 in committed and max(committed) < 6, committed
    out = train(olmo_server, folder, tmp_path, "b", *extra)
    resumed_at = int(next(line.split()[1] for line in out.splitlines() if line.startswith("RESUMED")))
    # the resume (Checkpointer.load_with) built its targets from the DCP index header, read no .metadata
    assert "DCP METADATA READ" not in out, out[-3000:]
    assert resumed_at == max(committed)
    resumed = load(tmp_path / "b" / "resumed.pt")
    assert resumed["global_step"] == resumed_at
    if mode == "sync":  # the state at the committed save (async saves are dumped by nobody)
        saved = load(tmp_path / "a" / f"saved-{resumed_at}.pt")
        assert any("exp_avg_sq" in k for k in _keys(saved["module"]["optim"]))
        assert diff(resumed, saved) == []
    assert diff(load(tmp_path / "b" / "final.pt"), load(reference)) == []
    steps = list(discovery.find_checkpoints(folder, with_markers=True))
    assert [s for s, _, _ in steps] == [0, 2, 4, 6] and all(m.verified and m.kind == "cloudckpt" for _, _, m in steps)


def _keys(tree, prefix=""):
    for k, v in tree.items():
        yield from _keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]


def test_olmo_core_reads_the_steps_the_adapter_committed(olmo_server, tmp_path):
    folder = str(tmp_path / "run")
    train(olmo_server, folder, tmp_path, "a", "--steps", "4")
    code = ("import json,sys; from olmo_core.train.checkpoint import Checkpointer as C; "
            "print(json.dumps([sorted(s for s, _ in C.find_checkpoints(sys.argv[1])), "
            "C.latest_checkpoint(sys.argv[1])]))")
    rc, out = olmo_server.run(["-c", code, folder], env=dict(os.environ, PYTHONPATH=""), cwd=str(tmp_path),
                              log=str(tmp_path / "check.log"), timeout=120)
    assert rc == 0, out[-3000:]
    assert out.strip().splitlines()[-1] == f'[[0, 2, 4], "{folder}/step4"]'
    assert subprocess.run([sys.executable, "-m", "cloudckpt", "verify", f"{folder}/step4"], capture_output=True,
                          timeout=120).returncode == 0
