"""The node-local tier against the bucket path, side by side in one run.

    .venv/bin/python -m bench.local_tier                    # 512 MiB state, 4 ranks as 2 nodes, 3 saves
    .venv/bin/python -m bench.local_tier --bytes 1GiB --reps 3
    .venv/bin/python -m bench.local_tier --smoke            # tiny, one save

4 spawned gloo ranks as 2 "nodes" x 2 ranks (LOCAL_WORLD_SIZE=2), each node with its
own folder under /dev/shm, replication factor 2; the bucket is SeaweedFS on 127.0.0.1.
S = the bytes of one rank's shard of the state (DTensor-sharded model + Adam state).

Per save, the time training is blocked (slowest rank), async saves on both paths:
- copy: every local tensor copied into buffers allocated beforehand (the floor);
- local: ``CheckpointManager.save_local`` with ``async_save`` (the staging copy into
  reused host buffers; the local write and the copies to the peer node run in the
  background), and its total until the copies are complete;
- bucket: ``Checkpointer.save_async`` of the same state to SeaweedFS, and its total.
Then: seconds until the copies to the peer node are complete (from the save's start,
and the copies alone, from the end of the local write), against twice the state
bytes over the process group's loopback bandwidth (measured in the same run: one
rank per node sends 64 MiB to its peer); host memory above the baseline during a
local save and its copying (peak RSS, a multiple of S); and a recovery: node 1's
folder is wiped, and ``resume()`` (its parts fetched from node 0) is timed against
``Checkpointer.load`` of the same step from the bucket, and against ``resume()`` of a
job configured without the tier (which finds that step in the bucket, then loads it).

Targets (issue 25): local blocked <= 1.1x the copy; copies complete <= 2x state
bytes / loopback bandwidth; recovery from peers >= 3x faster than the bucket load.
Results: ``bench/results/local_tier.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cloudckpt.units import MiB

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _loopback_bandwidth(nbytes: int) -> float:
    """Bytes/s of one send between node 0's and node 1's first ranks (0 -> 2), on a
    fresh gloo group; every rank returns the figure."""
    import torch
    import torch.distributed as dist

    g = dist.new_group(backend="gloo")
    buf = torch.ones(nbytes, dtype=torch.uint8)
    rank = dist.get_rank()
    dist.barrier(g)
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(buf, dst=2, group=g)
    elif rank == 2:
        dist.recv(buf, src=0, group=g)
    dist.barrier(g)
    secs = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX, group=g)
    return nbytes / float(secs.item())


def rank_main(rank: int, world_size: int, args: dict) -> dict:
    import torch

    from bench import state as S
    from cloudckpt import CheckpointConfig, Checkpointer

    sd = S.build_state(world_size, args["bytes"])
    nbytes = S.local_bytes(sd)
    work = tempfile.mkdtemp(prefix=f"local-bench-r{rank}-", dir=args["tmp"])
    out: dict = {"rank": rank, "S": nbytes, "copy_s": [], "local_blocked_s": [], "replicated_s": [],
                 "copying_s": [], "local_peak_over_S": [], "bucket_s": []}
    out["loopback_Bps"] = _loopback_bandwidth(args["probe"])

    bufs = [torch.empty_like(t) for t in S.local_tensors(sd)]
    for _ in range(args["reps"]):
        S.barrier()
        t0 = time.perf_counter()
        for b, t in zip(bufs, S.local_tensors(sd), strict=True):
            b.copy_(t)
        out["copy_s"].append(time.perf_counter() - t0)
    del bufs

    cfg = CheckpointConfig(save_folder=args["s3_url"] + "/tier", local_dir=os.path.join(args["local"], "node{node}"),
                           local_save_interval=1, keep_last_local=2, replication_factor=2, replication_jump=2,
                           work_dir=os.path.join(work, "w"), exact_resume=False, async_save=True)
    mgr = cfg.build()
    out["local_written_s"] = []
    for rep in range(args["reps"]):
        S.barrier()
        S.trim_malloc()
        before = S.rss()
        S.reset_peak()
        t0 = time.perf_counter()
        # the last: to the bucket too
        fut = mgr.save_local(rep + 1, sd, {"step": rep + 1}, persist=rep == args["reps"] - 1)
        out["local_blocked_s"].append(time.perf_counter() - t0)
        fut.result()
        out["local_written_s"].append(time.perf_counter() - t0)
        mgr.local.drain()
        out["replicated_s"].append(time.perf_counter() - t0)
        out["copying_s"].append(out["replicated_s"][-1] - out["local_written_s"][-1])
        out["local_peak_over_S"].append((S.peak_rss() - before) / nbytes)
    mgr.wait()
    last = args["reps"]
    mgr.close()

    ck = Checkpointer(work_dir=os.path.join(work, "b"))
    out["bucket_total_s"] = []
    for rep in range(args["reps"]):
        S.barrier()
        t0 = time.perf_counter()
        fut = ck.save_async(f"{args['s3_url']}/bucket/step{rep + 1}", sd, {"step": rep + 1})
        out["bucket_s"].append(time.perf_counter() - t0)
        fut.result()
        out["bucket_total_s"].append(time.perf_counter() - t0)

    # recovery: node 1 replaced (its folder wiped), then resume from its peers vs load from the bucket
    S.barrier()
    if rank == 2:
        shutil.rmtree(os.path.join(args["local"], "node1"))
    S.barrier()
    target = S.build_state(world_size, args["bytes"], zero=True)
    mgr = cfg.build()
    t0 = time.perf_counter()
    mgr.resume(target)
    out["recover_local_s"] = time.perf_counter() - t0
    out["recovered_from"] = (mgr.resumed_from, mgr.resumed_step)
    out["fetched_bytes"] = mgr.local.last_recovery.get("fetched_bytes", 0)
    mgr.close()
    ok_local = S.fingerprint(target) == S.fingerprint(sd)
    target = S.build_state(world_size, args["bytes"], zero=True)
    S.barrier()
    t0 = time.perf_counter()
    ck.load(f"{args['s3_url']}/tier/step{last}", target)
    out["recover_bucket_s"] = time.perf_counter() - t0
    ok_bucket = S.fingerprint(target) == S.fingerprint(sd)
    # what a job without the tier does at restart: resume() (finds the newest bucket step, then loads it)
    target = S.build_state(world_size, args["bytes"], zero=True)
    no_tier = CheckpointConfig(save_folder=args["s3_url"] + "/tier", work_dir=os.path.join(work, "nt"),
                               exact_resume=False)
    S.barrier()
    with no_tier.build() as plain:
        t0 = time.perf_counter()
        plain.resume(target)
        out["resume_bucket_s"] = time.perf_counter() - t0
        assert (plain.resumed_from, plain.resumed_step) == ("bucket", last), (plain.resumed_from, plain.resumed_step)
    out["bit_exact"] = ok_local and ok_bucket and S.fingerprint(target) == S.fingerprint(sd)
    ck.close()
    S.barrier()
    shutil.rmtree(work, ignore_errors=True)
    return out


def summarize(ranks: list[dict]) -> dict:
    def slowest(key: str) -> float:
        return statistics.median(max(r[key][i] for r in ranks) for i in range(len(ranks[0][key])))

    total_state = sum(r["S"] for r in ranks)
    bw = min(r["loopback_Bps"] for r in ranks)
    row = {
        "copy_s": slowest("copy_s"), "local_blocked_s": slowest("local_blocked_s"), "bucket_s": slowest("bucket_s"),
        "local_written_s": slowest("local_written_s"), "bucket_total_s": slowest("bucket_total_s"),
        "replicated_s": slowest("replicated_s"), "copying_s": slowest("copying_s"),
        "local_peak_over_S": slowest("local_peak_over_S"),
        "loopback_MBps": bw / 1e6, "replication_bound_s": 2 * total_state / bw,
        "recover_local_s": max(r["recover_local_s"] for r in ranks),
        "recover_bucket_s": max(r["recover_bucket_s"] for r in ranks),
        "resume_bucket_s": max(r["resume_bucket_s"] for r in ranks),
        "recovered_from": ranks[0]["recovered_from"], "fetched_bytes_node1": sum(r["fetched_bytes"] for r in ranks[2:]),
        "bit_exact": all(r["bit_exact"] for r in ranks),
    }
    row["local_over_copy"] = row["local_blocked_s"] / row["copy_s"]
    row["bucket_over_copy"] = row["bucket_s"] / row["copy_s"]
    row["replicated_over_bound"] = row["replicated_s"] / row["replication_bound_s"]
    row["copying_over_bound"] = row["copying_s"] / row["replication_bound_s"]
    row["recovery_speedup"] = row["recover_bucket_s"] / row["recover_local_s"]
    row["resume_speedup"] = row["resume_bucket_s"] / row["recover_local_s"]
    return row


def markdown(meta: dict, r: dict) -> str:
    S = meta["S_per_rank"]

    def yes(ok: bool) -> str:
        return "not judged (smoke)" if meta["smoke"] else ("yes" if ok else "**no**")

    return "\n".join([
        f"Command: `{meta['command']}`  ",
        f"When: {meta['when']}; {meta['ranks']} ranks as 2 nodes x 2, S = {S / MiB:.0f} MiB per rank "
        f"({meta['bytes'] / MiB:.0f} MiB state), {meta['reps']} saves each (median of the slowest rank); "
        f"{meta['cpus']} cores shared by the ranks and SeaweedFS; load average before {meta['load_before']}.", "",
        "| per save (async on both paths) | training blocked, s | / copy "
        "| until written (local) or committed (bucket), s |",
        "|---|---:|---:|---:|",
        f"| plain copy into existing buffers | {r['copy_s']:.3f} | 1.00 | - |",
        f"| local step (node folder in /dev/shm) | {r['local_blocked_s']:.3f} | {r['local_over_copy']:.2f} | "
        f"{r['local_written_s']:.3f} |",
        f"| bucket step (SeaweedFS) | {r['bucket_s']:.3f} | {r['bucket_over_copy']:.2f} "
        f"| {r['bucket_total_s']:.3f} |", "",
        "| after a save | measured | bound or peer | ratio |", "|---|---:|---:|---:|",
        f"| copies on the peer node complete (s) | {r['replicated_s']:.3f} | 2 x state / loopback = "
        f"{r['replication_bound_s']:.3f} (loopback {r['loopback_MBps']:.0f} MB/s) | {r['replicated_over_bound']:.2f} |",
        f"| of which the copies alone, after the local write (s) | {r['copying_s']:.3f} | "
        f"{r['replication_bound_s']:.3f} | {r['copying_over_bound']:.2f} |",
        f"| recovery of a replaced node from peers (s) | {r['recover_local_s']:.3f} "
        f"| bucket load {r['recover_bucket_s']:.3f} | "
        f"{r['recovery_speedup']:.2f}x faster |",
        f"| the same, against resume() of a job without the tier (s) | {r['recover_local_s']:.3f} | bucket resume "
        f"{r['resume_bucket_s']:.3f} | {r['resume_speedup']:.2f}x faster |",
        f"| host memory above baseline during a local save and its copying | {r['local_peak_over_S']:.2f} x S "
        "| | |", "",
        f"Recovery resumed from {r['recovered_from'][0]} step {r['recovered_from'][1]}; node 1 fetched "
        f"{r['fetched_bytes_node1'] / MiB:.1f} MiB from node 0; bit-exact: {r['bit_exact']}.", "",
        "| target | measured | met |", "|---|---:|---|",
        f"| local save blocked <= 1.1x copy | {r['local_over_copy']:.2f}x | {yes(r['local_over_copy'] <= 1.1)} |",
        f"| copies complete <= 2 x state / loopback bandwidth | {r['replicated_over_bound']:.2f}x the bound | "
        f"{yes(r['replicated_over_bound'] <= 1.0)} |",
        f"| the copies alone (after the local write) <= the same bound | {r['copying_over_bound']:.2f}x the bound | "
        f"{yes(r['copying_over_bound'] <= 1.0)} |",
        f"| recovery from peers >= 3x faster than from the bucket | {r['recovery_speedup']:.2f}x | "
        f"{yes(r['recovery_speedup'] >= 3)} |",
    ]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default=None, help="state size, e.g. 512MiB (default; smoke 4MiB)")
    ap.add_argument("--reps", type=int, default=None, help="saves of each kind (default 3; smoke 1)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default=None)
    a = ap.parse_args(argv)
    from bench.common import git_state, loadavg, parse_size
    from cloudckpt.testing.multiprocess import run_ranks
    from cloudckpt.testing.servers import SeaweedFS

    nbytes = parse_size(a.bytes or ("4MiB" if a.smoke else "512MiB"))
    reps = a.reps or (1 if a.smoke else 3)
    command = " ".join([".venv/bin/python -m bench.local_tier"] + (sys.argv[1:] if argv is None else list(argv)))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local = tempfile.mkdtemp(prefix="cloudckpt-local-bench-", dir=shm)
    load_before = loadavg()
    s3 = SeaweedFS().start()
    try:
        s3.create_bucket("tier")
        env = dict(os.environ, **s3.env(), LOCAL_WORLD_SIZE="2")
        args = {"bytes": nbytes, "reps": reps, "tmp": a.tmp, "local": local, "s3_url": "s3://tier/run",
                "probe": min(64 * MiB, max(nbytes // 4, MiB))}
        print(f"local tier bench: {nbytes / MiB:.0f} MiB state, 4 ranks, {reps} saves, load {load_before}", flush=True)
        ranks = run_ranks(4, rank_main, args, env=env, timeout=3600)
    finally:
        s3.stop()
        shutil.rmtree(local, ignore_errors=True)
    row = summarize(ranks)
    meta = {"command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ranks": 4, "bytes": nbytes,
            "S_per_rank": max(r["S"] for r in ranks), "reps": reps, "load_before": load_before, "load_after": loadavg(),
            "cpus": os.cpu_count(), "smoke": a.smoke, "git": git_state()}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "local_tier_smoke" if a.smoke else "local_tier"
    (out_dir / f"{stem}.json").write_text(json.dumps({**meta, "row": row, "per_rank": ranks}, indent=1) + "\n")
    md = markdown(meta, row)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
