"""Where a real rank's save CPU and memory go as the world grows: the same per-rank
state (T FSDP-style Shard(0) DTensors of ``rows x cols`` float32 per rank) saved by R
real gloo ranks against SeaweedFS on 127.0.0.1, in two jobs per R:

- job 1, a fresh job: ``first save`` (step 1; planned by owners, ``.metadata``
  assembled in the store: dcp/owners.py; ``--first-save gather``: every plan gathered on
  rank 0, as before owners), then a ``repeated save`` (step 2; planned from step 1's
  structure, ``.metadata`` copied in the store; ``gather``: DCP's plan cache);
- job 2, a restart: ``load`` of step 2 (checked bit-exact), then ``save after resume``
  (step 3: the first save of the job, planned from the loaded step), then the
  ``calibration``: every rank, started together, saves its shards with stock DCP alone
  (no process group) to a folder of its own: work that is the same at every R, so its
  growth is what R processes sharing this machine's cores cost, not the library.

    .venv/bin/python -m bench.real_ranks                      # R = 2, 4, 8; T = 4,000 (8 x 16)
    .venv/bin/python -m bench.real_ranks --ranks 2,8 --shards 400x8x16 --profile
    .venv/bin/python -m bench.real_ranks --first-save gather --stem real_ranks_gather

Per rank and phase: CPU seconds of the main thread (``time.thread_time``), of the
process (every thread but the probe's RSS sampler) and of each thread by name, peak RSS
growth (the resident set sampled every 2 ms from ``/proc/self/statm`` during the phase,
minus its size before), CPU per named collective
step (``dist.Coordinator``'s, and DCP's own ``plan`` and ``write``), and the bytes each
``torch.distributed`` call sends and receives, by step. ``--profile``: cProfile of the
main thread of every rank; the functions whose own time grew most from the smallest R
to the largest are reported for rank 0's first save and the median rank's saves.

Results: ``bench/results/real_ranks.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT, git_state, loadavg
from bench.real_load import _by_name, _threads

MiB = 1 << 20
PHASES = ("first save", "repeated save", "load", "save after resume", "calibration")


def state(world_size: int, tensors: int, rows: int, cols: int, zero: bool = False) -> dict:
    """``{"model": {layer{t}.weight: a Shard(0) DTensor}}``, rank ``r``'s shard of tensor ``t``
    filled with ``1000 t + r`` (zeros: ``zero``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    values = [0.0] * tensors if zero else [1000.0 * t + mesh.get_rank() for t in range(tensors)]
    shape = torch.Size((world_size * rows, cols))
    return {"model": {f"layer{t}.weight": DTensor.from_local(torch.full((rows, cols), v), mesh, [Shard(0)],
                                                             run_check=False, shape=shape, stride=(cols, 1))
                      for t, v in enumerate(values)}}


class RssPeak:
    """The peak resident set of this process while it runs, sampled from /proc/self/statm."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self.base = every, 0, 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> "RssPeak":
        self.base = self.peak = self._rss()
        self._t = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth_mib(self) -> float:
        return round((self.peak - self.base) / MiB, 1)


class Probe:
    """CPU seconds per named collective step and each ``torch.distributed`` call's bytes
    (pickled objects, tensors) by step. Steps: ``dist.Coordinator``'s names, and DCP's
    ``dcp plan`` / ``dcp write`` (the frames of its ``reduce_scatter`` / ``all_reduce``)."""

    CALLS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "all_reduce",
             "broadcast", "gather", "scatter", "all_gather", "all_gather_single", "all_to_all_single", "send",
             "recv")
    COORD = ("on_coordinator", "all_ranks", "to_coordinator", "gather_some", "agree", "ask_coordinator",
             "all_to_all_objects", "all_gather_ints", "any_rank")

    def __init__(self):
        self.tls = threading.local()
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, dict[str, list]] = {}  # step -> call -> [n, bytes out, bytes in]
        self.overhead = 0.0  # thread CPU-s the probe spent sizing objects (pickling them): not the save's
        self._undo: list = []

    def _stack(self) -> list:
        return self.tls.__dict__.setdefault("stack", [])

    def _enter(self, name: str) -> tuple[float, float]:
        self._stack().append(name)
        return time.thread_time(), self.overhead

    def _leave(self, t: tuple[float, float]) -> None:
        name = self._stack().pop()
        spent = time.thread_time() - t[0] - (self.overhead - t[1])  # the probe's own sizing is not the step's
        self.cpu[name] = self.cpu.get(name, 0.0) + spent
        if self._stack():  # the enclosing step's own time leaves this one out
            outer = self._stack()[-1]
            self.cpu[outer] = self.cpu.get(outer, 0.0) - spent

    def _count(self, call: str, out: int, got: int) -> None:
        step = self._stack()[-1] if self._stack() else "(outside)"
        row = self.calls.setdefault(step, {}).setdefault(call, [0, 0, 0])
        row[0] += 1
        row[1] += out
        row[2] += got

    def _patch(self, owner, name: str, make) -> None:
        orig = getattr(owner, name, None)
        if orig is not None:
            self._undo.append((owner, name, orig))
            setattr(owner, name, make(orig))

    def install(self) -> "Probe":
        import torch.distributed as tdist
        import torch.distributed.checkpoint.state_dict_saver as saver

        from cloudckpt import dist

        def nbytes(x) -> int:
            if isinstance(x, (list, tuple)):  # a list of objects (or tensors) each sent on its own
                return sum(nbytes(v) if hasattr(v, "element_size") else len(pickle.dumps(v)) for v in x)
            if hasattr(x, "element_size"):
                return int(x.numel() * x.element_size())
            try:
                return len(pickle.dumps(x)) if x is not None else 0
            except Exception:  # noqa: BLE001 - a figure, not a check
                return 0

        def size(x) -> int:
            t = time.thread_time()
            try:
                return nbytes(x)
            finally:
                self.overhead += time.thread_time() - t

        def call(orig, op):
            import inspect

            sig = inspect.signature(orig)

            def wrapped(*a, **kw):
                me, n = tdist.get_rank(), tdist.get_world_size()
                args = list(sig.bind_partial(*a, **kw).arguments.values())
                first, second = (args + [None, None])[:2]
                root = kw.get("dst", kw.get("src", kw.get("group_dst", kw.get("group_src", 0))))
                out = orig(*a, **kw)
                if op == "gather_object":  # (obj, object_gather_list): each object pickled on its own
                    mine = size([first])
                    self._count(op, 0 if me == root else mine, size(second) - mine if me == root else 0)
                elif op == "scatter_object_list":  # (scatter_object_output_list, scatter_object_input_list)
                    own = size(first)  # the root keeps its own entry: it is not sent
                    self._count(op, size(second) - own if me == root else 0, 0 if me == root else own)
                elif op == "broadcast_object_list":
                    self._count(op, size(first) * (n - 1) if me == root else 0, 0 if me == root else size(first))
                elif op == "all_gather_object":  # (object_list, obj)
                    self._count(op, size(second), size(first) - size(second))
                elif op == "all_to_all_single":  # (output, input)
                    self._count(op, size(second), size(first))
                elif op in ("all_gather", "all_gather_single"):  # (tensor_list or output, tensor)
                    self._count(op, size(second), size(first) - size(second))
                elif op in ("gather", "scatter"):  # (tensor, list on the root): the root's list, others' own
                    mine, many = size(first), size(second) if me == root else 0
                    others = max(0, many - mine)  # the root's list, its own entry left out
                    if op == "gather":
                        self._count(op, 0 if me == root else mine, others if me == root else 0)
                    else:
                        self._count(op, others if me == root else 0, 0 if me == root else mine)
                elif op == "broadcast":  # the root sends to every other rank
                    self._count(op, size(first) * (n - 1) if me == root else 0, 0 if me == root else size(first))
                elif op in ("send", "recv"):
                    self._count(op, size(first) if op == "send" else 0, size(first) if op == "recv" else 0)
                else:
                    self._count(op, size(first), size(first))
                return out
            return wrapped

        for op in self.CALLS:
            self._patch(tdist, op, lambda orig, op=op: call(orig, op))

        def named(orig, name_of):
            """``orig`` run as the step ``name_of(args, kwargs)`` names (None: as it is)."""
            def wrapped(*a, **kw):
                name = name_of(a, kw)
                if name is None:
                    return orig(*a, **kw)
                t = self._enter(name)
                try:
                    return orig(*a, **kw)
                finally:
                    self._leave(t)
            return wrapped

        def coord_step(default):  # its first string argument (all_to_all_objects, any_rank: the second)
            return lambda a, kw: kw.get("step") or next((x for x in a[1:3] if isinstance(x, str)), None) or default

        def outside(a, kw):  # a transfer outside any named step (the index header's layouts to rank 0)
            return None if self._stack() else "point to point (outside a named step)"

        for name in self.COORD:
            self._patch(dist.Coordinator, name, lambda orig, name=name: named(orig, coord_step(name)))
        for name in ("send_bytes", "recv_bytes"):
            self._patch(dist.Coordinator, name, lambda orig: named(orig, outside))
        wrapper = saver._DistWrapper  # DCP's named collective steps ("plan", "write")
        for name in ("reduce_scatter", "all_reduce", "all_gather"):
            self._patch(wrapper, name, lambda orig: named(orig, lambda a, kw: f"dcp {a[1]}"))
        # DCP's closing barrier when it runs with no collective (planned by owners or from a kept step)
        self._patch(wrapper, "barrier", lambda orig: named(orig, lambda a, kw: "dcp write"))
        return self

    def uninstall(self) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)


def _measure(phase: str, fn, prof_dir: str | None, rank: int) -> dict:
    import cProfile
    import gc

    probe = Probe().install()
    prof = cProfile.Profile(time.thread_time) if prof_dir else None
    gc.collect()
    with RssPeak() as rss:
        t, p = time.thread_time(), time.process_time()
        threads = _threads()
        if prof:
            prof.enable()
        try:
            fn()
        finally:
            if prof:
                prof.disable()
            probe.uninstall()
        # what the probe spent sizing objects (pickling a gather's every plan on rank 0) is left out
        thread, proc = time.thread_time() - t - probe.overhead, time.process_time() - p - probe.overhead
        by_thread = _by_name(threads, _threads())
        by_thread["(ended)"] = round(max(0.0, time.process_time() - p - sum(by_thread.values())), 3)
        proc -= by_thread.get("rss-sampler", 0.0)  # the probe's sampler is not the phase's
    out = {"thread_cpu_s": round(thread, 3), "process_cpu_s": round(proc, 3), "rss_growth_mib": rss.growth_mib,
           "steps": {k: round(v, 3) for k, v in probe.cpu.items()}, "calls": probe.calls,
           "threads": by_thread}
    out["steps"]["(outside)"] = round(thread - sum(probe.cpu.values()), 3)
    if prof:
        out["pstats"] = os.path.join(prof_dir, f"{phase.replace(' ', '_')}-rank{rank}.pstats")
        prof.dump_stats(out["pstats"])
    return out


def fresh_job(rank, world_size, url, work, tensors, rows, cols, prof_dir, owners=True):
    from cloudckpt import Checkpointer
    from cloudckpt.checkpoint.rank_writer import RankWriter

    RankWriter.owners_first_save = owners

    sd = state(world_size, tensors, rows, cols)
    out = {"rank": rank}
    with Checkpointer(work_dir=work) as ck:
        out["first save"] = _measure("first save", lambda: ck.save(f"{url}/step1", sd), prof_dir, rank)
        out["repeated save"] = _measure("repeated save", lambda: ck.save(f"{url}/step2", sd), prof_dir, rank)
    return out


def resumed_job(rank, world_size, url, work, tensors, rows, cols, prof_dir):
    from cloudckpt import Checkpointer

    sd = state(world_size, tensors, rows, cols, zero=True)
    out = {"rank": rank}
    with Checkpointer(work_dir=work) as ck:
        out["load"] = _measure("load", lambda: ck.load(f"{url}/step2", sd), prof_dir, rank)
        out["bitexact"] = all(float(v.to_local()[0, 0]) == float(i * 1000 + rank)
                              for i, v in enumerate(sd["model"].values()))
        out["save after resume"] = _measure("save after resume", lambda: ck.save(f"{url}/step3", sd), prof_dir,
                                            rank)
    out["calibration"] = _calibrate(rank, sd, work, prof_dir)
    return out


def _calibrate(rank: int, sd: dict, work: str, prof_dir: str | None) -> dict:
    """What this machine makes of R processes working at once, with no process group in
    the work: every rank, started together, saves its own shards (plain tensors) with
    stock DCP in one process to a folder of its own. Its work is the same at every R, so
    its CPU's growth from the smallest R is the machine's (R ranks and the store's server
    sharing two cores), not the library's."""
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp

    from cloudckpt.checkpoint.rank_writer import quiet_dcp

    local = {"model": {k: v.to_local().clone() for k, v in sd["model"].items()}}
    folder = os.path.join(work, f"calibration-r{rank}")
    tdist.barrier()
    with quiet_dcp():  # DCP warns that it saves in one process: intended
        return _measure("calibration", lambda: dcp.save(local, storage_writer=dcp.FileSystemWriter(folder),
                                                        no_dist=True), prof_dir, rank)


def _top(path: str) -> dict[str, tuple[float, int]]:
    import pstats

    return {f"{Path(f).name}:{line}({fn})": (tt, nc)
            for (f, line, fn), (_cc, nc, tt, _ct, _callers) in pstats.Stats(path).stats.items()}


def run(ranks: list[int], tensors: int, rows: int, cols: int, profile: bool, owners: bool = True) -> dict:
    from cloudckpt.testing.multiprocess import run_ranks
    from cloudckpt.testing.servers import SeaweedFS

    s3 = SeaweedFS().start()
    out: dict = {}
    try:
        bucket = s3.create_bucket("realranks")
        env = s3.env()
        with tempfile.TemporaryDirectory(prefix="cloudckpt-real-ranks-") as tmp:
            for R in ranks:
                url, work = f"{bucket}/R{R}", os.path.join(tmp, f"w{R}")
                pdir = os.path.join(tmp, f"prof{R}") if profile else None
                if pdir:
                    os.makedirs(pdir)
                a = run_ranks(R, fresh_job, url, work, tensors, rows, cols, pdir, owners, env=env, timeout=3600)
                b = run_ranks(R, resumed_job, url, work, tensors, rows, cols, pdir, env=env, timeout=3600)
                res = [{**x, **y} for x, y in zip(a, b, strict=True)]
                if pdir:
                    for r in res:
                        for ph in PHASES:
                            r[ph]["top"] = _top(r[ph].pop("pstats"))
                out[R] = res
                print(f"R={R}: done", file=sys.stderr, flush=True)
    finally:
        s3.stop()
    return out


def _median(rk: list[dict], phase: str, key: str) -> float:
    return statistics.median(r[phase][key] for r in rk)


def _median_rank(rk: list[dict], phase: str) -> dict:
    return sorted(rk, key=lambda r: r[phase]["thread_cpu_s"])[len(rk) // 2]


def report(res: dict, meta: dict) -> str:
    Rs = sorted(res)
    lo, hi = Rs[0], Rs[-1]
    lines = [f"# bench.real_ranks: one rank's save against the world size ({meta['tensors']:,} DTensor shards of "
             f"({meta['rows']}, {meta['cols']}) float32 per rank)", "",
             f"Command: `{meta['command']}`  ", f"Measured {meta['when']} on {meta['cpus']} CPUs "
             f"(load average before {meta['load_before']}).", "",
             "Median rank (main-thread CPU-s / process CPU-s / peak RSS growth MiB), and rank 0:", "",
             "| phase | " + " | ".join(f"R = {R}" for R in Rs) + f" | x ({hi} / {lo}) | x CPU over calibration's |",
             "|---|" + "---|" * (len(Rs) + 2)]
    cal = _median(res[hi], "calibration", "thread_cpu_s") / _median(res[lo], "calibration", "thread_cpu_s")
    calp = _median(res[hi], "calibration", "process_cpu_s") / _median(res[lo], "calibration", "process_cpu_s")
    for ph in PHASES:
        for who in ("median", "rank 0"):
            cells, first, last = [], None, None
            for R in Rs:
                rk = res[R]
                if who == "median":
                    v = (_median(rk, ph, "thread_cpu_s"), _median(rk, ph, "process_cpu_s"),
                         _median(rk, ph, "rss_growth_mib"))
                else:
                    v = (rk[0][ph]["thread_cpu_s"], rk[0][ph]["process_cpu_s"], rk[0][ph]["rss_growth_mib"])
                cells.append(f"{v[0]:.2f} / {v[1]:.2f} / {v[2]:.0f}")
                first = v if first is None else first
                last = v
            ratio = " / ".join(f"{b / a:.2f}" if a else "-" for a, b in zip(first, last, strict=True))
            norm = (f"{last[0] / first[0] / cal:.2f} / {last[1] / first[1] / calp:.2f}"
                    if first[0] and first[1] and ph != "calibration" else "-")
            lines.append(f"| {ph}, {who} | " + " | ".join(cells) + f" | {ratio} | {norm} |")
    lines += ["", "Calibration: every rank, started together, saves its own shards with stock DCP alone (no "
              "process group, a local folder): the same work at every R, so its growth is the machine's. The last "
              "column divides each phase's growth (main thread / process) by the calibration's.", "",
              f"Bit-exact loads: {all(r['bitexact'] for R in Rs for r in res[R])}.", ""]
    for ph in PHASES[:-1]:
        steps = sorted({s for R in Rs for r in res[R] for s in r[ph]["steps"]})
        lines += [f"## {ph}: per step, main-thread CPU-s (rank 0; rank 1) and bytes out / in (rank 0; rank 1)", "",
                  "| step | " + " | ".join(f"R = {R}" for R in Rs) + " |", "|---|" + "---|" * len(Rs)]
        for s in steps:
            cells = []
            for R in Rs:
                r0, r1 = res[R][0][ph], res[R][1][ph]
                b0, b1 = ([sum(v[i] for v in r["calls"].get(s, {}).values()) for i in (1, 2)] for r in (r0, r1))
                cells.append(f"{r0['steps'].get(s, 0):.3f}; {r1['steps'].get(s, 0):.3f} — "
                             f"{b0[0]:,} / {b0[1]:,}; {b1[0]:,} / {b1[1]:,}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    if all("top" in res[R][0][ph] for R in Rs for ph in PHASES):
        for ph, who in (("first save", "rank 0"), ("first save", "median"), ("save after resume", "rank 0"),
                        ("repeated save", "median")):
            a, b = ((res[R][0] if who == "rank 0" else _median_rank(res[R], ph))[ph]["top"] for R in (lo, hi))
            grew = sorted(((b[k][0] - a.get(k, (0, 0))[0], k) for k in b), reverse=True)[:12]
            lines += [f"## {ph}, {who}: own time that grew most, R = {lo} -> {hi}", "",
                      f"| function | own s, R = {lo} | R = {hi} | calls R = {lo} | R = {hi} |", "|---|---|---|---|---|"]
            lines += [f"| `{k}` | {a.get(k, (0, 0))[0]:.3f} | {b[k][0]:.3f} | {a.get(k, (0, 0))[1]:,} | {b[k][1]:,} |"
                      for _, k in grew]
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated")
    ap.add_argument("--shards", default="4000x8x16", help="per rank: TENSORSxROWSxCOLS float32 DTensor shards")
    ap.add_argument("--profile", action="store_true", help="cProfile every rank's main thread")
    ap.add_argument("--first-save", choices=("owners", "gather"), default="owners",
                    help="a fresh job's first save: planned by owners (the library's), or every plan gathered")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stem", default="real_ranks")
    a = ap.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",")]
    a.tensors, a.rows, a.cols = (int(x) for x in a.shards.split("x"))
    meta = {"command": " ".join([".venv/bin/python -m bench.real_ranks"] + (sys.argv[1:] if argv is None else argv)),
            "tensors": a.tensors, "rows": a.rows, "cols": a.cols, "cpus": os.cpu_count(), "load_before": loadavg(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": git_state()}
    res = run(ranks, a.tensors, a.rows, a.cols, a.profile, a.first_save == "owners")
    md = report(res, meta)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for rk in res.values():
        for r in rk:
            for ph in PHASES:
                r[ph].pop("top", None)
    (out / f"{a.stem}.json").write_text(json.dumps({**meta, "results": {str(k): v for k, v in res.items()}}) + "\n")
    (out / f"{a.stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
