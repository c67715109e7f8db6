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
part's path is ``part_name(rank)``. About 30 bytes per rank (a list of references,
format 2, took ~115), so the marker of 16,384 ranks is about half a megabyte.

Format 2 wrote the same references as a list of objects, and is still read::

     "parts": [{"rank": 0, "path": "manifest/rank0.json", "size": 900, "crc32c": "...",
                "objects": 5, "bytes": 1000}, ...]

A marker without parts (adopted manifests, the local tier's per-rank manifests) is
still written as format 2 (``"parts": []``), readable by cloudckpt versions that read
format 2. A reader of format 1 or 2 refuses a format 3 marker with
IncompatibleCheckpoint ("upgrade cloudckpt"), never reading it as a step without
parts.

``objects`` lists the step's own files (DCP's ``.metadata``); each rank's files are in
its *part*, ``manifest/rank{R}.json`` (``ManifestPart``), uploaded by that rank before
the commit and listed here with its size and CRC32C and what it declares (object count
and bytes)::

    {"format": "cloudckpt-part", "format_version": 2, "step": 1000, "rank": 3,
     "save_id": "...", "objects": [{"path": "model_and_optim/__3_0.distcp", "size": 100,
     "crc32c": "1a2b3c4d", "chunks": [[offset, length, "crc32c"], ...]}, ...]}

A part lists only its rank's files (``owner_of``: ``model_and_optim/__{R}_{K}.distcp``,
``train/rank{R}.pt``), so a reader knows which part describes a file from its name and
reads only the parts of the files it needs; a part is trusted only after its bytes
match the marker's size and CRC32C and it names the marker's step, save id and its rank.
``chunks`` hold the CRC32C of every item's byte range, so a loader that reads ranges
(resharding, streaming) can check exactly what it read.

Format version 1 (every object inline in ``objects``, no ``parts``) is still read: a
step written before parts existed loads and lists as it did. Adopted manifests and the
local tier's per-rank manifests are markers with every object inline and no parts.

Steps other tools wrote (``parse_marker``): a ``.metadata.json`` that is a JSON
object without our ``"format"`` field is another tool's marker (OLMo-core writes
``{"ephemeral": false, "version": "3.0.0"}``). Such a step is described by a
``Marker`` built from one listing of the step folder (``foreign_step``): sizes from
the listing, no CRC32C, ``verified=False``. ``cloudckpt adopt`` writes our manifest
for it beside that marker, in ``.cloudckpt.json`` (``ADOPTED_MANIFEST``), with an
``"adopted"`` field naming the tool and the CRC32C of the marker it vouches for.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable

from .._version import __version__
from ..errors import CorruptCheckpoint, IncompatibleCheckpoint, UnsafeCheckpoint
from ..untrusted.jsondoc import loads_json
from ..untrusted.limits import MAX_MARKER_BYTES
from ..untrusted.names import check_name
from .layout import ADOPTED_MANIFEST, DCP_METADATA, MARKER, PARTS_DIR, owner_of, part_name, rank_of_train_state

FORMAT = "cloudckpt"
FORMAT_VERSION = 3  # the newest this library reads; what a save writes (the parts as columns)
INLINE_FORMAT_VERSION = 2  # a marker without parts (adopted, local tier), and format 2 steps (parts as a list)
PART_FORMAT = "cloudckpt-part"
PART_FORMAT_VERSION = 2  # manifest parts are unchanged since format 2
MAX_PART_BYTES = 1 << 30  # no honest part comes near (~30 bytes per DCP item of one rank)
MAX_PART_OBJECTS = MAX_PART_BYTES // 32  # objects a part may declare: each entry takes more than 32 bytes of it
MAX_PART_DATA = (1 << 63) - 1  # bytes a part may declare (the objects' sizes are int64s)
FOREIGN_WRITER = "olmo-core"  # the tool whose layout (step{N}/model_and_optim, .metadata.json) we share
MAX_FOREIGN_OBJECTS = 1_000_000  # objects a listed (foreign) step may hold; honest ones hold ranks x threads
MARKER_MAX_DEPTH = 8  # a marker nests 5 deep (marker, objects, entry, chunks, chunk); room for additions
MAX_WORLD_SIZE = 1 << 20  # ranks a marker may name (jobs run on thousands); its marker stays under MAX_MARKER_BYTES
MAX_UNIX_TIME = 253402300799.0  # 9999-12-31T23:59:59Z: the latest time a date can show
_WRITER = re.compile(r"[a-z0-9][a-z0-9._-]{0,39}")


