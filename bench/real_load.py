"""Where a real rank's load CPU goes as the world grows: the same per-rank state (T
FSDP-style Shard(0) DTensors of ``rows x cols`` float32 per rank) saved, then loaded,
by R real gloo ranks against SeaweedFS on 127.0.0.1, each rank profiled.

    .venv/bin/python -m bench.real_load                      # R = 2, 8; T = 4,000 (8 x 16)
    .venv/bin/python -m bench.real_load --ranks 2,4,8 --tensors 1000 --no-profile

Per rank of each load: CPU seconds of the main thread (``time.thread_time``) and of the
process (every thread), per named collective step of ``dist.Coordinator`` (the load's
phases: ``read marker``, ``load prepare``, ``part refs``, ``load plan``, leftovers,
``load read``; what runs outside a named step is ``(outside)``), peak RSS growth, and
every ``torch.distributed`` call's bytes in and out (objects: their pickle; tensors:
their bytes), by step. ``--profile``: cProfile of the main thread per rank, whose top
functions by own time are reported for the median rank, with the functions whose own
time grew most from the smallest R to the largest.

Results: ``bench/results/real_load.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, git_state, loadavg

MiB = 1 << 20


def state(world_size: int, tensors: int, rows: int, cols: int, zero: bool = False) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    rank = mesh.get_rank()
    sd: dict = {}
    for t in range(tensors):
        local = torch.zeros(rows, cols) if zero else torch.full((rows, cols), float(t * 1000 + rank))
        sd[f"layer{t}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                    shape=torch.Size((world_size * rows, cols)), stride=(cols, 1))
    return {"model": sd}


class Collectives:
    """Counts each ``torch.distributed`` call's bytes (sent, received) by the named
    Coordinator step it runs in, and the CPU seconds spent in each step."""

    OBJ = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
    TENSOR = ("all_reduce", "broadcast", "scatter", "gather", "all_gather", "all_to_all_single", "send", "recv",
              "isend", "irecv", "all_gather_into_tensor", "reduce_scatter_tensor")
    STEPS = ("on_coordinator", "all_ranks", "to_coordinator", "gather_some", "agree", "ask_coordinator", "any_rank",
             "all_gather", "all_to_all_int64")

    def __init__(self):
        self.local = threading.local()
        self.calls: dict[str, dict[str, list]] = {}  # step -> op -> [calls, bytes out, bytes in]
        self.cpu: dict[str, list] = {}  # step -> [thread s, process s]
        self.saved: list = []

    def step(self) -> str:
        stack = getattr(self.local, "stack", None)
        return stack[-1] if stack else "(outside)"

    def _count(self, op: str, out: int, got: int) -> None:
        row = self.calls.setdefault(self.step(), {}).setdefault(op, [0, 0, 0])
        row[0] += 1
        row[1] += out
        row[2] += got

    def install(self) -> "Collectives":
        import torch.distributed as tdist

        from cloudckpt import dist

        def nbytes(x) -> int:
            if isinstance(x, (list, tuple)):
                return sum(nbytes(v) for v in x)
            return int(x.numel() * x.element_size()) if hasattr(x, "element_size") else 0

        def psize(x) -> int:
            try:
                return len(pickle.dumps(x))
            except Exception:  # noqa: BLE001 - an object pickle refuses: counted as 0
                return 0

        for op in self.OBJ + self.TENSOR:
            orig = getattr(tdist, op, None)
            if orig is None:
                continue
            self.saved.append((tdist, op, orig))

            def wrap(*a, _orig=orig, _op=op, **kw):
                me = tdist.get_rank()
                if _op == "all_gather_object":
                    out = _orig(*a, **kw)
                    objs = a[0]
                    self._count(_op, psize(a[1]), sum(psize(o) for i, o in enumerate(objs) if i != me))
                    return out
                if _op == "broadcast_object_list":
                    src = kw.get("src", a[1] if len(a) > 1 else 0)
                    before = psize(a[0]) if me == src else 0
                    out = _orig(*a, **kw)
                    self._count(_op, before * (tdist.get_world_size() - 1), 0 if me == src else psize(a[0]))
                    return out
                if _op == "gather_object":
                    out = _orig(*a, **kw)
                    dst = kw.get("dst", 0)
                    got = sum(psize(o) for i, o in enumerate(a[1] or []) if i != me) if me == dst else 0
                    self._count(_op, 0 if me == dst else psize(a[0]), got)
                    return out
                root = kw.get("src", kw.get("dst", a[2] if len(a) > 2 and isinstance(a[2], int) else 0))
                if _op in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"):
                    n = nbytes(a[0] if a else kw.get("tensor"))
                    self._count(_op, n, n)
                elif _op == "broadcast":  # the root sends, the others receive
                    src = kw.get("src", a[1] if len(a) > 1 else 0)
                    n = nbytes(a[0] if a else kw.get("tensor"))
                    self._count(_op, n if me == src else 0, 0 if me == src else n)
                elif _op in ("send", "isend"):
                    self._count(_op, nbytes(a[0]), 0)
                elif _op in ("recv", "irecv"):
                    self._count(_op, 0, nbytes(a[0]))
                elif _op == "all_to_all_single":
                    self._count(_op, nbytes(a[1]), nbytes(a[0]))
                elif _op == "gather":  # a rank sends its tensor; the root receives the others'
                    mine = nbytes(a[0])
                    got = nbytes(a[1] if len(a) > 1 else kw.get("gather_list") or []) - mine if me == root else 0
                    self._count(_op, 0 if me == root else mine, got)
                elif _op == "scatter":  # the root sends the others theirs; a rank receives its own
                    mine = nbytes(a[0])
                    out = nbytes(a[1] if len(a) > 1 else kw.get("scatter_list") or []) - mine if me == root else 0
                    self._count(_op, out, 0 if me == root else mine)
                return _orig(*a, **kw)

            setattr(tdist, op, wrap)
        for name in self.STEPS:
            orig = getattr(dist.Coordinator, name, None)
            if orig is None:
                continue
            self.saved.append((dist.Coordinator, name, orig))

            def step_wrap(coord, *a, _orig=orig, _name=name, **kw):
                step = a[0] if a and isinstance(a[0], str) else kw.get("step") or _name
                stack = self.local.__dict__.setdefault("stack", [])
                stack.append(step)
                t, p = time.thread_time(), time.process_time()
                try:
                    return _orig(coord, *a, **kw)
                finally:
                    stack.pop()
                    row = self.cpu.setdefault(step, [0.0, 0.0])
                    row[0] += time.thread_time() - t
                    row[1] += time.process_time() - p
                    for r in stack:  # an enclosing step's own time excludes this one
                        self.cpu.setdefault(r, [0.0, 0.0])
                        self.cpu[r][0] -= time.thread_time() - t
                        self.cpu[r][1] -= time.process_time() - p

            setattr(dist.Coordinator, name, step_wrap)
        return self

    def uninstall(self) -> None:
        for owner, name, orig in reversed(self.saved):
            setattr(owner, name, orig)


def _threads() -> dict[int, tuple[str, float]]:
    """``{native thread id: (name, CPU seconds so far)}`` of this process's threads
    (Python's name where the thread is Python's, else the kernel's)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (names.get(int(tid), comm), (int(fields[11]) + int(fields[12])) / tick)
    return out


def _by_name(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per thread name (a trailing number dropped: pool threads summed)
    between two ``_threads`` snapshots; ``(ended)``: threads gone by the second."""
    import re

    out: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        key = re.sub(r"[_-]?\d+$", "", name)
        out[key] = out.get(key, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}


class PoolProfile:
    """cProfile (``time.thread_time``) of every task the process's thread pools run (the
    transfer engine's streams: reading, checking and placing items), one profiler per
    thread, merged into one ``pstats`` file."""

    def __init__(self):
        self.profs: dict[int, Any] = {}
        self.lock = threading.Lock()

    def install(self) -> "PoolProfile":
        import cProfile
        from concurrent.futures import thread as pool_thread

        self.cls, self.orig = pool_thread._WorkItem, pool_thread._WorkItem.run
        orig, profs, lock = self.orig, self.profs, self.lock

        def run(item):
            tid = threading.get_native_id()
            with lock:
                prof = profs.get(tid)
                if prof is None:
                    prof = profs[tid] = cProfile.Profile(time.thread_time)
            prof.enable()
            try:
                return orig(item)
            finally:
                prof.disable()

        self.cls.run = run
        return self

    def uninstall(self) -> None:
        self.cls.run = self.orig

    def dump(self, path: str) -> str | None:
        import pstats

        profs = list(self.profs.values())
        if not profs:
            return None
        st = pstats.Stats(profs[0])
        for p in profs[1:]:
            st.add(p)
        st.dump_stats(path)
        return path


def _peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def save_worker(rank, world_size, url, work, tensors, rows, cols):
    from cloudckpt import Checkpointer

    with Checkpointer(work_dir=work) as ck:
        ck.save(url, state(world_size, tensors, rows, cols))
    return {}


def load_worker(rank, world_size, url, work, tensors, rows, cols, profile_dir, with_build):
    import cProfile
    import gc

    import torch

    from cloudckpt import Checkpointer

    sd = state(world_size, tensors, rows, cols, zero=True)
    ck = Checkpointer(work_dir=work)
    col = Collectives().install()
    prof = cProfile.Profile(time.thread_time) if profile_dir else None
    pool_prof = PoolProfile().install() if profile_dir else None
    gc.collect()
    base = _peak_kb()
    threads = _threads()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    t, p, w = time.thread_time(), time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    try:
        if with_build:
            sd, _ = ck.load_with(url, lambda md: sd)
        else:
            ck.load(url, sd)
    finally:
        if prof:
            prof.disable()
            pool_prof.uninstall()
        col.uninstall()
    thread, proc, wall = time.thread_time() - t, time.process_time() - p, time.perf_counter() - w
    ru2 = resource.getrusage(resource.RUSAGE_SELF)
    switches = [ru2.ru_nvcsw - ru.ru_nvcsw, ru2.ru_nivcsw - ru.ru_nivcsw]
    per_thread = _by_name(threads, _threads())
    per_thread["(ended)"] = round(proc - sum(per_thread.values()), 3)
    ck.close()
    me = torch.distributed.get_rank()
    ok = all(float(v.to_local()[0, 0]) == float(i * 1000 + me) for i, v in enumerate(sd["model"].values()))
    out = {"rank": rank, "thread_cpu_s": round(thread, 3), "process_cpu_s": round(proc, 3), "wall_s": round(wall, 3),
           "peak_rss_growth_mib": round((_peak_kb() - base) / 1024, 1), "bitexact": ok,
           "threads": per_thread, "context_switches": switches,
           "steps": {k: [round(v[0], 3), round(v[1], 3)] for k, v in col.cpu.items()}, "collectives": col.calls}
    out["steps"]["(outside)"] = [round(thread - sum(v[0] for v in col.cpu.values()), 3),
                                 round(proc - sum(v[1] for v in col.cpu.values()), 3)]
    if prof:
        path = os.path.join(profile_dir, f"rank{rank}.pstats")
        prof.dump_stats(path)
        out["pstats"] = path
        out["pool_pstats"] = pool_prof.dump(os.path.join(profile_dir, f"rank{rank}-pool.pstats"))
    return out


def _top(path: str, n: int) -> dict[str, tuple[float, float, int]]:
    import pstats

    st = pstats.Stats(path)
    rows = {}
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows[f"{Path(file).name}:{line}({fn})"] = (tt, ct, nc)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][0])[:n]) if n else rows


def run(ranks: list[int], tensors: int, rows: int, cols: int, profile: bool, with_build: bool, reps: int) -> dict:
    from cloudckpt.testing.multiprocess import run_ranks
    from cloudckpt.testing.servers import SeaweedFS

    s3 = SeaweedFS().start()
    out: dict = {}
    try:
        bucket = s3.create_bucket("realload")
        env = s3.env()
        os.environ.update(env)
        with tempfile.TemporaryDirectory(prefix="cloudckpt-real-load-") as tmp:
            for R in ranks:
                url = f"{bucket}/R{R}/step1"
                work = os.path.join(tmp, f"w{R}")
                run_ranks(R, save_worker, url, work, tensors, rows, cols, env=env, timeout=1800)
                runs = []
                for k in range(reps):
                    pdir = os.path.join(tmp, f"prof{R}-{k}") if profile else None
                    if pdir:
                        os.makedirs(pdir)
                    res = run_ranks(R, load_worker, url, work, tensors, rows, cols, pdir, with_build, env=env,
                                    timeout=1800)
                    if pdir:
                        for r in res:
                            r["top"] = _top(r.pop("pstats"), 0)
                            pool = r.pop("pool_pstats", None)
                            r["pool_top"] = _top(pool, 0) if pool else {}
                    runs.append(res)
                # the run whose median rank's thread CPU is the median of the runs
                med = [statistics.median(r["thread_cpu_s"] for r in res) for res in runs]
                pick = runs[sorted(range(len(runs)), key=lambda i: med[i])[len(runs) // 2]]
                out[R] = {"ranks": pick, "median_thread_cpu_runs": med}
                print(f"R={R}: median rank thread CPU {med} s", file=sys.stderr, flush=True)
    finally:
        s3.stop()
    return out


def _median_rank(ranks: list[dict]) -> dict:
    return sorted(ranks, key=lambda r: r["thread_cpu_s"])[len(ranks) // 2]


def report(res: dict, meta: dict) -> str:
    Rs = sorted(int(r) for r in res)
    lines = [f"# bench.real_load: one rank's load against the world size ({meta['tensors']:,} DTensor shards of "
             f"({meta['rows']}, {meta['cols']}) float32 per rank{', load_with' if meta['with_build'] else ''})", "",
             f"Command: `{meta['command']}`  ", f"Measured {meta['when']} on {meta['cpus']} CPUs "
             f"(load average before {meta['load_before']}).", "",
             "| R | CPU-s: main thread (median rank) / process (median of the ranks) | wall s | "
             "context switches: voluntary / involuntary | peak RSS growth (MiB) | bit-exact |",
             "|---|---|---|---|---|---|"]
    for R in Rs:
        rk = res[R]["ranks"]
        m = _median_rank(rk)
        sw = m.get("context_switches", [0, 0])
        lines.append(f"| {R} | {m['thread_cpu_s']:.2f} / {statistics.median(r['process_cpu_s'] for r in rk):.2f} | "
                     f"{m['wall_s']:.1f} | "
                     f"{sw[0]:,} / {sw[1]:,} | "
                     f"{statistics.median(r['peak_rss_growth_mib'] for r in rk):.0f} | "
                     f"{all(r['bitexact'] for r in rk)} |")
    names = sorted({n for R in Rs for n in _median_rank(res[R]["ranks"])["threads"]})
    lines += ["", "CPU-s by thread of the median rank (pool threads summed):", "",
              "| thread | " + " | ".join(f"R = {R}" for R in Rs) + " |", "|---|" + "---|" * len(Rs)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{_median_rank(res[R]['ranks'])['threads'].get(n, 0):.3f}"
                                             for R in Rs) + " |")
    steps = sorted({s for R in Rs for r in res[R]["ranks"] for s in r["steps"]})
    lines += ["", "Per step, main-thread CPU-s of the median rank, and what an ordinary rank (rank 1) sends / "
              "receives in the step (bytes):", "",
              "| step | " + " | ".join(f"R = {R}: CPU-s; out / in" for R in Rs) + " |",
              "|---|" + "---|" * len(Rs)]
    for s in steps:
        cells = []
        for R in Rs:
            m = _median_rank(res[R]["ranks"])
            one = res[R]["ranks"][1]
            c = one["collectives"].get(s, {})
            cells.append(f"{m['steps'].get(s, [0])[0]:.3f}; {sum(v[1] for v in c.values()):,} / "
                         f"{sum(v[2] for v in c.values()):,}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if all("top" in r for R in Rs for r in res[R]["ranks"]):
        lo, hi = Rs[0], Rs[-1]
        a, b = _median_rank(res[lo]["ranks"])["top"], _median_rank(res[hi]["ranks"])["top"]
        grew = sorted(((b[k][0] - a.get(k, (0,))[0], k) for k in b), reverse=True)[:15]
        lines += ["", f"Functions whose own time (main thread) grew most, R = {lo} -> {hi} (median rank):", "",
                  f"| function | own s, R = {lo} | R = {hi} | calls R = {lo} | R = {hi} |", "|---|---|---|---|---|"]
        for _, k in grew:
            lines.append(f"| `{k}` | {a.get(k, (0, 0, 0))[0]:.3f} | {b[k][0]:.3f} | {a.get(k, (0, 0, 0))[2]:,} | "
                         f"{b[k][2]:,} |")
        pa, pb = _median_rank(res[lo]["ranks"])["pool_top"], _median_rank(res[hi]["ranks"])["pool_top"]
        grew = sorted(((pb[k][0] - pa.get(k, (0,))[0], k) for k in pb), reverse=True)[:15]
        ta, tb = sum(v[0] for v in pa.values()), sum(v[0] for v in pb.values())
        lines += ["", f"Pool threads (the transfer engine's streams): own time grew most, R = {lo} -> {hi} "
                  f"(median rank; total {ta:.2f} -> {tb:.2f} s):",
                  "", f"| function | own s, R = {lo} | R = {hi} | calls R = {lo} | R = {hi} |", "|---|---|---|---|---|"]
        for _, k in grew:
            lines.append(f"| `{k}` | {pa.get(k, (0, 0, 0))[0]:.3f} | {pb[k][0]:.3f} | {pa.get(k, (0, 0, 0))[2]:,} | "
                         f"{pb[k][2]:,} |")
        top = sorted(b.items(), key=lambda kv: -kv[1][0])[:15]
        lines += ["", f"Top functions by own time at R = {hi} (median rank):", "",
                  "| function | own s | cum s | calls |", "|---|---|---|---|"]
        lines += [f"| `{k}` | {v[0]:.3f} | {v[1]:.3f} | {v[2]:,} |" for k, v in top]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,8")
    ap.add_argument("--tensors", type=int, default=4000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--cols", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1, help="loads per R; the run of median CPU is reported")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--load-with", action="store_true", help="load through Checkpointer.load_with")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stem", default="real_load")
    a = ap.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",")]
    meta = {"command": " ".join([".venv/bin/python -m bench.real_load"] + (sys.argv[1:] if argv is None else argv)),
            "tensors": a.tensors, "rows": a.rows, "cols": a.cols, "with_build": a.load_with, "cpus": os.cpu_count(),
            "load_before": loadavg(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": git_state()}
    res = run(ranks, a.tensors, a.rows, a.cols, a.profile, a.load_with, a.reps)
    md = report(res, meta)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for r in res.values():
        for rank in r["ranks"]:
            if rank["rank"] != _median_rank(r["ranks"])["rank"]:
                rank.pop("top", None)
                rank.pop("pool_top", None)
            for k in ("top", "pool_top"):  # the 200 functions of most own time
                if k in rank:
                    rank[k] = dict(sorted(rank[k].items(), key=lambda kv: -kv[1][0])[:200])
    (out / f"{a.stem}.json").write_text(json.dumps({**meta, "results": {str(k): v for k, v in res.items()}},
                                                   default=str) + "\n")
    (out / f"{a.stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
