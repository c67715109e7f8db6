"""Range reads into memory, without DCP: how fast can this machine move checkpoint
bytes from SeaweedFS (127.0.0.1) into a Python process, and at what CPU cost?

    .venv/bin/python -m bench.range_reads            # 2 x 256 MiB objects, 3 interleaved reps

It separates the load's transfer from everything else a DCP load does (planning,
CRC32C, copying into tensors). Two 256 MiB objects (the shape of a rank's shard
files: one PUT each, as cloudckpt uploads them) are read whole, per repetition, by:

- ``s5cmd``: ``s5cmd cp`` of both objects to a local folder (the bench's ceiling);
- ``boto3 8MiB`` / ``boto3 8MiB+4KiB`` / ``boto3 32MiB``: ``get_object(Range=...)``
  bodies read into ``bytes`` on 8 threads, ranges of that size (``+4KiB``: every
  range starts 4 KiB past a multiple of 8 MiB);
- ``engine 8MiB``: cloudckpt's ``TransferEngine.submit_read`` of 8 MiB ranges, 4 in
  flight per object (the reader's shape for a 512 MiB share), each range's CRC32C
  taken as the reader does.

Wall time, client CPU (this process, or s5cmd's) and SeaweedFS's CPU, medians over
repetitions in a rotated order. A benchmark, not a test: it only checks sizes.
Results: bench/results/range_reads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from itertools import pairwise
from pathlib import Path

from bench.common import BUCKET, MiB
from bench.measure import s5cmd_binary, server_cpu
from bench.ranks import self_cpu

RESULTS = Path(__file__).resolve().parent / "results"


def _ranges(size: int, step: int, skew: int = 0) -> list[tuple[int, int]]:
    cuts = [0] + list(range(skew or step, size, step)) + [size]
    return [(a, b) for a, b in pairwise(cuts) if b > a]


def boto3_reads(client, keys, size, step, skew=0) -> int:
    def get(job):
        key, (a, b) = job
        return len(client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={a}-{b - 1}")["Body"].read())

    jobs = [(k, r) for k in keys for r in _ranges(size, step, skew)]
    with ThreadPoolExecutor(8) as ex:
        return sum(ex.map(get, jobs))


def engine_reads(engine, urls, size, step, per_object_inflight=4) -> int:
    from cloudckpt.transfer import crc32c_bytes

    got = 0
    pending: set = set()
    jobs = [(u, r) for u in urls for r in _ranges(size, step)]
    for u, (a, b) in jobs:
        if len(pending) >= per_object_inflight * len(urls):
            done, pending = wait(pending, return_when="FIRST_COMPLETED")
            for f in done:
                data = f.result()
                crc32c_bytes(data)
                got += len(data)
        pending.add(engine.submit_read(u, a, b))
    for f in pending:
        data = f.result()
        crc32c_bytes(data)
        got += len(data)
    return got


def s5cmd_reads(env, keys, dest: Path) -> tuple[int, float]:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    argv = [s5cmd_binary(), "--endpoint-url", env["AWS_ENDPOINT_URL"], "cp", f"s3://{BUCKET}/ranges/*", f"{dest}/"]
    subprocess.run(argv, env=env, check=True, capture_output=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    got = sum((dest / Path(k).name).stat().st_size for k in keys)
    shutil.rmtree(dest)
    return got, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _ratio(med: dict, name: str) -> str:
    return f"{med['s5cmd']['seconds'] / med[name]['seconds']:.2f}" if "s5cmd" in med else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--object-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where range_reads.json / .md go")
    args = ap.parse_args()

    from cloudckpt.storage import open_store
    from cloudckpt.testing.servers import SeaweedFS
    from cloudckpt.transfer import TransferEngine

    size = args.object_mib * MiB
    samples: dict[str, list[dict]] = {}
    with SeaweedFS() as s3, tempfile.TemporaryDirectory(prefix="cloudckpt-ranges-") as tmp:
        s3.create_bucket(BUCKET)
        env = {**os.environ, **s3.env()}
        os.environ.update(s3.env())
        keys = [f"ranges/__{i}_0.distcp" for i in range(2)]
        urls = [f"s3://{BUCKET}/{k}" for k in keys]
        src = Path(tmp) / "src"
        with open(src, "wb") as f:
            for i in range(0, size, 8 * MiB):
                f.write(os.urandom(min(8 * MiB, size - i)))
        store = open_store(urls[0])
        for u in urls:
            store.upload_file(str(src), u)  # one PUT each, like a shard file
        src.unlink()
        client = s3.client()
        with TransferEngine() as engine:
            tools = {
                "s5cmd": lambda: s5cmd_reads(env, keys, Path(tmp) / "dl"),
                "boto3 8MiB": lambda: boto3_reads(client, keys, size, 8 * MiB),
                "boto3 8MiB+4KiB": lambda: boto3_reads(client, keys, size, 8 * MiB, skew=4096),
                "boto3 32MiB": lambda: boto3_reads(client, keys, size, 32 * MiB),
                "engine 8MiB": lambda: engine_reads(engine, urls, size, 8 * MiB),
            }
            if s5cmd_binary() is None:
                del tools["s5cmd"]
                print("s5cmd: not installed (no s5cmd binary in the venv or on PATH): its row is left out", flush=True)
            boto3_reads(client, keys, size, 8 * MiB)  # untimed: connections, caches
            names = list(tools)
            for rep in range(args.reps):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    s0, c0, t0 = server_cpu(s3), self_cpu(), time.perf_counter()
                    out = tools[name]()
                    dt = time.perf_counter() - t0
                    got, client_cpu = out if isinstance(out, tuple) else (out, self_cpu() - c0)
                    assert got == 2 * size, f"{name}: read {got} bytes, expected {2 * size}"
                    samples.setdefault(name, []).append(
                        {"seconds": dt, "client_cpu_s": client_cpu, "server_cpu_s": server_cpu(s3) - s0})
                    print(f"rep {rep} {name:16s} {dt:5.2f}s client {client_cpu:5.2f} "
                          f"server {samples[name][-1]['server_cpu_s']:5.2f}", flush=True)
    med = {n: {k: statistics.median(s[k] for s in v) for k in v[0]} for n, v in samples.items()}
    lines = [f"Command: `.venv/bin/python -m bench.range_reads --object-mib {args.object_mib} --reps {args.reps}` "
             f"(2 x {args.object_mib} MiB, medians of {args.reps})", "",
             "| reader | s | MB/s | client CPU s | SeaweedFS CPU s | speed / s5cmd |", "|---|---:|---:|---:|---:|---:|"]
    for n, m in med.items():
        lines.append(f"| {n} | {m['seconds']:.2f} | {2 * size / m['seconds'] / 1e6:.0f} | {m['client_cpu_s']:.2f} | "
                     f"{m['server_cpu_s']:.2f} | {_ratio(med, n)} |")
    print("\n".join(lines))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"object_bytes": size, "reps": args.reps, "samples": samples, "medians": med}
    (args.out_dir / "range_reads.json").write_text(json.dumps(doc, indent=1))
    (args.out_dir / "range_reads.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