def split_by_rank(entries: Iterable["ObjectEntry"], rank: int) -> tuple[list["ObjectEntry"], list["ObjectEntry"]]:
    """``(this rank's entries, the step's own)``. Raises ValueError for a file that
    belongs to another rank (a part may list only its rank's files)."""
    own, shared = [], []
    for e in entries:
        r = owner_of(e.path)
        if r is None:
            shared.append(e)
        elif r == rank:
            own.append(e)
        else:
            raise ValueError(f"rank {rank} wrote {e.path!r}, a file of rank {r}")
    return own, shared


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


_HEX8 = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True)
class PartRef:
    """What the marker says of one rank's manifest part: where it is, its size and
    CRC32C, and how many objects and bytes it lists."""

    rank: int
    path: str
    size: int
    crc32c: str
    objects: int
    bytes: int

    @classmethod
    def of(cls, rank: int, data: bytes, part: "ManifestPart") -> "PartRef":
        from ..transfer.checksum import crc32c_bytes

        return cls(rank, part_name(rank), len(data), crc32c_bytes(data), len(part.objects),
                   sum(o.size for o in part.objects))

    def entry(self) -> "ObjectEntry":
        """The part file itself as an object of the step."""
        return ObjectEntry(self.path, self.size, self.crc32c)

    def to_json(self) -> dict:
        return {"rank": self.rank, "path": self.path, "size": self.size, "crc32c": self.crc32c,
                "objects": self.objects, "bytes": self.bytes}


