"""``list`` (the steps of a run, or the runs under a bucket or prefix), ``latest`` and
``rm`` (one step)."""

from __future__ import annotations

import sys
import time

from ..checkpoint import discovery, layout
from ..errors import NotACheckpoint
from ..storage import url as urls
from .common import EXIT_NO, EXIT_NOT_FOUND, EXIT_OK, loc, positive_int, yes_opt
from .hints import missing_local
from .output import age, emit, emit_records, size, table, utc


def no_steps(folder: str, *, runs: str = "", given: str | None = None) -> int:
    """A folder with no step{N} folder (and, for ``list``, no run: ``runs`` says
    where none was found): one line, exit 3. A local path that does not exist is said
    so (``given``: the path as typed, for the hint about buckets)."""
    gone = missing_local(folder if given is None else given, folder)
    if gone:
        print(f"cloudckpt: error: {gone}", file=sys.stderr)
        return EXIT_NOT_FOUND
    hint = "is the path right?"
    if layout.step_of_name(urls.basename(folder)) is not None:
        hint = f"it looks like a step folder itself: use its save folder {urls.parent(folder)}"
    print(f"cloudckpt: no checkpoints in {folder}: it holds no step{{N}} folder{runs} ({hint})", file=sys.stderr)
    return EXIT_NOT_FOUND


# ---------------------------------------------------------------- list
def _list_runs(args, folder) -> int:
    from .. import ops

    found = ops.find_runs(folder, max_depth=args.depth, max_folders=args.max_folders)
    where = (f" and no run in the {found.folders_listed} folder(s) listed (--max-folders)" if found.truncated
             else f" and no run within {found.max_depth} level(s) below it")
    now = found.listed_at
    rows = [r.to_json(now) for r in found.runs]
    notes = []
    if found.truncated:
        notes.append(f"stopped after listing {found.folders_listed} folders (--max-folders): runs in folders not "
                     "listed are not shown; list a deeper prefix")
    if found.deeper:
        notes.append(f"{len(found.deeper)} folder(s) at depth {found.max_depth} have subfolders that were not "
                     f"searched (--depth), e.g. {found.deeper[0]}")
    if args.json:
        for n in notes:
            print(f"cloudckpt: note: {n}", file=sys.stderr)
        emit_records(args, rows, {"prefix": args.folder, "runs": rows, "depth": found.max_depth,
                                  "folders_listed": found.folders_listed, "truncated": found.truncated,
                                  "not_searched": found.deeper})
        return EXIT_OK if rows else no_steps(args.folder, runs=where, given=args.given.get("folder"))
    if not rows:
        for n in notes:
            print(n)
        return no_steps(args.folder, runs=where, given=args.given.get("folder"))
    lines = []
    for r in rows:
        counts = [r["steps"], r["step_dirs"] - r["steps"] or "-"]
        if r["newest_step"] is None:
            lines.append([r["url"], *counts, "-", "none committed", "-", "-", "-"])
        else:
            lines.append([r["url"], *counts, r["newest_step"], "ephemeral" if r["ephemeral"] else "persistent",
                          size(r["size_bytes"]), utc(r["created_unix"]), age(r["age_seconds"])])
    table(["RUN", "STEPS", "UNCOMMITTED", "NEWEST", "KIND", "SIZE", "CREATED (UTC)", "AGE"], lines,
          right=(1, 2, 3, 5, 7))
    print(f"{len(rows)} run(s) under {args.folder} (searched {found.max_depth} level(s) down, "
          f"{found.folders_listed} folder(s) listed); STEPS are committed steps, UNCOMMITTED step folders without "
          "a marker (saves in progress or crashed, folders a prune emptied); NEWEST is the newest "
          "committed step, SIZE and CREATED are its; `cloudckpt list RUN` shows a run's steps")
    for n in notes:
        print(n)
    return EXIT_OK


def cmd_list(args) -> int:
    from .. import ops

    folder = loc(args, args.folder)
    kind = True if args.ephemeral else (False if args.persistent else None)
    listing = ops.list_steps(folder, include_uncommitted=args.all, ephemeral=kind)
    if not listing.step_dirs:  # checkpoint folders with other names (Lightning's epoch=0-step=8.ckpt)
        from ..ops.list_named import list_named

        listing = list_named(folder, include_uncommitted=args.all, ephemeral=kind)
    if not listing.step_dirs:  # not a run: the runs beneath it
        return _list_runs(args, folder)
    for w in listing.warnings:
        print(f"cloudckpt: warning: {w}", file=sys.stderr)
    now = listing.listed_at
    rows = [{"type": "step", **r.to_json(now)} for r in listing.rows]
    if args.json:
        emit_records(args, rows, {"folder": args.folder, "steps": rows})
        return EXIT_OK
    if not rows:
        print(f"no {'step folders' if args.all else 'committed checkpoints'} in {args.folder}")
        return EXIT_OK
    lines = []
    for r in rows:
        when = [utc(r["created_unix"]), "-" if r["age_seconds"] is None else age(r["age_seconds"])]
        if r["status"] != "committed":
            lines.append(["-" if r["step"] is None else r["step"], r["status"], "-",
                          "-" if r["size_bytes"] is None else size(r["size_bytes"]),
                          "-" if r["object_count"] is None else r["object_count"], "-", *when, r["url"]])
        else:
            kind = "ephemeral" if r["ephemeral"] else "persistent"
            lines.append([r["step"], f"REFUSED ({kind})" if r["refused"] else kind, r["format"],
                          size(r["size_bytes"]), r["object_count"], r["world_size"], *when, r["url"]])
    table(["STEP", "KIND", "FORMAT", "SIZE", "OBJECTS", "WORLD", "CREATED", "AGE", "URL"], lines,
          right=(0, 3, 4, 5, 7))
    committed = [r for r in rows if r["status"] == "committed"]
    eph = sum(1 for r in committed if r["ephemeral"])
    refused = [r for r in committed if r["refused"]]
    summary = f"{len(committed)} committed ({len(committed) - eph} persistent, {eph} ephemeral), " \
              f"{size(sum(r['size_bytes'] for r in committed))}"
    if refused:
        summary += f", {len(refused)} of them REFUSED by a resume"
    others = len(rows) - len(committed)
    if others:
        summary += f"; {others} not committed"
    print(summary)
    for r in refused:
        print(f"REFUSED step{r['step']}: a resume found it failing its checks at {utc(r['refused']['refused_unix'])}"
              f": {r['refused']['reason']}")
    if refused:
        print("a resume passes over a REFUSED step to the previous one, and the run saves that step number afresh "
              "when it reaches it; `cloudckpt verify STEP` checks one again, `cloudckpt rm STEP --yes` removes one")
    unverified = [r for r in committed if not r["verified"]]
    if unverified:
        print(f"{len(unverified)} step(s) written by another tool have no manifest (FORMAT {unverified[0]['format']}): "
              "found and loaded without checksums; `cloudckpt adopt STEP --yes` records them")
    return EXIT_OK


