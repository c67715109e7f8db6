"""The DCP index read: its format, parsing and checks (every byte is hostile until
checked; the package docstring lists the checks). The names with an underscore that
``encode`` and ``select`` import (``_DTYPES``, ``_owner``, ``_bad``, ``_shown``) are the
package's own."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...checkpoint.layout import shard_writer
from ...errors import CorruptCheckpoint, UnsafeCheckpoint
from ...untrusted import loads_json
from ...untrusted.limits import MAX_DIM, MAX_TENSOR_DIMS

FORMAT = "cloudckpt-dcp-index"
VERSION = 1  # of a rank's part
HEADER_VERSIONS = (1, 2)  # 2: a layout may be a grid (``cuts``)
MAX_INDEX_BYTES = 1 << 30  # a header or a part; the manifest's CRC-checked size bounds each read first
MAX_KEY_CHARS = 4096
MAX_RANKS = 1 << 24


# dtypes a checkpoint may name: the dense ones DCP writes
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
                 "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
                 "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def _owner(rel: str) -> int:
    r = shard_writer(rel)
    if r is None:
        raise ValueError(f"DCP item in {rel!r}, not a shard file __{{rank}}_{{k}}.distcp")
    return r


@dataclass(frozen=True)
class Layout:
    """The chunks of a sharded tensor, numbered ``0 .. n - 1``: either ``lo``/``hi``
    (n x ndim int64, end exclusive: the boxes form) or ``cuts`` (each dimension's
    boundaries: the grid form, chunk ``k`` the ``k``-th cell in row-major order, never
    materialised); the rank that wrote each (``owner_list``, or ``start + k * step``)."""

    ndim: int
    n: int
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    cuts: tuple[np.ndarray, ...] | None = None
    owner_list: np.ndarray | None = None
    owner_rule: tuple[int, int] | None = None
    items: list | None = None  # a layout of one tensor: each chunk's item (no part to read)

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks ``rank`` wrote."""
        if self.owner_rule is not None:
            start, step = self.owner_rule
            k, r = divmod(rank - start, step)
            return [k] if r == 0 and 0 <= k < self.n else []
        return np.flatnonzero(self.owner_list == rank).tolist()

    def owners_of(self, ks: list[int]) -> list[int]:
        if self.owner_rule is not None:
            start, step = self.owner_rule
            return [start + k * step for k in ks]
        return self.owner_list[ks].tolist()

    def boxes(self, ks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """The offsets and the sizes of chunks ``ks``."""
        if self.cuts is None:
            lo, hi = self.lo[ks], self.hi[ks]
        else:
            idx = np.unravel_index(np.asarray(ks, dtype=np.int64), tuple(len(c) - 1 for c in self.cuts))
            lo = np.stack([c[i] for c, i in zip(self.cuts, idx, strict=True)], axis=1)
            hi = np.stack([c[i + 1] for c, i in zip(self.cuts, idx, strict=True)], axis=1)
        return lo.tolist(), (hi - lo).tolist()

    def pick(self, off: tuple[int, ...], sz: tuple[int, ...]) -> list[int]:
        """The chunks the box ``off``/``sz`` overlaps, by DCP's rule (in every dimension
        the chunk starts before the box ends and ends after the box starts)."""
        lo = np.array(off, dtype=np.int64)
        hi = lo + np.array(sz, dtype=np.int64)
        if self.cuts is None:
            return np.flatnonzero(np.all((self.lo < hi) & (lo < self.hi), axis=1)).tolist()
        ranges = []
        for c, a, b in zip(self.cuts, lo.tolist(), hi.tolist(), strict=True):
            i0 = max(0, int(np.searchsorted(c, a, side="right")) - 1)
            i1 = min(len(c) - 1, int(np.searchsorted(c, b, side="left")))
            if i1 <= i0:
                return []
            ranges.append(np.arange(i0, i1))
        dims = tuple(len(c) - 1 for c in self.cuts)
        return np.ravel_multi_index(np.meshgrid(*ranges, indexing="ij"), dims).ravel().tolist()


@dataclass(frozen=True)
class Tensor:
    dtype: torch.dtype
    size: tuple[int, ...]
    layout: int  # -1: stored whole, in ``item``
    item: tuple[str, int, int] | None


@dataclass
class Header:
    """A checked header: ``tensors`` and ``values`` (key -> item) in the order written."""

    url: str
    layouts: list[Layout]
    tensors: dict[str, Tensor]
    values: dict[str, tuple[str, int, int]]
    dcp_version: str | None

    def keys(self) -> list[str]:
        return [*self.tensors, *self.values]


def _bad(url: str, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"DCP index {url}: {why}; the step is damaged: load an older step "
                             "(cloudckpt list shows them) or restore the object")


def _int(x: Any, lo: int = 0, hi: int = MAX_DIM) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise ValueError(f"{_shown(x)} is not an integer in [{lo}, {hi}]")
    return x


def _ints(x: Any, n: int | None = None, limit: int = MAX_TENSOR_DIMS) -> tuple[int, ...]:
    if type(x) is not list or (n is not None and len(x) != n) or len(x) > limit:
        raise ValueError(f"{_shown(x)} is not a list of {n if n is not None else f'at most {limit}'} integers")
    return tuple(_int(v) for v in x)


def _key(x: Any) -> str:
    if type(x) is not str or not 0 < len(x) <= MAX_KEY_CHARS:
        raise ValueError(f"a key {_shown(x)} is not a string of 1 to {MAX_KEY_CHARS} characters")
    return x


def _item(x: Any) -> tuple[str, int, int]:
    if type(x) is not list or len(x) != 3 or type(x[0]) is not str:
        raise ValueError(f"an item {_shown(x)} is not [file, offset, length]")
    rel = x[0]
    _owner(rel)
    return rel, _int(x[1]), _int(x[2])


def _shown(x: Any) -> str:
    text = repr(x)
    return ascii(text[:60] + ("..." if len(text) > 60 else ""))


def parse_header(data: bytes, *, url: str, writers: int = 0) -> Header:
    """The checked header of a step (bytes already checked against the manifest).
    ``writers``: how many ranks wrote parts (the marker's part count): a grid layout
    whose owners are given by a rule (not listed) has at most that many chunks, so
    nothing is built beyond what the step's bytes carry. Raises CorruptCheckpoint."""
    d = loads_json(data, url=url, what="DCP index", limit=MAX_INDEX_BYTES)
    if type(d) is not dict or d.get("format") != FORMAT or type(d.get("version")) is not int or \
            d["version"] not in HEADER_VERSIONS:  # exact: true is not version 1
        raise _bad(url, f"not a {FORMAT} header of version {' or '.join(map(str, HEADER_VERSIONS))}")
    try:
        dv = d.get("dcp_version")
        if dv is not None and (type(dv) is not str or len(dv) > 32):
            raise ValueError("dcp_version is not a short string")
        raw_layouts, raw_tensors, raw_values = d["layouts"], d["tensors"], d["values"]
        if not all(type(x) is list for x in (raw_layouts, raw_tensors, raw_values)):
            raise ValueError("layouts, tensors and values must be lists")
        layouts = [_layout(x, writers, grids=d["version"] >= 2) for x in raw_layouts]
        tensors: dict[str, Tensor] = {}
        checked: set[tuple[int, tuple]] = set()
        itemized: set[int] = set()  # layouts with items, each used by one tensor
        for t in raw_tensors:
            if type(t) is not list or len(t) != 5:
                raise ValueError(f"a tensor entry {_shown(t)} is not [key, dtype, size, layout, item]")
            fqn = _key(t[0])
            dtype = _DTYPES.get(t[1]) if type(t[1]) is str else None
            if dtype is None:
                raise ValueError(f"{_shown(fqn)} has dtype {_shown(t[1])}, not one DCP writes")
            size = _ints(t[2])
            lid = _int(t[3], -1, len(layouts) - 1)
            if fqn in tensors:
                raise ValueError(f"{_shown(fqn)} is listed twice")
            if lid < 0:
                if t[4] is None:
                    raise ValueError(f"{_shown(fqn)} has neither an item nor a layout")
                tensors[fqn] = Tensor(dtype, size, -1, _item(t[4]))
                continue
            if t[4] is not None:
                raise ValueError(f"{_shown(fqn)} has both an item and a layout")
            if (lid, size) not in checked:
                _check_layout(layouts[lid], size, fqn)
                checked.add((lid, size))
            if layouts[lid].items is not None:
                if lid in itemized:
                    raise ValueError(f"a layout with its items is used by {_shown(fqn)} and another tensor")
                itemized.add(lid)
            tensors[fqn] = Tensor(dtype, size, lid, None)
        values: dict[str, tuple[str, int, int]] = {}
        for v in raw_values:
            if type(v) is not list or len(v) != 4:
                raise ValueError(f"a value entry {_shown(v)} is not [key, file, offset, length]")
            fqn = _key(v[0])
            if fqn in tensors or fqn in values:
                raise ValueError(f"{_shown(fqn)} is listed twice")
            values[fqn] = _item(v[1:])
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise _bad(url, f"{type(e).__name__}: {str(e)[:200]}") from None
    return Header(url, layouts, tensors, values, dv)


def _layout(x: Any, writers: int, *, grids: bool) -> Layout:
    if type(x) is not dict:
        raise ValueError("a layout is not an object")
    if "cuts" in x and grids:
        return _grid(x, writers)
    if not {"ndim", "boxes", "owners"} <= set(x) <= {"ndim", "boxes", "owners", "items"}:
        raise ValueError("a layout is not {ndim, boxes, owners[, items]} or {ndim, cuts, owners[, items]}")
    nd = _int(x["ndim"], 1, MAX_TENSOR_DIMS)
    boxes, owners = x["boxes"], x["owners"]
    if type(boxes) is not list or type(owners) is not list or not owners or len(boxes) != 2 * nd * len(owners):
        raise ValueError("a layout's boxes and owners do not agree in number")
    if not all(type(v) is int and 0 <= v <= MAX_DIM for v in boxes):
        raise ValueError("a layout's offsets and sizes are not integers in [0, 2^63)")
    own = _owner_list(owners)
    arr = np.array(boxes, dtype=np.uint64).reshape(len(owners), 2, nd)
    lo, sz = arr[:, 0, :], arr[:, 1, :]
    if np.any(sz > np.uint64(MAX_DIM) - lo):
        raise ValueError("a layout's chunk ends past 2^63")
    lay = Layout(nd, len(owners), lo=lo.astype(np.int64), hi=(lo + sz).astype(np.int64), owner_list=own)
    return _with_items(lay, x)


def _owner_list(owners: list) -> np.ndarray:
    if not all(type(v) is int and 0 <= v < MAX_RANKS for v in owners):
        raise ValueError(f"a layout's owners are not ranks in [0, {MAX_RANKS})")
    return np.array(owners, dtype=np.int64)


def _grid(x: dict, writers: int) -> Layout:
    """A layout in the grid form: ``cuts`` per dimension (ascending, from 0; the end is
    checked against each tensor's size), owners listed or ``{"start", "step"}``."""
    if not {"ndim", "cuts", "owners"} <= set(x) <= {"ndim", "cuts", "owners", "items"}:
        raise ValueError("a layout is not {ndim, cuts, owners[, items]}")
    nd = _int(x["ndim"], 1, MAX_TENSOR_DIMS)
    raw = x["cuts"]
    if type(raw) is not list or len(raw) != nd:
        raise ValueError(f"a layout's cuts are not {nd} lists")
    counts = [_cut_count(c) for c in raw]
    n = math.prod(counts)  # bounded before a cut is built: by the owners listed, or by the writers
    owners = x["owners"]
    if type(owners) is list:
        if len(owners) != n:
            raise ValueError(f"a layout's cuts make {n} chunks, its owners are {len(owners)}")
        own: dict = {"owner_list": _owner_list(owners)}
    elif type(owners) is dict and sorted(owners) == ["start", "step"]:
        start, step = _int(owners["start"], 0, MAX_RANKS), _int(owners["step"], 1, MAX_RANKS)
        if n > writers or start + (n - 1) * step >= MAX_RANKS:
            raise ValueError(f"a layout's cuts make {n} chunks, owned by ranks {start}, {start + step}, ...: more "
                             f"chunks than the {writers} ranks that wrote parts, or ranks past {MAX_RANKS}")
        own = {"owner_rule": (start, step)}
    else:
        raise ValueError("a layout's owners are neither a list nor {start, step}")
    cuts = tuple(_cuts(c) for c in raw)
    return _with_items(Layout(nd, n, cuts=cuts, **own), x)


def _cut_count(c: Any) -> int:
    """The number of intervals of one dimension's cuts (checked, nothing built)."""
    if type(c) is dict:
        if sorted(c) != ["end", "every"]:
            raise ValueError("a dimension's cuts are neither a list nor {every, end}")
        every, end = _int(c["every"], 1), _int(c["end"], 1)
        return -(-end // every)
    if type(c) is not list or len(c) < 2 or c[0] != 0 or not all(type(v) is int and 0 <= v <= MAX_DIM for v in c):
        raise ValueError("a layout's cuts are not lists of at least 2 integers in [0, 2^63) from 0")
    if any(b <= a for a, b in zip(c, c[1:], strict=False)):
        raise ValueError("a layout's cuts do not ascend (an empty or overlapping chunk)")
    return len(c) - 1


def _cuts(c: Any) -> np.ndarray:
    if type(c) is dict:
        return np.append(np.arange(0, c["end"], c["every"], dtype=np.int64), np.int64(c["end"]))
    return np.array(c, dtype=np.int64)


def _with_items(lay: Layout, x: dict) -> Layout:
    if "items" not in x:
        return lay
    if type(x["items"]) is not list or len(x["items"]) != lay.n:
        raise ValueError("a layout's items and chunks do not agree in number")
    items = [_item(i) for i in x["items"]]
    if any(_owner(rel) != o for (rel, _, _), o in zip(items, lay.owners_of(list(range(lay.n))), strict=True)):
        raise ValueError("a layout's item lies in a file of another rank than the chunk's owner")
    return dataclasses.replace(lay, items=items)


def _check_layout(lay: Layout, size: tuple[int, ...], fqn: str) -> None:
    """The chunks lie inside ``size``, are distinct, disjoint and cover it (once per
    layout and size). A grid: its cuts end at the size (ascending from 0, checked when
    parsed, they cover it exactly once). Boxes: a sorted sweep, linear and logarithmic
    for sharding's grids."""
    from ...untrusted.unpickle import _Budget, _disjoint, _numel

    nd = len(size)
    if lay.ndim != nd:
        raise ValueError(f"{_shown(fqn)} has {nd} dimensions, its layout {lay.ndim}")
    if lay.cuts is not None:
        if any(int(c[-1]) != s for c, s in zip(lay.cuts, size, strict=True)):
            raise ValueError(f"the chunks of {_shown(fqn)} end at {[int(c[-1]) for c in lay.cuts]}, its size is "
                             f"{list(size)}")
        return
    if nd and np.any(lay.hi > np.array(size, dtype=np.int64)):
        raise ValueError(f"a chunk of {_shown(fqn)} lies outside its size {list(size)}")
    numel = _numel(size)
    vols = [_numel(r) for r in (lay.hi - lay.lo).tolist()]
    if sum(vols) != numel:
        raise ValueError(f"the chunks of {_shown(fqn)} hold {sum(vols)} elements, its size {list(size)} has {numel}")
    boxes = [(tuple(lo), tuple(h - o for h, o in zip(hi, lo, strict=True)))
             for lo, hi, v in zip(lay.lo.tolist(), lay.hi.tolist(), vols, strict=True) if v]
    if len({b[0] for b in boxes}) != len(boxes):
        raise ValueError(f"two chunks of {_shown(fqn)} start at the same offsets")
    if len(boxes) > 1 and not _disjoint(boxes, 0, nd, _Budget(10 ** 8, "")):
        raise ValueError(f"chunks of {_shown(fqn)} overlap (and so leave part of it unwritten)")


def parse_part(data: bytes, *, url: str, rank: int) -> dict[tuple[str, tuple], tuple[tuple, str, int, int]]:
    """``{(key, chunk offsets): (chunk sizes, file, offset, length)}`` of rank ``rank``'s
    index part (bytes already checked against its manifest part). Raises
    CorruptCheckpoint, UnsafeCheckpoint (an item in another rank's file)."""
    d = loads_json(data, url=url, what="DCP index part", limit=MAX_INDEX_BYTES)
    if type(d) is not dict or d.get("format") != FORMAT or type(d.get("version")) is not int or \
            d["version"] != VERSION:
        raise _bad(url, f"not a {FORMAT} of version {VERSION}")
    if type(d.get("rank")) is not int or d["rank"] != rank:  # exact: not false for rank 0, nor 0.0
        raise UnsafeCheckpoint(f"DCP index part {url} names rank {_shown(d.get('rank'))}, not {rank}; refusing the "
                               "checkpoint")
    out: dict = {}
    try:
        items = d["items"]
        if type(items) is not list:
            raise ValueError("items is not a list")
        for it in items:
            if type(it) is not list or len(it) != 6:
                raise ValueError(f"an item {_shown(it)} is not [key, offsets, sizes, file, offset, length]")
            fqn, offs = _key(it[0]), _ints(it[1])
            sizes = _ints(it[2], len(offs))
            rel, off, n = _item(it[3:])
            if _owner(rel) != rank:
                raise UnsafeCheckpoint(f"DCP index part {url} of rank {rank} places {_shown(fqn)} in {rel!r}, a file "
                                       "of another rank; refusing the checkpoint")
            if (fqn, offs) in out:
                raise ValueError(f"{_shown(fqn)} at offsets {list(offs)} is listed twice")
            out[(fqn, offs)] = (sizes, rel, off, n)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise _bad(url, f"{type(e).__name__}: {str(e)[:200]}") from None
    return out


def check_tensor_bytes(header: Header, stored: int) -> None:
    """Refuse a header whose tensors hold more bytes than the step stores (``stored``,
    the marker's bytes): what a caller allocates from the header's sizes (``load_with``'s
    targets) is then at most what the checkpoint holds. Raises CorruptCheckpoint."""
    total = 0
    for fqn, t in header.tensors.items():
        total += math.prod(t.size) * t.dtype.itemsize
        if total > stored:
            raise _bad(header.url, f"its tensors (up to {_shown(fqn)}) hold {total:,} bytes, more than the "
                                   f"{stored:,} bytes the step stores; refused before anything is allocated")


def check_owners(header: Header, world_size: int) -> None:
    """Refuse a header whose chunks name a writer outside the ``world_size`` ranks that
    saved the step (a load finds out when it asks for that rank's part; a reader of the
    header alone, such as ``cloudckpt inspect``, asks here). Raises CorruptCheckpoint."""
    for lay in header.layouts:
        if lay.owner_rule is not None:
            start, step = lay.owner_rule
            last = start + (lay.n - 1) * step
        else:
            last = int(lay.owner_list.max()) if lay.n else -1
        if last >= world_size:
            raise _bad(header.url, f"a chunk is written by rank {last}, outside the {world_size} ranks that saved "
                                   "the step")


def _check_item(header: Header, fqn: str, item: tuple, files: dict[str, int]) -> None:
    rel, off, n = item[-3:]
    size = files.get(rel)
    if size is None or off + n > size:
        raise _bad(header.url, f"the item of {_shown(fqn)} ({rel!r}, bytes {off}..{off + n}) is not inside one of "
                               "the step's shard files")


def check_items(header: Header, files: dict[str, int]) -> None:
    """Every item the header holds itself (a tensor stored whole, a value, the chunks of
    a layout of one tensor) lies inside one of the step's shard files (``files``: name
    under ``model_and_optim/`` -> size). Raises CorruptCheckpoint."""
    for fqn, t in header.tensors.items():
        if t.layout < 0:
            _check_item(header, fqn, t.item, files)
        elif header.layouts[t.layout].items is not None:
            for item in header.layouts[t.layout].items:
                _check_item(header, fqn, item, files)
    for fqn, item in header.values.items():
        _check_item(header, fqn, item, files)


def check_part(header: Header, rank: int, part: dict | None, files: dict[str, int]) -> int:
    """Every chunk the header gives ``rank`` (outside the layouts that carry their
    items) is in its index part (``parse_part``'s result; None: the step has none) with
    the layout's sizes, inside one of the step's shard files, as a load finds it: what
    ``cloudckpt verify`` checks rank by rank (O(T) memory at any R). Returns the chunks
    checked. Raises CorruptCheckpoint."""
    mine: dict[int, list[int]] = {}  # per layout: the chunks of this rank
    n = 0
    for fqn, t in header.tensors.items():
        if t.layout < 0 or header.layouts[t.layout].items is not None:
            continue
        lay = header.layouts[t.layout]
        ks = mine.get(t.layout)
        if ks is None:
            ks = mine[t.layout] = lay.chunks_of(rank)
        if not ks:
            continue
        if part is None:
            raise _bad(header.url, f"rank {rank} wrote chunks of {_shown(fqn)} but the step has no index part of it")
        for lo, sizes in zip(*lay.boxes(ks), strict=True):
            got = part.get((fqn, tuple(lo)))
            if got is None or got[0] != tuple(sizes):
                raise _bad(header.url, f"the index part of rank {rank} lacks the chunk of {_shown(fqn)} at offsets "
                                       f"{lo} of sizes {list(sizes)} that the header gives it")
            _check_item(header, fqn, got[1:], files)
            n += 1
    return n
