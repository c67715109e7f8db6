"""Separate venvs for integrations whose pins conflict with .venv (torchtitan, OLMo-core):
built by their scripts/setup_*_venv.sh (idempotent, cached in the repo folder, ignored by
git), started in the background once the session has collected a test that needs them
(tests/venv_builds.py) and waited for on first use. A failed install fails the test with
pip's log: it is part of the suite.
Also the helpers their kill-and-resume tests share."""

from __future__ import annotations

import selectors
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def venv_python(script: str, venv: str, what: str) -> str:
    """Run ``scripts/{script}``; return the venv's python (its last line of output)."""
    from venv_builds import run_script  # under the lock of the build the session started (tests/venv_builds.py)

    t0 = time.monotonic()
    r = run_script(script, timeout=1200)
    if r.returncode != 0:
        log = REPO / venv / "setup.log"
        tail = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
        pytest.fail(f"scripts/{script} failed (exit {r.returncode}) after {time.monotonic() - t0:.0f}s: {what} could "
                    f"not be installed into {venv}\n{r.stderr[-2000:]}\n--- {log} ---\n{tail}")
    return r.stdout.strip().splitlines()[-1]


def run_until_committed_then_kill(cmd: list[str], env: dict, *, step: int, timeout: float = 180) -> str:
    """Start ``cmd`` (a trainer that prints "COMMITTED {step}" once a save is committed)
    and SIGKILL it as soon as it prints that line for ``step``; returns its output."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]
