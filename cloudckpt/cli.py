"""``cloudckpt`` / ``python -m cloudckpt``: look at runs from a laptop or a script.

Commands: ``list``, ``latest``, ``inspect``, ``verify``, ``download``, ``prune``, ``gc``,
``adopt``, ``export``.
Every command takes local paths, ``file://``, ``s3://`` and ``gs://`` URLs; ``--json``
prints one JSON document on stdout for scripts, otherwise a table for people.

Errors print one line on stderr (``cloudckpt: error: ...``, saying what to do) and
exit non-zero; ``--debug`` adds the traceback and debug logs of cloudckpt (never the
SDKs' wire logs, which carry signed headers). Exit codes:

    0  success
    1  the answer is "no" / a check failed: ``latest`` found no committed step,
       ``verify`` or ``download`` found missing or corrupt objects, an unreadable marker
    2  usage: bad arguments, a malformed URL or duration
    3  not found: bucket, folder or object missing; not a committed checkpoint;
       ``list`` / ``latest`` of a folder that holds no step{N} folder at all
    4  access denied or no usable credentials
    5  any other error (network, no answer within ``--timeout``, throttling after
       retries, local I/O)
    130 interrupted

Heavy imports (torch) happen only in the commands that need them (``inspect``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from ._version import __version__
from .errors import (
    AccessDenied,
    CloudCkptError,
    ConfigError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    InvalidURL,
    NotFound,
    UnsafeDelete,
)

EXIT_OK, EXIT_NO, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_DENIED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 5, 130

_MARKER_READ_THREADS = 32

log = logging.getLogger("cloudckpt.cli")


class CliError(Exception):
    """An error the CLI reports as one line with a given exit code."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


# ====================================================================== helpers
def _storage_options(args):
    from .storage import StorageOptions

    times = {"operation_timeout": args.timeout, "connect_timeout": args.connect_timeout}
    return StorageOptions(endpoint_url=args.endpoint_url, profile=args.profile, region=args.region,
                          **{k: v for k, v in times.items() if v is not None})


def _loc(args, url: str):
    """``url`` with the storage options of the command line, as a Location."""
    from .storage import Location

    return Location.of(url, _storage_options(args))


def _seconds_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: use a number of seconds > 0, e.g. 30")
    return v


def _no_steps(folder: str) -> int:
    """``list`` / ``latest`` of a folder without any step{N} folder: one line, exit 3."""
    from .checkpoint import layout
    from .storage import url as urls

    hint = "is the path right?"
    if layout.step_of_name(urls.basename(folder)) is not None:
        hint = f"it looks like a step folder itself: use its save folder {urls.parent(folder)}"
    print(f"cloudckpt: no checkpoints in {folder}: it holds no step{{N}} folder ({hint})", file=sys.stderr)
    return EXIT_NOT_FOUND


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
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


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``30m``, ``2h``, ``1d``, ``1h30m``, ``90`` (seconds) -> seconds. Raises ValueError."""
    s = text.strip().lower()
    pos, total, parts = 0, 0.0, 0
    while pos < len(s):
        m = _DURATION_RE.match(s, pos)
        if not m or (m.group(2) == "" and m.end() != len(s)):
            raise ValueError(text)
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos, parts = m.end(), parts + 1
    if not parts:
        raise ValueError(text)
    return total


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with a unit s, m, h, d or w, e.g. 30m, 2h, 1d, 1h30m"
        ) from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: use an integer >= 1")
    return v


def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> None:
    """Print an aligned table; columns listed in ``right`` are right-aligned; the
    last column is not padded."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals):
        out = []
        for i, v in enumerate(vals):
            if i == len(vals) - 1:
                out.append(v)
            elif i in right:
                out.append(v.rjust(widths[i]))
            else:
                out.append(v.ljust(widths[i]))
        return "  ".join(out).rstrip()

    print(line(list(headers)))
    for r in cells:
        print(line(r))


def _bar(args, total: int, desc: str):
    """A tqdm bar on stderr: shown on a terminal, or when ``--progress`` forces it."""
    from tqdm.auto import tqdm

    disable = True if args.progress is False else (False if args.progress else None)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=disable,
                dynamic_ncols=True, file=sys.stderr)


def _read_marker(dir: str, so) -> tuple[Any, bytes]:
    """The marker of a step folder and its raw bytes. Raises NotACheckpoint (no
    marker), BucketNotFound, CorruptCheckpoint / IncompatibleCheckpoint, storage errors."""
    from .checkpoint import discovery
    from .storage import Location

    return discovery.read_marker_bytes(Location.of(dir, so))


def _probe_marker(dir: str, so) -> tuple[Any, str | None]:
    """``(marker, None)`` when committed, ``(None, None)`` when there is no marker,
    ``(None, reason)`` when the marker cannot be read. Storage errors propagate."""
    from .errors import NotACheckpoint

    try:
        return _read_marker(dir, so)[0], None
    except NotACheckpoint:
        return None, None
    except (CorruptCheckpoint, IncompatibleCheckpoint) as e:
        return None, str(e)


def _manifest_path(root: str, rel: str, where: str) -> str:
    """``root/rel`` for a manifest entry (its name was checked when the marker was
    parsed; checked again here, as this path is written to)."""
    from .untrusted import check_name

    return os.path.join(root, *check_name(rel, what="object path in the marker", url=where).split("/"))


