"""Loads with and without the read-once exchange, side by side in one run.

    .venv/bin/python -m bench.exchange                 # 64 MiB state per replica, 4 ranks, 3 loads each way
    .venv/bin/python -m bench.exchange --bytes 256MiB --reps 3
    .venv/bin/python -m bench.exchange --smoke         # tiny, one load each way
    .venv/bin/python -m bench.exchange --ranks 2 --sim-ranks ''   # 2 ranks, no simulation
    .venv/bin/python -m bench.exchange --ranks 0       # the simulation only

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

At scale (issue 32's way, no real ranks): HSDP layouts of bench/scale.py's shape
(Llama-3-70B with AdamW) at R = 1,024 and 4,096 in 8 and 32 replica groups, through
exchange.py's own census and owners' choice (``_Sim``): per-rank bucket bytes, GETs,
bytes from peers, items sent and received, and the census's collective bytes, CPU
seconds and peak memory on rank 1 and on the rank that owns the most requests.

Target (issue 33): bucket bytes per load <= 1.05x the checkpoint's for every layout.
Results: ``bench/results/exchange.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from cloudckpt.dcp.exchange import EACH
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
    from cloudckpt import TransferConfig

    # --bandwidth: each rank's link to the bucket (a store on another machine), as the engine's cap
    ck = Checkpointer(work_dir=args["work"], collective_timeout=120,
                      transfer=TransferConfig(bandwidth_limit=args.get("bandwidth")))
    out: dict = {}
    for layout in args["layouts"]:
        step = f"{args['root']}/{layout}/step1"
        ck.save(step, state(layout, rank, args["items"], args["numel"]), {"rank": rank})
        want = flat(state(layout, rank, args["items"], args["numel"]))
        rows = []
        for rep in range(args["reps"]):
            for on in (False, True):
                ck.options = dataclasses.replace(ck.options, load_exchange=on)
                target = state(layout, rank, args["items"], args["numel"], zero=True)
                ck.coord.all_gather(None)  # start together
                before = snapshot()
                server0 = _cpu_of(args.get("server_pid"))
                c0, t0 = time.process_time(), time.perf_counter()
                ck.load(step, target)
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                ck.coord.all_gather(None)  # every rank done: the server's CPU of this load
                server = _cpu_of(args.get("server_pid")) - server0 if rank == 0 and server0 is not None else None
                after = snapshot()
                got = flat(target)
                if not all(torch.equal(want[k], got[k]) for k in want):
                    raise AssertionError(f"rank {rank}: {layout} load (exchange {on}) is not bit-exact")
                ex = exchange.for_coordinator(ck.coord) if on else None
                rows.append({"rep": rep, "exchange": on, "seconds": seconds, "cpu_s": cpu, "server_cpu_s": server,
                             "bucket": {k: after[k] - before[k] for k in after},
                             "census_s": ex.last_census_seconds if ex else None})
        out[layout] = rows
    return out


def _cpu_of(pid: int | None) -> float | None:
    """CPU seconds (user + system, with its waited-for children) of process ``pid``."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


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
                "rank_cpu_s": statistics.median(sum(x["cpu_s"] for x in load) for load in loads),
                "server_cpu_s": (statistics.median(load[0]["server_cpu_s"] for load in loads)
                                 if loads[0][0].get("server_cpu_s") is not None else None),
                "spread": max(per_rank) / min(per_rank) if min(per_rank) else None,
            })
    return rows


# ---------------------------------------------------------------------- at scale, simulated (issue 32's way)
TORCH_SAVE_BYTES = 1569  # what torch.save adds to a tensor's data (torch 2.13; a 0-dim int64: 1,577 bytes)


