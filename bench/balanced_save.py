"""Balanced save of replicated items: DCP's own dedup against cloudckpt's, side by side.

    .venv/bin/python -m bench.balanced_save            # Llama-shaped model + AdamW, ~275 MiB, 3 reps
    .venv/bin/python -m bench.balanced_save --smoke    # tiny, one rep

4 spawned gloo ranks save the same state to SeaweedFS on 127.0.0.1 with
``Checkpointer.save``, once with DCP 2.13's dedup of replicated items (``stock``:
``DefaultSavePlanner``'s ``dedup_save_plans``) and once with cloudckpt's
(``balanced``: ``_torch_compat.balanced_dedup``), alternating within each rep, in
two layouts:

- ``ddp``: every tensor replicated on the 4 ranks (plain tensors, as DDP's state dict);
- ``hsdp``: a 2x2 mesh, 2 replica groups of 2 shards (DTensors ``[Replicate(), Shard(0)]``;
  AdamW's ``step`` scalars plain, on every rank).

The state: a Llama-shaped model (embedding, layers, final norm, an untied output
layer) and its AdamW state (exp_avg, exp_avg_sq, step per parameter), in the order
``get_state_dict`` lists them. Per layout and mode: the DCP data bytes each rank wrote
(the ``__{R}_*.distcp`` objects of the committed step), the largest over the mean,
the save time (slowest rank, median over reps), and whether the repeated save reused
DCP's cached plan (every rank sent an empty local plan; no global plan built). Every
step saved is loaded back and compared bit-exactly. Results:
``bench/results/balanced_save.{json,md}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1024 * 1024
SHAPES = {
    # vocab, hidden, ffn, layers
    "small": {"vocab": 16000, "dim": 384, "ffn": 1024, "layers": 6},
    "test": {"vocab": 8192, "dim": 128, "ffn": 352, "layers": 2},
}
LAYOUTS = ("ddp", "hsdp")
KINDS = ("train", "weights")  # model + AdamW state; the model alone
MODES = ("stock", "balanced")
_RANK_FILE = re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$")


def parameters(shape: dict, seed: int) -> dict:
    """``{name: tensor}`` of a Llama-shaped model, in module order (dim 0 even everywhere)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    v, d, f = shape["vocab"], shape["dim"], shape["ffn"]
    p = {"embed_tokens.weight": torch.randn(v, d, generator=g)}
    for i in range(shape["layers"]):
        pre = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            p[pre + f"attn.{name}.weight"] = torch.randn(d, d, generator=g)
        p[pre + "mlp.gate_proj.weight"] = torch.randn(f, d, generator=g)
        p[pre + "mlp.up_proj.weight"] = torch.randn(f, d, generator=g)
        p[pre + "mlp.down_proj.weight"] = torch.randn(d, f, generator=g)
        p[pre + "input_norm.weight"] = torch.rand(d, generator=g)
        p[pre + "post_norm.weight"] = torch.rand(d, generator=g)
    p["norm.weight"] = torch.rand(d, generator=g)
    p["lm_head.weight"] = torch.randn(v, d, generator=g)
    return p


def full_state(shape: dict, seed: int, kind: str = "train") -> dict:
    """``{flat name: tensor or number}``: the model, then (``kind`` train) AdamW's state
    per parameter and its lr."""
    import torch

    params = parameters(shape, seed)
    flat = {f"model.{k}": t for k, t in params.items()}
    if kind == "weights":
        return flat
    if kind != "train":
        raise ValueError(f"unknown kind {kind!r}: one of {KINDS}")
    for k, t in params.items():
        flat[f"optim.state.{k}.exp_avg"] = t * 0.1
        flat[f"optim.state.{k}.exp_avg_sq"] = t * t * 0.01
        flat[f"optim.state.{k}.step"] = torch.tensor(float(100 + seed))
    flat["optim.lr"] = 1e-3 * (seed + 1)
    return flat


