"""Local steps on disk: one folder per rank's part, its manifest written last.

    {local_dir}/step{N}/rank{R}/          rank R's part (its own, or a copy of a peer's)
        model_and_optim/__R_0.distcp       the files the rank wrote (rank 0: also .metadata)
        train/rank{R}.pt
        part.json                          the part's manifest (a Marker of its files), LAST
    {local_dir}/step{N}/.tmp-write{R}-*    rank R's part being written (never read)
    {local_dir}/step{N}/.tmp-recv{S}-*     a copy of rank S's part being received (never read)
    {local_dir}/step{N}/.replicated-rank{R} rank R saw every rank finish copying the step
                                           (in the folder of R's node, one per rank of it)

Temporary folders of a killed process are removed by the rank that made them when it
writes (or receives) the same step again, and by retention (``remove_own_leftovers``).

A part counts only when ``part.json`` parses and every file it lists has its size;
``verify`` also checks every CRC32C. A rank's copies of a step count only once its
``.replicated-rank{R}`` exists: written after an all-gather in which every rank
reported its copies done, so a step whose save or copying was cut short (a rank
killed) is never taken as complete, whatever parts its folders hold. Nothing in these folders is trusted more than a
bucket: names are checked by the Marker parser and sizes bound every read.

Every path here is reached without following links (``storage/nofollow.py``): the
node folder is resolved once by the tier, and a link planted anywhere inside it (a
step, a part, a file, a marker) is never read or written through: a part reached
through one does not count, a save into one is refused (UnsafeCheckpoint) and
retention removes the link itself, never its target. The folders made here are
private (0700).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass

import google_crc32c

from ...errors import CheckpointError, CloudCkptError
from ...storage.nofollow import Folder
from .. import layout
from ..marker import Marker

log = logging.getLogger(__name__)

PART_MANIFEST = "part.json"
_MAX_MANIFEST = 256 * 1024 * 1024
_RANK_RE = re.compile(r"rank(0|[1-9][0-9]{0,8})")
_MISSING = (FileNotFoundError, NotADirectoryError)


@dataclass(frozen=True)
class Part:
    step: int
    rank: int
    path: str  # the part's folder
    marker: Marker  # its files (world_size and save_id of the save that wrote it)

    def file(self, rel: str) -> str:
        return os.path.join(self.path, *rel.split("/"))

    def open(self) -> Folder:
        """The part's folder, opened without following a link (UnsafeCheckpoint). Raises OSError."""
        return open_folder(self.path)


def open_folder(path: str, *, create: bool = False) -> Folder:
    """A folder of the tier (``path`` under the resolved node folder), opened from ``/``
    one component at a time: a link on the way is UnsafeCheckpoint, never followed."""
    return Folder.open(path, create=create, what="the node-local tier's folder (local_dir)")


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"step{int(step)}")


def part_folder(root: str, step: int, rank: int) -> str:
    return os.path.join(step_folder(root, step), f"rank{int(rank)}")


def new_tmp(root: str, step: int, what: str) -> str:
    """A fresh private temporary folder beside the step's parts (same filesystem:
    renamed into place); the step's folder is made if missing. A link in place of
    the step's folder: UnsafeCheckpoint (nothing is written through it)."""
    with open_folder(root) as r, r.folder(f"step{int(step)}", create=True) as s:
        return s.join(s.mkdtemp(f".tmp-{what}-"))


def new_view(root: str, what: str) -> str:
    """A fresh private temporary folder in the node folder itself (a recovery's view of
    a step: files linked and fetched into it, never renamed into a step), named
    ``.tmp-{what}-*`` (``remove_leftovers`` removes those a killed process left)."""
    with open_folder(root) as r:
        return r.join(r.mkdtemp(f".tmp-{what}-"))


def remove_leftovers(root: str, prefix: str) -> None:
    """Remove the entries of the node folder named ``prefix*`` (a rank's own temporary
    folders, left by a killed process); links are removed themselves."""
    try:
        with open_folder(root) as r:
            for n in r.names():
                if n.startswith(prefix):
                    with contextlib.suppress(OSError):
                        r.remove(n)
    except _MISSING:
        pass


def own_leftover(name: str, rank: int, peers: tuple[int, ...]) -> bool:
    """Whether the entry ``name`` of a step folder is a temporary folder ``rank`` makes:
    its part being written, or a copy being received from one of its ``peers``."""
    return name.startswith(f".tmp-write{int(rank)}-") or any(name.startswith(f".tmp-recv{int(p)}-") for p in peers)


def remove_own_leftovers(root: str, step: int, rank: int, peers: tuple[int, ...], *,
                         replicated: bool = False) -> list[str]:
    """Remove from ``step``'s folder the temporary folders ``rank`` makes (left by a
    killed process: this one has none in flight for the step), and with ``replicated``
    its ``.replicated-rank{R}`` record (the step is being written again: it is not
    complete on this rank until its copies are). Links are removed themselves. Returns
    the names removed."""
    gone = []
    try:
        with open_folder(step_folder(root, step)) as s:
            for n in s.names():
                if own_leftover(n, rank, peers) or (replicated and n == f".replicated-rank{int(rank)}"):
                    try:
                        s.remove(n)
                        gone.append(n)
                    except FileNotFoundError:
                        pass
                    except OSError as e:  # the next write of the step or retention tries again
                        log.warning("could not remove %s: %s", s.join(n), e)
    except _MISSING:
        pass
    return gone


