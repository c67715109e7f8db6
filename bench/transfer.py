"""Upload throughput: the cloudckpt transfer engine against s5cmd and boto3's
TransferManager (s3transfer), in the same run, on a local SeaweedFS (127.0.0.1).

    .venv/bin/python bench/transfer.py            # 16 x 64 MiB, 3 interleaved repetitions

Each repetition uploads the same files with each tool to a fresh prefix (then
deletes it), in the order engine, s5cmd, boto3, rotated every repetition so none
always goes first; one untimed boto3 upload warms the server up first. Throughput
is total bytes / wall time of the whole batch (MB = 10**6 bytes), reported as the
median over repetitions, with the ratios engine/s5cmd, engine/boto3 and
engine/best. CPU seconds (client process incl. children; the SeaweedFS process)
are recorded too: on a shared machine they are steadier than wall time.
Results go to bench/results/transfer.json.

s5cmd and boto3 send 16 MiB parts, 4 parts per 64 MiB file, every file in flight
at once (s5cmd --numworkers 16 --concurrency 4; boto3 max_request_concurrency 32);
the engine runs 8 files at once (its default) with the S3 backend's defaults: one
PUT per 64 MiB file today (``bench/results/transfer.json`` was recorded when that
default was 16 MiB parts, the same shape as the others). The engine also
computes CRC32C of every file; the others compute nothing of the kind.

This is a benchmark, not a test: it asserts nothing beyond "every object arrived
with the right size". The client and SeaweedFS share the machine's cores, so the
figures measure the whole loop (client CPU + server CPU), not a network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cloudckpt.units import MiB

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_files(folder: Path, n: int, size: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"shard{i:02d}.bin"
        with open(p, "wb") as f:
            left = size
            while left:
                k = min(left, 8 * MiB)
                f.write(os.urandom(k))
                left -= k
        paths.append(p)
    return paths


def s5cmd_binary() -> str:
    cand = Path(sys.executable).parent / "s5cmd"
    return str(cand) if cand.exists() else (shutil.which("s5cmd") or "s5cmd")


def run_engine(args, s3, bucket, prefix, files) -> float:
    from cloudckpt.storage import StorageOptions, clear_cache
    from cloudckpt.transfer import TransferConfig, TransferEngine

    clear_cache()  # a fresh client and connection pool per repetition, like the others
    opts = StorageOptions(endpoint_url=s3.endpoint_url, region=s3.region, addressing_style="path")
    cfg = TransferConfig(max_concurrency=args.engine_concurrency)
    with TransferEngine(cfg, storage_options=opts) as engine:
        t0 = time.perf_counter()
        results = engine.upload_all([(str(p), f"s3://{bucket}/{prefix}{p.name}") for p in files])
        dt = time.perf_counter() - t0
    assert all(r.crc32c for r in results)
    return dt


def run_s5cmd(args, s3, bucket, prefix, files) -> float:
    env = dict(os.environ, **s3.env())
    argv = [s5cmd_binary(), "--endpoint-url", s3.endpoint_url, "--numworkers", str(args.s5cmd_numworkers),
            "cp", "--concurrency", str(args.s5cmd_concurrency), "--part-size", str(args.s5cmd_part_mib),
            f"{files[0].parent}/*", f"s3://{bucket}/{prefix}"]
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run_boto3(args, s3, bucket, prefix, files) -> float:
    import boto3
    from botocore.config import Config
    from s3transfer.manager import TransferConfig, TransferManager

    client = boto3.client(
        "s3", endpoint_url=s3.endpoint_url, region_name=s3.region, aws_access_key_id=s3.access_key,
        aws_secret_access_key=s3.secret_key,
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=args.boto3_concurrency + 2,
                      retries={"mode": "standard"}),
    )
    cfg = TransferConfig(multipart_threshold=args.boto3_part_mib * MiB, multipart_chunksize=args.boto3_part_mib * MiB,
                         max_request_concurrency=args.boto3_concurrency)
    t0 = time.perf_counter()
    with TransferManager(client, cfg) as tm:
        futs = [tm.upload(str(p), bucket, f"{prefix}{p.name}") for p in files]
        for f in futs:
            f.result()
    return time.perf_counter() - t0


TOOLS = {"engine": run_engine, "s5cmd": run_s5cmd, "boto3": run_boto3}


def _client_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _server_cpu(s3) -> float:
    """CPU seconds used so far by the SeaweedFS process (``weed mini`` is one process)."""
    fields = Path(f"/proc/{s3.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_uploaded(s3, bucket, prefix, files, size) -> None:
    c = s3.client()
    got = {o["Key"]: o["Size"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
           for o in page.get("Contents", ())}
    want = {f"{prefix}{p.name}": size for p in files}
    if got != want:
        raise SystemExit(f"upload to {prefix} incomplete: {len(got)} objects, expected {len(want)} of {size} bytes")


def delete_prefix(s3, bucket, prefix) -> None:
    c = s3.client()
    keys = [{"Key": o["Key"]} for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", ())]
    for i in range(0, len(keys), 1000):
        c.delete_objects(Bucket=bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tools", default="engine,s5cmd,boto3")
    ap.add_argument("--engine-concurrency", type=int, default=8,
                    help="TransferConfig.max_concurrency (files in flight)")
    ap.add_argument("--s5cmd-numworkers", type=int, default=16, help="s5cmd --numworkers (files in flight)")
    ap.add_argument("--s5cmd-concurrency", type=int, default=4, help="s5cmd cp --concurrency (parts per file)")
    ap.add_argument("--s5cmd-part-mib", type=int, default=16, help="s5cmd cp --part-size (MiB)")
    ap.add_argument("--boto3-concurrency", type=int, default=32, help="s3transfer max_request_concurrency")
    ap.add_argument("--boto3-part-mib", type=int, default=16,
                    help="s3transfer multipart threshold and chunk size (MiB)")
    ap.add_argument("--keep", action="store_true", help="keep the uploaded objects between repetitions")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "transfer.json"))
    args = ap.parse_args()
    tools = [t for t in args.tools.split(",") if t]

    from cloudckpt.testing.servers import SeaweedFS

    size = args.size_mib * MiB
    total = args.files * size
    work = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-"))
    runs: dict[str, list[float]] = {t: [] for t in tools}
    cpu: dict[str, list[tuple[float, float]]] = {t: [] for t in tools}  # (client, server) CPU seconds
    try:
        print(f"writing {args.files} x {args.size_mib} MiB of random data to {work} ...", flush=True)
        files = write_files(work / "data", args.files, size)
        with SeaweedFS() as s3:
            os.environ.update(s3.env())
            bucket = "bench"
            s3.create_bucket(bucket)
            # warm up the server (volume allocation) and the page cache, not timed
            TOOLS["boto3"](args, s3, bucket, "warmup/", files)
            delete_prefix(s3, bucket, "warmup/")
            for rep in range(args.reps):
                order = tools[rep % len(tools):] + tools[:rep % len(tools)]
                for tool in order:
                    prefix = f"{tool}/rep{rep}/"
                    c0, s0 = _client_cpu(), _server_cpu(s3)
                    dt = TOOLS[tool](args, s3, bucket, prefix, files)
                    c1, s1 = _client_cpu(), _server_cpu(s3)
                    cpu[tool].append((c1 - c0, s1 - s0))
                    check_uploaded(s3, bucket, prefix, files, size)
                    if not args.keep:
                        delete_prefix(s3, bucket, prefix)
                    runs[tool].append(dt)
                    print(f"rep {rep} {tool:7s} {dt:6.2f}s  {total / dt / 1e6:7.1f} MB/s   "
                          f"cpu client {c1 - c0:5.1f}s server {s1 - s0:5.1f}s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {t: total / statistics.median(v) / 1e6 for t, v in runs.items()}
    gib = total / 1024**3
    cpu_per_gib = {t: {"client": statistics.median(c for c, _ in v) / gib,
                       "server": statistics.median(s for _, s in v) / gib}
                   for t, v in cpu.items()}
    print("\nmedian MB/s:", ", ".join(f"{t} {m:.1f}" for t, m in med.items()))
    print("median CPU s/GiB (client + server):",
          ", ".join(f"{t} {c['client']:.2f} + {c['server']:.2f}" for t, c in cpu_per_gib.items()))
    ratios = {}
    if "engine" in med:
        for t in med:
            if t != "engine":
                ratios[f"engine/{t}"] = med["engine"] / med[t]
        peers = [m for t, m in med.items() if t != "engine"]
        if peers:
            ratios["engine/best"] = med["engine"] / max(peers)
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    import boto3
    import s3transfer

    out = {
        "command": " ".join([Path(sys.executable).name, "bench/transfer.py"] + sys.argv[1:]),
        "files": args.files, "size_mib": args.size_mib, "reps": args.reps,
        "settings": {k: v for k, v in vars(args).items() if k.startswith(("engine_", "s5cmd_", "boto3_"))},
        "seconds": runs, "median_mb_per_s": med, "ratios": ratios,
        "cpu_seconds": {t: [{"client": c, "server": sv} for c, sv in v] for t, v in cpu.items()},
        "median_cpu_seconds_per_gib": cpu_per_gib,
        "load_average_at_end": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "versions": {"boto3": boto3.__version__, "s3transfer": s3transfer.__version__,
                     "s5cmd": subprocess.run([s5cmd_binary(), "version"], capture_output=True,
                                             text=True).stdout.strip()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
