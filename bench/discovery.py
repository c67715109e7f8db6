"""Discovery with and without the ``latest`` pointer, at 10 and 10,000 steps, on SeaweedFS.

    .venv/bin/python -m bench.discovery              # 10 and 10,000 steps, 5 reps
    .venv/bin/python -m bench.discovery --smoke      # 10 and 200 steps, 1 rep

Discovery is what ``resume`` does first: find the newest committed step of a save
folder. The folders hold markers only (``step{N}/.metadata.json`` from the writer's
own ``StepCommit.marker``), written directly with a thread pool, and a ``latest``
pointer naming the newest step, as the versions that kept one wrote it
(``{"step": N, "pending": false, ...}``). Each rep opens a fresh client (as a new
process would) and counts the HTTP requests it sends. The ways to discover:

- ``listing``: ``discovery.latest_checkpoint`` (one LIST of the step prefixes, a page
  per 1,000, then the newest step's marker);
- ``pointer alone``: GET the pointer, GET the marker of the step it names. Blind to
  a step the pointer does not name (another tool's, OLMo-core's; one whose pointer
  write failed): shown by the ``correctness`` rows;
- ``pointer + StartAfter``: the pointer, its step's marker, then a LIST of the step
  prefixes from ``StartAfter=step{N}/`` to see newer steps. S3 orders keys bytewise
  and step names are not zero-padded, so "after step{N}" is neither "newer than N"
  (``step10`` sorts before ``step9``) nor short (after ``step10000`` come ``step1001``
  ... ``step9999``): the ``prefixes listed`` column and the ``correctness`` rows.

The save side: the 4 requests the pointer added to every save (GET + conditional PUT
before the marker, the same after), timed on the same server. Results:
``bench/results/discovery.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BUCKET = "bench-discovery"
POINTER = "latest"


def marker_bytes(step: int) -> bytes:
    """A committed step's marker, built by the writer's own code (``StepCommit.marker``)."""
    from cloudckpt.checkpoint import layout
    from cloudckpt.checkpoint.commit import StepCommit
    from cloudckpt.checkpoint.entries import ObjectEntry
    from cloudckpt.checkpoint.step import StepRef

    c = StepCommit(StepRef.of(f"s3://{BUCKET}/x/step{step}", step=step), save_id=f"bench{step}", world_size=1)
    return c.marker((), (ObjectEntry(layout.DCP_METADATA, 3, None),), ephemeral=False).to_bytes()


def pointer_bytes(step: int, pending: bool = False) -> bytes:
    """The pointer as the versions that kept one wrote it."""
    return json.dumps({"step": step, "pending": pending, "dir": f"step{step}", "updated_unix": time.time()}).encode()


def populate(client, prefix: str, steps, *, pointer: int | None) -> None:
    """Markers of ``steps`` under ``prefix`` (PUTs straight to the bucket), and a pointer naming ``pointer``."""
    def one(step: int) -> None:
        client.put_object(Bucket=BUCKET, Key=f"{prefix}step{step}/.metadata.json", Body=marker_bytes(step))

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(one, steps))
    if pointer is not None:
        client.put_object(Bucket=BUCKET, Key=prefix + POINTER, Body=pointer_bytes(pointer))


def by_listing(url: str) -> tuple[int, int]:
    """``(newest step, prefixes listed)`` as resume finds it."""
    from cloudckpt.checkpoint import discovery, layout
    from cloudckpt.storage import url as urls

    found = discovery.latest_checkpoint(url, use_pointer=False)
    return layout.step_of_name(urls.basename(found)), -1


def by_pointer_alone(url: str) -> tuple[int, int]:
    from cloudckpt.checkpoint import discovery, layout, pointer

    step, pending = pointer.read(url)
    discovery.read_header(layout.step_dir(url, step))  # a pointer must be vouched for by its step's marker
    return step, 0


def by_pointer_start_after(url: str) -> tuple[int, int]:
    """The pointer's step, then every step prefix listed after ``step{N}/`` in key order."""
    from cloudckpt.checkpoint import discovery, layout, pointer
    from cloudckpt.storage import open_store

    step, _ = pointer.read(url)
    discovery.read_header(layout.step_dir(url, step))
    store = open_store(url)
    bucket, key = url[len("s3://"):].split("/", 1)
    prefix = key.rstrip("/") + "/"
    newer, listed = [], 0
    for page in store.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, Delimiter="/", StartAfter=f"{prefix}step{step}/"):
        for cp in page.get("CommonPrefixes", ()):
            listed += 1
            s = layout.step_of_name(cp["Prefix"][len(prefix):])
            if s is not None and s > step:
                newer.append(s)
    for s in sorted(newer, reverse=True):
        try:
            discovery.read_header(layout.step_dir(url, s))
            return s, listed
        except Exception:  # noqa: BLE001 - an uncommitted newer folder: try the next
            continue
    return step, listed


WAYS = {"listing": by_listing, "pointer alone": by_pointer_alone, "pointer + StartAfter": by_pointer_start_after}


