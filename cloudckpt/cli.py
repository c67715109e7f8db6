"""``cloudckpt`` / ``python -m cloudckpt``: look at runs from a laptop or a script.

Errors print one line on stderr saying what to do and exit non-zero; ``--debug``
shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .errors import CloudCkptError
from .storage import StorageOptions


def _storage_options(args) -> StorageOptions:
    return StorageOptions(endpoint_url=args.endpoint_url, profile=args.profile, region=args.region)


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f}{unit}"
    return f"{seconds:.0f}s"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def cmd_list(args) -> int:
    from .checkpoint import discovery

    so = _storage_options(args)
    steps = discovery.list_step_dirs(args.folder, storage_options=so)
    with ThreadPoolExecutor(max_workers=32) as pool:
        markers = list(pool.map(lambda sd: discovery._try_marker(sd[1], so), steps))
    now = time.time()
    rows = []
    for (step, dir), m in zip(steps, markers):
        if m is None:
            if not args.all:
                continue
            rows.append({"step": step, "url": dir, "status": "incomplete"})
            continue
        if (args.ephemeral and not m.ephemeral) or (args.persistent and m.ephemeral):
            continue
        rows.append({"step": step, "url": dir, "status": "ephemeral" if m.ephemeral else "persistent",
                     "size": m.total_bytes, "objects": len(m.objects), "world_size": m.world_size,
                     "created": m.created, "age_seconds": round(now - m.created_unix, 1)})
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    if not rows:
        print(f"no {'step folders' if args.all else 'committed checkpoints'} in {args.folder}")
        return 0
    print(f"{'STEP':>8}  {'KIND':<10}  {'SIZE':>9}  {'OBJECTS':>7}  {'WORLD':>5}  {'AGE':>5}  URL")
    for r in rows:
        if r["status"] == "incomplete":
            print(f"{r['step']:>8}  {'incomplete':<10}  {'-':>9}  {'-':>7}  {'-':>5}  {'-':>5}  {r['url']}")
        else:
            print(f"{r['step']:>8}  {r['status']:<10}  {_size(r['size']):>9}  {r['objects']:>7}  {r['world_size']:>5}  "
                  f"{_age(r['age_seconds']):>5}  {r['url']}")
    return 0


def cmd_latest(args) -> int:
    from .checkpoint import discovery
    from .errors import NotACheckpoint

    try:
        print(discovery.latest_checkpoint(args.folder, storage_options=_storage_options(args)))
        return 0
    except NotACheckpoint as e:
        print(f"cloudckpt: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint-url", help="S3-compatible endpoint (default: AWS_ENDPOINT_URL / the SDK's chain)")
    common.add_argument("--profile", help="AWS profile (default: AWS_PROFILE)")
    common.add_argument("--region", help="region (default: AWS_REGION)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p = argparse.ArgumentParser(prog="cloudckpt", description="Look at cloudckpt checkpoints in local folders, s3:// and gs://.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("list", parents=[common], help="committed steps of a save folder")
    s.add_argument("folder")
    s.add_argument("--all", action="store_true", help="also show uncommitted step folders (marked incomplete)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--ephemeral", action="store_true", help="only ephemeral checkpoints")
    g.add_argument("--persistent", action="store_true", help="only persistent checkpoints")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("latest", parents=[common], help="URL of the newest committed step (exit 1 if none)")
    s.add_argument("folder")
    s.set_defaults(func=cmd_latest)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not args.debug:
        for noisy in ("botocore", "urllib3", "google"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        return args.func(args)
    except CloudCkptError as e:
        if args.debug:
            raise
        print(f"cloudckpt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