# ====================================================================== list
def cmd_list(args) -> int:
    from .checkpoint import discovery
    from .storage import Location
    from .storage import url as urls

    so = _storage_options(args)
    steps = discovery.list_step_dirs(Location.of(args.folder, so))
    with ThreadPoolExecutor(max_workers=_MARKER_READ_THREADS) as pool:
        probes = list(pool.map(lambda sd: _probe_marker(sd[1], so), steps))
    now = time.time()
    contents: dict[str, tuple[int, int, float | None]] = {}
    if args.all:
        # what an uncommitted folder holds; stores that keep emptied folders (SeaweedFS)
        # list them as prefixes, and an empty one is no step at all
        from .storage import Location, open_store

        loose = [dir for (step, dir), (m, problem) in zip(steps, probes) if m is None and not problem]

        def scan(dir: str) -> tuple[int, int, float | None]:
            objs = list(Location.of(dir, so).store.walk(urls.as_prefix(dir)))
            return len(objs), sum(o.size for o in objs), max((o.mtime for o in objs if o.mtime), default=None)

        with ThreadPoolExecutor(max_workers=_MARKER_READ_THREADS) as pool:
            contents = dict(zip(loose, pool.map(scan, loose)))
    rows: list[dict] = []
    for (step, dir), (m, problem) in zip(steps, probes):
        if m is None:
            if problem:
                print(f"cloudckpt: warning: {dir} is not counted: {problem}", file=sys.stderr)
            count, size, newest = contents.get(dir, (None, None, None))
            if args.all and count != 0:
                rows.append({"step": step, "url": dir, "status": "unreadable" if problem else "incomplete",
                             "ephemeral": None, "size_bytes": size, "object_count": count, "world_size": None,
                             "created": None, "created_unix": newest,
                             "age_seconds": None if newest is None else round(now - newest, 1),
                             **({"error": problem} if problem else {})})
            continue
        if (args.ephemeral and not m.ephemeral) or (args.persistent and m.ephemeral):
            continue
        rows.append({"step": step, "url": dir, "status": "committed", "ephemeral": m.ephemeral,
                     "size_bytes": m.total_bytes, "object_count": len(m.objects), "world_size": m.world_size,
                     "created": m.created, "created_unix": m.created_unix, "age_seconds": round(now - m.created_unix, 1),
                     "format": m.kind, "writer": m.writer, "verified": m.verified})
    if args.json:
        _print_json({"folder": args.folder, "steps": rows})
        return EXIT_OK if steps else _no_steps(args.folder)
    if not steps:
        return _no_steps(args.folder)
    if not rows:
        print(f"no {'step folders' if args.all else 'committed checkpoints'} in {args.folder}")
        return EXIT_OK
    table = []
    for r in rows:
        if r["status"] != "committed":
            table.append([r["step"], r["status"], "-", "-" if r["size_bytes"] is None else _size(r["size_bytes"]),
                          "-" if r["object_count"] is None else r["object_count"], "-",
                          "-" if r["age_seconds"] is None else _age(r["age_seconds"]), r["url"]])
        else:
            table.append([r["step"], "ephemeral" if r["ephemeral"] else "persistent", r["format"],
                          _size(r["size_bytes"]), r["object_count"], r["world_size"], _age(r["age_seconds"]), r["url"]])
    _table(["STEP", "KIND", "FORMAT", "SIZE", "OBJECTS", "WORLD", "AGE", "URL"], table, right=(0, 3, 4, 5, 6))
    committed = [r for r in rows if r["status"] == "committed"]
    eph = sum(1 for r in committed if r["ephemeral"])
    summary = f"{len(committed)} committed ({len(committed) - eph} persistent, {eph} ephemeral), " \
              f"{_size(sum(r['size_bytes'] for r in committed))}"
    others = len(rows) - len(committed)
    if others:
        summary += f"; {others} not committed"
    print(summary)
    unverified = [r for r in committed if not r["verified"]]
    if unverified:
        print(f"{len(unverified)} step(s) written by another tool have no manifest (FORMAT {unverified[0]['format']}): "
              "found and loaded without checksums; `cloudckpt adopt STEP --yes` records them")
    return EXIT_OK


# ====================================================================== latest
def cmd_latest(args) -> int:
    from .checkpoint import discovery, layout
    from .errors import NotACheckpoint

    try:
        # Listing by default: correct even if something wrote a step without moving the pointer.
        url = discovery.latest_checkpoint(_loc(args, args.folder), use_pointer=args.pointer)
    except NotACheckpoint:
        if not discovery.list_step_dirs(_loc(args, args.folder)):
            return _no_steps(args.folder)
        print(f"cloudckpt: no committed checkpoint in {args.folder} (run `cloudckpt list --all {args.folder}` "
              "to see step folders)", file=sys.stderr)
        return EXIT_NO
    if args.json:
        from .storage import url as urls

        _print_json({"folder": args.folder, "step": layout.step_of_name(urls.basename(url)), "url": url})
    else:
        print(url)
    return EXIT_OK


