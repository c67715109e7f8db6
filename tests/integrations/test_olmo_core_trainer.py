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

The Trainer runs in tests/integrations/olmo/trainer_tool.py (see it); the venv comes
from scripts/setup_olmo_venv.sh.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery

from .venvs import REPO, diff, load, run_until_committed_then_kill, venv_python

pytestmark = pytest.mark.slow  # ~1 min on 2 cores (the venv is test_olmo_core.py's); CI runs slow tests

TOOL = Path(__file__).parent / "olmo" / "trainer_tool.py"


@pytest.fixture(scope="session")
def olmo_python() -> str:
    return venv_python("setup_olmo_venv.sh", ".venv-olmo", "OLMo-core")


def _env(tmp: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
                WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", CACHED_PATH_CACHE_ROOT=str(tmp / "cached_path"))


def train(py: str, folder: str, tmp: Path, out: str, *args: str) -> str:
    p = subprocess.run([py, str(TOOL), "train", folder, "--work", str(tmp / "work"), "--out", str(tmp / out), *args],
                       env=_env(tmp), capture_output=True, text=True, timeout=300, cwd=tmp)
    assert p.returncode == 0 and "DONE" in p.stdout, \
        f"trainer failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-5000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def reference(olmo_python, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run into a local folder: its final state."""
    tmp = tmp_path_factory.mktemp("olmo-ref")
    train(olmo_python, str(tmp / "run"), tmp, "ref")
    return tmp / "ref" / "final.pt"


@pytest.mark.parametrize("store,mode", [("s3_bucket", "sync"), ("gcs_bucket", "sync"), ("s3_bucket", "async")])
def test_olmo_core_trainer_killed_after_a_committed_save_resumes_weights_optimizer_and_step(
        store, mode, olmo_python, reference, request, tmp_path):
    folder = request.getfixturevalue(store) + "/olmo-run"
    extra = ["--async"] if mode == "async" else []
    run_until_committed_then_kill([olmo_python, str(TOOL), "train", folder, "--work", str(tmp_path / "work"), "--out",
                                   str(tmp_path / "a"), "--slow-after", "2", *extra], _env(tmp_path), step=2)
    committed = [s for s, _ in Checkpointer.find_checkpoints(folder)]
    assert 2 in committed and max(committed) < 6, committed
    out = train(olmo_python, folder, tmp_path, "b", *extra)
    resumed_at = int(next(line.split()[1] for line in out.splitlines() if line.startswith("RESUMED")))
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


def test_olmo_core_reads_the_steps_the_adapter_committed(olmo_python, tmp_path):
    folder = str(tmp_path / "run")
    train(olmo_python, folder, tmp_path, "a", "--steps", "4")
    code = ("import json,sys; from olmo_core.train.checkpoint import Checkpointer as C; "
            "print(json.dumps([sorted(s for s, _ in C.find_checkpoints(sys.argv[1])), "
            "C.latest_checkpoint(sys.argv[1])]))")
    r = subprocess.run([olmo_python, "-c", code, folder], env=dict(os.environ, PYTHONPATH=""), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == f'[[0, 2, 4], "{folder}/step4"]'
    assert subprocess.run([sys.executable, "-m", "cloudckpt", "verify", f"{folder}/step4"], capture_output=True,
                          timeout=120).returncode == 0
