"""The peer benchmark's report: ratios of cloudckpt to the peers of the same run, the
targets met or missed, and the outputs (``<stem>.json`` with every raw figure,
``<stem>.md`` with the medians, ``<stem>.png`` the chart); ``merge`` makes one report
from several runs' JSON."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import git_state, loadavg, parse_size, size_label
from bench.drivers import PEERS
from bench.measure import LoadSampler, Results, s5cmd_binary

LABELS = {"cloudckpt": "cloudckpt", "s5cmd": "s5cmd (ceiling)", "gcs_tm": "gcs transfer_manager (ceiling)", **PEERS}
# save targets: cloudckpt / peer >= x
SAVE_TARGETS = {"s5cmd": 0.9, "olmo": 1.3, "s3tc": 1.1}
LOAD_TARGET_S5CMD = 0.9
RSS_TARGET = 1.3
DISCOVERY_CASES = {"latest": "latest_checkpoint", "latest_list": "latest_checkpoint(use_pointer=False): listing",
                   "list": "`cloudckpt list` (in-process)", "list_cli": "`cloudckpt list` (command, incl. start-up)"}


def ratio(a, b):
    return a / b if a and b else None


def paired_ratios(res: Results, case: str, size: str) -> list[float]:
    """cloudckpt's load throughput over s5cmd's download of the same state bytes right
    after it (same minute, same machine state), one ratio per repetition."""
    return [s["s5cmd_paired_seconds"] / s["seconds"] for s in res.samples.get((case, size, "cloudckpt"), [])
            if s.get("s5cmd_paired_seconds") and s.get("seconds")]


def analyse(res: Results, sizes: list[str], disc_label: str | None,
            judge: bool = True) -> tuple[list[dict], list[dict]]:
    """(ratios, targets) from the medians. ``judge=False`` (smoke sizes, where fixed
    costs dominate) reports the values but not met/missed."""
    ratios, targets = [], []

    def mbps(case, size, tool):
        s = res.samples.get((case, size, tool))
        med = res.median(case, size, tool)
        return s[0]["bytes"] / med / 1e6 if s and med else None

    for size in sizes:
        ours = mbps("save", size, "cloudckpt")
        for peer in ("s5cmd", "olmo", "s3tc", "fsspec"):
            r = ratio(ours, mbps("save", size, peer))
            ratios.append({"size": size, "what": f"save: cloudckpt / {LABELS[peer]}", "ratio": r})
            if peer in SAVE_TARGETS:
                targets.append({"size": size, "target": f"save >= {SAVE_TARGETS[peer]}x {LABELS[peer]}", "value": r,
                                "met": None if r is None else r >= SAVE_TARGETS[peer]})
        down = mbps("load", size, "s5cmd")
        for case, name in (("load", "streaming"), ("load_pre", "pre-download"), ("load_2to1", "resharded 2->1")):
            unpaired = ratio(mbps(case, size, "cloudckpt"), down)
            pairs = paired_ratios(res, case, size)
            if pairs:  # judged on the pairs: each load against s5cmd's download right after it
                ratios.append({"size": size, "what": f"load {name}: cloudckpt / s5cmd download, medians of the "
                               "separate rows (unpaired)", "ratio": unpaired})
                r, how = statistics.median(pairs), f" (median of {len(pairs)} paired ratios)"
            else:
                r, how = unpaired, ""
            targets.append({"size": size, "target": f"load {name} >= {LOAD_TARGET_S5CMD}x s5cmd download{how}",
                            "value": r, "met": None if r is None else r >= LOAD_TARGET_S5CMD})
            rss = res.median(case, size, "cloudckpt", "rss_ratio")
            targets.append({"size": size, "target": f"load {name}: peak RSS per rank <= {RSS_TARGET}x bytes loaded",
                            "value": rss, "met": None if rss is None else rss <= RSS_TARGET})
        for peer in ("olmo", "s3tc", "fsspec"):
            ratios.append({"size": size, "what": f"load (streaming): cloudckpt / {LABELS[peer]}",
                           "ratio": ratio(mbps("load", size, "cloudckpt"), mbps("load", size, peer))})
        for case in ("gcs_save", "gcs_load"):
            r = ratio(mbps(case, size, "cloudckpt"), mbps(case, size, "gcs_tm"))
            if r is not None:
                ratios.append({"size": size, "what": f"{case.replace('_', ' ')}: cloudckpt / {LABELS['gcs_tm']}",
                               "ratio": r})
    if disc_label:
        ours, theirs = res.median("latest", disc_label, "cloudckpt"), res.median("latest", disc_label, "olmo")
        if ours and theirs:
            ratios.append({"size": disc_label, "what": "latest_checkpoint: OLMo-core time / cloudckpt time",
                           "ratio": theirs / ours})
    if not judge:
        for t in targets:
            t["met"] = None
    return ratios, targets


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def _run_header(meta: dict) -> list[str]:
    during = meta.get("load_1min_during") or {}
    load = (f"1-min load average during the run: median {during['median']:.1f}, max {during['max']:.1f} "
            f"({during['samples']} samples)") if during else "load during the run not sampled"
    dirty = (meta.get("git") or {}).get("dirty_library_files")
    dirty_note = (f" (library files modified in the work tree: {', '.join(x.split()[-1] for x in dirty)})"
                  if dirty else "")
    return [f"Command: `{meta['command']}`  ", f"When: {meta['when']}; machine: {meta['machine']['cpus']} cores; "
            f"load average before {meta['load_before']}, after {meta['load_after']}; {load}; "
            f"median of {meta['reps']} repetition(s) of the sizes {', '.join(meta['sizes'])}, {meta['ranks']} ranks; "
            f"commit {(meta.get('git') or {}).get('commit', '?')[:10]}"
            f"{dirty_note}."]


def markdown(meta: dict, rows: list[dict], ratios: list[dict], targets: list[dict]) -> str:
    out = []
    for run in meta.get("runs") or [meta]:
        out += _run_header(run) + ([f"Note: {run['note']}"] if run.get("note") else []) + [""]
    out += ["MB = 10^6 bytes; throughput = state bytes / wall time of the slowest rank. Server CPU: SeaweedFS's "
            "for S3 rows, fake-gcs-server's for GCS rows.", ""]
    out += ["| case | size | tool | median s | MB/s | peak RSS / bytes loaded | HTTP requests | client CPU s | "
            "server CPU s | runs | status |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["case"] in DISCOVERY_CASES:
            continue
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r['reason']}"
        out.append(f"| {r['case']} | {r['size']} | {LABELS.get(r['tool'], r['tool'])} "
                   f"| {fmt(r.get('median_seconds'))} | "
                   f"{fmt(r.get('mb_per_s'), '.0f')} | {fmt(r.get('rss_ratio'))} | {fmt(r.get('requests'), '.0f')} | "
                   f"{fmt(r.get('client_cpu_s'), '.1f')} | {fmt(r.get('server_cpu_s'), '.1f')} | {r['n']} | {status} |")
    disc = [r for r in rows if r["case"] in DISCOVERY_CASES]
    if disc:
        out += ["", "| discovery | over | tool | median s | HTTP requests | runs | status |",
                "|---|---|---|---:|---:|---:|---|"]
        names = DISCOVERY_CASES
        for r in disc:
            status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r['reason']}"
            out.append(f"| {names[r['case']]} | {r['size']} | {LABELS.get(r['tool'], r['tool'])} "
                       f"| {fmt(r.get('median_seconds'), '.3f')} | "
                       f"{fmt(r.get('requests'), '.0f')} | {r['n']} | {status} |")
    if ratios:
        out += ["", "| ratio (higher is better for cloudckpt) | size | value |", "|---|---|---:|"]
        out += [f"| {r['what']} | {r['size']} | {fmt(r['ratio'])} |" for r in ratios]
    if targets:
        out += ["", "| target | size | measured | met |", "|---|---|---:|---|"]
        out += [f"| {t['target']} | {t['size']} | {fmt(t['value'], '.3f')} | "
                f"{'not judged' if t['met'] is None else ('yes' if t['met'] else '**no**')} |" for t in targets]
    return "\n".join(out) + "\n"


def chart(path: Path, rows: list[dict], sizes: list[str], disc_label: str | None, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (bash bench/setup_peers.sh installs it): no chart"
    cases = [("save", "save"), ("load", "load"), ("load_pre", "load\npre-download"), ("load_2to1", "load\n2->1"),
             ("gcs_save", "GCS save"), ("gcs_load", "GCS load")]
    tools = ["cloudckpt", "s5cmd", "olmo", "s3tc", "fsspec", "gcs_tm"]
    colors = {"cloudckpt": "#1f77b4", "s5cmd": "#7f7f7f", "olmo": "#ff7f0e", "s3tc": "#2ca02c", "fsspec": "#d62728",
              "gcs_tm": "#9467bd"}
    by = {(r["case"], r["size"], r["tool"]): r for r in rows}
    panels = len(sizes) + (1 if disc_label else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=False):  # a last panel may follow: discovery
        present = [c for c in cases
                   if any((c[0], size, t) in by and by[(c[0], size, t)].get("mb_per_s") for t in tools)]
        here = [t for t in tools if any(by.get((c, size, t), {}).get("mb_per_s") for c, _ in present)]
        width = 0.8 / max(1, len(here))
        for i, tool in enumerate(here):
            xs, ys = [], []
            for j, (c, _) in enumerate(present):
                r = by.get((c, size, tool))
                if r and r.get("mb_per_s"):
                    xs.append(j + (i - len(here) / 2 + 0.5) * width)
                    ys.append(r["mb_per_s"])
            if xs:
                ax.bar(xs, ys, width, label=LABELS[tool], color=colors[tool])
        ax.set_xticks(range(len(present)), [name for _, name in present], fontsize=8)
        ax.set_ylabel("MB/s (median; higher is better)")
        ax.set_title(f"{size} state, 2 ranks")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    if disc_label:
        ax = axes[0][-1]
        items = [(f"{LABELS[r['tool']]}\n{r['case']}", r) for r in rows
                 if r["case"] in ("latest", "latest_list", "list") and r["size"] == disc_label
                 and r.get("requests") is not None]
        ax.bar(range(len(items)), [r["requests"] for _, r in items], color=[colors[r["tool"]] for _, r in items])
        for k, (_, r) in enumerate(items):
            ax.annotate(f"{r['median_seconds']:.2f}s", (k, r["requests"]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(items)), [n for n, _ in items], fontsize=8)
        ax.set_yscale("log")
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("HTTP requests (log; labels: median seconds)")
        ax.set_title(f"discovery over {disc_label}")
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None



def merge(paths: list[str], out_dir: Path, stem: str) -> int:
    """One report from several runs' JSON. Each (case, size, tool) keeps its own
    samples; ratios compare rows of the same size, so keep each size (and the GCS
    and discovery cases) within one run to keep the ratios same-run."""
    res, runs, sizes, disc_label = Results(), [], [], None
    for p in paths:
        d = json.loads(Path(p).read_text())
        runs.append({k: d.get(k) for k in ("command", "when", "reps", "ranks", "sizes", "load_before", "load_after",
                                           "load_1min_during", "wall_seconds", "git", "versions", "machine", "settings",
                                           "note")})
        for r in d["rows"]:
            key = (r["case"], r["size"], r["tool"])
            for sample in r["samples"]:
                res.add(*key, sample)
            if r["status"] in ("not installed", "error"):
                res.fail(*key, r["status"], r["reason"])
            if r["case"] in DISCOVERY_CASES:
                disc_label = r["size"]
            elif r["size"] not in sizes:
                sizes.append(r["size"])
    sizes.sort(key=parse_size)
    rows = res.rows()
    ratios, targets = analyse(res, sizes, disc_label)
    meta = {"merged_from": [str(p) for p in paths], "runs": runs}
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "rows": rows, "ratios": ratios, "targets": targets}
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = markdown(meta, rows, ratios, targets)
    (out_dir / f"{stem}.md").write_text(md)
    cmds = " + ".join(r["command"] for r in runs)
    problem = chart(out_dir / f"{stem}.png", rows, sizes, disc_label,
                    f"{cmds}  |  {runs[0]['when']} .. {runs[-1]['when']}")
    print(md)
    if problem:
        print(f"chart: {problem}")
    print(f"wrote {out_dir / stem}.json, .md{'' if problem else ', .png'}")
    return 0


def write_outputs(args, res: Results, disc_label, command: str, load_before, t_start: float, json_path: Path, log,
                  sampler: LoadSampler | None = None) -> None:
    """The JSON (always); with ``log``, also the markdown and the chart beside it."""
    load_after = loadavg()
    rows = res.rows()
    sizes = [size_label(s) for s in args.sizes]
    ratios, targets = analyse(res, sizes, disc_label, judge=not args.smoke)
    versions = {}
    for mod in ("torch", "boto3", "botocore", "google.cloud.storage"):
        with contextlib.suppress(Exception):
            versions[mod] = __import__(mod, fromlist=["__version__"]).__version__
    for tool in PEERS:
        freeze = Path(args.peer_venvs) / f".venv-bench-{tool}" / ".bench-freeze.txt"
        if freeze.exists():
            keep = ("ai2-olmo-core", "s3torchconnector", "s3fs", "fsspec", "aiobotocore", "botocore", "boto3", "torch")
            versions[tool] = [ln for ln in freeze.read_text().splitlines() if ln.split("==")[0].lower() in keep]
    if s5cmd_binary():
        versions["s5cmd"] = subprocess.run([s5cmd_binary(), "version"], capture_output=True, text=True).stdout.strip()
    meta = {
        "command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": args.reps,
        "ranks": args.ranks, "sizes": sizes, "load_before": load_before, "load_after": load_after,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "load_1min_during": sampler.summary() if sampler is not None else None,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "versions": versions,
        "git": git_state(),
        "settings": {"s5cmd_numworkers": args.s5cmd_numworkers, "s5cmd_concurrency": args.s5cmd_concurrency,
                     "gcs_workers": args.gcs_workers, "discovery_steps": args.discovery_steps},
    }
    json_path.write_text(json.dumps({**meta, "rows": rows, "ratios": ratios, "targets": targets}, indent=1) + "\n")
    if log is None:
        return
    md = markdown(meta, rows, ratios, targets)
    json_path.with_suffix(".md").write_text(md)
    problem = chart(json_path.with_suffix(".png"), rows, sizes, disc_label,
                    f"{command}  |  {meta['when']}  |  load avg {load_before} -> {load_after} "
                    f"on {os.cpu_count()} cores")
    log("\n" + md)
    if problem:
        log(f"chart: {problem}")
    log(f"wrote {json_path.with_suffix('')}.json, .md{'' if problem else ', .png'} in {meta['wall_seconds']}s")

