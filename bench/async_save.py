"""How long ``Checkpointer.save_async`` blocks the training loop, and the host
memory it takes, against a plain CPU copy of the same state and against
``torch.distributed.checkpoint.async_save`` (stock, ``FileSystemWriter``).

    .venv/bin/python bench/async_save.py                 # 1 GiB state, 2 ranks, 3 saves each
    .venv/bin/python bench/async_save.py --bytes 4GiB --reps 4
    .venv/bin/python bench/async_save.py --smoke         # tiny, one save each

Per rank (2 spawned gloo ranks, DTensor-sharded model + Adam state as in
``bench/run.py``; S = the bytes of this rank's shard):

- copy: ``t.clone()`` of every local tensor: the floor for any staging copy.
- cloudckpt -> local dir, cloudckpt -> S3 (SeaweedFS on 127.0.0.1):
  ``save_async`` to a new step each repetition; "blocked" is the time until it
  returns (staging included). The first save allocates the staging buffers, later
  ones reuse them, so the first and the rest are reported apart.
- DCP async_save -> local dir: ``dcp.async_save(sd, storage_writer=FileSystemWriter(...))``
  (stock staging: a fresh CPU copy each call), blocked until it returns.

While each background save runs, the rank runs a small "training loop" (fixed
matmuls) and reports how much slower its steps got (2 cores are shared by the
ranks, the background writers and the object store, so this is pessimistic).

Memory: peak RSS above the RSS just before the call, from the call until the
save's future is done (the kernel's high-water mark, reset before the call),
as a multiple of S. Targets (issue 4): blocked <= 1.5x the copy; peak RSS above
baseline <= 1.25x S. Results: ``bench/results/async_save.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cloudckpt.units import GiB

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _train_steps(seconds_budget: float, done) -> list[float]:
    """Run fixed matmul 'training steps' until ``done()``; their durations."""
    import torch

    a = torch.randn(384, 384)
    out = []
    deadline = time.perf_counter() + seconds_budget
    while not done() and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ a.T / 384)
        out.append(time.perf_counter() - t0)
    return out


def rank_main(rank: int, world_size: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from bench import state as S
    from cloudckpt import Checkpointer

    sd = S.build_state(world_size, args["bytes"])
    nbytes = S.local_bytes(sd)
    work = tempfile.mkdtemp(prefix=f"async-bench-r{rank}-", dir=args["tmp"])
    out: dict = {"rank": rank, "S": nbytes, "runs": {}}

    # idle step time of the "training loop"
    idle = _train_steps(3.0, lambda: False)
    out["idle_step_s"] = statistics.median(idle)

    def measure(name: str, start, wait) -> None:
        runs = out["runs"].setdefault(name, [])
        S.barrier()
        S.trim_malloc()
        before = S.rss()
        S.reset_peak()
        t0 = time.perf_counter()
        handle = start()
        blocked = time.perf_counter() - t0
        state = {"done": False}
        steps = _train_steps(600.0, lambda: state["done"] or handle_done(handle))
        wait(handle)
        total = time.perf_counter() - t0
        peak = S.peak_rss() - before
        runs.append({"blocked_s": blocked, "total_s": total, "peak_rss_above_baseline": peak,
                     "peak_over_S": peak / nbytes, "train_steps": len(steps),
                     "step_slowdown": (statistics.median(steps) / out["idle_step_s"]) if steps else None})

    def handle_done(h) -> bool:
        return h.done() if hasattr(h, "done") else True

    # 1. the floor: a plain CPU copy
    copies = []
    for _ in range(args["reps"]):
        S.barrier()
        t0 = time.perf_counter()
        clone = [t.clone() for t in S.local_tensors(sd)]
        copies.append(time.perf_counter() - t0)
        del clone
    out["copy_s"] = copies

    # 2. cloudckpt save_async (staging buffers allocated on the first save, reused after)
    targets = [("cloudckpt_local", os.path.join(work, "ck")), ]
    if args.get("s3_url"):
        targets.append(("cloudckpt_s3", args["s3_url"]))
    for name, base in targets:
        ck = Checkpointer(work_dir=os.path.join(work, "ckwork"))
        try:
            for rep in range(args["reps"]):
                measure(name,
                        lambda rep=rep, ck=ck, base=base: ck.save_async(f"{base}/step{rep + 1}", sd, {"step": rep + 1}),
                        lambda f: f.result())
        finally:
            ck.close()  # releases the staging buffers
        S.trim_malloc()

    # 3. stock DCP async_save to a local dir (its default staging: a new CPU copy per call)
    pg = dist.new_group(backend="gloo")  # DCP's background collectives off the default group
    for rep in range(args["reps"]):
        path = os.path.join(work, "dcp", f"step{rep + 1}")

        def start(path=path):
            return dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=2, sync_files=False),
                                  process_group=pg)

        def wait(h):
            fut = getattr(h, "upload_completion", h)
            fut.result()

        measure("dcp_async_local", start, wait)
    S.barrier()
    shutil.rmtree(work, ignore_errors=True)
    out["torch"] = torch.__version__
    return out


def summarize(ranks: list[dict]) -> dict:
    copy = statistics.median(max(r["copy_s"][i] for r in ranks) for i in range(len(ranks[0]["copy_s"])))
    rows = {"copy": {"blocked_s": copy, "ratio_to_copy": 1.0}}
    for name in ranks[0]["runs"]:
        runs = [[r["runs"][name][i] for r in ranks] for i in range(len(ranks[0]["runs"][name]))]

        def agg(rs, f, op=max):
            return op(x[f] for x in rs)

        first = runs[0]
        rest = runs[1:] or runs
        row = {
            "first_blocked_s": agg(first, "blocked_s"),
            "blocked_s": statistics.median(agg(r, "blocked_s") for r in rest),
            "total_s": statistics.median(agg(r, "total_s") for r in rest),
            "first_peak_over_S": agg(first, "peak_over_S"),
            "peak_over_S": statistics.median(agg(r, "peak_over_S") for r in rest),
            "step_slowdown": statistics.median(x for r in rest for x in [agg(r, "step_slowdown")] if x is not None)
            if any(agg(r, "step_slowdown") is not None for r in rest) else None,
            "samples": runs,
        }
        row["ratio_to_copy"] = row["blocked_s"] / copy
        row["first_ratio_to_copy"] = row["first_blocked_s"] / copy
        rows[name] = row
    return rows


def markdown(meta: dict, rows: dict) -> str:
    S = meta["S_per_rank"]
    out = [f"Command: `{meta['command']}`  ",
           f"When: {meta['when']}; {meta['ranks']} ranks, S = {S / GiB:.2f} GiB per rank "
           f"({meta['bytes'] / GiB:.2f} GiB state); "
           f"{meta['reps']} saves per tool (\"steady\" = median of saves 2..N, slowest rank each); load average before "
           f"{meta['load_before']}, after {meta['load_after']} on {meta['cpus']} cores.", "",
           "| what | blocked s (first save) | blocked s (steady) | blocked / copy (steady) | save total s | "
           "peak RSS above baseline / S (first; steady) | training step slowdown during the save |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    names = {"copy": "plain CPU copy (clone of every tensor)", "cloudckpt_local": "cloudckpt save_async -> local dir",
             "cloudckpt_s3": "cloudckpt save_async -> S3 (SeaweedFS)",
             "dcp_async_local": "DCP async_save -> local dir (FileSystemWriter)"}
    for k, r in rows.items():
        if k == "copy":
            out.append(f"| {names[k]} | - | {r['blocked_s']:.3f} | 1.00 | - | - | - |")
            continue
        slow = "-" if r["step_slowdown"] is None else f"{r['step_slowdown']:.2f}x"
        out.append(f"| {names.get(k, k)} | {r['first_blocked_s']:.3f} | {r['blocked_s']:.3f} | "
                   f"{r['ratio_to_copy']:.2f} | "
                   f"{r['total_s']:.2f} | {r['first_peak_over_S']:.2f}; {r['peak_over_S']:.2f} | {slow} |")
    out += ["", "| target | measured | met |", "|---|---:|---|"]
    for k in ("cloudckpt_local", "cloudckpt_s3"):
        if k in rows:
            r = rows[k]
            out.append(f"| {names[k]}: blocked <= 1.5x copy (steady; first) | {r['ratio_to_copy']:.2f}; "
                       f"{r['first_ratio_to_copy']:.2f} | "
                       f"{_yes(r['ratio_to_copy'] <= 1.5, meta)}; {_yes(r['first_ratio_to_copy'] <= 1.5, meta)} |")
            worst = max(r["first_peak_over_S"], r["peak_over_S"])
            out.append(f"| {names[k]}: peak RSS above baseline <= 1.25x S (worst of first, steady) | {worst:.2f} | "
                       f"{_yes(worst <= 1.25, meta)} |")
    return "\n".join(out) + "\n"


def _yes(ok: bool, meta: dict) -> str:
    if meta.get("smoke"):
        return "not judged"
    return "yes" if ok else "**no**"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default=None, help="state size, e.g. 1GiB (default; smoke 4MiB)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="saves per tool (default 3; smoke 1)")
    ap.add_argument("--no-s3", action="store_true", help="skip the cloudckpt -> S3 row (no SeaweedFS)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--stem", default=None, help="output file names (default async_save, or async_save_smoke)")
    a = ap.parse_args(argv)
    from bench.common import git_state, loadavg, parse_size
    from cloudckpt.testing.multiprocess import run_ranks
    from cloudckpt.testing.servers import SeaweedFS

    nbytes = parse_size(a.bytes or ("4MiB" if a.smoke else "1GiB"))
    reps = a.reps or (1 if a.smoke else 3)
    command = " ".join([".venv/bin/python bench/async_save.py"] + (sys.argv[1:] if argv is None else list(argv)))
    load_before = loadavg()
    args = {"bytes": nbytes, "reps": reps, "tmp": a.tmp}
    s3 = None
    try:
        env = dict(os.environ)
        if not a.no_s3:
            s3 = SeaweedFS().start()
            s3.create_bucket("async")
            env.update(s3.env())
            args["s3_url"] = "s3://async/run"
        print(f"async bench: {nbytes / GiB:.2f} GiB state, {a.ranks} ranks, {reps} saves each, load {load_before}",
              flush=True)
        ranks = run_ranks(a.ranks, rank_main, args, env=env, timeout=3600)
    finally:
        if s3 is not None:
            s3.stop()
    rows = summarize(ranks)
    meta = {"command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ranks": a.ranks,
            "bytes": nbytes, "S_per_rank": max(r["S"] for r in ranks), "reps": reps, "load_before": load_before,
            "load_after": loadavg(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": ranks[0]["torch"], "smoke": a.smoke, "git": git_state()}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = a.stem or ("async_save_smoke" if a.smoke else "async_save")
    (out_dir / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows, "per_rank": ranks}, indent=1) + "\n")
    md = markdown(meta, rows)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {out_dir / stem}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
