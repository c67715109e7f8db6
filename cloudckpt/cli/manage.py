"""``prune``, ``gc``, ``adopt`` and ``export``: commands that change a bucket or write files."""

from __future__ import annotations

import os
import time

from ..checkpoint import discovery
from ..errors import AlreadyExists, IncompatibleCheckpoint, MissingKeys
from .common import EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError, duration_arg, loc, positive_int, storage_options, yes_opt
from .hints import flag_words, is_local
from .output import Bar, age, emit, size, table, utc
from .step import progress_opts, transfer_opts


# ---------------------------------------------------------------- prune
def cmd_prune(args) -> int:
    from .. import ops

    if args.ephemeral_only and args.keep_last_ephemeral is not None:
        raise CliError("--keep-last-ephemeral cannot be combined with --ephemeral-only (there --keep-last counts "
                       "ephemeral steps)", EXIT_USAGE)
    plan = ops.plan_prune(loc(args, args.folder), keep_last=args.keep_last, keep_every=args.keep_every,
                          keep_last_ephemeral=args.keep_last_ephemeral, ephemeral_only=args.ephemeral_only,
                          include_foreign=args.include_foreign)
    if not args.json:
        foreign = plan.foreign
        if foreign and not args.include_foreign:
            print(f"not counted: {len(foreign)} step(s) written by another tool ({', '.join(map(str, foreign[:10]))}"
                  f"{', ...' if len(foreign) > 10 else ''}); --include-foreign counts them")
        if plan.refused:
            print(f"not counted, not pruned: {len(plan.refused)} step(s) a resume refused "
                  f"({', '.join(map(str, plan.refused[:10]))}{', ...' if len(plan.refused) > 10 else ''}): "
                  "`cloudckpt list` says why; `cloudckpt rm STEP --yes` removes one")
        if not plan.prune:
            print(f"nothing to prune in {args.folder}: the policy keeps all {plan.committed} committed step(s)")
        else:
            verbs = ("deleting", "keeping") if args.yes else ("would delete", "keep")
            print(f"{verbs[0]} {len(plan.prune)} of {plan.committed} committed step(s) "
                  f"({size(sum(i.size_bytes for i in plan.prune))}) and {verbs[1]} {len(plan.kept)}; "
                  "ACTION says which:")
            rows = sorted([(i, "delete") for i in plan.prune] + [(i, "keep") for i in plan.kept_items],
                          key=lambda r: r[0].step)
            table(["STEP", "ACTION", "KIND", "SIZE", "URL"],
                  [[i.step, action, "ephemeral" if i.ephemeral else "persistent", size(i.size_bytes), i.url]
                   for i, action in rows], right=(0, 3))
    if args.yes:
        ops.apply_prune(plan, on_deleted=None if args.json else (lambda i: print(f"deleted {i.url}")))
    elif plan.prune and not args.json:
        print(f"dry run: nothing was deleted; run again with --yes to delete the {len(plan.prune)} "
              "step(s) marked delete")
    if args.json:
        emit(args, plan.to_json(dry_run=not args.yes))
    return EXIT_OK


# ---------------------------------------------------------------- gc
def cmd_gc(args) -> int:
    from ..checkpoint import retention

    rep = retention.gc(loc(args, args.folder), older_than=args.older_than, dry_run=not args.yes)
    if args.json:
        emit(args, {"folder": args.folder, "dry_run": not args.yes, "older_than_seconds": args.older_than,
                    "step_dirs": rep.step_dirs, "uploads": rep.uploads, "failed": rep.failed, "young": rep.young,
                    "refusal_notes": rep.notes})
        return EXIT_ERROR if rep.failed else EXIT_OK
    verb = "removed" if args.yes else "would remove"
    older = f"{age(args.older_than)} (before {utc(time.time() - args.older_than)})"
    young = (f"; left {len(rep.young)} uncommitted step folder(s) younger than that ({_urls(rep.young)}: a save may "
             "still be writing them; a shorter --older-than takes them)") if rep.young else ""
    for n in rep.notes:
        print(f"{verb} refusal note {n} (its step was replaced, restored or removed since)")
    if not rep.step_dirs and not rep.uploads and not rep.failed:
        print(f"nothing to collect in {args.folder}: no uncommitted step folder or multipart upload older than "
              f"{older}{young}")
        return EXIT_OK
    for d in rep.step_dirs:
        print(f"{verb} uncommitted step folder {d}")
    for d in rep.failed:
        print(f"could not remove uncommitted step folder {d} (the warning above says why)")
    for u in rep.uploads:
        print(f"{'aborted' if args.yes else 'would abort'} multipart upload {u}")
    print(f"{len(rep.step_dirs)} uncommitted folder(s), {len(rep.uploads)} multipart upload(s) older than {older}"
          f"{f'; {len(rep.failed)} folder(s) could not be removed' if rep.failed else ''}{young}")
    if not args.yes:
        print("dry run: nothing was deleted; run again with --yes to delete")
    return EXIT_ERROR if rep.failed else EXIT_OK


