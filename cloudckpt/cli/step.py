"""``inspect``, ``verify`` and ``download``: one committed step."""

from __future__ import annotations

import sys
import time

from ..checkpoint import layout
from ..errors import CorruptCheckpoint
from .common import EXIT_NO, EXIT_OK, loc, positive_int
from .output import Bar, age, emit, size, table, utc


def transfer_opts(s, *, jobs: int, what: str) -> None:
    """``--jobs`` and ``--progress`` / ``--no-progress``."""
    s.add_argument("--jobs", "-j", type=positive_int, default=jobs, help=f"{what} at once (default {jobs})")
    progress_opts(s)


def progress_opts(s) -> None:
    g = s.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="always show the progress bar (default: only on a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="never show the progress bar")


# ---------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    from .. import ops

    rep = ops.inspect_step(loc(args, args.step))
    now = time.time()
    if args.json:
        emit(args, rep.to_json(now))
        return EXIT_OK
    marker = rep.marker
    kind = "ephemeral" if marker.ephemeral else "persistent"
    print(f"{args.step}")
    print(f"  step {marker.step}, {kind}, world size {marker.world_size}, "
          f"{len(marker.objects)} objects, {size(marker.total_bytes)}")
    when = f"committed {utc(marker.created_unix)} ({age(now - marker.created_unix)} ago) by"
    if not marker.foreign:
        print(f"  {when} cloudckpt {marker.library_version}, torch {marker.torch_version or '?'}; "
              f"format {marker.format_version}; save_id {marker.save_id or '-'}")
    elif marker.verified:
        print(f"  {when} {marker.writer}; adopted: manifest written by cloudckpt {marker.library_version} "
              f"({marker.save_id or '-'})")
    else:
        print(f"  {when} {marker.writer} {marker.library_version or '?'}; no manifest (unverified: sizes from a "
              "listing, no CRC32C)")
    print()
    if not rep.has_metadata:
        print(f"no DCP metadata ({layout.DCP_METADATA}) in this checkpoint")
    else:
        tensors = rep.tensors
        total = sum(t["size_bytes"] for t in tensors)
        numel = sum(t["numel"] for t in tensors)
        print(f"tensors ({rep.tensors_from}): {len(tensors)} tensors, {numel:,} elements, {size(total)}")
        if tensors:
            table(["KEY", "DTYPE", "SHAPE", "SIZE", "CHUNKS"],
                  [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", size(t["size_bytes"]),
                    t["chunks"]] for t in tensors], right=(3,))
        if rep.non_tensor_keys:
            print(f"non-tensor entries: {', '.join(rep.non_tensor_keys)}")
    print()
    train = rep.train_state
    if train is None:
        print(f"no train state ({layout.train_state_name(0)}) in this checkpoint")
    else:
        note = f"; one file per rank, {marker.world_size} ranks" if marker.world_size > 1 else ""
        print(f"train state ({train['path']}{note}): {train['type']}")
        if train["keys"]:
            table(["KEY", "TYPE", "VALUE"], [[k["key"], k["type"], k["summary"]] for k in train["keys"]])
    if args.objects:
        print()
        table(["OBJECT", "SIZE", "CRC32C"], [[o.path, size(o.size), o.crc32c or "-"] for o in marker.objects],
              right=(1,))
    return EXIT_OK