def state_dict(layout: str, rank: int, world_size: int, shape: dict, seed: int, kind: str = "train",
               zero: bool = False) -> dict:
    """This rank's nested DCP state dict for ``layout`` (``zero``: same structure, zeros)."""
    import torch

    flat = full_state(shape, seed, kind)
    if zero:
        flat = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in flat.items()}
    if layout == "hsdp":
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if world_size % 2:
            raise ValueError("the hsdp layout needs an even world size (2 replica groups)")
        mesh = _mesh(world_size)
        shard = mesh.get_local_rank("shard")

        def place(v):
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                return v  # AdamW's step and the lr: the same on every rank
            local = v.chunk(world_size // 2, dim=0)[shard].clone()
            return DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)

        flat = {k: place(v) for k, v in flat.items()}
    elif layout != "ddp":
        raise ValueError(f"unknown layout {layout!r}: one of {LAYOUTS}")
    nested: dict = {}
    for key, value in flat.items():
        node = nested
        *path, last = key.split(".") if not key.startswith(("model.", "optim.state.")) else _split(key)
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


@functools.lru_cache(maxsize=None)
def _mesh(world_size: int):
    """The 2 x (world_size / 2) mesh, made once per process (each one makes new groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))


def _split(key: str) -> list[str]:
    """``model.<param>`` -> [model, <param>]; ``optim.state.<param>.<x>`` -> [optim, state, <param>, <x>]."""
    if key.startswith("model."):
        return ["model", key[len("model."):]]
    param, _, field = key[len("optim.state."):].rpartition(".")
    return ["optim", "state", param, field]


def flatten(sd: dict, prefix: str = "") -> dict:
    """The nested state dict back to ``{flat name: full tensor or number}`` (DTensors gathered)."""
    out = {}
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def bit_exact(got: dict, want: dict) -> list[str]:
    """Names whose loaded value differs from the saved one (bitwise for tensors)."""
    import torch

    bad = [k for k in want if k not in got]
    for k, w in want.items():
        g = got.get(k)
        if isinstance(w, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape
                    and torch.equal(g.view(torch.uint8) if g.dim() else g, w.view(torch.uint8) if w.dim() else w)):
                bad.append(k)
        elif g != w:
            bad.append(k)
    return bad


class PlanCounter:
    """Counts, on this rank, the local plans sent to the coordinator (a cached plan is
    sent empty, ``usable=False``) and the global plans built (rank 0: DCP built a new
    global plan and metadata instead of reusing its cache). Wraps DefaultSavePlanner's
    methods, which the balanced planner inherits."""

    def __init__(self):
        from torch.distributed.checkpoint import DefaultSavePlanner

        self.cls = DefaultSavePlanner
        self.sent = 0
        self.cached = 0
        self.global_plans = 0
        self._local = DefaultSavePlanner.create_local_plan
        self._global = DefaultSavePlanner._create_global_plan
        counter = self

        def local(planner):
            plan = counter._local(planner)
            if plan.usable:
                counter.sent += 1
            else:
                counter.cached += 1
            return plan

        def build(planner, all_plans):
            counter.global_plans += 1
            return counter._global(planner, all_plans)

        DefaultSavePlanner.create_local_plan = local
        DefaultSavePlanner._create_global_plan = build

    def take(self) -> dict:
        out = {"local_plans_sent": self.sent, "local_plans_cached": self.cached,
               "global_plans_built": self.global_plans}
        self.sent = self.cached = self.global_plans = 0
        return out

    def close(self) -> None:
        self.cls.create_local_plan = self._local
        self.cls._create_global_plan = self._global


def use_planner(mode: str) -> None:
    """Make ``Checkpointer.save`` plan with ``mode``'s dedup (this process only)."""
    from cloudckpt import _torch_compat
    from cloudckpt.checkpoint import rank_writer

    rank_writer.caching_save_planner = functools.partial(_torch_compat.caching_save_planner,
                                                          balanced=mode == "balanced")


