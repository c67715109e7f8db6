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
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.testing.servers import free_port

from .venvs import REPO, venv_python

pytestmark = pytest.mark.slow  # ~40 s on 2 cores (+ ~75 s for the venv on a fresh machine); CI runs slow tests

TOOL = Path(__file__).parent / "titan" / "titan_tool.py"


@pytest.fixture(scope="session")
def titan_python() -> str:
    return venv_python("setup_torchtitan_venv.sh", ".venv-titan", "torchtitan")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def titan(py: str, *args: str, timeout: float = 180) -> str:
    p = subprocess.run([py, str(TOOL), *args], env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"titan_tool {args[0]} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}"
    return p.stdout


def run_until_committed_then_kill(py: str, *args: str, step: int, timeout: float = 120) -> str:
    """Start titan_tool train, SIGKILL it as soon as it prints COMMITTED {step}."""
    p = subprocess.Popen([py, str(TOOL), *args], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, sel = [], selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=1):
                continue
            line = p.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.strip() == f"COMMITTED {step}":
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)
                assert p.returncode == -signal.SIGKILL
                return "".join(seen)
        pytest.fail(f"no 'COMMITTED {step}' within {timeout}s (exit {p.poll()}):\n{''.join(seen)[-4000:]}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def diff(a, b, path="") -> list[str]:
    """Where two snapshots differ (tensors bit for bit, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                   b.view(-1).view(torch.uint8) if b.numel() else b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


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
    run_until_committed_then_kill(titan_python, "train", folder, "--steps", "6", "--out", str(tmp_path / "a"),
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