# ====================================================================== inspect
def _describe_value(v: Any) -> tuple[str, Any, str]:
    """(type name, JSON-able scalar or None, short text) of a train-state value."""
    tname = type(v).__name__
    if v is None or isinstance(v, (bool, int, float)):
        return tname, v, repr(v)
    if isinstance(v, str):
        return tname, v, repr(v if len(v) <= 60 else v[:57] + "...")
    shape = getattr(v, "shape", None)
    if shape is not None and hasattr(v, "dtype"):
        return tname, None, f"{str(v.dtype).replace('torch.', '')} {list(shape)}"
    if isinstance(v, (dict, list, tuple, set)):
        return tname, None, f"{len(v)} item(s)"
    return tname, None, ""


def cmd_inspect(args) -> int:
    from .checkpoint import layout
    from .storage import Location, open_store
    from .storage import url as urls

    so = _storage_options(args)
    marker, _ = _read_marker(args.step, so)
    store = Location.of(args.step, so).store
    now = time.time()

    # DCP metadata: tensors and non-tensor entries
    tensors: list[dict] = []
    others: list[str] = []
    meta_rel = f"{layout.MODEL_DIR}/.metadata"
    meta_entry = marker.object(meta_rel)
    if meta_entry is not None:
        import torch  # noqa: F401 - the metadata holds torch dtypes/sizes
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from .untrusted import MAX_METADATA_BYTES, loads_metadata, read_checked

        url = urls.join(args.step, meta_rel)
        md = loads_metadata(read_checked(store, url, meta_entry, limit=MAX_METADATA_BYTES, what="DCP metadata"),
                            url=url, files=marker.sizes_under(layout.MODEL_DIR))
        for key in sorted(md.state_dict_metadata):
            sm = md.state_dict_metadata[key]
            if isinstance(sm, TensorStorageMetadata):
                dtype = sm.properties.dtype
                numel = 1
                for d in sm.size:
                    numel *= int(d)
                tensors.append({"key": key, "dtype": str(dtype).replace("torch.", ""), "shape": [int(d) for d in sm.size],
                                "numel": numel, "size_bytes": numel * dtype.itemsize, "chunks": len(sm.chunks)})
            else:
                others.append(key)

    # train state of rank 0
    train: dict | None = None
    ts_rel = layout.train_state_name(0)
    ts_entry = marker.object(ts_rel)
    if ts_entry is not None:
        from .untrusted import MAX_TRAIN_STATE_BYTES, load_plain, read_checked

        url = urls.join(args.step, ts_rel)
        obj = load_plain(read_checked(store, url, ts_entry, limit=MAX_TRAIN_STATE_BYTES, what="train state"), url=url)
        keys = []
        if isinstance(obj, dict):
            for k, v in obj.items():
                tname, value, text = _describe_value(v)
                keys.append({"key": str(k), "type": tname, "value": value, "summary": text})
        tname, value, text = _describe_value(obj)
        train = {"path": ts_rel, "type": tname, "keys": keys, "ranks": marker.world_size,
                 **({} if isinstance(obj, dict) else {"summary": text})}

    summary = marker.summary()
    summary["age_seconds"] = round(now - marker.created_unix, 1)
    doc = {"url": args.step, "marker": summary, "tensors": tensors, "non_tensor_keys": others,
           "train_state": train, "objects": [o.to_json() for o in marker.objects]}
    if args.json:
        for o in doc["objects"]:
            o.pop("chunks", None)
        _print_json(doc)
        return EXIT_OK

    kind = "ephemeral" if marker.ephemeral else "persistent"
    print(f"{args.step}")
    print(f"  step {marker.step}, {kind}, world size {marker.world_size}, "
          f"{len(marker.objects)} objects, {_size(marker.total_bytes)}")
    if not marker.foreign:
        print(f"  committed {marker.created} ({_age(now - marker.created_unix)} ago) by cloudckpt {marker.library_version}, "
              f"torch {marker.torch_version or '?'}; format {marker.format_version}; save_id {marker.save_id or '-'}")
    elif marker.verified:
        print(f"  committed {marker.created} ({_age(now - marker.created_unix)} ago) by {marker.writer}; adopted: "
              f"manifest written by cloudckpt {marker.library_version} ({marker.save_id or '-'})")
    else:
        print(f"  committed {marker.created} ({_age(now - marker.created_unix)} ago) by {marker.writer} "
              f"{marker.library_version or '?'}; no manifest (unverified: sizes from a listing, no CRC32C)")
    print()
    if meta_entry is None:
        print("no DCP metadata (model_and_optim/.metadata) in this checkpoint")
    else:
        total = sum(t["size_bytes"] for t in tensors)
        print(f"tensors ({meta_rel}): {len(tensors)} tensors, {sum(t['numel'] for t in tensors):,} elements, {_size(total)}")
        if tensors:
            _table(["KEY", "DTYPE", "SHAPE", "SIZE", "CHUNKS"],
                   [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", _size(t["size_bytes"]), t["chunks"]]
                    for t in tensors], right=(3,))
        if others:
            print(f"non-tensor entries: {', '.join(others)}")
    print()
    if train is None:
        print("no train state (train/rank0.pt) in this checkpoint")
    else:
        note = f"; one file per rank, {marker.world_size} ranks" if marker.world_size > 1 else ""
        print(f"train state ({ts_rel}{note}): {train['type']}")
        if train["keys"]:
            _table(["KEY", "TYPE", "VALUE"], [[k["key"], k["type"], k["summary"]] for k in train["keys"]])
    if args.objects:
        print()
        _table(["OBJECT", "SIZE", "CRC32C"], [[o.path, o.size, o.crc32c or "-"] for o in marker.objects], right=(1,))
    return EXIT_OK