def publish(tmp: str, marker: Marker, root: str, rank: int) -> str:
    """Write the manifest into ``tmp`` (last), then move ``tmp`` into place as the
    part of ``rank``, replacing an older copy (or a link there: removed itself)."""
    folder, name = os.path.split(tmp)
    dest = part_folder(root, marker.step, rank)
    with open_folder(folder) as s:
        with s.folder(name) as t:
            t.write(PART_MANIFEST, marker.to_bytes())
        s.remove(os.path.basename(dest))
        s.rename(name, os.path.basename(dest))
    return dest


def mark_replicated(root: str, step: int, rank: int) -> None:
    with open_folder(step_folder(root, step)) as s:
        s.touch(f".replicated-rank{int(rank)}")


def is_replicated(root: str, step: int, rank: int) -> bool:
    try:
        with open_folder(step_folder(root, step)) as s:
            return s.file_stat(f".replicated-rank{int(rank)}") is not None
    except _MISSING:
        return False
    except (OSError, CloudCkptError) as e:
        log.warning("ignoring local step %d: %s", step, e)
        return False


def remove(path: str) -> None:
    """Remove the file or folder ``path`` of the tier (a link: the link itself). Never
    raises: a leftover is logged and removed by the next retention."""
    folder, name = os.path.split(path)
    try:
        with open_folder(folder) as f:
            f.remove(name)
    except _MISSING:
        pass
    except (OSError, CloudCkptError) as e:
        log.warning("could not remove %s: %s", path, e)


def remove_step(root: str, step: int, ranks: tuple[int, ...]) -> None:
    """Remove from ``step``'s folder the parts of ``ranks`` and every entry that is no
    rank's part (leftovers of failed writes, markers), then the folder if it is empty
    (another rank of the node may still hold parts in it). A link in place of the
    step's folder is removed itself; nothing is followed."""
    name = f"step{int(step)}"
    with open_folder(root) as r:
        if r.is_link(name):
            log.warning("%s is a symbolic link: removed (the local tier never follows links in its folder)",
                        r.join(name))
            r.remove(name)
            return
        try:
            s = r.folder(name)
        except _MISSING:
            return
        with s:
            for n in s.names():
                m = _RANK_RE.fullmatch(n)
                if m is None or int(m.group(1)) in ranks:
                    with contextlib.suppress(OSError):  # another rank of this node may remove it first
                        s.remove(n)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=r.fd)


def steps_on_disk(root: str) -> list[int]:
    """The steps with an entry in ``root`` (a folder, or a planted link: retention
    removes it, nothing reads through it)."""
    try:
        with open_folder(root) as r:
            names = r.names()
    except _MISSING:
        return []
    return sorted(s for s in (layout.step_of_name(n) for n in names) if s is not None)


def read_part(root: str, step: int, rank: int) -> Part | None:
    """The part of ``rank`` for ``step`` if its manifest parses and every file has the
    listed size; None otherwise (missing, partial, reached through a link, or
    unreadable: logged)."""
    path = part_folder(root, step, rank)
    mpath = os.path.join(path, PART_MANIFEST)
    try:
        with open_folder(path) as p:
            body = p.read(PART_MANIFEST, limit=_MAX_MANIFEST)
            if len(body) > _MAX_MANIFEST:
                log.warning("ignoring local part %s: its manifest is larger than %d bytes", path, _MAX_MANIFEST)
                return None
            marker = Marker.from_bytes(body, url=mpath)
            if marker.step != step:
                log.warning("ignoring local part %s: its manifest is of step %d", path, marker.step)
                return None
            for o in marker.objects:
                st = p.file_stat(o.path)
                if st is None or st.st_size != o.size:
                    log.warning("ignoring local part %s: %s is missing or has another size", path, o.path)
                    return None
    except _MISSING:
        return None
    except (OSError, CheckpointError) as e:  # UnsafeCheckpoint (a link) is a CheckpointError
        log.warning("ignoring local part %s: %s", path, e)
        return None
    return Part(step, rank, path, marker)


def verify(part: Part) -> bool:
    """Every file of the part has its CRC32C (a bit flipped on a node's disk is caught
    here, before the part is used or served); files are read without following links."""
    try:
        with part.open() as p:
            for o in part.marker.objects:
                if o.crc32c is not None and _crc32c(p, o.path) != o.crc32c:
                    log.warning("local part %s: %s fails its CRC32C; not used", part.path, o.path)
                    return False
    except (OSError, CloudCkptError) as e:
        log.warning("local part %s is not usable: %s", part.path, e)
        return False
    return True


def _crc32c(folder: Folder, rel: str) -> str:
    crc = 0
    with os.fdopen(folder.open_file(rel), "rb") as f:
        while chunk := f.read(8 << 20):
            crc = google_crc32c.extend(crc, chunk)
    return f"{crc:08x}"


def link_into(part: Part, rel: str, dest: str) -> None:
    """Put the part's file ``rel`` into the folder ``dest`` (a private temporary folder of
    the tier) under the same relative path: a hard link, else a copy; never through a link."""
    parent, name = os.path.split(rel)
    with part.open() as p, open_folder(dest) as d, d.folder(parent, create=True) as into:
        p.link_file(rel, into, name)
