"""The step folders of a save folder: committed ones with their marker, and (on
request) the others, with what they hold.

Cost: one paginated LIST of the folder (delimiter ``/``), the markers read
concurrently, one LIST of the run's refusal notes (``cloudckpt.checkpoint.refusals``)
and, per note, a GET of it and of its step's marker head; with ``include_uncommitted``
one recursive LIST of each folder without a marker.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..checkpoint import discovery, refusals
from ..checkpoint.marker import Marker
from ..checkpoint.refusals import Refusal
from ..errors import CorruptCheckpoint, IncompatibleCheckpoint, NotACheckpoint
from ..storage import Location, Where

MARKER_READ_THREADS = 32
JUNK_NOTE = ("not a step: step folders are named step{N} with no leading zero; this one is never loaded, "
             "counted or deleted by retention (remove it by hand if it is not yours)")


@dataclass(frozen=True)
class StepRow:
    """One step folder. ``status``: ``committed`` (``marker`` set), ``incomplete`` (no
    marker), ``unreadable`` (a marker that does not parse: ``error`` says why) or
    ``junk`` (a folder named like a step but not ``step{N}`` in its one spelling, e.g.
    ``step04``: ``step`` is None; it is no step, whatever it holds, and retention never
    counts or deletes it). For all but ``committed``, ``object_count``/``size_bytes``/
    ``newest_mtime`` describe what the folder holds (None when it was not scanned)."""

    step: int | None
    url: str
    status: str
    marker: Marker | None = None
    error: str | None = None
    object_count: int | None = None
    size_bytes: int | None = None
    newest_mtime: float | None = None
    refused: Refusal | None = None  # a resume found the step failing its checks (its refusal note)

    @property
    def created_unix(self) -> float | None:
        return self.marker.created_unix if self.marker else self.newest_mtime

    def to_json(self, now: float) -> dict:
        m = self.marker
        created = self.created_unix
        age = None if created is None else round(now - created, 1)
        r = self.refused
        refused = None if r is None else {"reason": r.reason, "refused_unix": r.refused_unix, "note": r.url}
        if m is None:
            return {"step": self.step, "url": self.url, "status": self.status, "ephemeral": None,
                    "size_bytes": self.size_bytes, "object_count": self.object_count, "world_size": None,
                    "created": None, "created_unix": created, "age_seconds": age,
                    **({"error": self.error} if self.error else {}), **({"refused": refused} if r else {})}
        return {"step": self.step, "url": self.url, "status": "committed", "ephemeral": m.ephemeral,
                "size_bytes": m.total_bytes, "object_count": m.object_count, "world_size": m.world_size,
                "created": m.created, "created_unix": m.created_unix, "age_seconds": age,
                "format": m.kind, "writer": m.writer, "verified": m.verified, "refused": refused}


@dataclass(frozen=True)
class StepListing:
    folder: str
    step_dirs: int  # step{N} folders found, whatever their state (0: not a save folder)
    rows: list[StepRow]  # ascending by step; with include_uncommitted, junk folders last
    warnings: list[str] = field(default_factory=list)  # unreadable markers, one line each
    listed_at: float = field(default_factory=time.time)

    @property
    def committed(self) -> list[StepRow]:
        return [r for r in self.rows if r.status == "committed"]

    @property
    def refused(self) -> list[StepRow]:
        """The committed steps a resume refused (they fail their checks)."""
        return [r for r in self.committed if r.refused is not None]


def probe_marker(dir: Location) -> tuple[Marker | None, str | None]:
    """``(marker, None)`` when committed, ``(None, None)`` when there is no marker,
    ``(None, reason)`` when the marker cannot be read. Storage errors propagate."""
    try:
        return discovery.read_header(dir), None
    except NotACheckpoint:
        return None, None
    except (CorruptCheckpoint, IncompatibleCheckpoint) as e:
        return None, str(e)


def _contents(dir: Location) -> tuple[int, int, float | None]:
    objs = list(dir.store.walk(dir.prefix))
    return len(objs), sum(o.size for o in objs), max((o.mtime for o in objs if o.mtime), default=None)


def list_steps(folder: Where, *, include_uncommitted: bool = False, ephemeral: bool | None = None) -> StepListing:
    """The step folders of ``folder``, ascending. Committed steps are filtered by
    ``ephemeral`` (None: both). With ``include_uncommitted``, folders without a
    readable marker are rows too, except empty ones (stores that keep emptied folders,
    e.g. SeaweedFS, list them as prefixes; an empty folder is no step at all), and so
    are folders named like steps in another spelling (``junk`` rows, last).
    Raises storage errors (BucketNotFound, AccessDenied, ...)."""
    loc = Location.of(folder)
    steps, junk = discovery.scan_step_dirs(loc)
    with ThreadPoolExecutor(max_workers=MARKER_READ_THREADS) as pool:
        probes = list(pool.map(lambda sd: probe_marker(loc.at(sd[1])), steps))
    contents: dict[str, tuple[int, int, float | None]] = {}
    if include_uncommitted:
        loose = [dir for (_, dir), (m, problem) in zip(steps, probes, strict=True) if m is None and not problem] + junk
        with ThreadPoolExecutor(max_workers=MARKER_READ_THREADS) as pool:
            contents = dict(zip(loose, pool.map(lambda d: _contents(loc.at(d)), loose), strict=True))
    rows: list[StepRow] = []
    warnings: list[str] = []
    notes = refusals.read_all(loc) if steps else {}
    with ThreadPoolExecutor(max_workers=MARKER_READ_THREADS) as pool:
        noted = [(s, d) for (s, d), (m, problem) in zip(steps, probes, strict=True) if s in notes and (m or problem)]
        live = {s for (s, d), fp in zip(noted, pool.map(lambda sd: refusals.fingerprint(loc.at(sd[1])), noted),
                                        strict=True) if notes[s].describes(fp)}
    for (step, dir), (m, problem) in zip(steps, probes, strict=True):
        refused = notes[step] if step in live else None
        if m is None:
            if problem:
                said = f" (a resume refused it at {refused.when})" if refused else ""
                warnings.append(f"{dir} is not counted: {problem}{said}")
            count, size, newest = contents.get(dir, (None, None, None))
            if include_uncommitted and count != 0:
                rows.append(StepRow(step, dir, "unreadable" if problem else "incomplete", error=problem,
                                    object_count=count, size_bytes=size, newest_mtime=newest, refused=refused))
            continue
        if ephemeral is not None and m.ephemeral != ephemeral:
            continue
        rows.append(StepRow(step, dir, "committed", marker=m, refused=refused))
    if include_uncommitted:
        for dir in junk:
            count, size, newest = contents[dir]
            if count:
                rows.append(StepRow(None, dir, "junk", error=JUNK_NOTE, object_count=count, size_bytes=size,
                                    newest_mtime=newest))
    return StepListing(loc.url, len(steps), rows, warnings)