@dataclass(frozen=True)
class ManifestPart:
    """One rank's manifest: its objects, with sizes, CRC32Cs and item CRC32Cs."""

    step: int
    rank: int
    save_id: str
    objects: tuple[ObjectEntry, ...]

    def entry(self, path: str) -> ObjectEntry | None:
        cache = self.__dict__.get("_by_path_cache")
        if cache is None:
            cache = {o.path: o for o in self.objects}
            object.__setattr__(self, "_by_path_cache", cache)
        return cache.get(path)

    def to_bytes(self) -> bytes:
        return json.dumps({"format": PART_FORMAT, "format_version": PART_FORMAT_VERSION, "step": self.step,
                           "rank": self.rank, "save_id": self.save_id,
                           "objects": [o.to_json() for o in self.objects]}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, url: str, ref: PartRef, step: int, save_id: str) -> "ManifestPart":
        """Parse the part ``ref`` of the marker of ``step`` (written by the save ``save_id``)
        and check it against the marker: its bytes (size, CRC32C), its step, save id and
        rank, and that it lists only its rank's files, as many and as large as declared.
        Raises CorruptCheckpoint, UnsafeCheckpoint."""
        from ..transfer.checksum import crc32c_bytes
        from ..untrusted import loads_json

        if len(data) != ref.size or crc32c_bytes(data) != ref.crc32c:
            raise CorruptCheckpoint(f"manifest part {url} does not match its size and CRC32C in the marker; the step "
                                    "is damaged: restore it or load an older step")
        d = loads_json(data, url=url, what="manifest part", limit=ref.size)
        if type(d) is not dict or d.get("format") != PART_FORMAT or d.get("format_version") != PART_FORMAT_VERSION:
            raise CorruptCheckpoint(f"manifest part {url} is not a cloudckpt manifest part of format "
                                    f"{PART_FORMAT_VERSION}")
        if d.get("step") != step or d.get("rank") != ref.rank or d.get("save_id") != save_id:
            raise UnsafeCheckpoint(f"manifest part {url} belongs to another step, rank or save than the marker "
                                   f"names (step {step}, rank {ref.rank}); refusing the checkpoint")
        try:
            raw = d["objects"]
            if type(raw) is not list:
                raise TypeError("objects is not a list")
            objects = tuple(_object_entry(o, url) for o in raw)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpoint(f"manifest part {url} is missing or has a bad field ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from None
        for o in objects:
            if owner_of(o.path) != ref.rank:
                raise UnsafeCheckpoint(f"manifest part {url} of rank {ref.rank} lists {o.path!r}, "
                                       "which is not a file of that rank; refusing the checkpoint")
        if len({o.path for o in objects}) != len(objects):
            raise UnsafeCheckpoint(f"manifest part {url} lists an object path twice; refusing the checkpoint")
        if len(objects) != ref.objects or sum(o.size for o in objects) != ref.bytes:
            raise UnsafeCheckpoint(f"manifest part {url} lists {len(objects)} objects of "
                                   f"{sum(o.size for o in objects)} "
                                   f"bytes; the marker declares {ref.objects} of {ref.bytes}: refusing the checkpoint")
        return cls(step, ref.rank, save_id, objects)


class PartTable(Sequence):
    """A marker's part references held as columns, as format 3 writes them: what a
    :class:`Marker` holds (and pickles) instead of one object per rank. Rank 0 hands
    the marker to every rank of a load; at 16,384 ranks that is about 20 bytes a rank
    and nothing built, and a rank makes a :class:`PartRef` only for the parts it reads
    (:meth:`get`). Iterating yields PartRefs in rank order; equal to a tuple of the same
    PartRefs."""

    __slots__ = ("_ranks", "_sizes", "_crcs", "_objects", "_bytes")

    def __init__(self, ranks: "range | array", sizes: array, crcs: bytes, objects: array, nbytes: array):
        self._ranks, self._sizes, self._crcs, self._objects, self._bytes = ranks, sizes, crcs, objects, nbytes

    @classmethod
    def of(cls, parts: Sequence[PartRef]) -> "PartTable | None":
        """The table of ``parts`` (ascending ranks, each at its own ``manifest/rank{R}.json``),
        or None when they are not that (they stay a tuple)."""
        ranks = [p.rank for p in parts]
        if any(b <= a for a, b in zip(ranks, ranks[1:], strict=False)) or any(
                p.path != part_name(p.rank) or not _HEX8.fullmatch(p.crc32c) for p in parts):
            return None
        try:
            sizes = array("Q", (p.size for p in parts))
            objects = array("Q", (p.objects for p in parts))
            nbytes = array("Q", (p.bytes for p in parts))
        except (OverflowError, TypeError):
            return None
        rng = range(ranks[0], ranks[-1] + 1) if ranks else range(0)
        return cls(rng if len(rng) == len(ranks) else array("q", ranks), sizes,
                   bytes.fromhex("".join(p.crc32c for p in parts)), objects, nbytes)

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        r = int(self._ranks[i])
        return PartRef(r, part_name(r), self._sizes[i], self._crcs[4 * i:4 * i + 4].hex(), self._objects[i],
                       self._bytes[i])

    def get(self, rank: int, default: Any = None) -> PartRef | Any:
        """The reference of rank ``rank``'s part, or ``default``."""
        ranks = self._ranks
        if isinstance(ranks, range):
            return self[ranks.index(rank)] if rank in ranks else default
        i = bisect.bisect_left(ranks, rank)
        return self[i] if i < len(ranks) and ranks[i] == rank else default

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PartTable, tuple, list)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PartTable({len(self)} parts)"

    def __reduce__(self):
        return (PartTable, (self._ranks, self._sizes, self._crcs, self._objects, self._bytes))