# ====================================================================== verify
class _CrcSink:
    """A write-only, non-seekable file object that computes CRC32C of what is written
    in order (s3transfer then delivers ranges in order, holding only a bounded window)."""

    def __init__(self, on_bytes: Callable[[int], None] | None = None):
        import google_crc32c

        self._extend = google_crc32c.extend
        self.crc = 0
        self.size = 0
        self._on_bytes = on_bytes

    def write(self, b) -> int:
        b = bytes(b)
        self.crc = self._extend(self.crc, b)
        self.size += len(b)
        if self._on_bytes:
            self._on_bytes(len(b))
        return len(b)

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def _verify_one(store, url: str, entry, *, size_only: bool, on_bytes) -> dict | None:
    from .errors import BucketNotFound

    try:
        if size_only:
            size, crc = store.stat(url).size, None
        else:
            sink = _CrcSink(on_bytes)
            store.download_fileobj(url, sink)
            size, crc = sink.size, sink.hexdigest()
    except BucketNotFound:
        raise
    except NotFound:
        return {"path": entry.path, "url": url, "problem": "missing", "detail": "object is missing"}
    if size != entry.size:
        return {"path": entry.path, "url": url, "problem": "size",
                "detail": f"size {size} bytes, the marker says {entry.size}", "size": size, "expected_size": entry.size}
    if crc is not None and entry.crc32c and crc != entry.crc32c:
        return {"path": entry.path, "url": url, "problem": "crc32c",
                "detail": f"CRC32C {crc}, the marker says {entry.crc32c}", "crc32c": crc, "expected_crc32c": entry.crc32c}
    return None


def _verify_contents(store, step: str, marker) -> list[dict]:
    """Parse what a load parses first (DCP ``.metadata``, the train state files) with
    the loader's own checks (untrusted/): a step whose bytes match the marker can
    still be refused by a load, and verify should say so first."""
    from .checkpoint import layout
    from .errors import CorruptCheckpoint as _Corrupt
    from .storage import url as urls
    from .untrusted import MAX_METADATA_BYTES, MAX_TRAIN_STATE_BYTES, load_plain, loads_metadata, read_checked

    prefix = layout.MODEL_DIR + "/"
    files = marker.sizes_under(layout.MODEL_DIR)
    bad = []
    for o in marker.objects:
        url = urls.join(step, o.path)
        try:
            if o.path == prefix + ".metadata":
                loads_metadata(read_checked(store, url, o, limit=MAX_METADATA_BYTES, what="DCP metadata"),
                               url=url, files=files)
            elif o.path.startswith(layout.TRAIN_DIR + "/"):
                load_plain(read_checked(store, url, o, limit=MAX_TRAIN_STATE_BYTES, what="train state"), url=url)
        except _Corrupt as e:
            bad.append({"path": o.path, "url": url, "detail": str(e)})
    return bad


def _verify_unverified(args, store, marker) -> int:
    """A foreign step without a manifest: nothing to check sizes and CRC32Cs against.
    Its DCP metadata and train state are still parsed as a load parses them. Exit 1."""
    bad = _verify_contents(store, args.step, marker)
    why = f"written by {marker.writer} with no manifest: there are no sizes or CRC32Cs to check its objects against"
    hint = f"`cloudckpt adopt {args.step} --yes` records them"
    if args.json:
        _print_json({"url": args.step, "ok": False, "checked": "none", "manifest": False, "writer": marker.writer,
                     "object_count": len(marker.objects), "total_bytes": marker.total_bytes, "bad": bad,
                     "detail": f"{why}; {hint}"})
    else:
        for r in bad:
            print(f"BAD  {r['path']}: {r['detail']}  ({r['url']})")
        print(f"UNVERIFIED: {args.step} was {why}")
        if not bad:
            print(f"its DCP metadata and train state parse as a load parses them; {hint}")
    print(f"cloudckpt: verify could not check {args.step}: no manifest ({marker.writer}); {hint}", file=sys.stderr)
    return EXIT_NO


def cmd_verify(args) -> int:
    from .storage import Location, open_store
    from .storage import url as urls

    so = _storage_options(args)
    marker, _ = _read_marker(args.step, so)
    store = Location.of(args.step, so).store
    if not marker.verified:
        return _verify_unverified(args, store, marker)
    objects = list(marker.objects)
    total = sum(o.size for o in objects)
    bar = _bar(args, 0 if args.size_only else total, "verify")
    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(
                lambda o: _verify_one(store, urls.join(args.step, o.path), o, size_only=args.size_only, on_bytes=bar.update),
                objects))
    finally:
        bar.close()
    bad = [r for r in results if r is not None]
    if not bad and not args.size_only:
        bad = _verify_contents(store, args.step, marker)
    unchecked = [o.path for o in objects if not o.crc32c]
    if args.json:
        _print_json({"url": args.step, "ok": not bad, "checked": "size" if args.size_only else "size+crc32c",
                     "object_count": len(objects), "total_bytes": total, "bad": bad, "no_checksum": unchecked})
    else:
        for r in bad:
            print(f"BAD  {r['path']}: {r['detail']}  ({r['url']})")
        what = "size" if args.size_only else "size and CRC32C"
        if bad:
            print(f"FAILED: {len(bad)} of {len(objects)} objects of {args.step} are missing or corrupt ({what} checked)")
        else:
            print(f"OK: {len(objects)} objects, {_size(total)}: {what} match the marker")
        if unchecked and not args.size_only:
            print(f"note: {len(unchecked)} object(s) have no CRC32C in the marker; only their size was checked")
    if bad:
        names = ", ".join(r["path"] for r in bad)
        print(f"cloudckpt: verify failed for {args.step}: {names}", file=sys.stderr)
        return EXIT_NO
    return EXIT_OK


