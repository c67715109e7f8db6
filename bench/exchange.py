"""Loads with and without the read-once exchange, side by side in one run.

    .venv/bin/python -m bench.exchange                 # 64 MiB state per replica, 4 ranks, 3 loads each way
    .venv/bin/python -m bench.exchange --bytes 256MiB --reps 3
    .venv/bin/python -m bench.exchange --smoke         # tiny, one load each way

4 spawned gloo ranks; the bucket is SeaweedFS on 127.0.0.1. Two layouts:
- DDP: every rank holds the same state (N tensors of 1 MiB), saved once (DCP's dedup);
- HSDP 2x2: ranks {0, 2} hold shard 0, {1, 3} shard 1 (N/2 tensors each), plus a
  replicated step: each shard saved once, needed by two ranks.

Each layout is saved once, then loaded ``reps`` times without and with the exchange,
alternating. Per load: bytes the bucket served for the step's data files over the
data bytes of the step (the S3 backend is subclassed in the ranks and counts what its
GETs return), GET requests (all objects), the slowest rank's load time, the census's
time (the exchange's collective prologue), and the spread of the reading over the
ranks (max / min bytes a rank read from the bucket).

Target (issue 33): bucket bytes per load <= 1.05x the checkpoint's for every layout.
Results: ``bench/results/exchange.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from cloudckpt.storage.s3 import S3Store

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
MiB = 1024 * 1024


class CountingS3(S3Store):
    """S3Store counting GET requests and the bytes they return: ``data`` for the step's
    DCP data files (``*.distcp``), ``other`` for everything else (marker, metadata,
    train states). Register it in a process with :func:`counting`."""

    lock = threading.Lock()
    counts = {"data_bytes": 0, "data_gets": 0, "other_bytes": 0, "other_gets": 0}

    def _count(self, url: str, n: int, gets: int) -> None:
        kind = "data" if url.endswith(".distcp") else "other"
        with self.lock:
            self.counts[f"{kind}_bytes"] += n
            self.counts[f"{kind}_gets"] += gets

    def get_bytes(self, url, *, start=None, end=None):
        data = super().get_bytes(url, start=start, end=end)
        self._count(url, len(data), 1)
        return data

    def get_bytes_versioned(self, url, *, limit=None):
        data, version = super().get_bytes_versioned(url, limit=limit)
        self._count(url, len(data), 1)
        return data, version

    def open_range(self, url, start, end):
        body = super().open_range(url, start, end)
        self._count(url, 0, 1)
        return _Counted(self, url, body)


class _Counted:
    def __init__(self, store: CountingS3, url: str, body):
        self.store, self.url, self.body = store, url, body

    def read(self, n):
        data = self.body.read(n)
        self.store._count(self.url, len(data), 0)
        return data

    def close(self):
        self.body.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.body.close()


def counting() -> None:
    """s3:// served by CountingS3 in this process."""
    from cloudckpt.storage import registry

    registry.register_backend("s3", f"{__name__}:CountingS3")
    registry.clear_cache()


def snapshot() -> dict:
    with CountingS3.lock:
        return dict(CountingS3.counts)


def state(layout: str, rank: int, items: int, numel: int, zero: bool = False) -> dict:
    """DDP: every rank the same ``items`` tensors; HSDP 2x2: shard ``rank % 2`` (half
    the tensors, shared with the rank of the other replica group) and a replicated step."""
    import torch

    shard = 0 if layout == "ddp" else rank % 2
    g = torch.Generator().manual_seed(1000 + shard)
    n = items if layout == "ddp" else items // 2
    model = {f"w{i:03d}": (torch.zeros(numel) if zero else torch.randn(numel, generator=g)) for i in range(n)}
    return {("model" if layout == "ddp" else f"shard{shard}"): model, "step": torch.tensor(0 if zero else 7)}


