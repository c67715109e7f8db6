"""Measuring one operation: the samples a case records, the CPU the store spends, the
machine's load while the bench runs, and the s5cmd copies that are the ceiling.

Standard library at import (torch and cloudckpt only inside the functions that need
them), like every library module of ``bench/``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import BUCKET, MiB, short_error


class Results:
    """Raw samples per (case, size, tool) and rows that could not run."""

    def __init__(self):
        self.samples: dict[tuple[str, str, str], list[dict]] = {}
        self.status: dict[tuple[str, str, str], tuple[str, str]] = {}

    def add(self, case, size, tool, sample: dict) -> None:
        self.samples.setdefault((case, size, tool), []).append(sample)
        self.status.setdefault((case, size, tool), ("ok", ""))

    def fail(self, case, size, tool, status: str, reason: str) -> None:
        self.status[(case, size, tool)] = (status, reason)

    def median(self, case, size, tool, field="seconds"):
        vals = [s[field] for s in self.samples.get((case, size, tool), []) if s.get(field) is not None]
        return statistics.median(vals) if vals else None

    def rows(self) -> list[dict]:
        out = []
        for key in sorted(set(self.samples) | set(self.status), key=lambda k: (k[1], k[0], k[2])):
            case, size, tool = key
            status, reason = self.status.get(key, ("ok", ""))
            ss = self.samples.get(key, [])
            row = {"case": case, "size": size, "tool": tool,
                   "status": status if not (status == "ok" and not ss) else "no data",
                   "reason": reason, "n": len(ss), "samples": ss}
            if ss:
                med = self.median(case, size, tool)
                row["median_seconds"] = med
                nbytes = ss[0].get("bytes")
                row["bytes"] = nbytes
                row["mb_per_s"] = nbytes / med / 1e6 if nbytes and med else None
                for f in ("rss_ratio", "requests", "objects", "client_cpu_s", "server_cpu_s"):
                    m = self.median(case, size, tool, f)
                    if m is not None:
                        row[f] = m
            out.append(row)
        return out


def summarize(ranks: list[dict], op: str) -> dict:
    """One sample from every rank's figures."""
    secs = max(r["seconds"] for r in ranks)
    total = sum(r["local_bytes"] for r in ranks)
    s = {"seconds": secs, "bytes": total, "fingerprint": ranks[0]["fingerprint"], "per_rank": ranks}
    reqs = [r.get("requests") for r in ranks]
    s["requests"] = sum(reqs) if all(x is not None for x in reqs) else None
    if op == "load":
        s["rss_ratio"] = max(r["peak_rss_above_baseline"] / r["local_bytes"] for r in ranks)
        s["peak_rss_above_baseline"] = max(r["peak_rss_above_baseline"] for r in ranks)
    else:
        s["peak_rss_above_state"] = max(r["peak_rss_above_state"] for r in ranks)
    if ranks[0].get("objects") is not None:
        s["objects"] = ranks[0]["objects"]
    cpu = [r.get("cpu_s") for r in ranks]
    if all(x is not None for x in cpu):
        s["client_cpu_s"] = sum(cpu)
    return s


class LoadSampler:
    """The 1-minute load average every 10 s while the bench runs (a daemon thread)."""

    def __init__(self, every: float = 10.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._every = every

    def start(self) -> "LoadSampler":
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            with contextlib.suppress(OSError):
                self.samples.append(os.getloadavg()[0])

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict | None:
        s = self.samples
        return {"min": min(s), "median": statistics.median(s), "max": max(s), "samples": len(s)} if s else None


def server_cpu(server) -> float | None:
    """CPU seconds (user + system) the server process has used so far."""
    try:
        with open(f"/proc/{server.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, IndexError, ValueError):
        return None


def cpu_delta(before, after):
    return None if before is None or after is None else after - before


def settle() -> None:
    """Flush dirty pages to disk before a timed operation (untimed). What SeaweedFS
    (or a tool downloading to disk) writes sits in the page cache and the kernel
    writes it back ~30 s later (``vm.dirty_expire_centisecs``), during whatever runs
    then: without this, the first tool after the warm-up paid for the warm-up's
    gigabytes (its 4 GiB saves were 15-30 % slower than its next ones)."""
    os.sync()


# ============================================================ the store
def delete_prefix(s3, prefix: str) -> None:
    c = s3.client()
    keys = [{"Key": o["Key"]} for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", ())]
    for i in range(0, len(keys), 1000):
        c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys[i:i + 1000], "Quiet": True})


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def warm_up(s3, nbytes: int, tmp: str | None) -> float:
    """Upload and delete ``nbytes`` once, untimed: a fresh SeaweedFS allocates its
    volumes on the first writes, which would otherwise be charged to whichever tool
    goes first."""
    c = s3.client()
    path = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-warm-", dir=tmp)) / "blob"
    t0 = time.perf_counter()
    try:
        chunk = min(nbytes, 64 * MiB)
        with open(path, "wb") as f:
            f.write(os.urandom(chunk))
        for i in range(max(1, nbytes // chunk)):
            c.upload_file(str(path), BUCKET, f"warmup/{i}")
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    delete_prefix(s3, "warmup/")
    return time.perf_counter() - t0


# ============================================================ s5cmd, the ceiling
def s5cmd_binary() -> str | None:
    cand = Path(sys.executable).parent / "s5cmd"
    return str(cand) if cand.exists() else shutil.which("s5cmd")


def run_s5cmd(args, env, argv_tail: list[str]) -> tuple[float, float]:
    """``s5cmd cp`` with the bench's workers and concurrency (``args.s5cmd_numworkers``,
    ``args.s5cmd_concurrency``): (wall seconds, CPU seconds of the s5cmd process)."""
    import resource

    exe = s5cmd_binary()
    settle()
    argv = [exe, "--endpoint-url", env["AWS_ENDPOINT_URL"], "--numworkers", str(args.s5cmd_numworkers), "cp",
            "--concurrency", str(args.s5cmd_concurrency), *argv_tail]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"s5cmd failed ({p.returncode}): {short_error(p.stderr or p.stdout)}")
    return dt, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def s5cmd_download(args, env, prefix: str, nbytes: int) -> tuple[float, float]:
    """s5cmd's download of ``prefix`` into a fresh local folder (removed after):
    (wall seconds, CPU seconds); raises unless it got ``nbytes`` bytes."""
    dst = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-dl-", dir=args.tmp))
    try:
        down, cpu = run_s5cmd(args, env, [f"s3://{BUCKET}/{prefix}*", f"{dst}/"])
        got = dir_bytes(dst)
        if got != nbytes:
            raise RuntimeError(f"s5cmd downloaded {got} bytes, expected {nbytes}")
        return down, cpu
    finally:
        shutil.rmtree(dst, ignore_errors=True)
