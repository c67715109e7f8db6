"""Separate venvs for integrations whose pins conflict with .venv (torchtitan, OLMo-core):
built on first use by their scripts/setup_*_venv.sh (idempotent, cached in the repo folder,
ignored by git). A failed install fails the test with pip's log: it is part of the suite."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def venv_python(script: str, venv: str, what: str) -> str:
    """Run ``scripts/{script}``; return the venv's python (its last line of output)."""
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "scripts" / script)], cwd=REPO, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        log = REPO / venv / "setup.log"
        tail = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
        pytest.fail(f"scripts/{script} failed (exit {r.returncode}) after {time.monotonic() - t0:.0f}s: {what} could "
                    f"not be installed into {venv}\n{r.stderr[-2000:]}\n--- {log} ---\n{tail}")
    return r.stdout.strip().splitlines()[-1]
