"""Run Megatron-core's own ``dist_checkpointing`` unit tests on CPU under gloo, with Megatron's
stock ``torch_dist`` strategy and with cloudckpt's, and print the counts side by side.

    .venv-megatron/bin/python tests/integrations/megatron_units/run_units.py \\
        --megatron-lm /tmp/Megatron-LM --world 8 --files test_serialization.py --strategy both

``--megatron-lm``: a Megatron-LM source tree (``git clone -b core_r0.19.0
https://github.com/NVIDIA/Megatron-LM``; only its ``tests/`` folder is used: the installed
megatron-core is what is tested). Each mode starts ``--world`` pytest processes (one per
rank, as ``torchrun`` would: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` on
127.0.0.1) with ``mcore_units_plugin`` (see its docstring for what it changes). A test passes
when it passes on every rank. Prints one line per test (outcome per mode, and for the
cloudckpt mode how many saves/loads went through cloudckpt and through Megatron's own
functions), then the totals; ``--json`` writes the same as JSON. Exits 0 when every mode
ran to its end (test failures are counts, not errors); 1 when a mode did not (a rank
crashed or the run passed ``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
OUTCOMES = ("passed", "failed", "skipped")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(strategy: str, *, src: Path, world: int, files: list[str], select: str | None, timeout: float,
             log: Path) -> dict:
    """Every rank's pytest of ``files`` with the plugin in mode ``strategy``; returns
    ``{"ranks_ok": bool, "tests": {nodeid: {"outcome", "calls"}}}`` (outcomes merged over ranks)."""
    with tempfile.TemporaryDirectory(prefix=f"mcore-units-{strategy}-") as tmp:
        tmp_path = Path(tmp)
        for d in ("out", "shared", "work"):
            (tmp_path / d).mkdir()
        env = dict(os.environ, MCORE_UNITS_STRATEGY=strategy, MCORE_UNITS_OUT=str(tmp_path / "out"),
                   MCORE_UNITS_SHARED=str(tmp_path / "shared"), MCORE_UNITS_WORK=str(tmp_path / "work"),
                   WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([str(src), str(HERE), str(REPO)]))
        tests = [str(src / "tests" / "unit_tests" / "dist_checkpointing" / f) for f in files]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "mcore_units_plugin", "--noconftest",
               "-p", "no:cacheprovider", "--rootdir", str(src), *(["-k", select] if select else []), *tests]
        procs = []
        with open(log, "w") as logf:
            for r in range(world):
                procs.append(subprocess.Popen(cmd, cwd=src, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                              stdout=logf if r == 0 else subprocess.DEVNULL,
                                              stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            timed_out = any(p.poll() is None for p in procs)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        reports = [tmp_path / "out" / f"rank{r}.json" for r in range(world)]
        merged: dict[str, dict] = {}
        for path in reports:
            if not path.exists():
                continue
            for nodeid, t in json.loads(path.read_text())["tests"].items():
                m = merged.setdefault(nodeid, {"outcome": t["outcome"], "calls": t["calls"]})
                if t["outcome"] == "failed":
                    m["outcome"] = "failed"
        return {"ranks_ok": not timed_out and all(p.exists() for p in reports), "tests": merged}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm", required=True, type=Path)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--files", nargs="+", default=["test_serialization.py"])
    ap.add_argument("-k", dest="select")
    ap.add_argument("--strategy", choices=("stock", "cloudckpt", "both"), default="both")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()))
    a = ap.parse_args()
    try:
        import pytest  # noqa: F401 - each rank runs this interpreter's pytest
    except ImportError:
        print(f"{sys.executable} has no pytest: pip install pytest into this venv", file=sys.stderr)
        return 2
    modes = ("stock", "cloudckpt") if a.strategy == "both" else (a.strategy,)
    results = {}
    for mode in modes:
        t0 = time.monotonic()
        log = a.logs / f"mcore-units-{mode}.log"
        results[mode] = run_mode(mode, src=a.megatron_lm.resolve(), world=a.world, files=a.files, select=a.select,
                                 timeout=a.timeout, log=log)
        results[mode]["seconds"] = round(time.monotonic() - t0)
        print(f"# {mode}: {results[mode]['seconds']} s, every rank finished: {results[mode]['ranks_ok']} "
              f"(rank 0's log: {log})", flush=True)
    names = sorted({n for r in results.values() for n in r["tests"]})
    for n in names:
        cols = []
        for mode in modes:
            t = results[mode]["tests"].get(n, {"outcome": "-", "calls": {}})
            calls = ", ".join(f"{k} {v}" for k, v in sorted(t["calls"].items()))
            cols.append(f"{mode}: {t['outcome']}" + (f" ({calls})" if mode == "cloudckpt" and calls else ""))
        print(f"{n.split('::', 1)[-1]}  |  " + "  |  ".join(cols))
    for mode in modes:
        counts = {o: sum(1 for t in results[mode]["tests"].values() if t["outcome"] == o) for o in OUTCOMES}
        through = sum(1 for t in results[mode]["tests"].values() if t["outcome"] == "passed"
                      and any(k.startswith("cloudckpt") for k in t["calls"]))
        extra = f", {through} of the passed through cloudckpt" if mode == "cloudckpt" else ""
        print(f"TOTAL {mode}: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES) + extra)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["ranks_ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