class WithheldParts(Sequence):
    """The part references one rank of a load holds while the coordinator keeps them all
    (``Checkpointer``'s load of a step with the DCP index): it asks for the ones its plan
    reads (:meth:`Marker.part_refs_for`, :meth:`add`). Its length is the marker's part
    count; asking it for a reference that was not fetched is an error (a bug), never
    taken for "no part"; it cannot be iterated."""

    def __init__(self, count: int, held: dict | None = None, total_bytes: int = 0):
        self._count = count
        self._held: dict[int, PartRef | None] = dict(held or {})
        self.total_bytes = total_bytes  # the withheld parts' own bytes and their objects' (Marker.total_bytes)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        raise TypeError("the part references are withheld on this rank (the coordinator holds them); look one up "
                        "by rank with get()")

    def __iter__(self):
        return self.__getitem__(0)

    def add(self, refs: dict[int, PartRef | None]) -> None:
        self._held.update(refs)

    def get(self, rank: int, default: Any = None) -> PartRef | Any:
        if rank not in self._held:
            raise RuntimeError(f"the manifest part reference of rank {rank} was not fetched from the coordinator for "
                               "this load (a cloudckpt bug: please report it)")
        got = self._held[rank]
        return default if got is None else got

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WithheldParts) and (self._count, self._held) == (other._count, other._held)

    def __hash__(self) -> int:
        return hash(self._count)

    def __repr__(self) -> str:
        return f"WithheldParts({len(self._held)} of {self._count} held)"

    def __reduce__(self):
        return (WithheldParts, (self._count, self._held, self.total_bytes))


REF_INTS = 5  # a part reference as integers: rank, size, CRC32C, objects, bytes (-1 after the rank: no part)


def encode_refs(marker: "Marker", ranks: Iterable[int]) -> list[int]:
    """The part references of ``ranks`` as integers (:data:`REF_INTS` each), for a rank
    that holds them withheld (``dist.Coordinator.ask_coordinator``)."""
    out: list[int] = []
    by_rank = marker._parts_by_rank
    for r in ranks:
        p = by_rank.get(r) if 0 <= r < marker.world_size else None
        out.extend((r, -1, -1, -1, -1) if p is None else (r, p.size, int(p.crc32c, 16), p.objects, p.bytes))
    return out


def decode_refs(ints: list[int]) -> dict[int, PartRef | None]:
    """:func:`encode_refs`'s references back (from the coordinator: our own process group)."""
    out: dict[int, PartRef | None] = {}
    for i in range(0, len(ints) - len(ints) % REF_INTS, REF_INTS):
        r, size, crc, objects, nbytes = ints[i:i + REF_INTS]
        out[r] = None if size < 0 else PartRef(r, part_name(r), size, f"{crc:08x}", objects, nbytes)
    return out


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

    def __post_init__(self) -> None:
        if self.parts and not isinstance(self.parts, (PartTable, WithheldParts)):
            table = PartTable.of(tuple(self.parts))
            object.__setattr__(self, "parts", table if table is not None else tuple(self.parts))

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
            d["parts"] = _columns(self.parts)
        elif self.format_version == 2:
            d["parts"] = [p.to_json() for p in self.parts]
        if self.foreign:
            d["adopted"] = {"writer": self.writer, "marker_crc32c": self.adopted_crc32c}
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
        return cls._from_json(_json(data, url), url)

    @classmethod
    def _from_json(cls, d: Any, url: str) -> "Marker":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CorruptCheckpoint(f"commit marker {url} is not a cloudckpt marker (no \"format\": \"cloudckpt\")")
        v = d.get("format_version")
        if not isinstance(v, int) or v > FORMAT_VERSION or v < 1:
            raise IncompatibleCheckpoint(
                f"commit marker {url} has format_version {v!r}; this cloudckpt {__version__} reads version "
                f"1 to {FORMAT_VERSION}: upgrade cloudckpt to read this checkpoint"
            )
        try:
            raw_objects = d["objects"]
            if type(raw_objects) is not list:
                raise TypeError("objects is not a list")
            objects = tuple(_object_entry(o, url) for o in raw_objects)
            step, world_size = _int(d["step"], "step"), _int(d["world_size"], "world_size")
            parts = (_part_columns(d["parts"], world_size) if v >= 3 else
                     _parts(d.get("parts", []), world_size) if v == 2 else ())
            if type(d["ephemeral"]) is not bool:
                raise TypeError("ephemeral is not true or false")
            writer, adopted_crc = FORMAT, ""
            if "adopted" in d:
                a = d["adopted"]
                if type(a) is not dict or type(a.get("writer")) is not str or not _WRITER.fullmatch(a["writer"]):
                    raise TypeError("adopted is not {\"writer\": name, \"marker_crc32c\": crc}")
                writer, adopted_crc = a["writer"], _crc(a.get("marker_crc32c"), "the adopted marker") or ""
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
    d = _json(data, url)
    if isinstance(d, dict) and "format" not in d:
        eph, version = d.get("ephemeral"), d.get("version", "")
        if eph is not None and type(eph) is not bool or type(version) is not str:
            raise CorruptCheckpoint(f"commit marker {url} is neither a cloudckpt marker nor OLMo-core's "
                                    "(\"ephemeral\" or \"version\" of the wrong type)")
        return ForeignMarker(ephemeral=bool(eph), version=re.sub(r"[^A-Za-z0-9.+_-]", "?", version[:64]))
    return Marker._from_json(d, url)


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