def rank_main(rank: int, world_size: int, args: dict) -> dict:
    """Per layout, ``args["reps"]`` rounds of one save per mode (order alternating per
    round; each round saves new values in the same structure, so from round 2 on DCP's
    plan cache is hit); then every step is loaded back into zeros and compared."""
    import torch.distributed as dist

    from cloudckpt import Checkpointer

    shape = SHAPES[args["shape"]]
    counter = PlanCounter()
    ck = Checkpointer(work_dir=args.get("work_dir"))
    saves = []
    try:
        for layout, kind in args["cases"]:
            for rep in range(args["reps"]):
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    use_planner(mode)
                    sd = state_dict(layout, rank, world_size, shape, seed=rep, kind=kind)
                    url = f"{args['url']}/{layout}-{kind}-{mode}/step{rep + 1}"
                    counter.take()
                    dist.barrier()
                    t0 = time.perf_counter()
                    ck.save(url, sd, {"rank": rank})
                    seconds = time.perf_counter() - t0
                    saves.append({"layout": layout, "kind": kind, "mode": mode, "rep": rep, "url": url,
                                  "seconds": seconds, **counter.take()})
        mismatches = {}
        for s in saves:
            sd = state_dict(s["layout"], rank, world_size, shape, seed=s["rep"], kind=s["kind"], zero=True)
            ck.load(s["url"], sd)
            bad = bit_exact(flatten(sd), full_state(shape, s["rep"], s["kind"]))
            if bad:
                mismatches[s["url"]] = bad[:5]
    finally:
        ck.close()
        counter.close()
    return {"rank": rank, "saves": saves, "mismatches": mismatches}


def bytes_per_rank(url: str, world_size: int) -> dict:
    """DCP data bytes each rank wrote to the committed step at ``url`` (from its marker)."""
    from cloudckpt.checkpoint import discovery

    marker = discovery.read_marker(url)
    per_rank = [0] * world_size
    other = 0
    for o in marker.objects:
        m = _RANK_FILE.search(o.path)
        if m:
            per_rank[int(m.group(1))] += o.size
        else:
            other += o.size
    mean = sum(per_rank) / world_size
    return {"per_rank": per_rank, "max_over_mean": max(per_rank) / mean if mean else 0.0, "other_bytes": other}


def summarize(ranks: list[dict], world_size: int) -> list[dict]:
    """One row per layout and mode: bytes per rank (the first rep's step; every rep's
    must match it), max/mean, median save time (slowest rank), plan reuse on repeats."""
    rows = []
    by_key: dict = {}
    for r in ranks:
        for s in r["saves"]:
            by_key.setdefault(((s["layout"], s["kind"]), s["mode"], s["rep"]), []).append(s)
    for layout in dict.fromkeys(k[0] for k in by_key):
        for mode in MODES:
            reps = sorted(k[2] for k in by_key if k[:2] == (layout, mode))
            written = [bytes_per_rank(by_key[(layout, mode, rep)][0]["url"], world_size) for rep in reps]
            seconds = [max(s["seconds"] for s in by_key[(layout, mode, rep)]) for rep in reps]
            repeats = [by_key[(layout, mode, rep)] for rep in reps[1:]]
            rows.append({
                "layout": layout[0], "kind": layout[1], "mode": mode, "per_rank": written[0]["per_rank"],
                "same_bytes_every_rep": all(w["per_rank"] == written[0]["per_rank"] for w in written),
                "max_over_mean": round(written[0]["max_over_mean"], 3), "other_bytes": written[0]["other_bytes"],
                "save_s": [round(x, 3) for x in seconds], "save_s_median": round(statistics.median(seconds), 3),
                "first_save_global_plans": sum(s["global_plans_built"] for s in by_key[(layout, mode, reps[0])]),
                "repeat_saves_plan_cached": bool(repeats) and all(
                    s["local_plans_sent"] == 0 and s["local_plans_cached"] == 1 and s["global_plans_built"] == 0
                    for rep in repeats for s in rep),
            })
    return rows


