"""The ranks' manifest parts and the marker's references to them.

Each rank's files are in its *part*, ``manifest/rank{R}.json`` (:class:`ManifestPart`),
uploaded by that rank before the commit and listed by the marker (checkpoint/marker.py)
with its size and CRC32C and what it declares (object count and bytes)::

    {"format": "cloudckpt-part", "format_version": 2, "step": 1000, "rank": 3,
     "save_id": "...", "objects": [{"path": "model_and_optim/__3_0.distcp", "size": 100,
     "crc32c": "1a2b3c4d", "chunks": [[offset, length, "crc32c"], ...]}, ...]}

A part lists only its rank's files (``layout.owner_of``: ``model_and_optim/__{R}_{K}.distcp``,
``train/rank{R}.pt``, ``index/rank{R}.json``), so a reader knows which part describes a
file from its name and reads only the parts of the files it needs; a part is trusted only
after its bytes match the marker's size and CRC32C and it names the marker's step, save
id and its rank. ``chunks`` hold the CRC32C of every item's byte range, so a loader that
reads ranges (resharding, streaming) can check exactly what it read.

The marker's references (:class:`PartRef`) are written as columns (format 3:
:func:`parts_columns`, read back by :func:`parse_part_columns`) or as a list (format 2:
:func:`parse_part_list`), and held as columns (:class:`PartTable`). A load's coordinator
keeps them all and hands the other ranks a marker whose references are withheld
(:class:`WithheldParts`); each rank asks for those its plan reads, sent as integers
(:func:`encode_refs`, :func:`decode_refs`). They stay here, beside the table they are a
form of, rather than in a module of their own: they are the same references in another
form, and the marker needs both.
"""

from __future__ import annotations

import bisect
import json
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from ..errors import CorruptCheckpoint, UnsafeCheckpoint
from .entries import ObjectEntry, check_crc, check_int, parse_entry
from .layout import owner_of, part_name

if TYPE_CHECKING:  # pragma: no cover
    from .marker import Marker

PART_FORMAT = "cloudckpt-part"
PART_FORMAT_VERSION = 2  # manifest parts are unchanged since format 2
MAX_PART_BYTES = 1 << 30  # no honest part comes near (~30 bytes per DCP item of one rank)
MAX_PART_OBJECTS = MAX_PART_BYTES // 32  # objects a part may declare: each entry takes more than 32 bytes of it
MAX_PART_DATA = (1 << 63) - 1  # bytes a part may declare (the objects' sizes are int64s)


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
        if type(d) is not dict or d.get("format") != PART_FORMAT or type(d.get("format_version")) is not int or \
                d["format_version"] != PART_FORMAT_VERSION:
            raise CorruptCheckpoint(f"manifest part {url} is not a cloudckpt manifest part of format "
                                    f"{PART_FORMAT_VERSION}")
        if (type(d.get("step")) is not int or d["step"] != step or type(d.get("rank")) is not int
                or d["rank"] != ref.rank or d.get("save_id") != save_id):  # exact types: not 1.0, not true
            raise UnsafeCheckpoint(f"manifest part {url} belongs to another step, rank or save than the marker "
                                   f"names (step {step}, rank {ref.rank}); refusing the checkpoint")
        try:
            raw = d["objects"]
            if type(raw) is not list:
                raise TypeError("objects is not a list")
            objects = tuple(parse_entry(o, url) for o in raw)
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
    :class:`~cloudckpt.checkpoint.marker.Marker` holds (and pickles) instead of one object per rank. Rank 0 hands
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