def _urls(urls: list[str], limit: int = 5) -> str:
    return ", ".join(urls[:limit]) + (f", ... ({len(urls)} in all)" if len(urls) > limit else "")


# ---------------------------------------------------------------- adopt
def cmd_adopt(args) -> int:
    from ..ops.adopt import adopt

    with Bar(args, "adopt") as bar:
        if args.yes:
            bar.start(0)
        rep = adopt(loc(args, args.step), dry_run=not args.yes, jobs=args.jobs, on_bytes=bar.update)
    if args.json:
        emit(args, {"url": args.step, "writer": rep.writer, "dry_run": not args.yes, "already": rep.already,
                    "written": rep.written, "manifest": rep.manifest_url, "object_count": rep.object_count,
                    "total_bytes": rep.total_bytes})
    elif rep.already:
        print(f"{args.step} already has a manifest ({'cloudckpt' if rep.writer == 'cloudckpt' else 'adopted'}): "
              "nothing to do")
    elif not rep.written:
        print(f"would adopt {args.step} ({rep.writer}, {rep.object_count} objects, {size(rep.total_bytes)}): "
              f"every object is read once and its size and CRC32C go to {rep.manifest_url}")
        print("dry run: the step is complete and parses; nothing was read in full or written; run again with --yes")
    else:
        print(f"adopted {args.step}: {rep.object_count} objects, {size(rep.total_bytes)}; manifest {rep.manifest_url}; "
              f"loads and `cloudckpt verify` now check sizes and CRC32Cs ({rep.writer}'s marker is unchanged)")
    return EXIT_OK


# ---------------------------------------------------------------- export
def _refuse_existing(args) -> None:
    """DEST (or, with --format hf, its model.safetensors / config.json) exists and no
    --force: exit 2 before the step is read (one stat; nothing heavy imported)."""
    if args.force:
        return
    if args.format == "hf":
        paths = [os.path.join(args.dest, name) for name in ("model.safetensors", "config.json")]
        found = [p for p in paths if os.path.lexists(p)]
    else:
        dest = args.dest + ("model.safetensors" if args.format == "safetensors" else "model.pt") \
            if args.dest.endswith("/") else args.dest
        found = [dest] if loc(args, dest).store.exists(dest) else []
    if found:
        raise CliError(f"{found[0]} already exists; rerun with --force to replace it", EXIT_USAGE)


def _saved_hf_config(args, step) -> dict:
    """The model config cloudckpt's Hugging Face integration saved with the step (rank
    0's train state, read as a load reads it), or exit 2 naming --config."""
    from ..checkpoint.committed import CommittedStep
    from ..checkpoint.step import StepRef
    from ..integrations.hf_export import MAX_CONFIG_BYTES, saved_json

    state = CommittedStep.open(StepRef.of(step)).train_state(0)
    section = state.get("hf") if isinstance(state, dict) else None
    text = section.get("config") if isinstance(section, dict) else None
    if not isinstance(text, str):
        raise CliError(f"{args.step} has no saved model config (it was not saved by cloudckpt's Hugging Face "
                       "integration): pass --config PATH (the model's config.json, or a folder holding one)",
                       EXIT_USAGE)
    value = saved_json(text, url=step.url, what="model config", limit=MAX_CONFIG_BYTES)
    if not isinstance(value.get("model_type"), str):
        raise IncompatibleCheckpoint(f"the model config saved with {args.step} is not a Hugging Face model config "
                                     "(a JSON object with 'model_type'); pass --config PATH")
    return value


