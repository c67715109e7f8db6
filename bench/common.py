"""Names and small helpers every bench script shares: sizes, the bucket, the machine's
load, the git state measured, and one-line error texts. Standard library only, so
``python -m bench.run --merge`` and the peers' venvs need nothing else."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# cloudckpt.units' values, repeated: bench.ranks and bench.state run in peers' venvs, where cloudckpt is not installed
MiB = 1024 * 1024
GiB = 1024 * MiB
BUCKET = "bench"


def parse_size(text: str) -> int:
    """``"4MiB"``, ``"1GiB"``, ``"512k"``, ``"100"`` -> bytes."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1024, "m": MiB, "g": GiB}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "kmg" else t) * mult)


def size_label(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB}GiB"
    if n % MiB == 0:
        return f"{n // MiB}MiB"
    return f"{n}B"


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def git_state() -> dict:
    """The commit measured, and which library files differed from it (others edit
    the tree while benchmarks run)."""
    def git(*a):
        p = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "cloudckpt")
    return {"commit": git("rev-parse", "HEAD"), "dirty_library_files": dirty.splitlines() if dirty else []}


def short_error(err: str, n: int = 300) -> str:
    """The line of a traceback or a tool's stderr that says what went wrong."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    interesting = [line for line in lines if ("Error" in line or "Exception" in line) and not line.startswith(" ")]
    # a rank that crashed makes the others fail with gloo's "Connection closed by peer": show the cause
    causes = [line for line in interesting if "Connection closed by peer" not in line]
    interesting = causes or interesting
    text = (interesting[0] if causes else interesting[-1]) if interesting else (lines[-1] if lines else err)
    text = text.strip()
    return text[:n]


def same(a: float, b: float) -> bool:
    """Two state fingerprints (float64 sums) are equal up to summation order."""
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))
