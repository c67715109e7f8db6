"""Reading the small files of a committed step, for every caller (load, export, the
CLI, the Lightning plugin): DCP's ``.metadata`` and the per-rank train state, each
checked against the step's marker (size, CRC32C) through ``cloudckpt.untrusted``
before it is parsed, and the map of item checksums the shard readers check.
"""

from __future__ import annotations

from typing import Any

from ..dcp.reader import Checksums
from ..errors import CorruptCheckpoint
from ..storage import Location
from ..untrusted import MAX_TRAIN_STATE_BYTES, load_plain, loads_metadata, read_checked
from ..untrusted.limits import read_metadata
from . import discovery, layout
from .marker import Marker

METADATA_REL = layout.DCP_METADATA


def metadata_bytes(step: Location, marker: Marker, *, verify: bool = True) -> bytes | None:
    """The bytes of the step's DCP ``.metadata``, checked against the marker (size,
    CRC32C); None when the marker lists none (each reader then reports it). Its ceiling
    follows the step (``untrusted.limits.metadata_limit``: 1 GiB, or the bytes of the
    step's other files the marker declares if more)."""
    entry = marker.object(METADATA_REL)
    if entry is None:
        return None
    return read_metadata(step.store, step.join(METADATA_REL).url, size=entry.size, crc32c=entry.crc32c,
                         described=marker.total_bytes - entry.size, verify=verify)


def parse_metadata(step: Location, marker: Marker, data: bytes | None) -> Any:
    """DCP ``Metadata`` from the bytes of the step's ``.metadata`` (allowlisted
    unpickling; every item inside one of the manifest's files). ``data`` None (the
    marker lists no metadata) raises CorruptCheckpoint."""
    url = step.join(METADATA_REL).url
    if data is None:
        raise CorruptCheckpoint(f"{url}: the checkpoint's marker lists no DCP metadata; "
                                "it holds no model or optimizer state")
    return loads_metadata(data, url=url, files=marker.sizes_under(layout.MODEL_DIR))


def read_dcp_metadata(step: Location, *, verify: bool = True) -> tuple[Marker, Any]:
    """The marker and the parsed DCP ``Metadata`` of a committed step (unpickled with
    the allowlist, every item inside the manifest's files). Raises NotACheckpoint,
    CorruptCheckpoint (no metadata listed, bad size or CRC32C), UnsafeCheckpoint,
    storage errors."""
    step = step.resolved_step()
    marker = discovery.read_marker(step)
    return marker, parse_metadata(step, marker, metadata_bytes(step, marker, verify=verify))


def parse_index_header(step: Location, marker: Marker, data: bytes) -> Any:
    """The DCP index header (dcp/index.py) from its bytes, checked: a chunk's writer
    must be one of the ranks the marker describes (a rank that wrote a chunk wrote a
    part or, a step of the local tier, an object the marker lists)."""
    from ..dcp import index

    return index.parse_header(data, url=step.join(layout.INDEX_HEADER).url,
                              writers=len(marker.parts) + len(marker.objects))


def index_header(step: Location, marker: Marker, *, verify: bool = True) -> Any:
    """The step's DCP index header, read (checked against the marker: size, CRC32C) and
    parsed; None when the marker lists none (a step another tool wrote, or one older than
    the index). Every key, dtype, size and chunk count of the checkpoint, in a fraction
    of ``.metadata``'s bytes: 0.24 MB against 1.6 GB at 4,096 ranks of a 70B model."""
    from ..dcp import index

    entry = marker.object(layout.INDEX_HEADER) if marker.verified else None
    if entry is None:
        return None
    data = read_checked(step.store, step.join(layout.INDEX_HEADER).url, entry, limit=index.MAX_INDEX_BYTES,
                        what="DCP index", verify=verify)
    return parse_index_header(step, marker, data)


def index_files(marker: Marker) -> dict[str, int]:
    """``{shard file under model_and_optim/: size}``: what the DCP index's items must lie in."""
    return {rel: o.size for rel, o in marker.files_under(layout.MODEL_DIR).items()}


def check_index_header(marker: Marker, header: Any, files: dict[str, int]) -> None:
    """The DCP index header checked against the step: its tensors hold no more bytes than
    the step stores, its owners are ranks of the saved world, its own items lie inside
    ``files``. Raises CorruptCheckpoint."""
    from ..dcp import index

    index.check_tensor_bytes(header, marker.total_bytes)
    index.check_owners(header, marker.world_size)
    index.check_items(header, files)


def index_part(step: Location, marker: Marker, header: Any, rank: int, files: dict[str, int], *,
               verify: bool = True) -> dict | None:
    """Rank ``rank``'s DCP index part, read (checked against the marker) and parsed, with
    every chunk the header gives that rank found in it inside ``files``
    (``index.check_part``); None when the step has none (and the rank wrote no chunk).
    Raises CorruptCheckpoint, UnsafeCheckpoint, storage errors."""
    from ..dcp import index

    rel = layout.index_part_name(rank)
    entry, url = marker.object(rel), step.join(rel).url
    part = None
    if entry is not None:
        data = read_checked(step.store, url, entry, limit=index.MAX_INDEX_BYTES, what="DCP index part", verify=verify)
        part = index.parse_part(data, url=url, rank=rank)
    index.check_part(header, rank, part, files)
    return part


def index_metadata(step: Location, marker: Marker, header: Any, keys: set[str], *, verify: bool = True) -> Any:
    """DCP ``Metadata`` of the step from its DCP index, holding every key and, for
    storage, the chunks and items of ``keys`` only (what a reader of those keys needs,
    not the step's whole ``.metadata``). The header is checked against the step
    (``check_index_header``); each rank's part that holds a chunk of ``keys`` is read and
    checked (``index_part``), and only the chunks of ``keys`` kept. Raises
    CorruptCheckpoint, UnsafeCheckpoint, storage errors."""
    from ..dcp import index

    files = index_files(marker)
    check_index_header(marker, header, files)
    wanted = {k: [((0,) * len(t.size), tuple(t.size))] for k, t in header.tensors.items() if k in keys}
    wanted.update((k, None) for k in header.values if k in keys)
    needs, owners = index.select(header, wanted)
    parts = {rank: {k: v for k, v in (index_part(step, marker, header, rank, files, verify=verify) or {}).items()
                    if k[0] in keys}
             for rank in sorted(owners)}
    return index.build_metadata(header, needs, parts, wanted)


def train_state(step: Location, marker: Marker, rel: str, *, verify: bool = True) -> Any:
    """The train state file ``rel`` of the step (``torch.load(weights_only=True)``),
    or None if the marker does not list it."""
    entry = marker.object(rel)
    if entry is None:
        return None
    url = step.join(rel).url
    data = read_checked(step.store, url, entry, limit=MAX_TRAIN_STATE_BYTES, what="train state", verify=verify)
    return load_plain(data, url=url, what="train state")


def item_checksums(marker: Marker) -> Checksums:
    """``{file under model_and_optim/: {(offset, length): crc32c}}`` from the manifest:
    one entry per DCP item, and the whole file as ``(0, size)``."""
    out: Checksums = {}
    for rel, o in marker.files_under(layout.MODEL_DIR).items():
        d = out[rel] = {(c[0], c[1]): c[2] for c in o.chunks}
        if o.crc32c:
            d[(0, o.size)] = o.crc32c
    return out
