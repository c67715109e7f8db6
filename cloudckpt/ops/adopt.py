"""Adopting a foreign step: our manifest for a step another tool committed.

A step OLMo-core wrote has a marker (``{"ephemeral": ..., "version": ...}``) but no
manifest: cloudckpt finds and loads it with sizes from a listing and nothing to
check checksums against (``Marker.verified`` is False). ``adopt`` reads every
object of such a step once, computing its CRC32C (and, for DCP shard files, the
CRC32C of each item's byte range, as our saves record them), and writes our manifest
to ``.cloudckpt.json`` beside the other tool's marker with a conditional create.
From then on loads and ``cloudckpt verify`` check sizes and CRC32Cs.

Why a sibling and not a replacement of ``.metadata.json``: the other tool's marker
stays byte for byte what that tool wrote, so that tool keeps reading the step exactly
as before (OLMo-core parses its marker strictly with ``CheckpointMetadata.from_file``
when it filters by ``ephemeral``, and refuses our marker's fields), and nothing is
ever overwritten (a conditional create, not a replace). The manifest records the
CRC32C of the marker it vouches for; if the step is rewritten later, discovery sees
a different marker, ignores the stale manifest with a warning and treats the step as
unverified again. The commit marker stays ``.metadata.json``: without it the step
is not a checkpoint, whatever ``.cloudckpt.json`` says.

Before anything is read in full, the step is checked like a load would: the DCP
metadata parses (untrusted/) and every file it names is in the folder with every item
inside it, and every ``train/rank{R}.pt`` up to the world size is there and loads as
plain data. A step with anything missing is refused (CorruptCheckpoint).
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..checkpoint import discovery, layout
from ..checkpoint.entries import ObjectEntry
from ..checkpoint.marker import Marker
from ..errors import AlreadyExists, CorruptCheckpoint
from ..storage import Location, Where
from ..storage import url as urls

log = logging.getLogger(__name__)

_PIECE = 8 * 1024 * 1024


@dataclass(frozen=True)
class AdoptReport:
    dir: str
    writer: str  # the tool that wrote the step ("cloudckpt" when it is ours)
    object_count: int
    total_bytes: int
    manifest_url: str
    written: bool  # the manifest was written now (False: dry run, or nothing to do)
    already: bool  # the step already had a manifest (ours, or adopted before): nothing to do


def adopt(dir: Where, *, dry_run: bool = True, jobs: int = 8,
          on_bytes: Callable[[int], None] | None = None) -> AdoptReport:
    """Write our manifest for the foreign step ``dir`` (see the module docstring).
    ``dry_run`` checks the step (metadata, train state, nothing missing) and writes
    nothing; otherwise every object is read once (``jobs`` at a time; ``on_bytes``
    gets each piece's length) and the manifest is created if absent.
    Raises NotACheckpoint (no marker), CorruptCheckpoint (something missing or changed
    while adopting), UnsafeCheckpoint (refused by the untrusted-input checks), storage errors."""
    loc = Location.of(dir).resolved_step()
    dir = loc.url
    marker, raw = discovery.read_marker_bytes(loc)
    manifest_url = urls.join(dir, layout.ADOPTED_MANIFEST)
    if not marker.foreign or marker.verified:
        return AdoptReport(dir, marker.writer, len(marker.objects), marker.total_bytes, manifest_url, False, True)
    store = loc.store
    sums, items = _check_complete(store, dir, marker)
    if dry_run:
        return AdoptReport(dir, marker.writer, len(marker.objects), marker.total_bytes, manifest_url, False, False)

    def one(o: ObjectEntry) -> ObjectEntry:
        if o.path in sums:  # read (and parsed) already by the checks
            return ObjectEntry(o.path, o.size, sums[o.path])
        ranges = items.get(o.path, [])
        crc, chunk_crcs = _stream_crc(store, urls.join(dir, o.path), o.size, ranges, on_bytes)
        ranged = tuple((off, n, c) for (off, n), c in zip(ranges, chunk_crcs, strict=True))
        return ObjectEntry(o.path, o.size, crc, ranged)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        objects = tuple(pool.map(one, marker.objects))
    from ..transfer import crc32c_bytes

    manifest = Marker(step=marker.step, ephemeral=marker.ephemeral, world_size=marker.world_size, objects=objects,
                      created_unix=marker.created_unix, save_id=f"adopt-{uuid.uuid4().hex[:12]}",
                      writer=marker.writer, adopted_crc32c=crc32c_bytes(raw))
    body = manifest.to_bytes()
    Marker.from_bytes(body, url=manifest_url)  # what readers will parse: checked before it is written
    _, again = discovery.read_marker_bytes(loc)
    if again != raw:
        raise CorruptCheckpoint(f"{layout.marker_url(dir)} changed while adopting {dir}: the step was rewritten; "
                                "nothing was written (run adopt again)")
    try:
        store.put_bytes(manifest_url, body, if_absent=True)
    except AlreadyExists:
        log.info("%s was created by another adopt meanwhile; kept as it is", manifest_url)
        return AdoptReport(dir, marker.writer, len(objects), manifest.total_bytes, manifest_url, False, True)
    log.info("adopted %s (%s): %d objects, %d bytes, manifest %s", dir, marker.writer, len(objects),
             manifest.total_bytes, manifest_url)
    return AdoptReport(dir, marker.writer, len(objects), manifest.total_bytes, manifest_url, True, False)


def _check_complete(store, dir: str, marker: Marker) -> tuple[dict[str, str], dict[str, list[tuple[int, int]]]]:
    """What a load would parse, parsed, and nothing missing. Returns the CRC32C of the
    objects read here (``{path: crc}``) and the item ranges of each DCP shard file
    (``{step-relative path: sorted [(offset, length)]}``)."""
    from ..transfer import crc32c_bytes
    from ..untrusted import MAX_METADATA_BYTES, MAX_TRAIN_STATE_BYTES, load_plain, loads_metadata, read_checked
    from ..untrusted.unpickle import validate_metadata

    prefix = layout.MODEL_DIR + "/"
    files = marker.sizes_under(layout.MODEL_DIR)
    meta = marker.object(layout.DCP_METADATA)
    url = urls.join(dir, meta.path)
    data = read_checked(store, url, meta, limit=MAX_METADATA_BYTES, what="DCP metadata", verify=False)
    sums = {meta.path: crc32c_bytes(data)}
    md = loads_metadata(data, url=url)
    named = {info.relative_path for info in md.storage_data.values()}
    missing = sorted(prefix + rel for rel in named - set(files))
    ranks, missing_ranks, named_ranks = _rank_files(marker)
    count = len(missing) + missing_ranks
    missing += named_ranks
    if count:
        shown = ", ".join(missing[:10]) + (f" and {count - 10} more" if count > 10 else "")
        raise CorruptCheckpoint(f"refusing to adopt {dir}: {count} object(s) are missing ({shown}); "
                                "the step is incomplete")
    validate_metadata(md, url=url, files=files, budget=4 * len(data) + 10_000)  # every item inside its file
    items: dict[str, list[tuple[int, int]]] = {}
    for info in md.storage_data.values():
        items.setdefault(prefix + info.relative_path, []).append((info.offset, info.length))
    for ranges in items.values():
        ranges.sort()
    for rel in ranks:
        entry = marker.object(rel)
        u = urls.join(dir, rel)
        data = read_checked(store, u, entry, limit=MAX_TRAIN_STATE_BYTES, what="train state", verify=False)
        load_plain(data, url=u)
        sums[rel] = crc32c_bytes(data)
    return sums, items


def _rank_files(marker: Marker) -> tuple[list[str], int, list[str]]:
    """The step's ``train/rank{R}.pt`` files (R below its world size), how many are
    missing, and the first ten missing names. None listed: a model-only step, nothing
    missing. The world size of a foreign step comes from the highest R listed
    (``train/rank999999999.pt`` says 10^9): the names built here are bounded by what
    the listing holds, never by that number."""
    present = sorted(r for o in marker.objects if (r := layout.rank_of_train_state(o.path)) is not None
                     and r < marker.world_size)
    if not present:
        return [], 0, []
    have, missing, r = set(present), [], 0
    while len(missing) < 10 and r < marker.world_size:  # at most len(present) + 10 turns
        if r not in have:
            missing.append(layout.train_state_name(r))
        r += 1
    return [layout.train_state_name(r) for r in present], marker.world_size - len(present), missing


def _stream_crc(store, url: str, size: int, ranges: list[tuple[int, int]],
                on_bytes: Callable[[int], None] | None) -> tuple[str, list[str]]:
    """CRC32C of an object and of each of its (sorted, disjoint) byte ranges, from one
    streamed read. Raises CorruptCheckpoint when it does not hold ``size`` bytes."""
    import google_crc32c

    from ..transfer.checksum import bytes_pieces

    def extend(crc: int, data) -> int:
        for piece in bytes_pieces(data):
            crc = google_crc32c.extend(crc, piece)
        return crc

    whole, crcs, nxt, pos = 0, [0] * len(ranges), 0, 0
    if size:
        with store.open_range(url, 0, size) as r:
            while True:
                buf = r.read(_PIECE)
                if not buf:
                    break
                mv, end = memoryview(buf), pos + len(buf)
                whole = extend(whole, buf)
                j = nxt
                while j < len(ranges) and ranges[j][0] < end:
                    off, n = ranges[j]
                    a, b = max(off, pos), min(off + n, end)
                    if a < b:
                        crcs[j] = extend(crcs[j], mv[a - pos:b - pos])
                    if off + n > end:
                        break
                    j += 1
                nxt, pos = j, end
                if on_bytes:
                    on_bytes(len(buf))
    if pos != size:
        raise CorruptCheckpoint(f"{url} holds {pos} bytes, the listing said {size}: it changed while adopting; "
                                "nothing was written (run adopt again)")
    return f"{whole:08x}", [f"{c:08x}" for c in crcs]
