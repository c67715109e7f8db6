"""Checking a committed step against its manifest: every object exists with its
recorded size and CRC32C (streamed, never stored), then what a load parses (the DCP
index, header and every rank's part, or DCP ``.metadata`` for a step without it; the
train state) is parsed with the loader's own checks, so a step a load would refuse
fails here too.

A step another tool wrote without a manifest has nothing to check against: its
report says so (``manifest`` False) after the parse checks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..checkpoint import discovery, layout, refusals
from ..checkpoint.entries import ObjectEntry
from ..checkpoint.marker import Marker
from ..checkpoint.step import StepRef
from ..errors import BucketNotFound, CorruptCheckpoint, NotFound, ObjectTooLarge
from ..storage import Location, Where
from .progress import Progress

_PART_JOBS = 8  # index parts read at once


@dataclass(frozen=True)
class VerifyReport:
    url: str
    marker: Marker
    checked: str  # "size", "size+crc32c", or "none" (no manifest)
    bad: list[dict]  # {path, url, problem?, detail, ...}: see docs/cli.md
    no_checksum: list[str] = field(default_factory=list)  # objects whose entry has no CRC32C
    notes: list[dict] = field(default_factory=list)  # {path, url, detail}: what was checked less, and why
    refused: dict | None = None  # {reason, refused_unix, note}: a resume found the step failing its checks

    @property
    def manifest(self) -> bool:
        return self.marker.verified

    @property
    def ok(self) -> bool:
        return self.manifest and not self.bad

    @property
    def object_count(self) -> int:
        return len(self.marker.objects)

    @property
    def total_bytes(self) -> int:
        return self.marker.total_bytes

    def to_json(self) -> dict:
        if not self.manifest:
            return {"url": self.url, "ok": False, "checked": "none", "manifest": False, "writer": self.marker.writer,
                    "object_count": self.object_count, "total_bytes": self.total_bytes, "bad": self.bad,
                    "detail": f"{unverified_reason(self.marker)}; {adopt_hint(self.url)}"}
        return {"url": self.url, "ok": self.ok, "checked": self.checked, "object_count": self.object_count,
                "total_bytes": self.total_bytes, "bad": self.bad, "no_checksum": self.no_checksum, "notes": self.notes,
                "refused": self.refused}


def refusal_of(step: Location) -> dict | None:
    """The refusal note of the step folder ``step`` when it still describes the step
    (``cloudckpt.checkpoint.refusals``): ``{reason, refused_unix, note}``, else None."""
    number = layout.step_of_name(step.name)
    note = None if number is None else refusals.read(step.parent(), number)
    if note is None or not note.describes(refusals.fingerprint(step)):
        return None
    return {"reason": note.reason, "refused_unix": note.refused_unix, "note": note.url}


def unverified_reason(marker: Marker) -> str:
    return f"written by {marker.writer} with no manifest: there are no sizes or CRC32Cs to check its objects against"


def adopt_hint(url: str) -> str:
    return f"`cloudckpt adopt {url} --yes` records them"


class _CrcSink:
    """A write-only, non-seekable file object that computes the CRC32C of what is
    written, in order (s3transfer then delivers ranges in order, holding only a
    bounded window)."""

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


def _check_object(store, url: str, entry: ObjectEntry, *, size_only: bool,
                  on_bytes: Callable[[int], None] | None) -> dict | None:
    try:
        if size_only:
            size, crc = store.stat(url).size, None
        else:
            sink = _CrcSink(on_bytes)
            store.download_sized(url, sink, size=entry.size)  # never more than the marker's size
            size, crc = sink.size, sink.hexdigest()
    except BucketNotFound:
        raise
    except NotFound:
        return {"path": entry.path, "url": url, "problem": "missing", "detail": "object is missing"}
    except ObjectTooLarge:
        return {"path": entry.path, "url": url, "problem": "size",
                "detail": f"more than {entry.size} bytes, the marker says {entry.size} (not read past that)",
                "size": None, "expected_size": entry.size}
    if size != entry.size:
        return {"path": entry.path, "url": url, "problem": "size",
                "detail": f"size {size} bytes, the marker says {entry.size}", "size": size, "expected_size": entry.size}
    if crc is not None and entry.crc32c and crc != entry.crc32c:
        return {"path": entry.path, "url": url, "problem": "crc32c",
                "detail": f"CRC32C {crc}, the marker says {entry.crc32c}", "crc32c": crc,
                "expected_crc32c": entry.crc32c}
    return None


# a step with the DCP index: its .metadata (read by stock DCP, not by our loads) is parsed up to this size;
# a larger one (~600 ranks of a 70B model and more: 1.6 GB at 4,096 ranks, ~27 GB of memory to unpickle) is
# checked by size and CRC32C only, and the report says so
PARSE_METADATA_BYTES = 256 << 20


def check_contents(step: Location, marker: Marker, notes: list[dict] | None = None) -> list[dict]:
    """Parse what a load parses, with its checks (cloudckpt.untrusted): the DCP index
    (its header, then every rank's part, one at a time) where the step has one, else
    DCP's ``.metadata``, and every train state file; ``{path, url, detail}`` for each one
    refused. ``.metadata`` of a step with the index is parsed too up to
    ``PARSE_METADATA_BYTES``; above, ``{path, url, detail}`` goes to ``notes``."""
    from ..checkpoint.committed import CommittedStep  # imports torch

    c = CommittedStep(StepRef.of(step), marker)
    bad = []
    header = None
    try:
        header = c.header()
    except CorruptCheckpoint as e:
        bad.append({"path": layout.INDEX_HEADER, "url": c.step.index_header_url, "detail": str(e)})
    for o in marker.objects:
        url = c.step.url_of(o.path)
        try:
            if o.path == layout.DCP_METADATA:
                if marker.object(layout.INDEX_HEADER) is not None and o.size > PARSE_METADATA_BYTES:
                    if notes is not None:
                        notes.append({"path": o.path, "url": url, "detail": (
                            f"{o.size:,} bytes: checked by size and CRC32C, not parsed (over {PARSE_METADATA_BYTES:,};"
                            " loads read the DCP index, parsed here)")})
                    continue
                md = c.metadata()
                if header is not None:
                    _same_keys(header, md)
            elif o.path.startswith(layout.TRAIN_DIR + "/"):
                c.train_state_file(o.path)
        except CorruptCheckpoint as e:
            bad.append({"path": o.path, "url": url, "detail": str(e)})
    if header is not None:
        bad.extend(_check_parts(c))
    return bad


def _same_keys(header, md) -> None:
    """The DCP index and ``.metadata`` describe the same checkpoint (keys, dtypes, sizes):
    our loads read the one, stock DCP the other. Raises CorruptCheckpoint naming the first
    difference."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ours = {k: (t.dtype, tuple(t.size)) for k, t in header.tensors.items()}
    ours.update((k, None) for k in header.values)
    theirs = {k: (m.properties.dtype, tuple(m.size)) if isinstance(m, TensorStorageMetadata) else None
              for k, m in md.state_dict_metadata.items()}
    if ours != theirs:
        k = next(iter(sorted((ours.keys() ^ theirs.keys()) or {k for k in ours if ours[k] != theirs[k]})))
        raise CorruptCheckpoint(f"{header.url}: the DCP index and {layout.DCP_METADATA} disagree on {k[:200]!r} "
                                f"(index: {ours.get(k, 'absent')}, .metadata: {theirs.get(k, 'absent')}): loads and "
                                "stock DCP would read different checkpoints")


def _check_parts(c: Any) -> list[dict]:
    """The DCP index parts as the loads of every rank check them (``c``: a CommittedStep
    whose header passed its checks): each rank's part for the chunks the header gives
    that rank (one part in memory at a time)."""
    files = c.model_files()

    def check(rank: int) -> dict | None:
        try:
            c.index_part(rank, files)
        except CorruptCheckpoint as e:
            rel = layout.index_part_name(rank)
            return {"path": rel, "url": c.step.index_part_url(rank), "detail": str(e)}
        return None

    # the parts' reads overlap (4,096 GETs); the parse and check (~0.04 CPU-s a rank of a 70B model) hold
    # the GIL, so a few parts are in memory at a time
    with ThreadPoolExecutor(max_workers=_PART_JOBS) as pool:
        return [r for r in pool.map(check, range(c.marker.world_size)) if r is not None]


def verify_step(step: Where, *, size_only: bool = False, jobs: int = 16,
                progress: Progress | None = None) -> VerifyReport:
    """Check every object of the committed step ``step`` (``jobs`` at once; with
    ``size_only`` one HEAD each, no download), then parse what a load parses.
    ``progress`` gets the bytes streamed. Raises NotACheckpoint (no marker),
    CorruptCheckpoint / IncompatibleCheckpoint (unreadable marker), storage errors;
    bad objects are in the report, not raised."""
    loc = Location.of(step).resolved_step()
    url = Location.of(step).url
    marker = discovery.read_marker(loc)
    if not marker.verified:
        return VerifyReport(url, marker, "none", check_contents(loc, marker))
    objects = list(marker.objects)
    if progress is not None:
        progress.start(0 if size_only else marker.total_bytes)
    on_bytes = progress.update if progress is not None else None
    store, objects_at = loc.store, StepRef(loc, root=marker.root)  # a replaced step's objects: under its root
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(
            lambda o: _check_object(store, objects_at.url_of(o.path), o, size_only=size_only, on_bytes=on_bytes),
            objects))
    bad = [r for r in results if r is not None]
    notes: list[dict] = []
    if not bad and not size_only:
        bad = check_contents(loc, marker, notes)
    return VerifyReport(url, marker, "size" if size_only else "size+crc32c", bad,
                        [o.path for o in objects if not o.crc32c], notes, refusal_of(loc))
