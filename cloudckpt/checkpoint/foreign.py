"""Steps other tools wrote (:func:`parse_marker`, :func:`foreign_step`).

A ``.metadata.json`` that is a JSON object without our ``"format"`` field is another
tool's marker (OLMo-core writes ``{"ephemeral": false, "version": "3.0.0"}``). Such a
step is described by a ``Marker`` built from one listing of the step folder
(``foreign_step``): sizes from the listing, no CRC32C, ``verified=False``. ``cloudckpt
adopt`` writes our manifest for it beside that marker, in ``.cloudckpt.json``
(``layout.ADOPTED_MANIFEST``), with an ``"adopted"`` field naming the tool and the
CRC32C of the marker it vouches for (read as our marker, checkpoint/marker.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from ..errors import CorruptCheckpoint, UnsafeCheckpoint
from ..untrusted.names import check_name
from .entries import ObjectEntry
from .layout import ADOPTED_MANIFEST, DCP_METADATA, MARKER, rank_of_train_state
from .marker import MAX_UNIX_TIME, Marker, marker_json

FOREIGN_WRITER = "olmo-core"  # the tool whose layout (step{N}/model_and_optim, .metadata.json) we share
MAX_FOREIGN_OBJECTS = 1_000_000  # objects a listed (foreign) step may hold; honest ones hold ranks x threads


@dataclass(frozen=True)
class ForeignMarker:
    """Another tool's marker: a JSON object without our ``"format"`` field."""

    ephemeral: bool
    version: str  # the tool's version as its marker says ("" if it does not)
    writer: str = FOREIGN_WRITER


def parse_marker(data: bytes, *, url: str = "") -> "Marker | ForeignMarker":
    """Our marker (``Marker``) or another tool's (``ForeignMarker``). Raises
    CorruptCheckpoint (not JSON, not an object, or a field of the wrong type),
    IncompatibleCheckpoint, UnsafeCheckpoint (as ``Marker.from_bytes``)."""
    d = marker_json(data, url)
    if isinstance(d, dict) and "format" not in d:
        eph, version = d.get("ephemeral"), d.get("version", "")
        if eph is not None and type(eph) is not bool or type(version) is not str:
            raise CorruptCheckpoint(f"commit marker {url} is neither a cloudckpt marker nor OLMo-core's "
                                    "(\"ephemeral\" or \"version\" of the wrong type)")
        return ForeignMarker(ephemeral=bool(eph), version=re.sub(r"[^A-Za-z0-9.+_-]", "?", version[:64]))
    return Marker.from_json(d, url)


def foreign_step(fm: ForeignMarker, *, step: int, listing: Iterable[tuple[str, int, float | None]], url: str) -> Marker:
    """The ``Marker`` of a foreign step from one listing of its folder: ``(relative
    name, size, mtime)`` of every object. Every name is checked (untrusted.names);
    sizes are the listing's; no CRC32C (``verified=False``); the world size is one
    more than the highest R of the ``train/rank{R}.pt`` files (1 without any); the
    time is the marker's.
    Raises CorruptCheckpoint (no ``model_and_optim/.metadata``: not a checkpoint),
    UnsafeCheckpoint (a bad name, more than MAX_FOREIGN_OBJECTS objects)."""
    objects, ranks, created, newest = [], [], None, 0.0
    for rel, size, mtime in listing:
        newest = max(newest, mtime or 0.0)
        if rel in (MARKER, ADOPTED_MANIFEST):
            created = mtime if rel == MARKER else created
            continue
        if len(objects) >= MAX_FOREIGN_OBJECTS:
            raise UnsafeCheckpoint(f"{url}: the step folder holds more than {MAX_FOREIGN_OBJECTS} objects; refusing it")
        objects.append(ObjectEntry(check_name(rel, what="object name in the step folder", url=url), int(size), None))
        rank = rank_of_train_state(rel)
        if rank is not None:
            ranks.append(rank)
    objects.sort(key=lambda o: o.path)
    if not any(o.path == DCP_METADATA for o in objects):
        raise CorruptCheckpoint(f"{url}: the step has another tool's marker but no {DCP_METADATA}; "
                                "it is not a checkpoint")
    return Marker(step=step, ephemeral=fm.ephemeral, world_size=max(ranks, default=0) + 1, objects=tuple(objects),
                  created_unix=_clamp_time(created or newest), library_version=fm.version,
                  format_version=0, writer=fm.writer, verified=False)


def _clamp_time(t: float) -> float:
    """A time from a listing (mtimes), held inside what a date can show."""
    return min(max(float(t), 0.0), MAX_UNIX_TIME) if t == t else 0.0