# ====================================================================== download
def _local_matches(path: str, entry) -> bool:
    from .transfer import crc32c_file

    try:
        if os.path.getsize(path) != entry.size:
            return False
        return not entry.crc32c or crc32c_file(path) == entry.crc32c
    except OSError:
        return False


def cmd_download(args) -> int:
    from .checkpoint import layout
    from .storage import Location, open_store
    from .storage import url as urls
    from .transfer import TqdmProgress, TransferConfig, TransferEngine

    if urls.scheme_of(args.dest) != "file":
        raise InvalidURL(f"DEST {args.dest!r} is not a local path: `cloudckpt download` writes to a local folder")
    so = _storage_options(args)
    marker, raw = _read_marker(args.step, so)
    dest_arg = args.dest
    if layout.step_of_name(urls.basename(dest_arg)) is None:
        dest_arg = urls.join(dest_arg, f"step{marker.step}")  # DEST is a save folder: the step goes inside it
    dest = urls.parse_url(dest_arg).key.rstrip("/")
    marker_path = os.path.join(dest, layout.MARKER)
    os.makedirs(dest, exist_ok=True)

    # A marker already here from another checkpoint goes first: while we download, DEST is uncommitted.
    try:
        with open(marker_path, "rb") as f:
            if f.read() != raw:
                os.unlink(marker_path)
                log.info("removed the marker of a different checkpoint at %s", marker_path)
    except FileNotFoundError:
        pass
    # temporary files of an interrupted earlier download (store.download_file names them .part-*)
    for root, _, files in os.walk(dest):
        for fn in files:
            if fn.startswith(".part-"):
                os.unlink(os.path.join(root, fn))

    plan = [(o, urls.join(args.step, o.path), _manifest_path(dest, o.path, args.step)) for o in marker.objects]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        present = list(pool.map(lambda p: _local_matches(p[2], p[0]), plan))
    todo = [p for p, ok in zip(plan, present) if not ok]
    skipped = [p[0].path for p, ok in zip(plan, present) if ok]
    nbytes = sum(o.size for o, _, _ in todo)

    bad: list[dict] = []
    if todo:
        disable = True if args.progress is False else (False if args.progress else None)
        progress = TqdmProgress(desc=f"download step{marker.step}", total=nbytes, disable=disable, file=sys.stderr)
        try:
            with TransferEngine(TransferConfig(max_concurrency=args.jobs), storage_options=so, progress=progress) as eng:
                try:
                    results = eng.download_all([(url, path) for _, url, path in todo])
                except NotFound as e:
                    if type(e) is not NotFound:
                        raise
                    raise CorruptCheckpoint(f"{e.url or e} is listed in the marker of {args.step} but missing; the "
                                            "checkpoint is damaged (run `cloudckpt verify`, or download an older step)") from None
        finally:
            progress.close()
        for (o, url, path), res in zip(todo, results):
            if res.size != o.size or (o.crc32c and res.crc32c != o.crc32c):
                bad.append({"path": o.path, "url": url, "size": res.size, "expected_size": o.size,
                            "crc32c": res.crc32c, "expected_crc32c": o.crc32c})
                os.unlink(path)
    if bad:
        if args.json:
            _print_json({"url": args.step, "dest": dest_arg, "ok": False, "bad": bad})
        for b in bad:
            print(f"BAD  {b['path']}: size {b['size']} crc32c {b['crc32c']}, the marker says size "
                  f"{b['expected_size']} crc32c {b['expected_crc32c']}", file=sys.stderr)
        print(f"cloudckpt: download of {args.step} failed: {len(bad)} object(s) do not match the marker; "
              f"{dest_arg} is left uncommitted (run `cloudckpt verify {args.step}`)", file=sys.stderr)
        return EXIT_NO

    # Marker last: only now is DEST a committed checkpoint (atomic rename of a complete file).
    if marker.foreign and marker.verified:  # an adopted step: its manifest goes along, before the marker
        from .checkpoint.marker import ADOPTED_MANIFEST

        manifest_path = os.path.join(dest, ADOPTED_MANIFEST)
        open_store(manifest_path).put_bytes(manifest_path, marker.to_bytes())
    open_store(marker_path).put_bytes(marker_path, raw)
    doc = {"url": args.step, "dest": dest_arg, "ok": True, "step": marker.step,
           "downloaded": [o.path for o, _, _ in todo], "skipped": skipped,
           "bytes_downloaded": nbytes, "total_bytes": marker.total_bytes}
    if args.json:
        _print_json(doc)
    else:
        print(f"downloaded {len(todo)} object(s) ({_size(nbytes)}), skipped {len(skipped)} already present; "
              f"{dest_arg} is a committed checkpoint (step {marker.step})")
    return EXIT_OK