def _part_ref(rank: int, size: Any, crc: Any, objects: Any, nbytes: Any) -> PartRef:
    """One part reference, checked: a size of at most MAX_PART_BYTES, a CRC32C, the counts
    it declares within what a part can hold."""
    size = check_int(size, f"the size of the part of rank {rank}")
    if check_crc(crc, f"the part of rank {rank}") is None or size > MAX_PART_BYTES:
        raise ValueError(f"the part of rank {rank} has no CRC32C or declares {size} bytes (at most {MAX_PART_BYTES})")
    objects, nbytes = check_int(objects, "a part's object count"), check_int(nbytes, "a part's bytes")
    if objects > MAX_PART_OBJECTS or nbytes > MAX_PART_DATA:
        raise ValueError(f"the part of rank {rank} declares {objects} objects of {nbytes} bytes (at most "
                         f"{MAX_PART_OBJECTS} objects, {MAX_PART_DATA} bytes)")
    return PartRef(rank, part_name(rank), size, crc, objects, nbytes)


def parse_part_list(raw: Any, world_size: int) -> tuple[PartRef, ...]:
    """Format 2's part references (a list of objects), checked: one per rank at most,
    each at its own name, with a size, a CRC32C and the counts it declares."""
    if type(raw) is not list:
        raise TypeError("parts is not a list")
    out, seen = [], set()
    for p in raw:
        if type(p) is not dict:
            raise TypeError("a part is not a JSON object")
        rank = check_int(p["rank"], "a part's rank")
        if rank >= world_size or rank in seen:
            raise ValueError(f"a part of rank {rank} is listed twice or past the world size {world_size}")
        seen.add(rank)
        if p["path"] != part_name(rank):
            raise ValueError(f"the part of rank {rank} is not at {part_name(rank)!r}")
        out.append(_part_ref(rank, p["size"], p["crc32c"], p["objects"], p["bytes"]))
    return tuple(out)


PART_COLUMNS = ("ranks", "size", "crc32c", "objects", "bytes")
_HEX = re.compile(r"[0-9a-f]*")


def parts_columns(parts: Iterable[PartRef]) -> dict:
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


def parse_part_columns(raw: Any, world_size: int) -> tuple[PartRef, ...]:
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
        first, count = check_int(run[0], "a run's first rank"), check_int(run[1], "a run's count")
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
    from .marker import INLINE_FORMAT_VERSION  # (marker imports this module)

    if not (isinstance(d, dict) and d.get("format_version") == 3 and isinstance(d.get("parts"), dict)):
        return d
    c = d["parts"]
    ranks = [r for first, count in c["ranks"] for r in range(first, first + count)]
    refs = [{"rank": r, "path": part_name(r), "size": c["size"][i], "crc32c": c["crc32c"][8 * i:8 * i + 8],
             "objects": c["objects"][i], "bytes": c["bytes"][i]} for i, r in enumerate(ranks)]
    return {**d, "format_version": INLINE_FORMAT_VERSION, "parts": refs}


class WithheldParts(Sequence):
    """The part references one rank of a load holds while the coordinator keeps them all
    (a load of a step with the DCP index): the rank asks for the ones its plan reads and
    holds a new marker with them (``CommittedStep.with_part_refs``). Its length is the
    marker's part count; asking it for a reference that was not fetched is an error (a
    bug), never taken for "no part"; it cannot be iterated. Never changed once made."""

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

    @property
    def held(self) -> dict[int, PartRef | None]:
        """The references fetched so far (rank -> its reference; None: the rank wrote no part)."""
        return dict(self._held)

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
    """:func:`encode_refs`'s references back (from the coordinator: our own process group).
    Trusted as the marker they came from, not checked again: the coordinator encodes
    them from a marker it parsed and checked (:func:`parse_part_columns` or
    :func:`parse_part_list`), and a peer's objects are trusted (docs/security.md, threat
    model: do not put ranks of different trust in one process group). What a reference
    leads to is not: the part's bytes are checked against it (size, CRC32C) and parsed
    by :meth:`ManifestPart.from_bytes` as for a reference read from the marker."""
    out: dict[int, PartRef | None] = {}
    for i in range(0, len(ints) - len(ints) % REF_INTS, REF_INTS):
        r, size, crc, objects, nbytes = ints[i:i + REF_INTS]
        out[r] = None if size < 0 else PartRef(r, part_name(r), size, f"{crc:08x}", objects, nbytes)
    return out
