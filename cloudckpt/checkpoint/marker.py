"""The commit marker ``.metadata.json``: its schema, writing and parsing.

A step counts as a checkpoint if and only if its marker exists and parses. The
marker is written last, by one rank, with a conditional create, after every rank
reported its files uploaded; so whoever sees a marker sees a complete step.

Schema (format_version 3, two levels, the parts as columns)::

    {"format": "cloudckpt", "format_version": 3, "step": 1000, "ephemeral": false,
     "world_size": 8, "created": "2026-11-21T23:00:00+00:00", "created_unix": 1.79e9,
     "library_version": "0.1.0", "torch_version": "2.13.0", "save_id": "...",
     "total_bytes": 123, "object_count": 42,
     "objects": [{"path": "model_and_optim/.metadata", "size": 100, "crc32c": "1a2b3c4d"}],
     "parts": {"ranks": [[0, 8]], "size": [900, ...], "crc32c": "1a2b3c4d5e6f7a8b...",
               "objects": [5, ...], "bytes": [1000, ...]}}

``parts`` holds one column per field of the ranks' part references: ``ranks`` as runs
``[first, count]`` (ascending, disjoint; ``[[0, W]]`` when every rank wrote a part),
then for the i-th rank of those runs its part's ``size``, its CRC32C (characters
``8i`` to ``8i + 8`` of one hex string), the ``objects`` and ``bytes`` it declares; the
part's path is ``layout.part_name(rank)``. About 30 bytes per rank (a list of references,
format 2, took ~115), so the marker of 16,384 ranks is about half a megabyte.

Format 4 is format 3 and one field more, ``"root": ".replace/{save id}"``: the folder,
under the step, that holds every object of the step but the marker (their paths in
the manifest stay relative to it). A save that replaces a committed step
(``save_overwrite``) writes its objects there and swaps the marker in one conditional
request, so a reader sees the old step or the new one, never neither
(``commit.StepCommit``); a reader of format 3 or older refuses it
(IncompatibleCheckpoint) rather than look for its objects in the wrong place.

Format 2 wrote the same references as a list of objects, and is still read::

     "parts": [{"rank": 0, "path": "manifest/rank0.json", "size": 900, "crc32c": "...",
                "objects": 5, "bytes": 1000}, ...]

A marker without parts (adopted manifests, the local tier's per-rank manifests) is
still written as format 2 (``"parts": []``), readable by cloudckpt versions that read
format 2. A reader of format 1 or 2 refuses a format 3 marker with
IncompatibleCheckpoint ("upgrade cloudckpt"), never reading it as a step without
parts.

``objects`` lists the step's own files (DCP's ``.metadata``, the DCP index's header);
each rank's files are in its *part*, ``manifest/rank{R}.json``, listed here by reference
(checkpoint/parts.py: the part's schema, the references and their checks).

Format version 1 (every object inline in ``objects``, no ``parts``) is still read: a
step written before parts existed loads and lists as it did. Adopted manifests and the
local tier's per-rank manifests are markers with every object inline and no parts.

Steps other tools wrote (another tool's ``.metadata.json``) are read by
checkpoint/foreign.py.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable

from .._version import __version__
from ..errors import CorruptCheckpoint, IncompatibleCheckpoint, UnsafeCheckpoint
from ..untrusted.jsondoc import loads_json
from ..untrusted.limits import MAX_MARKER_BYTES
from .entries import ObjectEntry, check_crc, check_int, parse_entry
from .layout import PARTS_DIR, REPLACE_DIR, owner_of
from .parts import (
    ManifestPart,
    PartRef,
    PartTable,
    WithheldParts,
    parse_part_columns,
    parse_part_list,
    parts_columns,
)

FORMAT = "cloudckpt"
FORMAT_VERSION = 3  # what a save writes (the parts as columns)
REPLACED_FORMAT_VERSION = 4  # a step replaced in one step (save_overwrite): format 3 and its objects' ``root``
NEWEST_FORMAT_VERSION = REPLACED_FORMAT_VERSION  # the newest this library reads
ROOT_RE = re.compile(re.escape(REPLACE_DIR) + r"/[0-9a-f]{32}")  # a replaced step's objects: .replace/{save id}
INLINE_FORMAT_VERSION = 2  # a marker without parts (adopted, local tier), and format 2 steps (parts as a list)
MARKER_MAX_DEPTH = 8  # a marker nests 5 deep (marker, objects, entry, chunks, chunk); room for additions
MAX_WORLD_SIZE = 1 << 20  # ranks a marker may name (jobs run on thousands); its marker stays under MAX_MARKER_BYTES
MAX_UNIX_TIME = 253402300799.0  # 9999-12-31T23:59:59Z: the latest time a date can show
_WRITER = re.compile(r"[a-z0-9][a-z0-9._-]{0,39}")


class _ByRank:
    """A PartTable (or a tuple of PartRefs) looked up by rank."""

    def __init__(self, parts: Any):
        self._get = parts.get if isinstance(parts, (PartTable, WithheldParts)) else {p.rank: p for p in parts}.get

    def get(self, rank: int, default: Any = None) -> Any:
        return self._get(rank, default)

    def __getitem__(self, rank: int) -> PartRef:
        got = self._get(rank)
        if got is None:
            raise KeyError(rank)
        return got


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
    format_version: int = INLINE_FORMAT_VERSION  # how to_bytes writes the parts: 3 columns, 2 a list, 1 none
    writer: str = FORMAT  # the tool that wrote the step's objects ("olmo-core" for a foreign step)
    verified: bool = True  # a manifest with CRC32Cs (ours or adopted); False: sizes from a listing only
    adopted_crc32c: str = ""  # adopted: the CRC32C of the other tool's marker this manifest vouches for
    parts: "Sequence[PartRef]" = ()  # the ranks' manifest parts (format 2); ``objects`` then holds the step's own files
    root: str = ""  # format 4: the folder under the step that holds every object but the marker (``.replace/{id}``)

    def __post_init__(self) -> None:
        if self.parts and not isinstance(self.parts, (PartTable, WithheldParts)):
            table = PartTable.of(tuple(self.parts))
            object.__setattr__(self, "parts", table if table is not None else tuple(self.parts))

    def without_root(self) -> "Marker":
        """This marker of a replaced step (format 4) as format 3: what a copy of the step
        whose objects are in the step folder itself carries (``cloudckpt download``)."""
        import dataclasses

        return dataclasses.replace(self, root="", format_version=min(self.format_version, FORMAT_VERSION))

    def withholding_parts(self) -> "Marker":
        """This marker with its part references withheld (:class:`WithheldParts`): what
        the coordinator hands the other ranks of a load, each then fetching those it reads."""
        import dataclasses

        return dataclasses.replace(self, parts=WithheldParts(len(self.parts), total_bytes=self._parts_bytes()))

    def __getstate__(self) -> dict:
        # the lookup caches are rebuilt where they are needed, not carried (rank 0 hands markers to every rank)
        return {k: v for k, v in self.__dict__.items() if not k.endswith("_cache")}

    def __repr__(self) -> str:
        # short: a sync save returns a Marker, and its full manifest (every item's CRC32C)
        # would print thousands of characters in a notebook or a log line
        return (f"Marker(step={self.step}, ephemeral={self.ephemeral}, world_size={self.world_size}, "
                f"objects={self.object_count}, bytes={self.total_bytes}, writer={self.writer!r}, "
                f"format_version={self.format_version})")

    @property
    def foreign(self) -> bool:
        """Written by another tool (adopted or not)."""
        return self.writer != FORMAT

    @property
    def kind(self) -> str:
        """What ``cloudckpt list`` shows: ``cloudckpt``, ``olmo-core`` (no manifest: unverified)
        or ``olmo-core+manifest`` (adopted)."""
        if not self.foreign:
            return FORMAT
        return f"{self.writer}+manifest" if self.verified else self.writer

    @property
    def total_bytes(self) -> int:
        """Bytes of every object of the step (the parts and what they list included)."""
        return sum(o.size for o in self.objects) + self._parts_bytes()

    def _parts_bytes(self) -> int:
        if isinstance(self.parts, WithheldParts):
            return self.parts.total_bytes
        return sum(p.size + p.bytes for p in self.parts)

    @property
    def object_count(self) -> int:
        """Objects of the step (the parts and what they list included)."""
        return len(self.objects) + sum(1 + p.objects for p in self.parts)

    def part_of(self, path: str) -> PartRef | None:
        """The part that lists ``path`` (None: the marker lists it, or no part does)."""
        r = owner_of(path)
        return None if r is None else self._parts_by_rank.get(r)

    @property
    def _parts_by_rank(self) -> _ByRank:
        cache = self.__dict__.get("_parts_cache")
        if cache is None:
            cache = _ByRank(self.parts)
            object.__setattr__(self, "_parts_cache", cache)
        return cache

    def with_parts(self, parts: Iterable[ManifestPart]) -> "Marker":
        """This marker with every object inline: its own, the part files and what the
        ``parts`` (one per PartRef, already checked) list. What ``cloudckpt verify``,
        ``download`` and ``inspect`` read."""
        import dataclasses

        objects = list(self.objects) + [p.entry() for p in self.parts]
        for part in parts:
            objects.extend(part.objects)
        return dataclasses.replace(self, objects=tuple(sorted(objects, key=lambda o: o.path)), parts=())

    @property
    def created(self) -> str:
        return datetime.fromtimestamp(self.created_unix, tz=timezone.utc).isoformat(timespec="seconds")

    def object(self, path: str) -> ObjectEntry | None:
        return self._by_path.get(path)

    def files_under(self, folder: str) -> dict[str, ObjectEntry]:
        """The manifest entries under ``folder`` (e.g. ``model_and_optim``), keyed by
        their path relative to it."""
        prefix = folder.rstrip("/") + "/"
        return {o.path[len(prefix):]: o for o in self.objects if o.path.startswith(prefix)}

    def sizes_under(self, folder: str) -> dict[str, int] | None:
        """``{path relative to folder: size}``: what DCP's ``.metadata`` items must lie in
        (``untrusted.loads_metadata(files=...)``); None when the sizes are in the parts,
        not read here (a loading rank checks each item it reads against its part)."""
        if self.parts:
            return None
        return {rel: o.size for rel, o in self.files_under(folder).items()}

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
            "object_count": self.object_count,
            "objects": [o.to_json() for o in self.objects],
        }
        if self.format_version >= 3:
            d["parts"] = parts_columns(self.parts)
        elif self.format_version == 2:
            d["parts"] = [p.to_json() for p in self.parts]
        if self.foreign:
            d["adopted"] = {"writer": self.writer, "marker_crc32c": self.adopted_crc32c}
        if self.format_version >= REPLACED_FORMAT_VERSION:
            d["root"] = self.root
        return json.dumps(d, separators=(",", ":")).encode()

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("objects")
        d.pop("parts")
        d.update(created=self.created, total_bytes=self.total_bytes, object_count=self.object_count)
        return d

    @classmethod
    def from_bytes(cls, data: bytes, *, url: str = "") -> "Marker":
        """Parse a marker. Raises CorruptCheckpoint (not JSON / wrong shape) or
        IncompatibleCheckpoint (a format version this library cannot read)."""
        return cls.from_json(marker_json(data, url), url)

    @classmethod
    def from_json(cls, d: Any, url: str) -> "Marker":
        """Parse a marker from its JSON document (``marker_json``). Raises as :meth:`from_bytes`."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CorruptCheckpoint(f"commit marker {url} is not a cloudckpt marker (no \"format\": \"cloudckpt\")")
        v = d.get("format_version")
        if type(v) is not int or v > NEWEST_FORMAT_VERSION or v < 1:  # exact: true is not format 1
            raise IncompatibleCheckpoint(
                f"commit marker {url} has format_version {v!r}; this cloudckpt {__version__} reads version "
                f"1 to {NEWEST_FORMAT_VERSION}: upgrade cloudckpt to read this checkpoint"
            )
        try:
            raw_objects = d["objects"]
            if type(raw_objects) is not list:
                raise TypeError("objects is not a list")
            objects = tuple(parse_entry(o, url) for o in raw_objects)
            step, world_size = check_int(d["step"], "step"), check_int(d["world_size"], "world_size")
            parts = (parse_part_columns(d["parts"], world_size) if v >= 3 else
                     parse_part_list(d.get("parts", []), world_size) if v == 2 else ())
            if type(d["ephemeral"]) is not bool:
                raise TypeError("ephemeral is not true or false")
            writer, adopted_crc = FORMAT, ""
            if "adopted" in d:
                a = d["adopted"]
                if type(a) is not dict or type(a.get("writer")) is not str or not _WRITER.fullmatch(a["writer"]):
                    raise TypeError("adopted is not {\"writer\": name, \"marker_crc32c\": crc}")
                writer, adopted_crc = a["writer"], check_crc(a.get("marker_crc32c"), "the adopted marker") or ""
            root = ""
            if v >= REPLACED_FORMAT_VERSION:
                root = d["root"]
                if type(root) is not str or not ROOT_RE.fullmatch(root):
                    raise ValueError(f"root is {str(root)[:80]!r}, not .replace/ and a save id of 32 hex digits")
            marker = cls(
                step=step,
                ephemeral=d["ephemeral"],
                world_size=world_size,
                objects=objects,
                created_unix=_unix_time(d["created_unix"]),
                library_version=str(d.get("library_version", "")),
                torch_version=str(d.get("torch_version", "")),
                save_id=str(d.get("save_id", "")),
                format_version=v,
                writer=writer,
                adopted_crc32c=adopted_crc,
                parts=parts,
                root=root,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpoint(f"commit marker {url} is missing or has a bad field "
                                    f"({type(e).__name__}: {e})") from None
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise CorruptCheckpoint(f"commit marker {url} has world_size {world_size}; it must be between 1 and "
                                    f"{MAX_WORLD_SIZE}")
        if len(marker._by_path) != len(objects):
            raise UnsafeCheckpoint(f"commit marker {url} lists an object path twice; refusing the checkpoint")
        if parts and any(owner_of(o.path) is not None or o.path.startswith(PARTS_DIR + "/") for o in objects):
            raise UnsafeCheckpoint(f"commit marker {url} lists a rank's file beside the ranks' parts; refusing the "
                                   "checkpoint")
        return marker


def marker_json(data: bytes, url: str) -> Any:
    """The marker's JSON under untrusted.loads_json's bounds (size, nesting measured
    before parsing, finite numbers, integers of at most 20 digits)."""
    return loads_json(data, url=url, what="commit marker", limit=MAX_MARKER_BYTES, max_depth=MARKER_MAX_DEPTH)


def _unix_time(v: Any) -> float:
    """A marker's time: a JSON number (not a bool or string) between 0 and year 9999,
    so that every date shown from it can be formatted."""
    if type(v) not in (int, float) or not 0 <= v <= MAX_UNIX_TIME:
        raise ValueError(f"created_unix is {str(v)[:40]!r}, not a time in seconds between 0 and {MAX_UNIX_TIME:.0f}")
    return float(v)