def plans_only(shape: dict, world_sizes=(4, 8, 16)) -> list[dict]:
    """Without ranks: DDP's local plans (every rank holds every item) for ``world_sizes``
    ranks, deduplicated by DCP 2.13 and by ``balanced_dedup``; the largest rank's bytes
    over the mean for each."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    from cloudckpt._torch_compat import _item_bytes, balanced_dedup

    def max_over_mean(plans) -> float:
        written = [sum(_item_bytes(i) for i in p.items) for p in plans]
        return round(max(written) * len(written) / sum(written), 3)

    rows = []
    for kind in KINDS:
        flat = full_state(shape, 0, kind)
        for world in world_sizes:
            plans = [create_default_local_save_plan(flat, r == 0) for r in range(world)]
            rows.append({"layout": "ddp", "kind": kind, "ranks": world, "stock": max_over_mean(dedup_save_plans(plans)),
                         "balanced": max_over_mean(balanced_dedup(plans))})
    return rows


def plans_markdown(rows: list[dict]) -> str:
    lines = ["DDP without ranks (the planners alone on every rank's plan; `--plans`): largest rank's bytes / mean", "",
             "| state | ranks | DCP 2.13 | cloudckpt |", "|---|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['ranks']} | {r['stock']:.2f} | {r['balanced']:.2f} |" for r in rows]
    return "\n".join(lines + [""])


def markdown(meta: dict, rows: list[dict]) -> str:
    def mib(n):
        return f"{n / MiB:.2f}"

    lines = [
        "# Balanced save of replicated items", "",
        f"`{meta['command']}` ({meta['when']}; {meta['ranks']} gloo ranks, SeaweedFS on 127.0.0.1, "
        f"{meta['cpus']} cores shared; shape {meta['shape']} {meta['shape_dims']}: a replica of the state is "
        f"{mib(meta['state_bytes']['train'])} MiB with AdamW (train), {mib(meta['state_bytes']['weights'])} MiB "
        "without (weights); "
        f"{meta['reps']} reps; load average before {meta['load_before']}).", "",
        "| layout | state | dedup | MiB written per rank | max / mean | save s (median, slowest rank) "
        "| repeat saves reuse the plan |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        cached = "n/a (1 rep)" if meta["reps"] < 2 else ("yes" if r["repeat_saves_plan_cached"] else "NO")
        lines.append(f"| {r['layout']} | {r['kind']} | {r['mode']} | {' / '.join(mib(b) for b in r['per_rank'])} | "
                     f"{r['max_over_mean']:.2f} | {r['save_s_median']:.2f} | {cached} |")
    lines += ["", f"Every step loaded back bit-exactly: {'yes' if meta['bit_exact'] else 'NO'}. "
              "Bytes: the `__{R}_*.distcp` objects of each committed step (rank 0 also writes the "
              "`.metadata`, and every rank its train state, not counted).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (default small; smoke test)")
    ap.add_argument("--reps", type=int, default=None, help="saves per layout and mode (default 3; smoke 2)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--plans", action="store_true",
                    help="only the planners on DDP plans of 4, 8, 16 ranks (no ranks, no store)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    from bench.common import git_state, loadavg
    from cloudckpt.testing.multiprocess import run_ranks
    from cloudckpt.testing.servers import SeaweedFS

    shape = a.shape or ("test" if a.smoke else "small")
    plan_rows = plans_only(SHAPES[shape])
    if a.plans:
        print(plans_markdown(plan_rows))
        return 0
    reps = a.reps or (2 if a.smoke else 3)
    world = 4
    command = " ".join([".venv/bin/python -m bench.balanced_save"] + (sys.argv[1:] if argv is None else list(argv)))
    load_before = loadavg()
    s3 = SeaweedFS().start()
    try:
        url = s3.create_bucket("balanced")
        env = dict(os.environ, **s3.env())
        os.environ.update(s3.env())
        args = {"shape": shape, "reps": reps, "cases": [[layout, kind] for layout in LAYOUTS for kind in KINDS],
                "url": f"{url}/run"}
        print(f"balanced save bench: shape {shape}, {world} ranks, {reps} reps, load {load_before}", flush=True)
        ranks = run_ranks(world, rank_main, args, env=env, timeout=3600)
        rows = summarize(ranks, world)
    finally:
        s3.stop()
    import torch

    state_bytes = {kind: sum(v.numel() * v.element_size() for v in full_state(SHAPES[shape], 0, kind).values()
                             if isinstance(v, torch.Tensor)) for kind in KINDS}
    mismatches = {k: v for r in ranks for k, v in r["mismatches"].items()}
    meta = {"command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ranks": world,
            "shape": shape, "shape_dims": SHAPES[shape], "state_bytes": state_bytes, "reps": reps,
            "load_before": load_before, "load_after": loadavg(), "cpus": os.cpu_count(), "smoke": a.smoke,
            "bit_exact": not mismatches, "mismatches": mismatches, "git": git_state()}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "balanced_save_smoke" if a.smoke else "balanced_save"
    (out_dir / f"{stem}.json").write_text(
        json.dumps({**meta, "rows": rows, "plans_only": plan_rows, "per_rank": ranks}, indent=1) + "\n")
    md = markdown(meta, rows) + "\n" + plans_markdown(plan_rows)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
