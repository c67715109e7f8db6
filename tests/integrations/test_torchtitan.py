"""cloudckpt under the real torchtitan (0.3.0, its own venv .venv-titan):

- CloudCheckpointManager, built through torchtitan's ``config.checkpoint.build(...)`` call
  with torchtitan's model wrapper, OptimizersContainer (AdamW) and LRSchedulersContainer,
  saves a run to SeaweedFS and fake-gcs-server (synchronous and async saves); the run is
  SIGKILLed after a committed save and resumed in a new process: the state right after
  load equals the state handed to the newest committed save (weights, AdamW moments and
  step counts, LR scheduler, train state) and the final state equals an uninterrupted
  run's, bit for bit.
- ``exclude_from_loading`` keeps the named state as it is at resume.
- A ``step-N`` folder written by torchtitan's own CheckpointManager is imported as a
  committed ``step{N}`` (``cloudckpt verify`` passes) and a run resumes from it with
  exactly torchtitan's saved state.

torchtitan's Trainer itself needs CUDA and a tokenizer download, so
tests/integrations/titan/titan_tool.py runs its loop with the same checkpoint calls (see
that file). The venv is built by scripts/setup_torchtitan_venv.sh (idempotent, ~1 min on
a fresh machine); a failed install FAILS these tests with pip's log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloudckpt import Checkpointer
from cloudckpt.testing.servers import free_port

from .venvs import REPO, diff, load, run_until_committed_then_kill, venv_python

pytestmark = pytest.mark.slow  # ~40 s on 2 cores (+ ~75 s for the venv on a fresh machine); CI runs slow tests

TOOL = Path(__file__).parent / "titan" / "titan_tool.py"


@pytest.fixture(scope="session")
def titan_python() -> str:
    return venv_python("setup_torchtitan_venv.sh", ".venv-titan", "torchtitan")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def kill_after(py: str, *args: str, step: int) -> str:
    return run_until_committed_then_kill([py, str(TOOL), *args], _env(), step=step)


def titan(py: str, *args: str, timeout: float = 180) -> str:
    p = subprocess.run([py, str(TOOL), *args], env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"titan_tool {args[0]} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def reference(titan_python, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run (local folder): its final state."""
    out = tmp_path_factory.mktemp("titan-ref")
    titan(titan_python, "train", str(out / "run"), "--steps", "6", "--out", str(out))
    return out / "final.pt"


@pytest.mark.parametrize("store,mode", [("s3_bucket", "sync"), ("s3_bucket", "async"), ("gcs_bucket", "sync")])
def test_torchtitan_run_killed_after_a_committed_save_resumes_weights_optimizer_scheduler_and_step(
        store, mode, titan_python, reference, request, tmp_path):
    folder = request.getfixturevalue(store) + "/titan-run"
    extra = ["--async"] if mode == "async" else []
    kill_after(titan_python, "train", folder, "--steps", "6", "--out", str(tmp_path / "a"),
                                  "--slow-after", "2", *extra, step=2)
    committed = [s for s, _ in Checkpointer.find_checkpoints(folder)]
    assert 2 in committed and max(committed) < 6, committed
    out = titan(titan_python, "train", folder, "--steps", "6", "--out", str(tmp_path / "b"), *extra)
    resumed_at = int(next(line.split()[1] for line in out.splitlines() if line.startswith("RESUMED")))
    assert resumed_at == max(committed)
    resumed, saved = load(tmp_path / "b" / "resumed.pt"), load(tmp_path / "a" / f"saved-{resumed_at}.pt")
    assert resumed["train_state"]["step"] == resumed_at and len(resumed["optim"]) > 0
    assert any(k.endswith("exp_avg_sq") for k in resumed["optim"])  # AdamW moments are part of the comparison
    assert diff(resumed, saved) == []
    assert diff(load(tmp_path / "b" / "final.pt"), load(reference)) == []
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [2, 4, 6]


def test_torchtitan_exclude_from_loading_keeps_the_lr_scheduler_as_built(titan_python, tmp_path):
    folder = str(tmp_path / "run")
    titan(titan_python, "train", folder, "--steps", "4", "--out", str(tmp_path / "a"))
    titan(titan_python, "train", folder, "--steps", "6", "--out", str(tmp_path / "b"), "--exclude", "lr_scheduler")
    resumed, saved = load(tmp_path / "b" / "resumed.pt"), load(tmp_path / "a" / "saved-4.pt")
    assert diff(resumed["model"], saved["model"]) == [] and diff(resumed["optim"], saved["optim"]) == []
    assert saved["lr_scheduler"]["last_epoch"] == 4 and resumed["lr_scheduler"]["last_epoch"] == 0


def test_torchtitan_step_folder_is_imported_as_a_committed_step_and_resumed_exactly(titan_python, s3_bucket, tmp_path):
    titan(titan_python, "titan-save", str(tmp_path / "titan"), "--port", str(free_port()))
    src = tmp_path / "titan" / "checkpoint" / "step-2"
    assert (src / ".metadata").is_file()
    folder = s3_bucket + "/imported"
    out = titan(titan_python, "import", str(src), folder)
    assert out.strip().splitlines()[-1] == f"IMPORTED {folder}/step2"
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "verify", f"{folder}/step2"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    titan(titan_python, "train", folder, "--steps", "4", "--out", str(tmp_path / "b"))
    assert diff(load(tmp_path / "b" / "resumed.pt"), load(tmp_path / "titan" / "saved-2.pt")) == []
