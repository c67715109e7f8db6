"""The runs under a bucket or prefix: folders that hold ``step{N}`` folders, found by
walking delimiter listings, each with its newest committed step.

The walk is bounded: ``max_depth`` levels of folders below the prefix (a run's own
folders are not walked into) and at most ``max_folders`` LIST calls (each a page of up
to 1000 entries or more pages for big folders); the listing says when either bound
stopped it. Every request is bounded in time by the store's options.

Cost: one LIST per folder visited, then per run the markers from its highest step
folder down to the first committed one (one GET when the newest folder is committed)
and one HEAD per step folder for whether it holds a marker (``committed``: a folder a
crashed save or a prune left, empty or not, is a step folder but not a step).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..checkpoint import layout
from ..checkpoint.marker import Marker
from ..storage import Location, Where
from ..storage import url as urls
from .steps import probe_marker

THREADS = 16


@dataclass(frozen=True)
class RunRow:
    url: str
    step_dirs: int  # step{N} folders, committed or not
    newest: Marker | None = None  # the newest committed step's marker (None: no committed step)
    newest_url: str | None = None
    unreadable: int = 0  # markers passed over because they do not parse
    committed: int = 0  # step folders holding a marker (the run's steps); the others are leftovers

    def to_json(self, now: float) -> dict:
        m = self.newest
        return {"type": "run", "url": self.url, "steps": self.committed, "step_dirs": self.step_dirs,
                "newest_step": m.step if m else None, "newest_url": self.newest_url,
                "ephemeral": m.ephemeral if m else None, "format": m.kind if m else None,
                "size_bytes": m.total_bytes if m else None, "object_count": m.object_count if m else None,
                "created": m.created if m else None, "created_unix": m.created_unix if m else None,
                "age_seconds": round(now - m.created_unix, 1) if m else None}


@dataclass(frozen=True)
class RunsListing:
    prefix: str
    runs: list[RunRow]
    folders_listed: int
    max_depth: int
    max_folders: int
    deeper: list[str]  # folders at max_depth that have subfolders not searched
    truncated: bool  # stopped at max_folders with folders left to list
    listed_at: float = field(default_factory=time.time)


def _children(folder: Location) -> list[str]:
    """The sub-folder URLs of ``folder`` (one delimiter listing), without trailing slash."""
    return [e.url.rstrip("/") for e in folder.store.list(folder.prefix, delimiter="/") if e.is_prefix]


def _newest(run: Location, step_dirs: list[tuple[int, str]]) -> RunRow:
    unreadable = 0
    for _, dir in reversed(step_dirs):
        m, problem = probe_marker(run.at(dir))
        if m is not None:
            return RunRow(run.url, len(step_dirs), m, dir, unreadable)
        unreadable += bool(problem)
    return RunRow(run.url, len(step_dirs), unreadable=unreadable)


def find_runs(prefix: Where, *, max_depth: int = 3, max_folders: int = 500) -> RunsListing:
    """Runs at or below ``prefix`` (a bucket root, a prefix or a local folder), sorted
    by URL. A folder is a run when one of its sub-folders is named ``step{N}``; runs
    are not searched further down. Raises storage errors (BucketNotFound, AccessDenied,
    Timeout, ...)."""
    root = Location.of(prefix).resolved()
    level = [root]
    found: list[tuple[Location, list[tuple[int, str]]]] = []
    deeper: list[str] = []
    listed, truncated = 0, False
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        for depth in range(max_depth + 1):
            if not level:
                break
            room = max_folders - listed
            if len(level) > room:
                level, truncated = level[:room], True
            children = list(pool.map(_children, level))
            listed += len(level)
            nxt = []
            for folder, subs in zip(level, children, strict=True):
                steps = sorted((s, u) for u in subs if (s := layout.step_of_name(urls.basename(u))) is not None)
                if steps:
                    found.append((folder, [(s, urls.join(folder.url, f"step{s}")) for s, _ in steps]))
                elif depth == max_depth:
                    if subs:
                        deeper.append(folder.url)
                else:
                    nxt.extend(folder.at(u) for u in subs)
            level = nxt
            if truncated:
                break
        runs = list(pool.map(lambda f: _newest(*f), found))
        dirs = [(i, d) for i, (_, steps) in enumerate(found) for _, d in steps]
        has = list(pool.map(lambda d: root.store.exists(layout.marker_url(d[1])), dirs))
        counts = [0] * len(runs)
        for (i, _), yes in zip(dirs, has, strict=True):
            counts[i] += yes
        runs = [dataclasses.replace(r, committed=n) for r, n in zip(runs, counts, strict=True)]
    runs.sort(key=lambda r: r.url)
    return RunsListing(root.url, runs, listed, max_depth, max_folders, sorted(deeper), truncated)
