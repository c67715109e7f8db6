"""cloudckpt against its peers, side by side, in one run on one machine:
save, load (streaming, pre-download, resharded), GCS, and discovery.

    .venv/bin/python -m bench.run                      # 1 GiB and 4 GiB, median of 3
    .venv/bin/python -m bench.run --sizes 1GiB --reps 5
    .venv/bin/python -m bench.run --smoke              # tiny sizes, one repetition
    bash bench/setup_peers.sh                          # the peers' venvs (once)

It starts SeaweedFS (S3) and fake-gcs-server on 127.0.0.1, runs every case
``--reps`` times (tools in a rotated order each repetition, so none always goes
first; dirty pages flushed to disk, untimed, before every timed operation, so no
tool pays for the kernel writing back what an earlier one wrote), and writes to
``--out-dir`` (default ``bench/results/``):
``bench.json`` (every raw figure, the command, the machine's load), ``bench.md``
(medians, ratios to the peers of the same run, targets met or missed) and
``bench.png`` (the chart). ``--smoke`` writes ``smoke.*`` instead.

Tools (each case on 2 spawned gloo ranks, DTensor-sharded model + Adam state):
- cloudckpt (this venv) — ``Checkpointer.save`` / ``load`` (streaming, ``pre_download``, 2 -> 1);
- OLMo-core, s3torchconnector, DCP fsspec + s3fs — each in its own venv
  ``.venv-bench-{olmo,s3tc,fsspec}`` (``bench/setup_peers.sh``), run by ``bench/peers/launch.py``;
  a peer whose venv is missing is a "not installed" row; one that fails is an "error" row
  with the reason;
- s5cmd copying the same DCP bytes already on local disk (written by stock
  ``FileSystemWriter``): the upload / download ceiling of this machine. s5cmd also
  downloads those bytes right after every cloudckpt load (a copy uploaded once per
  size, untimed), and the load targets are judged on these pairs (median of the
  per-repetition ratios): single operations of one tool move by 15-20 % over the
  minutes between the separate rows, and the pair sees the same machine state. The
  unpaired ratio (medians of the separate rows) is reported beside it;
- GCS: cloudckpt against fake-gcs-server, and google-cloud-storage's
  ``transfer_manager`` copying the same files (the GCS ceiling);
- discovery over ``--discovery-steps`` committed steps: ``latest_checkpoint`` and
  ``cloudckpt list`` (in-process, HTTP requests counted at botocore's HTTP layer),
  and OLMo-core's ``Checkpointer.latest_checkpoint``.

Throughput is state bytes (fp32 tensor bytes, all ranks) / wall time of the
slowest rank between two barriers, MB = 10**6 bytes. This is a benchmark, not
a test: it asserts only that what was loaded matches what was saved.

This module is the command line only; the library is beside it: ``bench.cases``
(what each case runs), ``bench.drivers`` (ranks and peer venvs), ``bench.measure``
(samples, CPU, s5cmd), ``bench.report`` (ratios, targets, outputs, ``--merge``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench.cases import run_cases
from bench.common import ROOT, loadavg, parse_size, size_label
from bench.measure import LoadSampler, Results
from bench.report import merge, write_outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="comma-separated state sizes (default 1GiB,4GiB; smoke 4MiB)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per case, median reported (default 3; smoke 1)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cases", default="save_load,gcs,discovery", help="save_load, gcs, discovery")
    ap.add_argument("--tools", default="cloudckpt,s5cmd,olmo,s3tc,fsspec")
    ap.add_argument("--gcs-sizes", default=None, help="sizes for the GCS rows (default: the smallest of --sizes)")
    ap.add_argument("--gcs-workers", type=int, default=8)
    ap.add_argument("--discovery-steps", type=int, default=None,
                    help="committed steps for discovery (default 1000; smoke 20)")
    ap.add_argument("--s5cmd-numworkers", type=int, default=256, help="s5cmd --numworkers (its default)")
    ap.add_argument("--s5cmd-concurrency", type=int, default=5, help="s5cmd cp --concurrency (its default)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition, smoke.* outputs")
    ap.add_argument("--peer-venvs", default=str(ROOT), help="folder holding .venv-bench-* (default: the repo)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default=None, help="folder for local copies (default: the system temp dir)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case before it counts as hung")
    ap.add_argument("--keep", action="store_true", help="keep uploaded objects (disk grows by every repetition)")
    ap.add_argument("--stem", default=None, help="output file names (default: bench, or smoke with --smoke)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="no run: combine the JSON of earlier runs (each size / case from one run) into one report")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out_dir), args.stem or "bench")
    args.sizes = [parse_size(s) for s in (args.sizes or ("4MiB" if args.smoke else "1GiB,4GiB")).split(",") if s]
    args.reps = args.reps or (1 if args.smoke else 3)
    args.discovery_steps = args.discovery_steps or (20 if args.smoke else 1000)
    args.tools_list = [t for t in args.tools.split(",") if t]
    cases = set(c for c in args.cases.split(",") if c)
    gcs_sizes = [parse_size(s) for s in args.gcs_sizes.split(",")] if args.gcs_sizes else [min(args.sizes)]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("smoke" if args.smoke else "bench")
    command = " ".join([".venv/bin/python -m bench.run"] + (sys.argv[1:] if argv is None else list(argv)))

    t_log = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_log:6.0f}s] {msg}", flush=True)

    load_before = loadavg()
    log(f"bench: sizes {[size_label(s) for s in args.sizes]}, reps {args.reps}, ranks {args.ranks}, "
        f"cases {sorted(cases)}, load average {load_before} on {os.cpu_count()} cores")
    res = Results()
    t_start = time.perf_counter()
    sampler = LoadSampler().start()

    def partial(disc_label: str | None) -> None:  # after each size: what a killed run leaves
        write_outputs(args, res, disc_label, command, load_before, t_start, out_dir / f"{stem}.partial.json", log=None,
                      sampler=sampler)

    disc_label = run_cases(args, cases, gcs_sizes, res, log, partial)
    sampler.stop()
    write_outputs(args, res, disc_label, command, load_before, t_start, out_dir / f"{stem}.json", log=log,
                  sampler=sampler)
    (out_dir / f"{stem}.partial.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