def _json(data: bytes, url: str) -> Any:
    """The marker's JSON under untrusted.loads_json's bounds (size, nesting measured
    before parsing, finite numbers, integers of at most 20 digits)."""
    return loads_json(data, url=url, what="commit marker", limit=MAX_MARKER_BYTES, max_depth=MARKER_MAX_DEPTH)


def _unix_time(v: Any) -> float:
    """A marker's time: a JSON number (not a bool or string) between 0 and year 9999,
    so that every date shown from it can be formatted."""
    if type(v) not in (int, float) or not 0 <= v <= MAX_UNIX_TIME:
        raise ValueError(f"created_unix is {str(v)[:40]!r}, not a time in seconds between 0 and {MAX_UNIX_TIME:.0f}")
    return float(v)


def _clamp_time(t: float) -> float:
    """A time from a listing (mtimes), held inside what a date can show."""
    return min(max(float(t), 0.0), MAX_UNIX_TIME) if t == t else 0.0


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


def _part_ref(rank: int, size: Any, crc: Any, objects: Any, nbytes: Any) -> PartRef:
    """One part reference, checked: a size of at most MAX_PART_BYTES, a CRC32C, the counts
    it declares within what a part can hold."""
    size = _int(size, f"the size of the part of rank {rank}")
    if _crc(crc, f"the part of rank {rank}") is None or size > MAX_PART_BYTES:
        raise ValueError(f"the part of rank {rank} has no CRC32C or declares {size} bytes (at most {MAX_PART_BYTES})")
    objects, nbytes = _int(objects, "a part's object count"), _int(nbytes, "a part's bytes")
    if objects > MAX_PART_OBJECTS or nbytes > MAX_PART_DATA:
        raise ValueError(f"the part of rank {rank} declares {objects} objects of {nbytes} bytes (at most "
                         f"{MAX_PART_OBJECTS} objects, {MAX_PART_DATA} bytes)")
    return PartRef(rank, part_name(rank), size, crc, objects, nbytes)


def _parts(raw: Any, world_size: int) -> tuple[PartRef, ...]:
    """Format 2's part references (a list of objects), checked: one per rank at most,
    each at its own name, with a size, a CRC32C and the counts it declares."""
    if type(raw) is not list:
        raise TypeError("parts is not a list")
    out, seen = [], set()
    for p in raw:
        if type(p) is not dict:
            raise TypeError("a part is not a JSON object")
        rank = _int(p["rank"], "a part's rank")
        if rank >= world_size or rank in seen:
            raise ValueError(f"a part of rank {rank} is listed twice or past the world size {world_size}")
        seen.add(rank)
        if p["path"] != part_name(rank):
            raise ValueError(f"the part of rank {rank} is not at {part_name(rank)!r}")
        out.append(_part_ref(rank, p["size"], p["crc32c"], p["objects"], p["bytes"]))
    return tuple(out)


