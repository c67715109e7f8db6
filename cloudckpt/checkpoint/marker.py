"""The commit marker ``.metadata.json``: its schema, writing and parsing.

A step counts as a checkpoint if and only if its marker exists and parses. The
marker is written last, by one rank, with a conditional create, after every rank
reported its files uploaded; so whoever sees a marker sees a complete step.

Schema (format_version 1)::

    {"format": "cloudckpt", "format_version": 1, "step": 1000, "ephemeral": false,
     "world_size": 8, "created": "2026-11-21T23:00:00+00:00", "created_unix": 1.79e9,
     "library_version": "0.1.0", "torch_version": "2.13.0", "total_bytes": 123,
     "objects": [{"path": "model_and_optim/__0_0.distcp", "size": 100, "crc32c": "1a2b3c4d",
                  "chunks": [[offset, length, "crc32c"], ...]}, ...]}

``chunks`` (DCP shard files only) hold the CRC32C of every item's byte range, so a
loader that reads ranges (resharding, streaming) can check exactly what it read.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from .._version import __version__
from ..errors import CorruptCheckpoint, IncompatibleCheckpoint, UnsafeCheckpoint
from ..untrusted.names import check_name

FORMAT = "cloudckpt"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ObjectEntry:
    path: str  # relative to the step folder, "/"-separated
    size: int
    crc32c: str | None
    chunks: tuple = ()  # ((offset, length, crc32c), ...)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"path": self.path, "size": self.size, "crc32c": self.crc32c}
        if self.chunks:
            d["chunks"] = [list(c) for c in self.chunks]
        return d


@dataclass(frozen=True)
class Marker:
    step: int
    ephemeral: bool
    world_size: int
    objects: tuple[ObjectEntry, ...]
    created_unix: float = field(default_factory=time.time)
    library_version: str = __version__
    torch_version: str = ""
    save_id: str = ""  # the save attempt that committed it
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def created(self) -> str:
        return datetime.fromtimestamp(self.created_unix, tz=timezone.utc).isoformat(timespec="seconds")

    def object(self, path: str) -> ObjectEntry | None:
        return self._by_path.get(path)

    @property
    def _by_path(self) -> dict[str, ObjectEntry]:
        cache = self.__dict__.get("_by_path_cache")
        if cache is None:
            cache = {o.path: o for o in self.objects}
            object.__setattr__(self, "_by_path_cache", cache)
        return cache

    def to_bytes(self) -> bytes:
        d = {
            "format": FORMAT,
            "format_version": self.format_version,
            "step": self.step,
            "ephemeral": self.ephemeral,
            "world_size": self.world_size,
            "created": self.created,
            "created_unix": self.created_unix,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "save_id": self.save_id,
            "total_bytes": self.total_bytes,
            "object_count": len(self.objects),
            "objects": [o.to_json() for o in self.objects],
        }
        return json.dumps(d, separators=(",", ":")).encode()

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("objects")
        d.update(created=self.created, total_bytes=self.total_bytes, object_count=len(self.objects))
        return d

    @classmethod
    def from_bytes(cls, data: bytes, *, url: str = "") -> "Marker":
        """Parse a marker. Raises CorruptCheckpoint (not JSON / wrong shape) or
        IncompatibleCheckpoint (a format version this library cannot read)."""
        try:
            d = json.loads(data)
        except (ValueError, RecursionError) as e:  # not JSON, bad UTF-8, over-long integers, nested too deeply
            raise CorruptCheckpoint(f"commit marker {url} is not valid JSON ({e}); the step is not a usable checkpoint") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CorruptCheckpoint(f"commit marker {url} is not a cloudckpt marker (no \"format\": \"cloudckpt\")")
        v = d.get("format_version")
        if not isinstance(v, int) or v > FORMAT_VERSION or v < 1:
            raise IncompatibleCheckpoint(
                f"commit marker {url} has format_version {v!r}; this cloudckpt {__version__} reads version "
                f"{FORMAT_VERSION}: upgrade cloudckpt to read this checkpoint"
            )
        try:
            raw_objects = d["objects"]
            if type(raw_objects) is not list:
                raise TypeError("objects is not a list")
            objects = tuple(_object_entry(o, url) for o in raw_objects)
            step, world_size = _int(d["step"], "step"), _int(d["world_size"], "world_size")
            if type(d["ephemeral"]) is not bool:
                raise TypeError("ephemeral is not true or false")
            marker = cls(
                step=step,
                ephemeral=d["ephemeral"],
                world_size=world_size,
                objects=objects,
                created_unix=float(d["created_unix"]),
                library_version=str(d.get("library_version", "")),
                torch_version=str(d.get("torch_version", "")),
                save_id=str(d.get("save_id", "")),
                format_version=v,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpoint(f"commit marker {url} is missing or has a bad field ({type(e).__name__}: {e})") from None
        if world_size < 1:
            raise CorruptCheckpoint(f"commit marker {url} has world_size {world_size}; it must be at least 1")
        if len(marker._by_path) != len(objects):
            raise UnsafeCheckpoint(f"commit marker {url} lists an object path twice; refusing the checkpoint")
        return marker


def _int(v: Any, name: str) -> int:
    """A non-negative JSON integer (not a bool, float or string)."""
    if type(v) is not int or v < 0:
        raise ValueError(f"{name} is {v!r}, not a non-negative integer")
    return v


_CRC = re.compile(r"[0-9a-f]{8}")


def _crc(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if type(v) is not str or not _CRC.fullmatch(v):
        raise ValueError(f"the CRC32C of {what} is {v!r}, not 8 hex digits")
    return v


def _object_entry(o: Any, url: str) -> ObjectEntry:
    """One manifest entry, checked: a safe name (untrusted.names), a size, a CRC32C,
    and item ranges inside the object that do not overlap."""
    if type(o) is not dict:
        raise TypeError("an object entry is not a JSON object")
    path = check_name(o["path"], what="object path in the marker", url=url)
    size = _int(o["size"], f"the size of {path!r}")
    crc = _crc(o.get("crc32c"), repr(path))
    raw_chunks = o.get("chunks", [])
    if type(raw_chunks) is not list:
        raise TypeError(f"the chunks of {path!r} are not a list")
    chunks = []
    end = 0
    for c in raw_chunks:
        if type(c) is not list or len(c) != 3:
            raise TypeError(f"a chunk of {path!r} is not [offset, length, crc32c]")
        off, n = _int(c[0], "a chunk offset"), _int(c[1], "a chunk length")
        if off < end or off + n > size:
            raise UnsafeCheckpoint(f"commit marker {url}: the item ranges of {path!r} overlap or run past its "
                                   f"{size} bytes (at [{off}, {off + n})); refusing the checkpoint")
        end = off + n
        chunks.append((off, n, _crc(c[2], f"a chunk of {path!r}")))
    return ObjectEntry(path, size, crc, tuple(chunks))