class _Sim:
    """One HSDP layout of an R-rank job, simulated with bench/scale.py's shape and
    layout (``rank_items``/``rank_files``: the items and files DCP's metadata of that
    job holds, each item with torch.save's bytes added): shard groups of ``S`` ranks,
    ``R / S`` replica groups; shard ``s`` (ranks ``s, s + S, ...``) stored once, in the files ``__{s}_{k}.distcp`` (the
    replica group DCP's dedup keeps), the replicated ``step`` scalars in shard 0's
    files and needed by every rank. The owners' choice is exchange.py's own
    (``owner_of``, ``assign``), made for every owner of the job."""

    def __init__(self, shape, R: int, S: int):
        from bench.scale import rank_files, rank_items
        from cloudckpt.dcp.exchange import assign, file_id, owner_of

        self.R, self.S, self.G = R, S, R // S
        self.rels: dict[int, str] = {}
        self.shard_keys: list[list] = []  # per shard: its sharded items' keys (fid, offset, length), sorted
        self.scalars: list = []
        for s in range(S):
            # as DCP stores them: each tensor item through torch.save (its data + 1,569 bytes)
            items = [(fqn, off, size, n + TORCH_SAVE_BYTES) for fqn, off, size, n in rank_items(shape, S, s)]
            keys = []
            for k, f in enumerate(rank_files(items)):
                rel = f"model_and_optim/__{s}_{k}.distcp"
                fid = file_id(rel)
                self.rels[fid] = rel
                for idx, off, n in f:
                    (keys if items[idx][1] else self.scalars).append((fid, off, n))
            self.shard_keys.append(sorted(keys))
        self.scalars.sort()
        everyone = list(range(R))
        self.requesters: dict = {}
        owned: list[dict] = [{} for _ in range(R)]
        for s, keys in enumerate(self.shard_keys):
            reps = list(range(s, R, S))
            for k in keys:
                self.requesters[k] = reps
                owned[owner_of(k[0], k[1], k[2], R)][k] = reps
        for k in self.scalars:
            self.requesters[k] = everyone
            owned[owner_of(k[0], k[1], k[2], R)][k] = everyone
        self.owned = owned
        self.owner = {k: o for o, d in enumerate(owned) for k in d}
        self.reader: dict = {}
        for d in owned:
            self.reader.update(assign(d, {}))

    def needs(self, r: int) -> list:
        """Rank r's keys, sorted (as the census sorts them)."""
        return sorted(self.shard_keys[r % self.S] + self.scalars)

    def per_rank(self) -> dict:
        """Per rank (lists of R): bucket bytes and requests with and without the
        exchange, bytes from peers, messages (items sent x ranks, items received), and
        the census's collective bytes (sent + received, the four all_to_all)."""
        from cloudckpt.dcp.resumable import coalesce

        R = self.R
        zero = lambda: [0] * R  # noqa: E731
        read_b, read_keys, sends, req_owned, dests_owned, dests_in = zero(), [[] for _ in range(R)], zero(), \
            zero(), zero(), zero()
        for k, rd in self.reader.items():
            if rd == EACH:  # each rank that needs it reads it
                for r in self.requesters[k]:
                    read_b[r] += k[2]
                    read_keys[r].append(k)
                req_owned[self.owner[k]] += len(self.requesters[k])
                continue
            others = len(self.requesters[k]) - 1
            read_b[rd] += k[2]
            read_keys[rd].append(k)
            sends[rd] += others
            o = self.owner[k]
            req_owned[o] += others + 1
            dests_owned[o] += others
            dests_in[rd] += others

        def requests(keys, max_gap):
            planned = sum(k[2] for k in keys)
            stream = min(512 * MiB, max(16 * MiB, planned // 4))  # StreamingReader.budget (S3: streamed)
            by_file: dict = {}
            for k in keys:
                by_file.setdefault(k[0], []).append((k[1], k[2], None))
            return sum(len(coalesce(v, max_gap=max_gap, max_range=stream)) for v in by_file.values())

        need_b, need_n, plain_req = [], [], []
        per_shard = {}
        for r in range(R):
            s = r % self.S
            if s not in per_shard:
                keys = self.needs(r)
                per_shard[s] = (sum(k[2] for k in keys), len(keys), requests(keys, MiB))
            b, n, q = per_shard[s]
            need_b.append(b)
            need_n.append(n)
            plain_req.append(q)
        ex_req = [requests(read_keys[r], 0) for r in range(R)]
        census = [2 * 8 * R + 24 * need_n[r] + 24 * req_owned[r] + 16 * req_owned[r] + 16 * need_n[r]
                  + 8 * dests_owned[r] + 8 * dests_in[r] for r in range(R)]
        return {"need_bytes": need_b, "bucket_bytes": read_b, "peer_bytes": [need_b[r] - read_b[r] for r in range(R)],
                "plain_requests": plain_req, "requests": ex_req, "items_sent": sends,
                "items_received": [need_n[r] - len(read_keys[r]) for r in range(R)], "census_bytes": census,
                "requests_owned": req_owned}

    def census_inputs(self, me: int) -> list:
        """What the four all_to_all of the census bring rank ``me`` (from the peers,
        per the owners' choice above), in the order the census calls them."""
        import torch

        from cloudckpt.dcp.exchange import owner_of

        R = self.R
        rows_from: list[list] = [[] for _ in range(R)]
        for k in sorted(self.owned[me]):
            for src in self.requesters[k]:
                rows_from[src].append(k)
        mine = self.needs(me)
        by_owner: list[list] = [[] for _ in range(R)]
        for k in mine:
            by_owner[owner_of(k[0], k[1], k[2], R)].append(k)
        order = [k for b in by_owner for k in b]
        answers = [x for k in order for x in ((me, 0) if self.reader[k] == EACH else
                                              (self.reader[k], len(self.requesters[k]) - 1 if self.reader[k] == me
                                               else 0))]
        dests = [r for k in order if self.reader[k] == me for r in self.requesters[k] if r != me]
        return [torch.tensor([len(x) for x in rows_from], dtype=torch.int64),
                torch.tensor([x for b in rows_from for k in b for x in k], dtype=torch.int64),
                torch.tensor(answers, dtype=torch.int64), torch.tensor(dests, dtype=torch.int64)]

    def run_census(self, me: int) -> dict:
        """exchange.py's ``Exchange.census`` on rank ``me``, its peers simulated: CPU
        seconds, peak RSS above the start, bytes it sends and receives; the plan it
        returns checked against the owners' choice."""
        from bench.scale import Meter
        from cloudckpt.dcp.exchange import Exchange

        coord = _SimA2A(me, self.R, self.census_inputs(me))
        needed: dict = {}
        for fid, off, n in self.needs(me):
            needed.setdefault(self.rels[fid], []).append((off, n))
        with Meter() as m:
            plan = Exchange(coord).census(needed)
        want = {k for k in self.needs(me) if self.reader[k] in (me, EACH)}
        if set(plan.reads) != want or any(sorted(plan.reads[k]) != ([] if self.reader[k] == EACH else
                                                                    [r for r in self.requesters[k] if r != me])
                                          for k in want):
            raise AssertionError(f"rank {me}: the simulated census's plan differs from the owners' choice")
        return {"rank": me, **m.report(), "sent_bytes": coord.sent, "received_bytes": coord.received,
                "reads": len(plan.reads), "receives": len(plan.recvs)}


class _SimA2A:
    """``dist.Coordinator`` for ``Exchange.census`` on one rank: each ``all_to_all_int64``
    returns the next of ``inputs`` (what the peers send, computed beforehand) and counts
    the bytes this rank sends and receives."""

    def __init__(self, rank: int, world_size: int, inputs: list):
        self.rank, self.world_size, self.timeout, self.local = rank, world_size, 600.0, False
        self.inputs = list(inputs)
        self.sent = self.received = 0

    def any_rank(self, flags):
        """The census's first step (does any rank read another's files?): one all_reduce of
        a byte per flag. The simulated jobs are replicated, so some rank does."""
        self.sent += len(flags)
        self.received += len(flags)
        return [True] * len(flags)

    def all_to_all_int64(self, rows, send_counts, recv_counts):
        out = self.inputs.pop(0)
        if sum(send_counts) != rows.numel() or sum(recv_counts) != out.numel():
            raise AssertionError(f"census call: counts {sum(send_counts)}/{sum(recv_counts)} against "
                                 f"{rows.numel()}/{out.numel()} elements")
        self.sent += 8 * rows.numel()
        self.received += 8 * out.numel()
        return out.clone()


def _dist(xs: list) -> dict:
    xs = sorted(xs)
    return {"median": xs[len(xs) // 2], "max": xs[-1], "min": xs[0]}


def simulate(shape_name: str, ranks: list[int], shard_groups: list[int]) -> list[dict]:
    """For each R and each number of replica groups G (shard groups of R / G ranks): the
    per-rank figures of ``_Sim.per_rank`` (median and max over ranks) and the census run
    for real on rank 1 and on the rank that owns the most requests."""
    from bench.scale import shape_named

    shape = shape_named(shape_name)
    total = shape.total_bytes()
    rows = []
    for R in ranks:
        for G in shard_groups:
            t0 = time.process_time()
            sim = _Sim(shape, R, R // G)
            pr = sim.per_rank()
            build = time.process_time() - t0
            hot = max(range(R), key=pr["requests_owned"].__getitem__)
            census = [sim.run_census(1)] + ([sim.run_census(hot)] if hot != 1 else [])
            row = {"ranks": R, "replica_groups": G, "shard_group": R // G, "checkpoint_bytes": total,
                   "distinct_items": len(sim.reader), "hot_owner": hot, "sim_cpu_s": round(build, 1),
                   **{k: _dist(v) for k, v in pr.items()},
                   "bucket_over_ckpt": sum(pr["bucket_bytes"]) / sum(k[2] for k in sim.reader),
                   "plain_bucket_over_ckpt": sum(pr["need_bytes"]) / sum(k[2] for k in sim.reader),
                   "gets": sum(pr["requests"]), "plain_gets": sum(pr["plain_requests"]), "census": census}
            print(f"simulated R={R} G={G}: {json.dumps({k: row[k] for k in ('bucket_over_ckpt', 'gets')})} "
                  f"census {[(c['rank'], c['cpu_s'], c['received_bytes']) for c in census]}", flush=True)
            rows.append(row)
            del sim, pr
    return rows


def markdown(meta: dict, rows: list[dict], sim: list[dict]) -> str:
    lines = ["# Read-once exchange at load (bench/exchange.py)", ""]
    if rows:
        lines += [
            f"`{meta['command']}` ({meta['when']}): {meta['ranks']} gloo ranks, {meta['reps']} loads each way, "
            f"{meta['cpus']} cores shared by the ranks and SeaweedFS; load average before {meta['load_before']}.",
            f"Per replica: {meta['items']} tensors of {meta['numel'] * 4 / MiB:.2f} MiB."
            + (f" Each rank's bandwidth to the bucket: {meta['bandwidth']}/s (the engine's bandwidth_limit)."
               if meta.get("bandwidth") else " No bandwidth limit: the bucket is on the same 2 cores (loopback)."),
            "",
            "| layout | exchange | data bytes | bucket bytes / checkpoint | GETs per load (data) "
            "| load s (slowest rank, median) | census s | reading max/min over ranks "
            "| CPU s per load: ranks + SeaweedFS |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            census = "-" if r["census_s"] is None else f"{r['census_s']:.4f}"
            spread = "-" if r["spread"] is None else f"{r['spread']:.2f}"
            server = "?" if r.get("server_cpu_s") is None else f"{r['server_cpu_s']:.2f}"
            lines.append(f"| {r['layout']} | {'on' if r['exchange'] else 'off'} | {r['data_bytes']:,} | "
                         f"{r['bucket_over_ckpt']:.3f} | {r['gets']:.0f} ({r['data_gets']:.0f}) | "
                         f"{r['load_s']:.3f} | {census} | {spread} | {r['rank_cpu_s']:.2f} + {server} |")
        lines.append("")
    if sim:
        lines += sim_markdown(meta, sim)
    return "\n".join(lines) + "\n"


def sim_markdown(meta: dict, sim: list[dict]) -> list[str]:
    gb = lambda x: f"{x / 1e9:.2f}"  # noqa: E731
    lines = [
        f"## Simulated at scale ({meta['sim_shape']}, {sim[0]['checkpoint_bytes'] / 1e9:.0f} GB)", "",
        "HSDP: R ranks in G replica groups of R / G shard ranks; exchange.py's census and owners' choice "
        "(`owner_of`, `assign`) run for every owner of the job, `Exchange.census` itself on rank 1 and on the "
        "rank that owns the most requests (its peers simulated). Per rank: median (max) over the R ranks.", "",
        "| R | G x shard group | bucket bytes / checkpoint, off -> on | GB from the bucket per rank, off -> on "
        "| GB from peers per rank | GETs per load, off -> on (max per rank on) | items sent per rank "
        "| items received per rank | census collective bytes per rank | census CPU s, rank 1 / hottest owner "
        "| census peak MB, rank 1 / hottest owner |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sim:
        c = r["census"]
        hot = c[-1]
        lines.append(
            f"| {r['ranks']:,} | {r['replica_groups']} x {r['shard_group']} | {r['plain_bucket_over_ckpt']:.2f} -> "
            f"{r['bucket_over_ckpt']:.3f} | {gb(r['need_bytes']['median'])} -> {gb(r['bucket_bytes']['median'])} "
            f"({gb(r['bucket_bytes']['max'])}) | {gb(r['peer_bytes']['median'])} | {r['plain_gets']:,} -> "
            f"{r['gets']:,} ({r['requests']['max']}) | {r['items_sent']['median']:,} ({r['items_sent']['max']:,}) | "
            f"{r['items_received']['median']:,} ({r['items_received']['max']:,}) | "
            f"{r['census_bytes']['median'] / 1e3:.0f} kB ({r['census_bytes']['max'] / 1e3:.0f} kB) | "
            f"{c[0]['cpu_s']:.3f} / {hot['cpu_s']:.3f} | {c[0]['peak_rss_above_base_mb']:.1f} / "
            f"{hot['peak_rss_above_base_mb']:.1f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default=None, help="state per replica, e.g. 64MiB (default; smoke 4MiB)")
    ap.add_argument("--reps", type=int, default=None, help="loads each way (default 3; smoke 1)")
    ap.add_argument("--ranks", type=int, default=4, help="real gloo ranks (default 4; 0: the simulation only)")
    ap.add_argument("--sim-ranks", default=None, help="simulated R, comma-separated (default 1024,4096; "
                                                      "smoke 64; empty: no simulation)")
    ap.add_argument("--sim-groups", default="8,32", help="replica groups G of the simulation (default 8,32)")
    ap.add_argument("--sim-shape", default=None, help="bench/scale.py's shape (default llama3-70b; smoke small-T96)")
    ap.add_argument("--bandwidth", default=None, help="each rank's bandwidth to the bucket, e.g. 100MiB (per "
                    "second; the transfer engine's bandwidth_limit): a bucket on another machine, not loopback")
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
    sim_ranks = [int(x) for x in (a.sim_ranks if a.sim_ranks is not None else ("64" if a.smoke else "1024,4096"))
                 .split(",") if x]
    sim_shape = a.sim_shape or ("small-T96" if a.smoke else "llama3-70b")
    command = " ".join([".venv/bin/python -m bench.exchange"] + (sys.argv[1:] if argv is None else list(argv)))
    load_before = loadavg()
    rows, ranks, t_real = [], [], time.time()
    if a.ranks:
        s3 = SeaweedFS().start()
        try:
            root = s3.create_bucket("exchange") + "/run"
            os.environ.update(s3.env())
            with tempfile.TemporaryDirectory(prefix="cloudckpt-exchange-bench-") as work:
                args = {"root": root, "work": work, "layouts": ["ddp", "hsdp"], "items": items, "numel": numel,
                        "reps": reps, "server_pid": s3.proc.pid,
                        "bandwidth": parse_size(a.bandwidth) if a.bandwidth else None}
                print(f"exchange bench: {items} x {numel * 4 / MiB:.2f} MiB per replica, {a.ranks} ranks, {reps} "
                      "loads each way", flush=True)
                ranks = run_ranks(a.ranks, rank_main, args, env=dict(os.environ), timeout=3600)
            store = open_store(root)
            data = {layout: sum(e.size for e in store.list(f"{root}/{layout}/step1/", delimiter=None)
                                if e.url.endswith(".distcp"))
                    for layout in args["layouts"]}
        finally:
            s3.stop()
        rows = summarize(ranks, data)
    load_after = loadavg()
    sim = simulate(sim_shape, sim_ranks, [int(x) for x in a.sim_groups.split(",") if x]) if sim_ranks else []
    meta = {"command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_real)), "ranks": a.ranks,
            "items": items, "numel": numel, "reps": reps, "load_before": load_before, "load_after": load_after,
            "cpus": os.cpu_count(), "smoke": a.smoke, "sim_shape": sim_shape, "git": git_state(),
            "bandwidth": a.bandwidth}
    md = markdown(meta, rows, sim)
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    name = "exchange" + ("_smoke" if a.smoke else "") + ("" if a.ranks in (0, 4) else f"-{a.ranks}ranks") + (
        f"-{a.bandwidth}ps" if a.bandwidth else "")
    for ext, text in (("json", json.dumps({**meta, "rows": rows, "simulated": sim, "per_rank": ranks}, indent=1)
                       + "\n"), ("md", md)):
        (Path(a.out_dir) / f"{name}.{ext}").write_text(text)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
