"""``list`` and ``latest``: what a save folder holds."""

from __future__ import annotations

import sys

from .common import EXIT_NO, EXIT_NOT_FOUND, EXIT_OK, loc
from .output import age, print_json, size, table


def no_steps(folder: str) -> int:
    """``list`` / ``latest`` of a folder without any step{N} folder: one line, exit 3."""
    from ..checkpoint import layout
    from ..storage import url as urls

    hint = "is the path right?"
    if layout.step_of_name(urls.basename(folder)) is not None:
        hint = f"it looks like a step folder itself: use its save folder {urls.parent(folder)}"
    print(f"cloudckpt: no checkpoints in {folder}: it holds no step{{N}} folder ({hint})", file=sys.stderr)
    return EXIT_NOT_FOUND


def cmd_list(args) -> int:
    from .. import ops

    kind = True if args.ephemeral else (False if args.persistent else None)
    listing = ops.list_steps(loc(args, args.folder), include_uncommitted=args.all, ephemeral=kind)
    for w in listing.warnings:
        print(f"cloudckpt: warning: {w}", file=sys.stderr)
    now = listing.listed_at
    rows = [r.to_json(now) for r in listing.rows]
    if args.json:
        print_json({"folder": args.folder, "steps": rows})
        return EXIT_OK if listing.step_dirs else no_steps(args.folder)
    if not listing.step_dirs:
        return no_steps(args.folder)
    if not rows:
        print(f"no {'step folders' if args.all else 'committed checkpoints'} in {args.folder}")
        return EXIT_OK
    lines = []
    for r in rows:
        if r["status"] != "committed":
            lines.append([r["step"], r["status"], "-", "-" if r["size_bytes"] is None else size(r["size_bytes"]),
                          "-" if r["object_count"] is None else r["object_count"], "-",
                          "-" if r["age_seconds"] is None else age(r["age_seconds"]), r["url"]])
        else:
            lines.append([r["step"], "ephemeral" if r["ephemeral"] else "persistent", r["format"],
                          size(r["size_bytes"]), r["object_count"], r["world_size"], age(r["age_seconds"]), r["url"]])
    table(["STEP", "KIND", "FORMAT", "SIZE", "OBJECTS", "WORLD", "AGE", "URL"], lines, right=(0, 3, 4, 5, 6))
    committed = [r for r in rows if r["status"] == "committed"]
    eph = sum(1 for r in committed if r["ephemeral"])
    summary = f"{len(committed)} committed ({len(committed) - eph} persistent, {eph} ephemeral), " \
              f"{size(sum(r['size_bytes'] for r in committed))}"
    others = len(rows) - len(committed)
    if others:
        summary += f"; {others} not committed"
    print(summary)
    unverified = [r for r in committed if not r["verified"]]
    if unverified:
        print(f"{len(unverified)} step(s) written by another tool have no manifest (FORMAT {unverified[0]['format']}): "
              "found and loaded without checksums; `cloudckpt adopt STEP --yes` records them")
    return EXIT_OK


def cmd_latest(args) -> int:
    from ..checkpoint import discovery, layout
    from ..errors import NotACheckpoint
    from ..storage import url as urls

    folder = loc(args, args.folder)
    try:
        # Listing by default: correct even if something wrote a step without moving the pointer.
        url = discovery.latest_checkpoint(folder, use_pointer=args.pointer)
    except NotACheckpoint:
        if not discovery.list_step_dirs(folder):
            return no_steps(args.folder)
        print(f"cloudckpt: no committed checkpoint in {args.folder} (run `cloudckpt list --all {args.folder}` "
              "to see step folders)", file=sys.stderr)
        return EXIT_NO
    if args.json:
        print_json({"folder": args.folder, "step": layout.step_of_name(urls.basename(url)), "url": url})
    else:
        print(url)
    return EXIT_OK


def register(command) -> None:
    s = command("list", cmd_list, "committed steps of a save folder",
                "Committed steps of a save folder: kind, size, objects, world size, age. One LIST of the "
                "folder plus concurrent marker reads. Exit 3 if the folder holds no step folder at all.")
    s.add_argument("folder", metavar="FOLDER", help="the save folder (local path, s3://bucket/prefix, gs://bucket/prefix)")
    s.add_argument("--all", action="store_true", help="also show uncommitted step folders (marked incomplete)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--ephemeral", action="store_true", help="only ephemeral checkpoints")
    g.add_argument("--persistent", action="store_true", help="only persistent checkpoints")

    s = command("latest", cmd_latest, "URL of the newest committed step (exit 1 if none)",
                "URL of the newest committed step, found by listing the folder; exit 1 if there is none, "
                "3 if the folder holds no step folder at all.")
    s.add_argument("folder", metavar="FOLDER")
    s.add_argument("--pointer", action="store_true",
                   help="also read the folder's `latest` pointer and warn when a step another tool wrote is newer "
                        "than it (the answer always comes from listing)")