def measure(fn, url: str, counter) -> tuple[int, int, int, float]:
    from cloudckpt.storage import clear_cache

    clear_cache()  # a fresh client, like a new process
    n0, t0 = counter.n, time.perf_counter()
    step, listed = fn(url)
    return step, listed, counter.n - n0, time.perf_counter() - t0


def save_side(client, url: str, counter, reps: int) -> dict:
    """The pointer's requests per save: GET + conditional PUT ("pending") before the
    marker, the same ("final") after, as the versions that wrote one made them."""
    from cloudckpt.storage import clear_cache, open_store

    clear_cache()
    store = open_store(url)
    purl = url + "/" + POINTER
    secs, reqs = [], []
    for k in range(1, reps + 1):
        n0, t0 = counter.n, time.perf_counter()
        for pending in (True, False):
            try:
                _, version = store.get_bytes_versioned(purl, limit=64 * 1024)
                store.put_bytes_if_match(purl, pointer_bytes(k, pending), version)
            except FileNotFoundError:
                store.put_bytes(purl, pointer_bytes(k, pending), if_absent=True)
        secs.append(time.perf_counter() - t0)
        reqs.append(counter.n - n0)
    return {"requests": statistics.median(reqs), "seconds": statistics.median(secs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="10,10000", help="folder sizes (comma-separated)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="10 and 200 steps, one rep, no results written")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "discovery"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.reps = "10,200", 1
    sizes = [int(s) for s in args.steps.split(",")]

    import os

    from bench.common import git_state, loadavg
    from bench.ranks import HttpCounter
    from cloudckpt.testing.servers import SeaweedFS

    counter = HttpCounter.install()
    rows, checks = [], []
    with SeaweedFS() as sw:
        os.environ.update(sw.env())
        client = sw.client()
        client.create_bucket(Bucket=BUCKET)
        for n in sizes:
            prefix = f"run{n}/"
            t0 = time.perf_counter()
            populate(client, prefix, range(1, n + 1), pointer=n)
            print(f"{n} steps: wrote {n} markers in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            url = f"s3://{BUCKET}/{prefix}".rstrip("/")
            for way, fn in WAYS.items():
                samples = [measure(fn, url, counter) for _ in range(args.reps)]
                found = {s[0] for s in samples}
                if found != {n}:
                    raise RuntimeError(f"{way} at {n} steps found {found}, expected {n}")
                rows.append({"steps": n, "way": way, "requests": statistics.median(s[2] for s in samples),
                             "seconds": statistics.median(s[3] for s in samples),
                             "prefixes_listed": n if way == "listing" else samples[0][1]})
                print(f"  {way}: {rows[-1]}", file=sys.stderr)
        # correctness: steps 1..9 with the pointer at 9, then step 10 committed without moving
        # it (another tool's save, or a save whose pointer write failed)
        for case, steps, ptr, newest in (("step10 committed, pointer at 9", range(1, 11), 9, 10),
                                         ("step10000 committed, pointer at 9999", range(9990, 10001), 9999, 10000)):
            prefix = f"check{newest}/"
            populate(client, prefix, steps, pointer=ptr)
            url = f"s3://{BUCKET}/{prefix}".rstrip("/")
            for way, fn in WAYS.items():
                step = measure(fn, url, counter)[0]
                checks.append({"case": case, "way": way, "found": step, "right": step == newest})
        save = save_side(client, f"s3://{BUCKET}/saves", counter, max(args.reps, 5) * 4)
    cmd = "python -m bench.discovery " + " ".join(argv or sys.argv[1:])
    result = {"rows": rows, "correctness": checks, "pointer_per_save": save, "reps": args.reps,
              "loadavg": loadavg(), "git": git_state(), "cmd": cmd}
    print(json.dumps(result, indent=1))
    if not args.smoke:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out + ".md").write_text(report(result))
    return 0


def report(r: dict) -> str:
    out = ["# Discovery with and without the `latest` pointer (SeaweedFS, 127.0.0.1)", "",
           f"`{r['cmd'].strip()}`; medians of {r['reps']} reps, a fresh client each; load average "
           f"{', '.join(f'{x:.1f}' for x in r['loadavg'])}.", "",
           "| steps | way | requests | seconds | step prefixes listed |", "|---:|---|---:|---:|---:|"]
    for row in r["rows"]:
        out.append(f"| {row['steps']:,} | {row['way']} | {row['requests']:g} | {row['seconds']:.3f} | "
                   f"{row['prefixes_listed']:,} |")
    out += ["", "Does it find the newest committed step when the pointer does not name it?", "",
            "| folder | way | found | right |", "|---|---|---:|---|"]
    for c in r["correctness"]:
        out.append(f"| {c['case']} | {c['way']} | step{c['found']} | {'yes' if c['right'] else '**no**'} |")
    s = r["pointer_per_save"]
    out += ["", f"The pointer's cost per save (GET + conditional PUT before the marker and after it): "
            f"{s['requests']:g} requests, {s['seconds'] * 1000:.1f} ms (median).", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
