"""Interleaved A/B of cloudckpt's load between git revisions: which of two versions of
the reader is faster, measured in the same minutes on the same store.

One SeaweedFS on 127.0.0.1, one save (by the working tree), then for every repetition
and mode each revision's load in turn, each in fresh rank processes (``bench/ranks.py``,
as the peer bench's cloudckpt rows). A revision is a git revision (exported with
``git archive`` into a temporary folder) or ``.`` for the working tree. Prints one line
per load (wall time of the slowest rank, client CPU of all ranks, SeaweedFS CPU, HTTP
requests, peak RSS / bytes loaded) and the medians; ``--out`` writes them as JSON.
Every load is checked against the saved state (fingerprint), else it raises.

    .venv/bin/python -m bench.ab_load --revs c1359b4,. --modes pre --size 1GiB --reps 4

The machine's state moves single loads by 20-50 % here (bench/NOTES.md), which is
why revisions alternate within each repetition: compare pairs and medians, not runs
made at different times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"stream": (2, {}), "pre": (2, {"pre_download": True}), "2to1": (1, {})}  # (ranks, load options)


def ab_case(rank: int, world_size: int, args: dict) -> dict:
    """A rank of one load with the cloudckpt (and bench) of ``args["root"]``."""
    for k in list(sys.modules):
        if k.split(".")[0] in ("cloudckpt", "bench"):
            del sys.modules[k]
    sys.path.insert(0, args["root"])
    import cloudckpt
    from bench.ranks import cloudckpt_case

    if not cloudckpt.__file__.startswith(args["root"]):
        raise RuntimeError(f"imported {cloudckpt.__file__}, not the revision in {args['root']}")
    return cloudckpt_case(rank, world_size, args)


def export(rev: str, into: Path) -> str:
    """A folder holding ``rev``'s tree (the working tree for ``.``)."""
    if rev == ".":
        return str(ROOT)
    dest = into / rev.replace("/", "_")
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return str(dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--revs", required=True, help="comma-separated git revisions; '.' is the working tree")
    ap.add_argument("--modes", default="stream,pre", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--size", default="1GiB", help="state size (default 1GiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args(argv)
    from bench.ab_load import ab_case as case  # by its module's name, not __main__'s, for the rank processes
    from bench.common import parse_size, same
    from bench.measure import server_cpu
    from cloudckpt.testing.multiprocess import run_ranks
    from cloudckpt.testing.servers import SeaweedFS

    revs, modes, nbytes = a.revs.split(","), a.modes.split(","), parse_size(a.size)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cloudckpt-ab-") as tmp, SeaweedFS() as s3:
        roots = {rev: export(rev, Path(tmp)) for rev in revs}
        s3.create_bucket("abload")
        env = s3.env()
        url = "s3://abload/ck"
        saved = run_ranks(2, case, {"root": str(ROOT), "tool": "cloudckpt", "op": "save", "url": url,
                                       "bytes": nbytes}, env=env, timeout=1800)
        print(f"saved {a.size} in {max(r['seconds'] for r in saved):.2f}s", flush=True)
        for rep in range(a.reps):
            for mode in modes:
                ranks, extra = MODES[mode]
                for rev in revs:
                    c0 = server_cpu(s3)
                    got = run_ranks(ranks, case, {"root": roots[rev], "tool": "cloudckpt", "op": "load", "url": url,
                                                     "bytes": nbytes, **extra}, env=env, timeout=1800)
                    if not all(same(r["fingerprint"], saved[0]["fingerprint"]) for r in got):
                        raise RuntimeError(f"{rev} {mode}: the loaded state differs from the saved one")
                    row = {"rep": rep, "mode": mode, "rev": rev, "seconds": max(r["seconds"] for r in got),
                           "client_cpu_s": sum(r["cpu_s"] for r in got), "server_cpu_s": server_cpu(s3) - c0,
                           "requests": sum(r["requests"] or 0 for r in got),
                           "rss_ratio": max(r["peak_rss_above_baseline"] / r["local_bytes"] for r in got)}
                    rows.append(row)
                    print(f"rep {rep} {mode:6s} {rev:12s} {row['seconds']:6.2f}s  client {row['client_cpu_s']:5.2f} "
                          f"server {row['server_cpu_s']:5.2f} CPU-s  requests {row['requests']:4d}  "
                          f"rss {row['rss_ratio']:.2f}", flush=True)
    print("medians:")
    for mode in modes:
        for rev in revs:
            mine = [r for r in rows if r["mode"] == mode and r["rev"] == rev]
            print(f"  {mode:6s} {rev:12s} {statistics.median(r['seconds'] for r in mine):6.2f}s  client "
                  f"{statistics.median(r['client_cpu_s'] for r in mine):5.2f}  server "
                  f"{statistics.median(r['server_cpu_s'] for r in mine):5.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"command": " ".join([".venv/bin/python -m bench.ab_load"] + sys.argv[1:]),
                                           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                           "size": a.size, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
