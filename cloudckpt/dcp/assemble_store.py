"""DCP's ``.metadata`` joined in the store from every rank's fragment (dcp/assemble.py):
no rank holds more than its run of fragments, the coordinator only begins and completes.

The call order (every rank calls :func:`assemble_in_store`; roles inside):

1. (coordinator) ``store.begin_assembly(url)``, broadcast (one small value).
2. (all ranks) one all_gather of each rank's fragment size (one int64 a rank).
3. (all ranks, the same answer) :func:`runs`: consecutive ranks grouped so that
   every run's bytes (the header counted with rank 0's fragment, the trailer with the
   last rank's) reach the store's least piece (S3: 5 MiB) but the last run's, and the
   runs number no more than the store takes (S3: 10,000). A store without a least
   piece (GCS, local folders) has one run per rank with bytes.
4. (ranks of a run) each sends its fragment to the run's first rank (point to point);
   that rank joins them in rank order and uploads the run as piece ``k``.
5. (all ranks -> coordinator) the pieces' records and each piece's CRC32C (a few
   dozen bytes each) are gathered; the coordinator completes the object, or, if any
   rank failed, every rank raises one error naming each failure and the coordinator
   aborts the assembly (nothing appears at the URL; its pieces are removed). The
   object's CRC32C (what a step's manifest records) is the pieces' CRC32Cs combined
   (:func:`crc32c_combine`): no rank reads the object back.

What a reader sees meanwhile: nothing at the URL until the complete; and a step's
``.metadata`` is read only once its marker exists, which the save writes after this.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Optional

import google_crc32c

from ..dist import Coordinator
from ..storage import ObjectStore
from ..storage.assembly import Piece
from ..storage.base import ObjectInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """Ranks ``[first, end)`` whose fragments make piece ``index``: bytes ``[offset,
    offset + size)`` of the object, uploaded by rank ``first``."""

    index: int
    first: int
    end: int
    offset: int
    size: int


def runs(sizes: list[int], *, min_piece: int, max_pieces: Optional[int]) -> list[Run]:
    """The runs of ranks whose joined fragments (``sizes``, in rank order, the header and
    trailer counted in) make the pieces: each at least ``target`` bytes but the last,
    where ``target`` is the store's least piece, raised so that at most ``max_pieces``
    runs are made (and at least 1 byte: a rank without bytes joins the next run)."""
    total = sum(sizes)
    target = max(min_piece, 1, math.ceil(total / max_pieces) if max_pieces else 0)
    out: list[Run] = []
    first, acc, offset = 0, 0, 0
    for r, n in enumerate(sizes):
        acc += n
        if acc >= target:
            out.append(Run(len(out), first, r + 1, offset, acc))
            first, offset, acc = r + 1, offset + acc, 0
    if first < len(sizes) and (acc or not out):
        out.append(Run(len(out), first, len(sizes), offset, acc))
    elif first < len(sizes):  # ranks without bytes at the end: part of the last run
        last = out[-1]
        out[-1] = Run(last.index, last.first, len(sizes), last.offset, last.size)
    return out


_CASTAGNOLI = 0x82F63B78  # CRC32C's polynomial, reflected


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_ZEROS: dict[int, list[list[int]]] = {}  # poly -> operators: [k] advances a CRC over 2**k zero bytes


def _zeros(poly: int, k: int) -> list[int]:
    """The operator that advances a CRC (reflected ``poly``) over ``2**k`` zero bytes,
    made once per polynomial and ``k`` by squaring (64 at most: ``len2`` is below 2**64)."""
    ops = _ZEROS.setdefault(poly, [])
    if not ops:
        one_bit = [poly] + [1 << n for n in range(31)]
        ops.append(_gf2_square(_gf2_square(_gf2_square(one_bit))))  # eight zero bits: one byte
    while len(ops) <= k:
        ops.append(_gf2_square(ops[-1]))
    return ops[k]


def crc32c_combine(crc1: int, crc2: int, len2: int, *, poly: int = _CASTAGNOLI) -> int:
    """The CRC32C of ``a + b`` from ``crc1`` of ``a``, ``crc2`` of ``b`` and ``len(b)``
    (zlib's ``crc32_combine``; ``poly``: another reflected polynomial, zlib's CRC-32 is
    0xEDB88320): ``crc1`` advanced over ``len2`` zero bytes, one cached operator per set
    bit of ``len2`` (each a power of two of zero bytes), then xor ``crc2``. A few dozen
    microseconds a call: the coordinator combines one CRC per piece of an assembly. A
    length seen twice gets its own operator (the set bits' composed, kept for the
    next calls): an assembly's pieces are mostly of one size, so most calls then cost
    one operator's application."""
    if len2 <= 0:
        return crc1
    key = (poly, len2)
    op = _BY_LENGTH.get(key, _UNSEEN)
    if op is _UNSEEN:  # the first time: bit by bit; the length is remembered
        if len(_BY_LENGTH) >= 256:
            _BY_LENGTH.clear()
        _BY_LENGTH[key] = op = None
    elif op is None:  # the second time: compose its operator once
        op = _BY_LENGTH[key] = _length_operator(poly, len2)
    if op:
        return _gf2_times(op, crc1) ^ crc2
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_zeros(poly, k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


_UNSEEN = object()
_BY_LENGTH: dict[tuple[int, int], list[int] | None] = {}  # (poly, length) -> its operator (None: seen once)


def _length_operator(poly: int, len2: int) -> list[int]:
    """The operator that advances a CRC over ``len2`` zero bytes: the set bits' operators
    composed (they commute: each is a power of the one-byte operator)."""
    op = [1 << n for n in range(32)]  # the identity
    k = 0
    while len2:
        if len2 & 1:
            z = _zeros(poly, k)
            op = [_gf2_times(z, col) for col in op]
        len2 >>= 1
        k += 1
    return op


def assemble_in_store(coord: Coordinator, store: ObjectStore, url: str, fragment: bytes, *, header: bytes,
                      trailer: bytes, if_absent: bool = False) -> ObjectInfo:
    """Every rank: the object ``url`` made of ``header``, every rank's ``fragment`` in
    rank order and ``trailer`` (the same header and trailer on every rank), assembled in
    ``store``; returns its ObjectInfo on every rank. Raises on every rank if any failed
    (CollectiveError naming each failing rank, or PeerLost); nothing is at ``url`` then.
    The ObjectInfo's ``crc32c`` is the object's (8 hex digits), combined from the pieces'."""
    assembly = coord.on_coordinator("begin the assembly of " + url, lambda: store.begin_assembly(url))
    try:
        mine = len(fragment) + (len(header) if coord.rank == 0 else 0) \
            + (len(trailer) if coord.rank == coord.world_size - 1 else 0)
        sizes = [s[0] for s in coord.all_gather_ints([mine], "sizes of the fragments of " + url)]
        plan = runs(sizes, min_piece=store.min_piece_size, max_pieces=store.max_pieces)
        run = next(x for x in plan if x.first <= coord.rank < x.end)

        def upload() -> Optional[tuple[Piece, int]]:
            if coord.rank != run.first:
                if sizes[coord.rank]:
                    coord.send_bytes(fragment, run.first)
                return None
            parts = [header] if coord.rank == 0 else []
            parts.append(fragment)
            for r in range(run.first + 1, run.end):
                if sizes[r]:
                    parts.append(coord.recv_bytes(r, limit=sizes[r]))
            if run.end == coord.world_size:
                parts.append(trailer)
            data = b"".join(parts)
            if len(data) != run.size:
                raise RuntimeError(f"assemble {url}: run {run.index} holds {len(data)} bytes, not the {run.size} "
                                   "its ranks announced")
            return store.put_piece(assembly, run.index, data, offset=run.offset), google_crc32c.value(data)

        uploaded = coord.gather_some("upload the pieces of " + url, upload)

        def complete() -> ObjectInfo:
            done = sorted((x for x in uploaded if x is not None), key=lambda x: x[0].index)
            info = store.complete_assembly(assembly, [p for p, _ in done], if_absent=if_absent)
            crc = 0
            for p, c in done:
                crc = crc32c_combine(crc, c, p.size)
            return dataclasses.replace(info, crc32c=f"{crc:08x}")

        return coord.on_coordinator("complete the assembly of " + url, complete)
    except BaseException:
        if coord.is_coordinator:
            try:
                store.abort_assembly(assembly)
            except Exception as e:  # noqa: BLE001 - the error raised below says more; this one is logged
                log.warning("assemble %s failed, and aborting it failed too: %s", url, e)
        raise