PART_COLUMNS = ("ranks", "size", "crc32c", "objects", "bytes")
_HEX = re.compile(r"[0-9a-f]*")


def _columns(parts: Iterable[PartRef]) -> dict:
    """Format 3's ``parts``: the references as columns, the ranks as runs."""
    parts = sorted(parts, key=lambda p: p.rank)
    runs: list[list[int]] = []
    for p in parts:
        if runs and runs[-1][0] + runs[-1][1] == p.rank:
            runs[-1][1] += 1
        else:
            runs.append([p.rank, 1])
    return {"ranks": runs, "size": [p.size for p in parts], "crc32c": "".join(p.crc32c for p in parts),
            "objects": [p.objects for p in parts], "bytes": [p.bytes for p in parts]}


def _part_columns(raw: Any, world_size: int) -> tuple[PartRef, ...]:
    """Format 3's part references from their columns, checked before any is built: the
    columns exactly these, of one length (the CRC32Cs 8 hex digits each), at most one
    per rank of the world; the rank runs ascending, disjoint, inside the world and
    covering exactly as many ranks as the columns hold (counted before a rank is made,
    so nothing is built beyond what the marker's bytes carry)."""
    if type(raw) is not dict or sorted(raw) != sorted(PART_COLUMNS):
        raise TypeError(f"parts is not an object of the columns {', '.join(PART_COLUMNS)}")
    runs, sizes, crcs, objects, nbytes = (raw[k] for k in PART_COLUMNS)
    if not all(type(c) is list for c in (runs, sizes, objects, nbytes)) or type(crcs) is not str:
        raise TypeError("a column of parts is not a list (the CRC32Cs: not a string)")
    n = len(sizes)
    if not n == len(objects) == len(nbytes) or len(crcs) != 8 * n:
        raise ValueError(f"the columns of parts disagree in length ({n} sizes, {len(objects)} object counts, "
                         f"{len(nbytes)} byte counts, {len(crcs)} CRC32C digits: 8 per part)")
    if n > world_size:
        raise ValueError(f"{n} parts in a world of {world_size} ranks")
    if not _HEX.fullmatch(crcs):
        raise ValueError("the CRC32Cs of parts are not lowercase hex digits")
    end = covered = 0
    for run in runs:
        if type(run) is not list or len(run) != 2:
            raise TypeError("a run of part ranks is not [first, count]")
        first, count = _int(run[0], "a run's first rank"), _int(run[1], "a run's count")
        if count < 1 or first < end or first + count > world_size:
            raise ValueError(f"the part ranks [{first}, {count}] are empty, out of order, overlap, or run past the "
                             f"world size {world_size}")
        end, covered = first + count, covered + count
        if covered > n:
            break
    if covered != n:
        raise ValueError(f"the part ranks cover {'more than ' if covered > n else ''}{covered} ranks; the columns "
                         f"hold {n} parts")
    out, i = [], 0
    for first, count in runs:
        for rank in range(first, first + count):
            out.append(_part_ref(rank, sizes[i], crcs[8 * i:8 * i + 8], objects[i], nbytes[i]))
            i += 1
    return tuple(out)


def as_part_list(d: Any) -> Any:
    """A marker's JSON document with format 3's part columns rewritten as format 2's
    list of references (and ``format_version`` 2, which every reader still reads);
    anything else as it is. For tests and tools that edit a marker by hand; nothing is
    checked (the result is parsed like any marker)."""
    if not (isinstance(d, dict) and d.get("format_version") == 3 and isinstance(d.get("parts"), dict)):
        return d
    c = d["parts"]
    ranks = [r for first, count in c["ranks"] for r in range(first, first + count)]
    refs = [{"rank": r, "path": part_name(r), "size": c["size"][i], "crc32c": c["crc32c"][8 * i:8 * i + 8],
             "objects": c["objects"][i], "bytes": c["bytes"][i]} for i, r in enumerate(ranks)]
    return {**d, "format_version": INLINE_FORMAT_VERSION, "parts": refs}


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
