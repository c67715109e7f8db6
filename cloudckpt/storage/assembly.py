"""One object assembled in the store from pieces that different processes upload.

The call order (the roles as in DCP's ``storage.py``):

0. (one process) ``assembly = store.begin_assembly(url)``: an :class:`Assembly`, a small
   picklable value handed to every process that uploads a piece.
1. (any process, any order, concurrently) ``piece = store.put_piece(assembly, index,
   data, offset=...)``: piece ``index`` (0, 1, ...) holds the bytes ``[offset, offset +
   len(data))`` of the object. Returns a :class:`Piece`: a small record (index, offset,
   size, the store's tag for it) that the completing process needs.
2. (one process) ``store.complete_assembly(assembly, pieces)``: with every piece's
   record, the object appears at ``url`` at once, whole; or
   ``store.abort_assembly(assembly)`` (any process, also after a failed complete):
   nothing appears and what the pieces left is removed.

No object is visible at ``url`` before step 2 returns (S3: a multipart upload;
GCS: component objects beside it, composed; local: a temporary file renamed).
What each backend requires of the pieces is class data of the store:
``assembles_objects``, ``min_piece_size`` (every piece but the last),
``max_pieces``; :func:`check_pieces` holds the records to them before the complete
sends anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import PreconditionFailed


@dataclass(frozen=True)
class Assembly:
    """An object being assembled: its URL and the store's token for the assembly
    (S3: the multipart upload id; GCS and local: a random name of its temporary
    pieces). Picklable: the process that begins it hands it to the others."""

    url: str
    token: str


@dataclass(frozen=True)
class Piece:
    """One uploaded piece: bytes ``[offset, offset + size)`` of the object, piece
    number ``index``; ``tag`` is what the store said of it (S3: the part's ETag; GCS:
    the component's generation; local: empty)."""

    index: int
    offset: int
    size: int
    tag: str = ""


def check_pieces(url: str, pieces: Sequence[Piece], *, min_piece_size: int, max_pieces: Optional[int]) -> list[Piece]:
    """``pieces`` in index order, checked: indices 0..n-1 once each, each piece starting
    where the one before it ends (from 0), every piece but the last at least
    ``min_piece_size`` bytes, at most ``max_pieces`` of them, at least one. Raises
    PreconditionFailed naming what is wrong (nothing is sent to the store then)."""
    out = sorted(pieces, key=lambda p: p.index)
    if not out:
        raise PreconditionFailed(f"assemble {url}: no pieces; an assembled object needs at least one", url=url)
    if max_pieces is not None and len(out) > max_pieces:
        raise PreconditionFailed(f"assemble {url}: {len(out)} pieces, more than the {max_pieces} the store takes; "
                                 "upload fewer, larger pieces", url=url)
    at = 0
    for k, p in enumerate(out):
        if p.index != k:
            raise PreconditionFailed(f"assemble {url}: piece {k} is missing or given twice (indices "
                                     f"{[q.index for q in out[:k + 1]]}...); every piece 0..{len(out) - 1} once",
                                     url=url)
        if p.offset != at or p.size < 0:
            raise PreconditionFailed(f"assemble {url}: piece {k} holds bytes {p.offset}..{p.offset + p.size}, but "
                                     f"the pieces before it end at {at}: the pieces must follow each other", url=url)
        if k < len(out) - 1 and p.size < min_piece_size:
            raise PreconditionFailed(f"assemble {url}: piece {k} holds {p.size} bytes; every piece but the last must "
                                     f"hold at least {min_piece_size} in this store", url=url)
        at += p.size
    return out