# ---------------------------------------------------------------- verify
def cmd_verify(args) -> int:
    from .. import ops
    from ..ops.verify import adopt_hint, unverified_reason

    with Bar(args, "verify") as bar:
        try:
            rep = ops.verify_step(loc(args, args.step), size_only=args.size_only, jobs=args.jobs, progress=bar)
        except CorruptCheckpoint:  # the marker itself is refused: say whether a resume recorded it too
            from ..ops.verify import refusal_of

            refused = refusal_of(loc(args, args.step))
            if refused:
                print(f"REFUSED: a resume found {args.step} failing its checks at {utc(refused['refused_unix'])}: "
                      f"{refused['reason']}", file=sys.stderr)
            raise
    if args.json:
        emit(args, rep.to_json())
    else:
        for r in rep.bad:
            print(f"BAD  {r['path']}: {r['detail']}  ({r['url']})")
    if not rep.manifest:
        if not args.json:
            print(f"UNVERIFIED: {args.step} was {unverified_reason(rep.marker)}")
            if not rep.bad:
                print(f"its DCP metadata and train state parse as a load parses them; {adopt_hint(args.step)}")
        print(f"cloudckpt: verify could not check {args.step}: no manifest ({rep.marker.writer}); "
              f"{adopt_hint(args.step)}", file=sys.stderr)
        return EXIT_NO
    if not args.json:
        what = "size" if args.size_only else "size and CRC32C"
        if rep.bad:
            print(f"FAILED: {len(rep.bad)} of {rep.object_count} objects of {args.step} are missing or corrupt "
                  f"({what} checked)")
        else:
            print(f"OK: {rep.object_count} objects, {size(rep.total_bytes)}: {what} match the marker")
        if rep.no_checksum and not args.size_only:
            print(f"note: {len(rep.no_checksum)} object(s) have no CRC32C in the marker; only their size was checked")
        for n in rep.notes:
            print(f"note: {n['path']}: {n['detail']}")
        if rep.refused:
            print(f"REFUSED: a resume found {args.step} failing its checks at {utc(rep.refused['refused_unix'])}: "
                  f"{rep.refused['reason']}" + ("" if rep.bad else " (it passes now: the next resume that reaches it "
                                                                   "loads it and removes the note)"))
    if rep.bad:
        print(f"cloudckpt: verify failed for {args.step}: {', '.join(r['path'] for r in rep.bad)}", file=sys.stderr)
        return EXIT_NO
    return EXIT_OK


# ---------------------------------------------------------------- download
def cmd_download(args) -> int:
    from .. import ops

    plan = ops.prepare_download(loc(args, args.step), args.dest, jobs=args.jobs)
    with Bar(args, f"download step{plan.marker.step}") as bar:
        rep = ops.run_download(plan, jobs=args.jobs, progress=bar)
    if not rep.ok:
        if args.json:
            emit(args, rep.to_json())
        for b in rep.bad:
            got = b.get("detail") or f"size {b['size']} crc32c {b['crc32c']}"
            print(f"BAD  {b['path']}: {got}, the marker says size {b['expected_size']} crc32c {b['expected_crc32c']}",
                  file=sys.stderr)
        print(f"cloudckpt: download of {args.step} failed: {len(rep.bad)} object(s) do not match the marker; "
              f"{rep.dest} is left uncommitted (run `cloudckpt verify {args.step}`)", file=sys.stderr)
        return EXIT_NO
    if args.json:
        emit(args, rep.to_json())
    else:
        print(f"downloaded {len(rep.downloaded)} object(s) ({size(rep.bytes_downloaded)}), skipped {len(rep.skipped)} "
              f"already present; {rep.dest} is a committed checkpoint (step {rep.step})")
    return EXIT_OK


def register(command) -> None:
    s = command("inspect", cmd_inspect, "tensors, train state keys and marker fields of one step")
    s.add_argument("step", metavar="STEP", help="a step folder, e.g. s3://bucket/run-7/step1000")
    s.add_argument("--objects", action="store_true", help="also list every object of the manifest")

    s = command("verify", cmd_verify, "check every object of a step against its marker (size and CRC32C)",
                "Check that every object listed in the step's marker exists with the right size and CRC32C "
                "(each object is streamed and checksummed, concurrently). Exit 1 naming each bad object.")
    s.add_argument("step", metavar="STEP")
    s.add_argument("--size-only", action="store_true", help="check existence and size only (no download)")
    transfer_opts(s, jobs=16, what="objects checked")

    s = command("download", cmd_download, "download a step to a local folder (parallel, resumable)",
                "Download a committed step into a local folder: parallel, with a progress bar, resumable (files "
                "already present with the right size and CRC32C are skipped), marker written last. If DEST is "
                "named step{N} it is the step folder; otherwise the step goes into DEST/step{N}.")
    s.add_argument("step", metavar="STEP")
    s.add_argument("dest", metavar="DEST", help="local step folder (named step{N}) or save folder")
    transfer_opts(s, jobs=8, what="downloads")

