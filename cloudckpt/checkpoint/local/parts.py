"""Local steps on disk: one folder per rank's part, its manifest written last.

    {local_dir}/step{N}/rank{R}/          rank R's part (its own, or a copy of a peer's)
        model_and_optim/__R_0.distcp       the files the rank wrote (rank 0: also .metadata)
        train/rank{R}.pt
        part.json                          the part's manifest (a Marker of its files), LAST
    {local_dir}/step{N}/.tmp-*             a part being written or received (never read)
    {local_dir}/step{N}/.replicated-rank{R} rank R saw every rank finish copying the step

A part counts only when ``part.json`` parses and every file it lists has its size;
``verify`` also checks every CRC32C. A rank's copies of a step count only once its
``.replicated-rank{R}`` exists: written after an all-gather in which every rank
reported its copies done, so a step whose save or copying was cut short (a rank
killed) is never taken as complete, whatever parts its folders hold. Nothing in these folders is trusted more than a
bucket: names are checked by the Marker parser and sizes bound every read.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass

from ...errors import CheckpointError
from ...transfer import crc32c_file
from .. import layout
from ..marker import Marker

log = logging.getLogger(__name__)

PART_MANIFEST = "part.json"
_MAX_MANIFEST = 256 * 1024 * 1024


@dataclass(frozen=True)
class Part:
    step: int
    rank: int
    path: str  # the part's folder
    marker: Marker  # its files (world_size and save_id of the save that wrote it)

    def file(self, rel: str) -> str:
        return os.path.join(self.path, *rel.split("/"))


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"step{int(step)}")


def part_folder(root: str, step: int, rank: int) -> str:
    return os.path.join(step_folder(root, step), f"rank{int(rank)}")


def new_tmp(root: str, step: int, what: str) -> str:
    """A fresh temporary folder beside the step's parts (same filesystem: renamed into place)."""
    path = os.path.join(step_folder(root, step), f".tmp-{what}-{uuid.uuid4().hex[:12]}")
    os.makedirs(path)
    return path


def publish(tmp: str, marker: Marker, root: str, rank: int) -> str:
    """Write the manifest into ``tmp`` (last), then move ``tmp`` into place as the
    part of ``rank``, replacing an older copy."""
    body = marker.to_bytes()
    with open(os.path.join(tmp, PART_MANIFEST + ".tmp"), "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(tmp, PART_MANIFEST + ".tmp"), os.path.join(tmp, PART_MANIFEST))
    dest = part_folder(root, marker.step, rank)
    if os.path.lexists(dest):
        remove(dest)
    os.replace(tmp, dest)
    return dest


def mark_replicated(root: str, step: int, rank: int) -> None:
    with open(os.path.join(step_folder(root, step), f".replicated-rank{int(rank)}"), "wb"):
        pass


def is_replicated(root: str, step: int, rank: int) -> bool:
    return os.path.isfile(os.path.join(step_folder(root, step), f".replicated-rank{int(rank)}"))


def remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def steps_on_disk(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(s for s in (layout.step_of_name(n) for n in names) if s is not None)


def read_part(root: str, step: int, rank: int) -> Part | None:
    """The part of ``rank`` for ``step`` if its manifest parses and every file has the
    listed size; None otherwise (missing, partial, or unreadable: logged)."""
    path = part_folder(root, step, rank)
    mpath = os.path.join(path, PART_MANIFEST)
    try:
        if os.path.islink(path) or os.path.getsize(mpath) > _MAX_MANIFEST:
            return None
        with open(mpath, "rb") as f:
            marker = Marker.from_bytes(f.read(_MAX_MANIFEST + 1), url=mpath)
    except FileNotFoundError:
        return None
    except (OSError, CheckpointError) as e:
        log.warning("ignoring local part %s: %s", path, e)
        return None
    if marker.step != step:
        log.warning("ignoring local part %s: its manifest is of step %d", path, marker.step)
        return None
    part = Part(step, rank, path, marker)
    for o in marker.objects:
        f = part.file(o.path)
        if os.path.islink(f) or not os.path.isfile(f) or os.path.getsize(f) != o.size:
            log.warning("ignoring local part %s: %s is missing or has another size", path, o.path)
            return None
    return part


def verify(part: Part) -> bool:
    """Every file of the part has its CRC32C (a bit flipped on a node's disk is caught
    here, before the part is used or served)."""
    for o in part.marker.objects:
        if o.crc32c is not None and crc32c_file(part.file(o.path)) != o.crc32c:
            log.warning("local part %s: %s fails its CRC32C; not used", part.path, o.path)
            return False
    return True
