"""Downloading a committed step into a local folder so that it is a committed local
checkpoint: parallel (the transfer engine), resumable, marker last.

- Files already present with the manifest's size and CRC32C are skipped.
- The others are downloaded into a staging folder inside DEST (:data:`STAGING`,
  flat derived names) and each is renamed to its manifest path as soon as it is
  complete and matches; a later run removes a staging folder an interrupted run
  left, so nothing half-written ever has a manifest name, and the storage layer's
  own temporary names stay its business.
- The marker (and an adopted step's manifest, just before it) is written only after
  every file is in place and matches; a marker of a different checkpoint already in
  DEST is removed first, so DEST is uncommitted while it changes.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from ..checkpoint import discovery, layout
from ..checkpoint.entries import ObjectEntry
from ..checkpoint.marker import Marker
from ..checkpoint.step import StepRef
from ..errors import CorruptCheckpoint, InvalidURL, NotFound, ObjectTooLarge
from ..storage import Location, Where
from ..storage import url as urls
from ..transfer import TransferConfig, TransferEngine, crc32c_file
from ..untrusted import check_name
from .progress import Progress, engine_subscriber

log = logging.getLogger(__name__)

STAGING = ".cloudckpt-download"  # inside DEST; removed when a download ends or starts


@dataclass(frozen=True)
class DownloadItem:
    entry: ObjectEntry
    url: str  # the remote object
    path: str  # its local path under DEST


@dataclass(frozen=True)
class DownloadPlan:
    step: Location
    marker: Marker
    marker_bytes: bytes
    dest: str  # the local step folder, as the caller named it (a URL or path)
    dest_path: str  # the same as a filesystem path
    todo: tuple[DownloadItem, ...]
    skipped: tuple[str, ...]  # manifest paths already present and matching

    @property
    def bytes_to_fetch(self) -> int:
        return sum(i.entry.size for i in self.todo)


@dataclass(frozen=True)
class DownloadReport:
    url: str
    dest: str
    step: int
    downloaded: list[str]
    skipped: list[str]
    bytes_downloaded: int
    total_bytes: int
    bad: list[dict]  # {path, url, size, expected_size, crc32c, expected_crc32c}; DEST then stays uncommitted

    @property
    def ok(self) -> bool:
        return not self.bad

    def to_json(self) -> dict:
        if self.bad:
            return {"url": self.url, "dest": self.dest, "ok": False, "bad": self.bad}
        return {"url": self.url, "dest": self.dest, "ok": True, "step": self.step, "downloaded": self.downloaded,
                "skipped": self.skipped, "bytes_downloaded": self.bytes_downloaded, "total_bytes": self.total_bytes}


def _local_path(root: str, rel: str, where: str) -> str:
    """``root/rel`` for a manifest entry (its name was checked when the marker was
    parsed; checked again here, as this path is written to)."""
    rel = check_name(rel, what="object path in the marker", url=where)
    if rel.split("/")[0] == STAGING:
        raise CorruptCheckpoint(f"{where}: the marker lists {rel!r}, inside the download's staging folder {STAGING}; "
                                "refusing to download it")
    return os.path.join(root, *rel.split("/"))


def _matches(path: str, entry: ObjectEntry) -> bool:
    try:
        if os.path.getsize(path) != entry.size:
            return False
        return not entry.crc32c or crc32c_file(path) == entry.crc32c
    except OSError:
        return False


def prepare_download(step: Where, dest: str, *, jobs: int = 8) -> DownloadPlan:
    """Read the step's marker and get DEST ready: created, uncommitted (a different
    checkpoint's marker removed), an interrupted download's staging folder removed,
    and the files already present checked (``jobs`` at a time). DEST named ``step{N}``
    is the step folder; otherwise the step goes into ``DEST/step{N}``.
    Raises InvalidURL (DEST not local), NotACheckpoint, CorruptCheckpoint /
    UnsafeCheckpoint (a refused marker), storage errors, OSError."""
    if urls.local_path(dest) is None:
        raise InvalidURL(f"DEST {dest!r} is not a local path: `cloudckpt download` writes to a local folder")
    loc = Location.of(step).resolved_step()
    marker, raw = discovery.read_marker_bytes(loc)
    if marker.root:  # a replaced step: its objects go to their usual places, under a marker that says so
        raw = Marker.from_bytes(raw, url=loc.url).without_root().to_bytes()
    if layout.step_of_name(urls.basename(dest)) is None:
        dest = urls.join(dest, f"step{marker.step}")  # DEST is a save folder: the step goes inside it
    root = urls.parse_url(dest).key.rstrip("/")
    os.makedirs(root, exist_ok=True)
    marker_path = os.path.join(root, layout.MARKER)
    try:
        with open(marker_path, "rb") as f:
            if f.read() != raw:
                os.unlink(marker_path)
                log.info("removed the marker of a different checkpoint at %s", marker_path)
    except FileNotFoundError:
        pass
    shutil.rmtree(os.path.join(root, STAGING), ignore_errors=True)
    objects_at = StepRef(loc, root=marker.root)  # a replaced step's objects are under its root
    items = [DownloadItem(o, objects_at.url_of(o.path), _local_path(root, o.path, loc.url)) for o in marker.objects]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        present = list(pool.map(lambda i: _matches(i.path, i.entry), items))
    return DownloadPlan(loc, marker, raw, dest, root, tuple(i for i, ok in zip(items, present, strict=True) if not ok),
                        tuple(i.entry.path for i, ok in zip(items, present, strict=True) if ok))


def _fetch(plan: DownloadPlan, jobs: int, progress: Progress | None) -> list[dict]:
    """Download ``plan.todo`` through the staging folder; returns the mismatches."""
    staging = os.path.join(plan.dest_path, STAGING)
    os.makedirs(staging, exist_ok=True)
    bad: list[dict] = []
    try:
        with TransferEngine(TransferConfig(max_concurrency=jobs), storage_options=plan.step.options,
                            progress=engine_subscriber(progress) if progress is not None else None) as eng:
            futures = {eng.submit_download(i.url, os.path.join(staging, str(n)), size=i.entry.size):
                       (i, os.path.join(staging, str(n))) for n, i in enumerate(plan.todo)}
            try:
                for fut in as_completed(futures):
                    item, staged = futures[fut]
                    try:
                        res = fut.result()
                    except NotFound as e:
                        if type(e) is not NotFound:
                            raise
                        raise CorruptCheckpoint(
                            f"{e.url or e} is listed in the marker of {plan.step.url} but missing; the checkpoint "
                            "is damaged (run `cloudckpt verify`, or download an older step)") from None
                    except ObjectTooLarge:  # stopped at the manifest's size: nothing past it was written
                        o = item.entry
                        bad.append({"path": o.path, "url": item.url, "size": None, "expected_size": o.size,
                                    "crc32c": None, "expected_crc32c": o.crc32c,
                                    "detail": f"more than {o.size} bytes (not read past that)"})
                        continue
                    o = item.entry
                    if res.size != o.size or (o.crc32c and res.crc32c != o.crc32c):
                        bad.append({"path": o.path, "url": item.url, "size": res.size, "expected_size": o.size,
                                    "crc32c": res.crc32c, "expected_crc32c": o.crc32c})
                        os.unlink(staged)
                        continue
                    os.makedirs(os.path.dirname(item.path), exist_ok=True)
                    os.replace(staged, item.path)
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    order = {i.entry.path: n for n, i in enumerate(plan.todo)}
    return sorted(bad, key=lambda b: order[b["path"]])


def run_download(plan: DownloadPlan, *, jobs: int = 8, progress: Progress | None = None) -> DownloadReport:
    """Download what ``plan`` lacks (``jobs`` at once; ``progress`` gets the bytes),
    then commit DEST: an adopted step's manifest, then the marker. When a file does
    not match the manifest it is not kept, DEST stays uncommitted and the report
    names it (``ok`` False). Raises CorruptCheckpoint (an object listed in the
    marker is missing), storage errors, OSError."""
    bad: list[dict] = []
    if plan.todo:
        if progress is not None:
            progress.start(plan.bytes_to_fetch)
        bad = _fetch(plan, jobs, progress)
    report = DownloadReport(plan.step.url, plan.dest, plan.marker.step, [i.entry.path for i in plan.todo],
                            list(plan.skipped), plan.bytes_to_fetch, plan.marker.total_bytes, bad)
    if bad:
        return report
    # Marker last: only now is DEST a committed checkpoint (atomic rename of a complete file).
    local = Location.of(plan.dest_path)
    if plan.marker.foreign and plan.marker.verified:  # an adopted step: its manifest goes along, before the marker
        local.store.put_bytes(local.join(layout.ADOPTED_MANIFEST).url, plan.marker.to_bytes())
    local.store.put_bytes(local.join(layout.MARKER).url, plan.marker_bytes)
    return report


def download(step: Where, dest: str, *, jobs: int = 8, progress: Progress | None = None) -> DownloadReport:
    """:func:`prepare_download` then :func:`run_download`."""
    return run_download(prepare_download(step, dest, jobs=jobs), jobs=jobs, progress=progress)
