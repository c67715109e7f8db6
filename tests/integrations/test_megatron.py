"""cloudckpt under the real megatron-core (0.19.2, its own venv .venv-megatron), 2 gloo ranks on CPU:

- a sharded state dict (a dim-0 split ShardedTensor, a replicated float64 one, a
  ShardedTensorFactory, one ShardedObject per rank, common state) saved through
  ``cloudckpt.integrations.megatron.save`` to SeaweedFS is a committed step whose manifest
  lists Megatron's ``metadata.json``, and loads back bit for bit at 2 ranks, at 1 (2 -> 1)
  and saved at 1, at 2 (1 -> 2);
- Megatron's own ``dist_checkpointing.load`` (its default strategy) reads our step after
  ``cloudckpt download``; a folder Megatron's own ``dist_checkpointing.save`` wrote is NOT
  imported yet: its ``.metadata`` holds pickled SavePlans that cloudckpt's allowlist refuses
  (the test pins that refusal);
- a tiny GPTModel (local layer spec) saved at tensor parallel 2 and loaded at 1 gives the
  same logits (slow).

tests/integrations/megatron/mcore_tool.py runs each side (it starts the ranks). The venv is
built by scripts/setup_megatron_venv.sh (idempotent, ~2 min on a fresh machine); a failed
install FAILS these tests with pip's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.testing.servers import free_port

from .venvs import REPO, venv_python

TOOL = Path(__file__).parent / "megatron" / "mcore_tool.py"


@pytest.fixture(scope="session")
def megatron_python() -> str:
    return venv_python("setup_megatron_venv.sh", ".venv-megatron", "megatron-core")


def mcore(py: str, tmp_path: Path, *args: str, saved_world: int | None = None, timeout: float = 240,
          fails: bool = False) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONWARNINGS="ignore")
    if saved_world is not None:
        env["SAVED_WORLD"] = str(saved_world)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    p = subprocess.run([py, str(TOOL), *args, "--port", str(free_port()), "--work", str(work)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if fails:
        assert p.returncode != 0, f"mcore_tool {args} succeeded:\n{p.stdout[-3000:]}"
        return p.stdout + p.stderr
    assert p.returncode == 0, f"mcore_tool {args} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}"
    return p.stdout


def test_megatron_sharded_state_saved_to_s3_loads_back_exactly_at_2_and_1_ranks(megatron_python, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run/iter_0000010"
    mcore(megatron_python, tmp_path, "save", url, "--world", "2")
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "verify", url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    assert "LOADED OK" in mcore(megatron_python, tmp_path, "load", url, "--world", "2")
    assert "LOADED OK" in mcore(megatron_python, tmp_path, "load", url, "--world", "1", saved_world=2)


def test_megatron_saved_at_1_rank_loads_resharded_at_2(megatron_python, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run/iter_0000001"
    mcore(megatron_python, tmp_path, "save", url, "--world", "1")
    assert "LOADED OK" in mcore(megatron_python, tmp_path, "load", url, "--world", "2", saved_world=1)


def test_megatron_own_loader_reads_our_step_after_download(megatron_python, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run/iter_0000020"
    mcore(megatron_python, tmp_path, "save", url, "--world", "2")
    dest = tmp_path / "dl"
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "download", url, str(dest)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    folder = dest / "step20" / "model_and_optim"  # the download keeps the step folder (named by its number)
    assert json.loads((folder / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                                  "sharded_backend_version": 1}
    assert "LOADED OK" in mcore(megatron_python, tmp_path, "load", str(folder), "--stock", "--world", "2")
    assert "LOADED OK" in mcore(megatron_python, tmp_path, "load", str(folder), "--stock", "--world", "1",
                                saved_world=2)


def test_megatron_own_save_is_refused_by_import_without_running_its_pickled_save_plans(megatron_python, s3_bucket,
                                                                                      tmp_path):
    """Megatron's own save stores its ranks' SavePlans in DCP's .metadata (``all_local_plans``,
    for its cached-plan reuse): cloudckpt's metadata allowlist refuses them, so a folder
    Megatron wrote is not imported yet (issue 43, phase 2). What this proves: the refusal
    is a clear UnsafeCheckpoint, and nothing is committed."""
    src = tmp_path / "stock"
    mcore(megatron_python, tmp_path, "save", str(src), "--stock", "--world", "2")
    assert (src / "metadata.json").is_file() and (src / ".metadata").is_file()
    url = f"{s3_bucket}/imported/iter_0000005"
    out = mcore(megatron_python, tmp_path, "import", str(src), url, fails=True)
    assert "UnsafeCheckpoint" in out and "SavePlan is not in the allowlist" in out, out[-3000:]
    assert not Checkpointer.dir_is_checkpoint(url)


@pytest.mark.slow  # ~40 s on 2 cores: Megatron's model code imports and builds twice
def test_megatron_gpt_saved_at_tensor_parallel_2_loads_at_1_with_the_same_logits(megatron_python, s3_bucket,
                                                                                  tmp_path):
    url = f"{s3_bucket}/gpt/iter_0000003"
    mcore(megatron_python, tmp_path, "gpt-save", url, "--world", "2", "--out", str(tmp_path / "tp2.pt"))
    mcore(megatron_python, tmp_path, "gpt-load", url, "--world", "1", "--out", str(tmp_path / "tp1.pt"))
    saved, loaded = (torch.load(tmp_path / f, weights_only=True) for f in ("tp2.pt", "tp1.pt"))
    assert saved.shape == loaded.shape == (2, 8, 64)
    assert torch.allclose(saved, loaded, atol=1e-5, rtol=0), (saved - loaded).abs().max()