# ====================================================================== prune
def cmd_prune(args) -> int:
    from .checkpoint import discovery, layout, retention

    if args.ephemeral_only and args.keep_last_ephemeral is not None:
        raise CliError("--keep-last-ephemeral cannot be combined with --ephemeral-only (there --keep-last counts "
                       "ephemeral steps)", EXIT_USAGE)
    folder = _loc(args, args.folder)
    found = list(discovery.find_checkpoints(folder, with_markers=True))
    foreign = [s for s, _, m in found if m.foreign]
    if not args.include_foreign:  # steps other tools wrote are neither counted nor deleted
        found = [f for f in found if not f[2].foreign]
    committed = [(s, m.ephemeral) for s, _, m in found]
    markers = {s: m for s, _, m in found}
    newest = max((s for s, _ in committed), default=None)
    keep_every = args.keep_every
    if args.ephemeral_only:
        # only ephemeral steps are candidates; multiples of --keep-every are kept and not counted
        candidates = [(s, e) for s, e in committed if e and not (keep_every and s % keep_every == 0)]
        policy = retention.Policy(keep_last_ephemeral=args.keep_last, max_checkpoints=None)
        protect = frozenset({newest} if newest is not None else ())
        doomed = retention.steps_to_prune(candidates, policy, protect=protect)
    else:
        policy = retention.Policy(keep_last_ephemeral=args.keep_last_ephemeral or 1, max_checkpoints=args.keep_last,
                                  keep_every=keep_every)
        doomed = retention.steps_to_prune(committed, policy)
    doomed = [s for s in doomed if s != newest]  # never the newest committed step, whatever the policy says
    items = [{"step": s, "url": layout.step_dir(args.folder, s), "ephemeral": markers[s].ephemeral,
              "size_bytes": markers[s].total_bytes} for s in doomed]
    kept = [s for s, _ in committed if s not in set(doomed)]
    doc = {"folder": args.folder, "dry_run": not args.yes,
           "policy": {"keep_last": args.keep_last, "keep_every": keep_every, "ephemeral_only": args.ephemeral_only,
                      "keep_last_ephemeral": None if args.ephemeral_only else policy.keep_last_ephemeral},
           "prune": items, "kept": kept, "deleted": [],
           "foreign": {"steps": foreign, "counted": bool(args.include_foreign)}}

    if not args.json:
        if foreign and not args.include_foreign:
            print(f"not counted: {len(foreign)} step(s) written by another tool ({', '.join(map(str, foreign[:10]))}"
                  f"{', ...' if len(foreign) > 10 else ''}); --include-foreign counts them")
        if not items:
            print(f"nothing to prune in {args.folder}: the policy keeps all {len(committed)} committed step(s)")
        else:
            verb = "deleting" if args.yes else "would delete"
            print(f"{verb} {len(items)} of {len(committed)} committed step(s) "
                  f"({_size(sum(i['size_bytes'] for i in items))}); keeping {len(kept)}:")
            _table(["STEP", "KIND", "SIZE", "URL"],
                   [[i["step"], "ephemeral" if i["ephemeral"] else "persistent", _size(i["size_bytes"]), i["url"]]
                    for i in items], right=(0, 2))
    if args.yes:
        for i in items:
            retention.delete_step(folder.at(i["url"]))  # marker first, then the objects
            doc["deleted"].append(i["step"])
            if not args.json:
                print(f"deleted {i['url']}")
    elif items and not args.json:
        print("dry run: nothing was deleted; run again with --yes to delete")
    if args.json:
        _print_json(doc)
    return EXIT_OK


# ====================================================================== gc
def cmd_gc(args) -> int:
    from .checkpoint import retention

    rep = retention.gc(_loc(args, args.folder), older_than=args.older_than, dry_run=not args.yes)
    if args.json:
        _print_json({"folder": args.folder, "dry_run": not args.yes, "older_than_seconds": args.older_than,
                     "step_dirs": rep.step_dirs, "uploads": rep.uploads})
        return EXIT_OK
    verb = "removed" if args.yes else "would remove"
    age = _age(args.older_than)
    if not rep.step_dirs and not rep.uploads:
        print(f"nothing to collect in {args.folder}: no uncommitted step folder or multipart upload older than {age}")
        return EXIT_OK
    for d in rep.step_dirs:
        print(f"{verb} uncommitted step folder {d}")
    for u in rep.uploads:
        print(f"{'aborted' if args.yes else 'would abort'} multipart upload {u}")
    print(f"{len(rep.step_dirs)} uncommitted folder(s), {len(rep.uploads)} multipart upload(s) older than {age}")
    if not args.yes:
        print("dry run: nothing was deleted; run again with --yes to delete")
    return EXIT_OK


