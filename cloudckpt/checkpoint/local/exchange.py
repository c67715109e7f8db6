"""Moving local parts between ranks over the tier's own gloo group.

Both exchanges follow one rule: every rank computes the same list of transfers
``(source rank, destination rank, ...)`` in the same order and takes part in the
ones that name it, in that order. A transfer waits only for its two ranks, and the
earliest unfinished transfer of the list always has both ready, so the exchange
cannot deadlock; a dead peer ends it with the group's timeout.

- ``replicate``: after a local save, each rank's part goes to the other members of
  its replication group (groups.py). The receiver writes into a temporary folder,
  checks every file's CRC32C as it arrives, writes the manifest last and moves the
  folder into place: a copy is either whole and verified or absent.
- ``fetch``: at recovery, the byte ranges a rank's load reads from files it does not
  hold come from a rank that holds them (the part's lowest live holder).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Iterable

import google_crc32c

from ... import dist
from ...errors import CorruptCheckpoint
from ...untrusted import check_name
from ..marker import Marker
from . import parts
from .groups import Replication

log = logging.getLogger(__name__)
_MAX_MANIFEST = 256 * 1024 * 1024


def _recv_checked(coord: dist.Coordinator, path: str, size: int, crc: str | None, src: int, *,
                  offset: int | None = None) -> None:
    state = {"crc": 0}

    def on_chunk(data) -> None:
        state["crc"] = google_crc32c.extend(state["crc"], bytes(data))

    os.makedirs(os.path.dirname(path), exist_ok=True)
    coord.recv_file(path, size, src, on_chunk=on_chunk if crc else None, offset=offset)
    if crc and f"{state['crc']:08x}" != crc:
        raise CorruptCheckpoint(f"{path}: the copy received from rank {src} fails its CRC32C")


def replicate(coord: dist.Coordinator, rep: Replication, root: str, step: int) -> dict:
    """Copy this rank's part of ``step`` to its group peers and receive theirs. Returns
    ``{"sent": bytes, "received": bytes, "seconds": s}``. Collective over ``coord``."""
    me = coord.rank
    t0 = time.monotonic()
    sent = received = 0
    own = parts.read_part(root, step, me) if rep.factor > 1 else None  # factor 1: nothing to send
    for src, dst in rep.transfers():
        if src == me:
            body = own.marker.to_bytes() if own is not None else b""
            coord.send_bytes(body, dst)
            if own is None:
                continue  # our own part is gone: the peer records nothing
            for o in own.marker.objects:
                coord.send_file(own.file(o.path), o.size, dst)
                sent += o.size
        elif dst == me:
            body = coord.recv_bytes(src, limit=_MAX_MANIFEST)
            if not body:
                log.warning("local step %d: rank %d had no part to send; no copy kept", step, src)
                continue
            marker = Marker.from_bytes(body, url=f"rank {src}'s part of local step {step}")
            parts.remove_own_leftovers(root, step, me, (src,))  # a killed process's copy of the same step
            tmp = parts.new_tmp(root, step, f"recv{src}")
            try:
                for o in marker.objects:
                    rel = check_name(o.path, what="path in a peer's part", url=f"rank {src}")
                    _recv_checked(coord, os.path.join(tmp, *rel.split("/")), o.size, o.crc32c, src)
                    received += o.size
                parts.publish(tmp, marker, root, src)
            except BaseException:
                parts.remove(tmp)
                raise
    return {"sent": sent, "received": received, "seconds": time.monotonic() - t0}


def fetch(coord: dist.Coordinator, needs: Iterable[tuple[int, str, int, int]], holders: dict[int, list[int]],
          held: dict[int, parts.Part], markers: dict[int, Marker], dest: str) -> int:
    """Bring the byte ranges this rank ``needs`` (``(part's rank, relative path, offset,
    length)``) into the files of the folder ``dest`` (each created at its full size, the
    ranges written in place), from the lowest holder of each part. A range that is a
    whole file, or one of the items the part's manifest lists, is checked against its
    CRC32C as it arrives (the load checks every item again). ``holders``: part rank ->
    ranks holding a verified copy (the same on every rank); ``held``: this rank's
    copies; ``markers``: each part's manifest. Collective. Returns the bytes received."""
    every = coord.all_gather(_coalesced(needs))
    received = 0
    for needer in range(len(every)):
        for part_rank, rel, offset, length in every[needer]:
            source = min(holders[part_rank])
            if needer == source:
                continue
            entry = markers[part_rank].object(rel)
            if entry is None or offset < 0 or length < 0 or offset + length > entry.size:
                raise CorruptCheckpoint(f"{rel} [{offset}, {offset + length}) is not in rank {part_rank}'s part")
            if coord.rank == source:
                coord.send_file(held[part_rank].file(rel), length, needer, offset=offset)
            elif coord.rank == needer:
                path = os.path.join(dest, *check_name(rel, what="path in a part", url=dest).split("/"))
                if not os.path.exists(path):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "xb") as f:
                        f.truncate(entry.size)  # sparse: only the ranges read are written
                crc = entry.crc32c if (offset, length) == (0, entry.size) else \
                    next((c[2] for c in entry.chunks if (c[0], c[1]) == (offset, length)), None)
                _recv_checked(coord, path, length, crc, source, offset=offset)
                received += length
    return received


def _coalesced(needs: Iterable[tuple[int, str, int, int]]) -> list[tuple[int, str, int, int]]:
    """Sorted, with ranges of a file that touch merged into one transfer."""
    out: list[tuple[int, str, int, int]] = []
    for part, rel, off, n in sorted(set(needs)):
        if out and out[-1][:2] == (part, rel) and out[-1][2] + out[-1][3] >= off:
            p, r, o, m = out[-1]
            out[-1] = (p, r, o, max(o + m, off + n) - o)
        else:
            out.append((part, rel, off, n))
    return out
