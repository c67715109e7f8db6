"""Checking a committed step against its manifest: every object exists with its
recorded size and CRC32C (streamed, never stored), then the files a load parses
first (DCP ``.metadata``, the train state) are parsed with the loader's own checks,
so a step a load would refuse fails here too.

A step another tool wrote without a manifest has nothing to check against: its
report says so (``manifest`` False) after the parse checks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ..checkpoint import discovery, layout
from ..checkpoint.marker import Marker, ObjectEntry
from ..errors import BucketNotFound, CorruptCheckpoint, NotFound, ObjectTooLarge
from ..storage import Location, Where
from .progress import Progress


@dataclass(frozen=True)
class VerifyReport:
    url: str
    marker: Marker
    checked: str  # "size", "size+crc32c", or "none" (no manifest)
    bad: list[dict]  # {path, url, problem?, detail, ...}: see docs/cli.md
    no_checksum: list[str] = field(default_factory=list)  # objects whose entry has no CRC32C

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
                "total_bytes": self.total_bytes, "bad": self.bad, "no_checksum": self.no_checksum}


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


def check_contents(step: Location, marker: Marker) -> list[dict]:
    """Parse the DCP ``.metadata`` and every train state file as a load does
    (cloudckpt.untrusted); ``{path, url, detail}`` for each one refused."""
    from ..checkpoint import step_files

    bad = []
    for o in marker.objects:
        url = step.join(o.path).url
        try:
            if o.path == step_files.METADATA_REL:
                step_files.parse_metadata(step, marker, step_files.metadata_bytes(step, marker))
            elif o.path.startswith(layout.TRAIN_DIR + "/"):
                step_files.train_state(step, marker, o.path)
        except CorruptCheckpoint as e:
            bad.append({"path": o.path, "url": url, "detail": str(e)})
    return bad


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
    store = loc.store
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(
            lambda o: _check_object(store, loc.join(o.path).url, o, size_only=size_only, on_bytes=on_bytes), objects))
    bad = [r for r in results if r is not None]
    if not bad and not size_only:
        bad = check_contents(loc, marker)
    return VerifyReport(url, marker, "size" if size_only else "size+crc32c", bad,
                        [o.path for o in objects if not o.crc32c])