# ====================================================================== adopt
def cmd_adopt(args) -> int:
    from .checkpoint.adopt import adopt

    bar = _bar(args, 0, "adopt") if args.yes else None
    try:
        rep = adopt(_loc(args, args.step), dry_run=not args.yes, jobs=args.jobs,
                    on_bytes=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    if args.json:
        _print_json({"url": args.step, "writer": rep.writer, "dry_run": not args.yes, "already": rep.already,
                     "written": rep.written, "manifest": rep.manifest_url, "object_count": rep.object_count,
                     "total_bytes": rep.total_bytes})
    elif rep.already:
        print(f"{args.step} already has a manifest ({'cloudckpt' if rep.writer == 'cloudckpt' else 'adopted'}): "
              "nothing to do")
    elif not rep.written:
        print(f"would adopt {args.step} ({rep.writer}, {rep.object_count} objects, {_size(rep.total_bytes)}): "
              f"every object is read once and its size and CRC32C go to {rep.manifest_url}")
        print("dry run: the step is complete and parses; nothing was read in full or written; run again with --yes")
    else:
        print(f"adopted {args.step}: {rep.object_count} objects, {_size(rep.total_bytes)}; manifest {rep.manifest_url}; "
              f"loads and `cloudckpt verify` now check sizes and CRC32Cs ({rep.writer}'s marker is unchanged)")
    return EXIT_OK


def cmd_export(args) -> int:
    from .export import export_weights

    res = export_weights(args.step, args.dest, dtype=args.dtype, fmt=args.format, key_prefix=args.key,
                         overwrite=args.force, storage_options=_storage_options(args))
    if args.json:
        _print_json(res)
        return EXIT_OK
    print(f"exported {res['tensors']} tensor(s), {_size(res['bytes'])}, of step {res['step']} "
          f"as {res['format']}{' (' + str(res['dtype']) + ')' if res['dtype'] else ''} to {res['dest']}")
    if res.get("skipped"):
        print(f"not exported (not tensors): {', '.join(map(str, res['skipped']))}")
    return EXIT_OK


# ====================================================================== parser
def _add_common(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    """Options accepted before and after the command. On subcommands their default is
    SUPPRESS so a value given before the command is not overwritten."""
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    g = p.add_argument_group("storage and output options")
    g.add_argument("--endpoint-url", default=d(None), metavar="URL",
                   help="S3-compatible endpoint, or GCS API endpoint (default: AWS_ENDPOINT_URL / the SDK's chain; "
                        "STORAGE_EMULATOR_HOST for GCS emulators)")
    g.add_argument("--profile", default=d(None), help="AWS profile (default: AWS_PROFILE)")
    g.add_argument("--region", default=d(None), help="S3 region (default: AWS_REGION)")
    g.add_argument("--timeout", type=_seconds_arg, default=d(None), metavar="SECONDS",
                   help="deadline of each request over all its retries; a store that does not answer fails the "
                        "command after about this long (default 60; transfers that make progress are not cut)")
    g.add_argument("--connect-timeout", type=_seconds_arg, default=d(None), metavar="SECONDS",
                   help="wait at most this long to open a connection (default 10)")
    g.add_argument("--json", action="store_true", default=d(False), help="print one JSON document for scripts")
    g.add_argument("--debug", action="store_true", default=d(False), help="show tracebacks and cloudckpt debug logs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cloudckpt",
        description="Look at and manage cloudckpt checkpoints in local folders, s3:// and gs://.",
        epilog="exit codes: 0 ok, 1 no/check failed, 2 usage, 3 not found, 4 access denied, 5 other error",
    )
    p.add_argument("--version", action="version", version=f"cloudckpt {__version__}")
    _add_common(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func, help: str, description: str | None = None) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=description or help)
        _add_common(s, suppress=True)
        s.set_defaults(func=func)
        return s

    def progress_opts(s):
        g = s.add_mutually_exclusive_group()
        g.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="always show the progress bar (default: only on a terminal)")
        g.add_argument("--no-progress", dest="progress", action="store_false", help="never show the progress bar")

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

    s = command("inspect", cmd_inspect, "tensors, train state keys and marker fields of one step")
    s.add_argument("step", metavar="STEP", help="a step folder, e.g. s3://bucket/run-7/step1000")
    s.add_argument("--objects", action="store_true", help="also list every object of the manifest")

    s = command("verify", cmd_verify, "check every object of a step against its marker (size and CRC32C)",
                "Check that every object listed in the step's marker exists with the right size and CRC32C "
                "(each object is streamed and checksummed, concurrently). Exit 1 naming each bad object.")
    s.add_argument("step", metavar="STEP")
    s.add_argument("--size-only", action="store_true", help="check existence and size only (no download)")
    s.add_argument("--jobs", "-j", type=_positive_int, default=16, help="objects checked at once (default 16)")
    progress_opts(s)

    s = command("download", cmd_download, "download a step to a local folder (parallel, resumable)",
                "Download a committed step into a local folder: parallel, with a progress bar, resumable (files "
                "already present with the right size and CRC32C are skipped), marker written last. If DEST is "
                "named step{N} it is the step folder; otherwise the step goes into DEST/step{N}.")
    s.add_argument("step", metavar="STEP")
    s.add_argument("dest", metavar="DEST", help="local step folder (named step{N}) or save folder")
    s.add_argument("--jobs", "-j", type=_positive_int, default=8, help="downloads at once (default 8)")
    progress_opts(s)

    s = command("prune", cmd_prune, "delete old committed steps by a keep-last policy (dry run unless --yes)",
                "Delete old committed steps, marker first. Default: keep the newest N persistent steps (steps "
                "divisible by --keep-every are kept and not counted) and the newest --keep-last-ephemeral (1) "
                "ephemeral ones. --ephemeral-only: persistent steps are untouched and the newest N ephemeral ones "
                "are kept. The newest committed step is never deleted. Dry run unless --yes.")
    s.add_argument("folder", metavar="FOLDER")
    s.add_argument("--keep-last", type=_positive_int, required=True, metavar="N",
                   help="persistent steps to keep (ephemeral ones with --ephemeral-only)")
    s.add_argument("--keep-every", type=_positive_int, metavar="K", help="also keep every step divisible by K")
    s.add_argument("--keep-last-ephemeral", type=_positive_int, metavar="M",
                   help="ephemeral steps to keep (default 1; not with --ephemeral-only)")
    s.add_argument("--ephemeral-only", action="store_true", help="consider only ephemeral steps")
    s.add_argument("--include-foreign", action="store_true",
                   help="also count (and delete) steps another tool wrote, e.g. OLMo-core's (default: left alone)")
    s.add_argument("--yes", "-y", action="store_true", help="really delete (default: dry run)")

    s = command("gc", cmd_gc, "remove uncommitted step folders and orphaned multipart uploads (dry run unless --yes)",
                "Remove what crashed saves left: step folders without a marker whose newest object is older than "
                "--older-than (empty folders are left alone), and multipart uploads under the folder started "
                "before that. Dry run unless --yes.")
    s.add_argument("folder", metavar="FOLDER")
    s.add_argument("--older-than", type=_duration_arg, default=3600.0, metavar="DURATION",
                   help="only what is older than this, e.g. 30m, 2h, 1d (default 1h)")
    s.add_argument("--yes", "-y", action="store_true", help="really delete (default: dry run)")

    s = command("adopt", cmd_adopt, "record sizes and CRC32Cs for a step another tool wrote (dry run unless --yes)",
                "Give a step another tool committed (OLMo-core's marker, no manifest) cloudckpt's manifest: every "
                "object is read once, its size and CRC32C (and each DCP item's) go to .cloudckpt.json beside the "
                "other tool's marker, which is left unchanged; loads and verify then check them. Refuses a step "
                "with anything missing. Dry run unless --yes.")
    s.add_argument("step", metavar="STEP")
    s.add_argument("--yes", "-y", action="store_true", help="read every object and write the manifest (default: dry run)")
    s.add_argument("--jobs", "-j", type=_positive_int, default=8, help="objects read at once (default 8)")
    progress_opts(s)

    s = command("export", cmd_export, "export model weights of a step to safetensors or a torch file",
                "Stream the tensors under --key (default: model) of a committed step into a safetensors file "
                "(one tensor in memory at a time) or a torch file, locally or in a bucket, optionally cast to "
                "another dtype.")
    s.add_argument("step", metavar="STEP")
    s.add_argument("dest", metavar="DEST", help="output file URL or path (a trailing / appends model.safetensors)")
    s.add_argument("--dtype", default=None, help="cast floating-point tensors, e.g. bfloat16, float16")
    s.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    s.add_argument("--key", default="model", help="top-level key of the state dict to export (default: model)")
    s.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    return p