# ---------------------------------------------------------------- latest
def cmd_latest(args) -> int:
    from ..ops.list_named import latest_named

    folder = loc(args, args.folder)
    try:
        # Listing by default: correct even if something wrote a step without moving the pointer.
        url = discovery.latest_checkpoint(folder, use_pointer=args.pointer)
        step = layout.step_of_name(urls.basename(url))
    except NotACheckpoint:
        if discovery.list_step_dirs(folder):
            print(f"cloudckpt: no committed checkpoint in {args.folder} (run `cloudckpt list --all {args.folder}` "
                  "to see step folders)", file=sys.stderr)
            return EXIT_NO
        named = latest_named(folder)  # checkpoint folders with other names (Lightning's epoch=0-step=8.ckpt)
        if named is None:
            return no_steps(args.folder, given=args.given.get("folder"))
        step, url = named
    if args.json:
        emit(args, {"folder": args.folder, "step": step, "url": url})
    else:
        print(url)
    return EXIT_OK


# ---------------------------------------------------------------- rm
def cmd_rm(args) -> int:
    from .. import ops

    plan = ops.plan_remove(loc(args, args.step))
    m = plan.marker
    if m is not None:
        what = (f"committed {'ephemeral' if m.ephemeral else 'persistent'} step {plan.number} ({m.kind}), "
                f"created {utc(m.created_unix)} ({age(time.time() - m.created_unix)} ago)")
    else:
        what = f"uncommitted step folder ({'unreadable marker: ' + plan.problem if plan.problem else 'no marker'})"
    deleted = None
    if args.yes:
        deleted = ops.apply_remove(plan)
    if args.json:
        emit(args, plan.to_json(dry_run=not args.yes, deleted=deleted))
    elif args.yes:
        print(f"deleted {plan.step.url}: {what}; marker first, then {deleted} object(s), {size(plan.size_bytes)}")
    else:
        print(f"would delete {plan.step.url}: {what}; {plan.object_count} object(s), {size(plan.size_bytes)}")
        print("dry run: nothing was deleted; run again with --yes to delete (the marker goes first)")
    return EXIT_OK


def register(command) -> None:
    s = command("list", cmd_list, "steps of a run, or the runs under a bucket or prefix",
                "Given a save folder (a run: it holds step{N} folders): its steps with kind, size, objects, world "
                "size, creation time (UTC) and age; one LIST plus concurrent marker reads. Given a bucket or any "
                "other prefix: the runs beneath it (folders holding step{N} folders, searched --depth levels "
                "down) with their newest committed step. Exit 3 if there is neither.")
    s.add_argument("folder", metavar="URL",
                   help="a save folder or a prefix above runs (local path, s3://bucket[/prefix], gs://bucket[/prefix])")
    s.add_argument("--all", action="store_true", help="also show uncommitted step folders (marked incomplete)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--ephemeral", action="store_true", help="only ephemeral checkpoints")
    g.add_argument("--persistent", action="store_true", help="only persistent checkpoints")
    s.add_argument("--depth", type=positive_int, default=3, metavar="N",
                   help="when listing runs: folder levels searched below URL (default 3)")
    s.add_argument("--max-folders", type=positive_int, default=500, metavar="N",
                   help="when listing runs: stop after listing this many folders (default 500)")

    s = command("latest", cmd_latest, "URL of the newest committed step (exit 1 if none)",
                "URL of the newest committed step, found by listing the folder; exit 1 if there is none, "
                "3 if the folder holds no step folder at all.")
    s.add_argument("folder", metavar="FOLDER")
    s.add_argument("--pointer", action="store_true",
                   help="also read the `latest` pointer an earlier cloudckpt wrote (saves no longer write one) and "
                        "warn when it names another step (the answer always comes from listing)")

    s = command("rm", cmd_rm, "delete one step folder, marker first (dry run unless --yes)",
                "Delete one step folder (named step{N}, committed or not): its marker first, then every object, "
                "so a crash part-way leaves an uncommitted folder, never a committed step with objects missing. "
                "Dry run unless --yes.")
    s.add_argument("step", metavar="STEP", help="a step folder, e.g. s3://bucket/run-7/step1000")
    yes_opt(s)