def cmd_export(args) -> int:
    if args.format != "hf" and args.config is not None:
        raise CliError("--config is for --format hf (the model config written beside the weights)", EXIT_USAGE)
    if args.format == "hf" and not is_local(args.dest):
        raise CliError(f"--format hf writes a local folder (from_pretrained reads one), got {args.dest}; export to a "
                       "local folder, then upload it", EXIT_USAGE)
    _refuse_existing(args)
    step = loc(args, args.step).resolved_step()
    discovery.read_marker(step)  # a step that is not there is reported before torch is imported
    from ..ops.progress import engine_subscriber

    with Bar(args, "export read") as read, Bar(args, "export upload") as bar:
        common = dict(dtype=args.dtype, key_prefix=args.key, overwrite=args.force,
                      storage_options=storage_options(args), progress=engine_subscriber(bar), read_progress=read)
        try:
            if args.format == "hf":
                from ..integrations.hf_export import export_hf

                config = args.config if args.config is not None else _saved_hf_config(args, step)
                res = export_hf(args.step, args.dest, config=config, **common)
            else:
                from ..ops.export import export_weights

                res = export_weights(args.step, args.dest, fmt=args.format, **common)
        except (AlreadyExists, MissingKeys) as e:  # DEST created while we read (no --force), or a --key naming nothing
            raise CliError(flag_words(str(e)), EXIT_USAGE) from e
    if args.json:
        emit(args, res)
        return EXIT_OK
    print(f"exported {res['tensors']} tensor(s), {size(res['bytes'])}, of step {res['step']} "
          f"as {args.format}{' (' + str(res['dtype']) + ')' if res['dtype'] else ''} to {res['dest']}"
          f"{'; config ' + res['config'] if res.get('config') else ''}")
    if res.get("skipped"):
        print(f"not exported (not tensors): {', '.join(map(str, res['skipped']))}")
    return EXIT_OK


def register(command) -> None:
    s = command("prune", cmd_prune, "delete old committed steps by a keep-last policy (dry run unless --yes)",
                "Delete old committed steps, marker first. Default: keep the newest N persistent steps (steps "
                "divisible by --keep-every are kept and not counted) and the newest --keep-last-ephemeral (1) "
                "ephemeral ones. --ephemeral-only: persistent steps are untouched and the newest N ephemeral ones "
                "are kept. The newest committed step is never deleted. Dry run unless --yes.")
    s.add_argument("folder", metavar="FOLDER")
    s.add_argument("--keep-last", type=positive_int, required=True, metavar="N",
                   help="persistent steps to keep (ephemeral ones with --ephemeral-only)")
    s.add_argument("--keep-every", type=positive_int, metavar="K", help="also keep every step divisible by K")
    s.add_argument("--keep-last-ephemeral", type=positive_int, metavar="M",
                   help="ephemeral steps to keep (default 1; not with --ephemeral-only)")
    s.add_argument("--ephemeral-only", action="store_true", help="consider only ephemeral steps")
    s.add_argument("--include-foreign", action="store_true",
                   help="also count (and delete) steps another tool wrote, e.g. OLMo-core's (default: left alone)")
    yes_opt(s)

    s = command("gc", cmd_gc, "remove uncommitted step folders and orphaned multipart uploads (dry run unless --yes)",
                "Remove what crashed saves left: step folders without a marker whose newest object is older than "
                "--older-than (empty folders are left alone), and multipart uploads under the folder started "
                "before that. Dry run unless --yes.")
    s.add_argument("folder", metavar="FOLDER")
    s.add_argument("--older-than", type=duration_arg, default=3600.0, metavar="DURATION",
                   help="only what is older than this, e.g. 30m, 2h, 1d (default 1h)")
    yes_opt(s)

    s = command("adopt", cmd_adopt, "record sizes and CRC32Cs for a step another tool wrote (dry run unless --yes)",
                "Give a step another tool committed (OLMo-core's marker, no manifest) cloudckpt's manifest: every "
                "object is read once, its size and CRC32C (and each DCP item's) go to .cloudckpt.json beside the "
                "other tool's marker, which is left unchanged; loads and verify then check them. Refuses a step "
                "with anything missing. Dry run unless --yes.")
    s.add_argument("step", metavar="STEP")
    yes_opt(s, "read every object and write the manifest (default: dry run)")
    transfer_opts(s, jobs=8, what="objects read")

    s = command("export", cmd_export, "export model weights of a step (safetensors, torch file, Hugging Face folder)",
                "Stream the tensors under --key (default: model) of a committed step into a safetensors file "
                "(one tensor in memory at a time) or a torch file, locally or in a bucket, optionally cast to "
                "another dtype; --format hf writes a local Hugging Face model folder (model.safetensors and "
                "config.json) that from_pretrained opens. A bucket DEST is uploaded with a progress bar.")
    s.add_argument("step", metavar="STEP")
    s.add_argument("dest", metavar="DEST", help="output file URL or path (a trailing / appends model.safetensors); "
                                                "with --format hf a local folder")
    s.add_argument("--dtype", default=None, help="cast floating-point tensors, e.g. bfloat16, float16")
    s.add_argument("--format", choices=("safetensors", "torch", "hf"), default="safetensors")
    s.add_argument("--config", default=None, metavar="PATH",
                   help="with --format hf: the model's config.json (or a folder holding one); default: the config "
                        "cloudckpt's Hugging Face integration saved with the step")
    s.add_argument("--key", default="model", help="top-level key of the state dict to export (default: model)")
    s.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    progress_opts(s)