def exit_code(e: BaseException) -> int:
    """The exit code for an error (see the module docstring)."""
    from .errors import NotACheckpoint

    if isinstance(e, CliError):
        return e.code
    if isinstance(e, (InvalidURL, ConfigError, UnsafeDelete)):
        return EXIT_USAGE
    if isinstance(e, (CorruptCheckpoint, IncompatibleCheckpoint)):
        return EXIT_NO
    if isinstance(e, (NotFound, NotACheckpoint)):
        return EXIT_NOT_FOUND
    if isinstance(e, AccessDenied):
        return EXIT_DENIED
    return EXIT_ERROR


def _message(e: BaseException) -> str:
    if isinstance(e, (CloudCkptError, CliError)):
        return " ".join(str(e).split())  # one line
    if isinstance(e, OSError):
        return f"{e.strerror or type(e).__name__}: {e.filename or ''}".rstrip(": ") + \
            "; check the local path and its permissions (rerun with --debug for details)"
    return f"unexpected {type(e).__name__}: {' '.join(str(e).split())} (rerun with --debug for the traceback)"


def _resolve_local_paths(args) -> None:
    """Local paths given on the command line are resolved to their real path once
    (the local backend follows no link inside a save folder); a STEP's own last
    component is kept, so a step folder that is a planted link is refused."""
    from .storage import resolve_local, resolve_step_dir

    for name, resolve in (("step", resolve_step_dir), ("folder", resolve_local), ("dest", resolve_local)):
        value = getattr(args, name, None)
        if isinstance(value, str):
            setattr(args, name, resolve(value))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.debug:
        logging.getLogger("cloudckpt").setLevel(logging.DEBUG)
    # The SDKs' debug logs include signed request headers: never enable them here.
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3", "google"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        _resolve_local_paths(args)
        return args.func(args)
    except KeyboardInterrupt:
        print("cloudckpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of our stdout went away (e.g. `| head`): not an error
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - every error becomes one line and an exit code
        if args.debug:
            traceback.print_exc()
        print(f"cloudckpt: error: {_message(e)}", file=sys.stderr)
        return exit_code(e)