def flat(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        out.update({f"{k}.{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {k: v})
    return out


def rank_main(rank: int, world: int, args: dict) -> dict:
    import torch

    from cloudckpt import Checkpointer
    from cloudckpt.dcp import exchange

    counting()
    ck = Checkpointer(work_dir=args["work"], collective_timeout=120)
    out: dict = {}
    for layout in args["layouts"]:
        step = f"{args['root']}/{layout}/step1"
        ck.save(step, state(layout, rank, args["items"], args["numel"]), {"rank": rank})
        want = flat(state(layout, rank, args["items"], args["numel"]))
        rows = []
        for rep in range(args["reps"]):
            for on in (False, True):
                exchange.ENABLED = on
                target = state(layout, rank, args["items"], args["numel"], zero=True)
                ck.coord.all_gather(None)  # start together
                before = snapshot()
                t0 = time.perf_counter()
                ck.load(step, target)
                seconds = time.perf_counter() - t0
                after = snapshot()
                got = flat(target)
                if not all(torch.equal(want[k], got[k]) for k in want):
                    raise AssertionError(f"rank {rank}: {layout} load (exchange {on}) is not bit-exact")
                ex = exchange.for_coordinator(ck.coord) if on else None
                rows.append({"rep": rep, "exchange": on, "seconds": seconds,
                             "bucket": {k: after[k] - before[k] for k in after},
                             "census_s": ex.last_census_seconds if ex else None})
        out[layout] = rows
    return out


def summarize(ranks: list[dict], data_bytes: dict[str, int]) -> list[dict]:
    rows = []
    for layout, data in data_bytes.items():
        for on in (False, True):
            n = len(ranks[0][layout])
            loads = [[r[layout][i] for r in ranks] for i in range(n) if ranks[0][layout][i]["exchange"] == on]
            per_load_bytes = [sum(x["bucket"]["data_bytes"] for x in load) for load in loads]
            per_rank = [statistics.mean(load[r]["bucket"]["data_bytes"] for load in loads) for r in range(len(ranks))]
            rows.append({
                "layout": layout, "exchange": on, "data_bytes": data,
                "bucket_over_ckpt": statistics.mean(per_load_bytes) / data,
                "gets": statistics.mean(sum(x["bucket"]["data_gets"] + x["bucket"]["other_gets"] for x in load)
                                        for load in loads),
                "data_gets": statistics.mean(sum(x["bucket"]["data_gets"] for x in load) for load in loads),
                "load_s": statistics.median(max(x["seconds"] for x in load) for load in loads),
                "census_s": statistics.median(max(x["census_s"] for x in load) for load in loads) if on else None,
                "spread": max(per_rank) / min(per_rank) if min(per_rank) else None,
            })
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Read-once exchange at load (bench/exchange.py)", "",
        f"`{meta['command']}` ({meta['when']}): {meta['ranks']} gloo ranks, {meta['reps']} loads each way, "
        f"{meta['cpus']} cores shared by the ranks and SeaweedFS; load average before {meta['load_before']}.",
        f"Per replica: {meta['items']} tensors of {meta['numel'] * 4 / MiB:.2f} MiB.", "",
        "| layout | exchange | data bytes | bucket bytes / checkpoint | GETs per load (data) "
        "| load s (slowest rank, median) | census s | reading max/min over ranks |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        census = "-" if r["census_s"] is None else f"{r['census_s']:.4f}"
        spread = "-" if r["spread"] is None else f"{r['spread']:.2f}"
        lines.append(f"| {r['layout']} | {'on' if r['exchange'] else 'off'} | {r['data_bytes']:,} | "
                     f"{r['bucket_over_ckpt']:.3f} | {r['gets']:.0f} ({r['data_gets']:.0f}) | {r['load_s']:.3f} | "
                     f"{census} | {spread} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default=None, help="state per replica, e.g. 64MiB (default; smoke 4MiB)")
    ap.add_argument("--reps", type=int, default=None, help="loads each way (default 3; smoke 1)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    import tempfile

    from bench.common import git_state, loadavg, parse_size
    from cloudckpt.storage import open_store
    from cloudckpt.testing.multiprocess import run_ranks
    from cloudckpt.testing.servers import SeaweedFS

    nbytes = parse_size(a.bytes or ("4MiB" if a.smoke else "64MiB"))
    reps = a.reps or (1 if a.smoke else 3)
    numel = MiB // 4 if nbytes >= 16 * MiB else 16 * 1024
    items = max(4, nbytes // (numel * 4))
    command = " ".join([".venv/bin/python -m bench.exchange"] + (sys.argv[1:] if argv is None else list(argv)))
    load_before = loadavg()
    s3 = SeaweedFS().start()
    try:
        root = s3.create_bucket("exchange") + "/run"
        os.environ.update(s3.env())
        with tempfile.TemporaryDirectory(prefix="cloudckpt-exchange-bench-") as work:
            args = {"root": root, "work": work, "layouts": ["ddp", "hsdp"], "items": items, "numel": numel,
                    "reps": reps}
            print(f"exchange bench: {items} x {numel * 4 / MiB:.2f} MiB per replica, 4 ranks, {reps} loads each way",
                  flush=True)
            ranks = run_ranks(4, rank_main, args, env=dict(os.environ), timeout=3600)
        store = open_store(root)
        data = {layout: sum(e.size for e in store.list(f"{root}/{layout}/step1/", delimiter=None)
                            if e.url.endswith(".distcp"))
                for layout in args["layouts"]}
    finally:
        s3.stop()
    rows = summarize(ranks, data)
    meta = {"command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ranks": 4, "items": items,
            "numel": numel, "reps": reps, "load_before": load_before, "load_after": loadavg(), "cpus": os.cpu_count(),
            "smoke": a.smoke, "git": git_state()}
    md = markdown(meta, rows)
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    for ext, text in (("json", json.dumps({**meta, "rows": rows, "per_rank": ranks}, indent=1) + "\n"), ("md", md)):
        (Path(a.out_dir) / f"exchange{'_smoke' if a.smoke else ''}.{ext}").write_text(text)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
