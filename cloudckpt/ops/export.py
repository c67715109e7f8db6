"""Export the model weights of a committed checkpoint (torchtitan's ``export``).

    from cloudckpt.ops.export import export_weights
    export_weights("s3://bucket/run-7/step1000", "s3://bucket/run-7/export/model.safetensors",
                   dtype="bfloat16")

Only the tensors under one top-level key of the DCP state (``model`` by default)
are exported, named without that prefix (``model.layers.0.w`` -> ``layers.0.w``),
optionally cast to another floating-point dtype (integer and bool tensors keep
their dtype).

Streaming (``safetensors``): the header is written first (every name, dtype and
shape is known from the DCP metadata), then the tensors one at a time: read the
byte ranges of its chunks (concurrent range reads, CRC32C-checked against the
commit marker), assemble, cast, write, drop. Memory above baseline is bounded
by the largest tensor, not by the model: about two to three times the largest
tensor (its bytes as read, the decoded chunk, and for sharded tensors or a cast
the assembled or cast copy; measured: 33 MiB for 16 MiB tensors cast to bf16).
What the export knows of the step is bounded the same way: for a step with the DCP
index, every name, dtype and shape comes from the index header, and each tensor's
chunks (item and CRC32C) from a chunk index built rank by rank (that rank's manifest
part and index part read, checked and dropped) in a SQLite file beside the output, so
it holds one rank's parts, then one tensor's chunk list: never the job's R x T chunks
(3 M at 4,096 ranks of a 70B model with AdamW). A step without the index is read
from its ``.metadata``, whole.
The output goes to a local file (next to the destination
when it is local, else in ``work_dir``), so local disk holds the whole output
once; a bucket destination is then uploaded by the transfer engine (multipart
above the store's threshold, CRC32C computed).

``torch`` format: ``torch.save`` of ``{name: tensor}`` needs every tensor in
memory at once; only safetensors is strictly streaming.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import struct
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..checkpoint.committed import CommittedStep
from ..checkpoint.step import StepRef
from ..dcp import index
from ..dcp.items import decode_item_tensor
from ..errors import AlreadyExists, ConfigError, CorruptCheckpoint, MissingKeys
from ..options import default_work_dir
from ..storage import Location, StorageOptions, Where
from ..storage import url as urls
from ..transfer import TransferConfig, TransferEngine, crc32c_bytes
from ..units import MiB

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "torch")

#: torch dtype -> safetensors dtype code
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}

_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def parse_dtype(dtype: "str | torch.dtype | None") -> torch.dtype | None:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` -> ``torch.bfloat16``; None stays None.
    Raises ConfigError (a ValueError) for anything but a floating-point dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and not dtype.is_floating_point:
            raise ConfigError(f"export dtype must be a floating-point dtype, got {dtype}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ConfigError(f"unknown export dtype {dtype!r}: use one of {', '.join(sorted(_DTYPE_NAMES))}")
    return _DTYPE_NAMES[key]


# ---------------------------------------------------------------- reading the checkpoint
def read_dcp_metadata(step: Where, *, verify: bool = True):
    """The commit marker (every object inline) and the DCP ``Metadata`` of a committed
    step, from its ``.metadata`` (unpickled with the allowlist, every item inside the
    manifest's files). Raises NotACheckpoint, CorruptCheckpoint (no metadata listed, bad
    size or CRC32C), UnsafeCheckpoint, storage errors."""
    c = CommittedStep.open(StepRef.of(step), whole=True, verify=verify)
    return c.marker, c.metadata()


@dataclass(frozen=True)
class _Entry:
    name: str  # output name (fqn without the prefix)
    fqn: str
    shape: tuple[int, ...]
    src_dtype: torch.dtype
    dtype: torch.dtype  # output dtype
    chunks: tuple  # ChunkStorageMetadata

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _plan(metadata, key_prefix: str, dtype: torch.dtype | None, *, safetensors: bool) -> tuple[list[_Entry], list[str]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{key_prefix}." if key_prefix else ""
    entries, skipped = [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        if not isinstance(md, TensorStorageMetadata):
            skipped.append(fqn)
            continue
        src = md.properties.dtype
        out = dtype if (dtype is not None and src.is_floating_point) else src
        if safetensors and out not in SAFETENSORS_DTYPES:
            raise ConfigError(f"{fqn!r} has dtype {out}, which safetensors cannot store; use fmt='torch'")
        entries.append(_Entry(fqn[len(prefix):], fqn, tuple(md.size), src, out, tuple(md.chunks)))
    if not entries:
        tops = sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata})
        raise MissingKeys(f"no tensors under {key_prefix!r} in this checkpoint; its top-level keys are {tops}: "
                          "pass key_prefix= one of them")
    return entries, skipped


Located = tuple  # (offsets, sizes, file under model_and_optim/, offset, length, CRC32C or None): one chunk's item


def _metadata_chunks(metadata, checksums: dict):
    """``locate(entry)`` for a DCP ``Metadata`` holding every chunk and item (a step
    without the DCP index: its ``.metadata``): each chunk of the entry with its item."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def locate(e: _Entry) -> list[Located]:
        out = []
        for ch in e.chunks:
            info = metadata.storage_data[MetadataIndex(e.fqn, ch.offsets)]
            if getattr(info, "transform_descriptors", None):
                raise CorruptCheckpoint(f"the item of {e.fqn!r} in {info.relative_path} uses stream transforms, "
                                        "which cloudckpt does not support")
            out.append((tuple(ch.offsets), tuple(ch.sizes), info.relative_path, info.offset, info.length,
                        checksums.get(info.relative_path, {}).get((info.offset, info.length))))
        return out
    return locate


class _ChunkIndex:
    """Every chunk of the exported tensors with its item and CRC32C, from a step's DCP
    index, gathered one rank at a time (its manifest part and index part read, checked
    against the header and dropped) into a SQLite file beside the export's output.
    What the export holds is the header and one rank's parts during that pass, then one
    tensor's chunk list at a time (:meth:`locate`): never the job's R x T chunks (3 M at
    4,096 ranks of a 70B model with AdamW, every one a Python object in a ``Metadata``).
    Which chunks a tensor has comes from the header's checked layouts (disjoint, covering
    the tensor), so an extra or missing entry in a part cannot add or drop one."""

    def __init__(self, c: CommittedStep, keys: list[str], path: str):
        import sqlite3

        from ..checkpoint.layout import shard_writer

        self.path = path
        self.db = sqlite3.connect(path)
        self.db.execute("CREATE TABLE chunk (t INTEGER, offsets TEXT, sizes TEXT, rel TEXT, pos INTEGER, "
                        "len INTEGER, crc TEXT)")
        header = c.header()
        self.ids = {k: i for i, k in enumerate(keys)}
        held: dict[int, list] = {}  # rank -> the items the header itself gives (whole tensors, one-tensor layouts)
        parted: dict[int, list[tuple[int, str]]] = {}  # layout -> the exported tensors whose chunks parts hold
        for i, fqn in enumerate(keys):
            t = header.tensors[fqn]
            if t.layout < 0:
                held.setdefault(shard_writer(t.item[0]), []).append(
                    (i, (0,) * len(t.size), tuple(t.size), t.item))
                continue
            lay = header.layouts[t.layout]
            if lay.items is None:
                parted.setdefault(t.layout, []).append((i, fqn))
                continue
            ks = list(range(lay.n))
            for k, owner, lo, sz in zip(ks, lay.owners_of(ks), *lay.boxes(ks), strict=True):
                held.setdefault(owner, []).append((i, tuple(lo), tuple(sz), lay.items[k]))
        ranks = set(held)
        for lid in parted:
            lay = header.layouts[lid]
            ranks.update(lay.owners_of(list(range(lay.n))))
        self.stored = 0
        self.files: dict[str, int] = {}  # {shard file: size} of the ranks visited (a few per rank)
        try:
            for rank in sorted(ranks):
                self._add_rank(c, header, rank, held.pop(rank, ()), parted)
            # every item the header holds itself (values too, exported or not) inside its shard file,
            # as a load checks it: a header that places one past its file is a damaged step
            for rank in sorted(_header_item_writers(header) - ranks):
                self.files.update((rel, o.size) for rel, o in _shards(c.rank_objects(rank)).items())
            index.check_items(header, self.files)
            self.db.execute("CREATE INDEX chunk_t ON chunk (t)")
            self.db.commit()
        except BaseException:
            self.close()  # a damaged step: no chunk index left behind
            raise

    def _add_rank(self, c: CommittedStep, header, rank: int, held, parted: dict) -> None:
        objects = c.rank_objects(rank)
        shards = _shards(objects)
        files = {rel: o.size for rel, o in shards.items()}
        self.files.update(files)
        crcs = {(rel, x[0], x[1]): x[2] for rel, o in shards.items() for x in o.chunks}
        rows = [(i, lo, sz, *item) for i, lo, sz, item in held]
        if parted:
            part = c.index_part(rank, files, objects=objects)  # every chunk the header gives the rank, checked
            for lid, tensors in parted.items():
                lay = header.layouts[lid]
                ks = lay.chunks_of(rank)
                if not ks:
                    continue
                boxes = list(zip(*lay.boxes(ks), strict=True))
                for i, fqn in tensors:
                    for lo, sz in boxes:
                        got = part[(fqn, tuple(lo))]
                        rows.append((i, tuple(lo), tuple(sz), *got[1:]))
            del part
        out = []
        for i, lo, sz, rel, pos, n in rows:
            size = files.get(rel)
            if size is None or pos + n > size:
                raise CorruptCheckpoint(f"{c.step.model.url}: the DCP index places an item of "
                                        f"{list(self.ids)[i][:200]!r} at [{pos}, {pos + n}) of {rel!r}, which rank "
                                        f"{rank}'s manifest does not list that far; the step is damaged")
            crc = crcs.get((rel, pos, n))
            if crc is None and (pos, n) == (0, size):
                crc = shards[rel].crc32c or None
            out.append((i, ",".join(map(str, lo)), ",".join(map(str, sz)), rel, pos, n, crc))
            self.stored += n
        self.db.executemany("INSERT INTO chunk VALUES (?, ?, ?, ?, ?, ?, ?)", out)

    def locate(self, e: "_Entry") -> list[Located]:
        def ints(text: str) -> tuple[int, ...]:
            return tuple(int(x) for x in text.split(",")) if text else ()

        rows = self.db.execute("SELECT offsets, sizes, rel, pos, len, crc FROM chunk WHERE t = ?",
                               (self.ids[e.fqn],)).fetchall()
        return [(ints(lo), ints(sz), rel, pos, n, crc) for lo, sz, rel, pos, n, crc in rows]

    def close(self) -> None:
        self.db.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


class _TensorReader:
    """Reads one tensor at a time: the byte ranges of its chunks (split into
    ``piece_size`` pieces read concurrently), checked against the marker's CRC32C,
    decoded and assembled.

    Reads go straight to the store (its SDK retries throttling and transient
    errors), not through the transfer engine: the engine's futures keep their
    result alive until Python's cyclic garbage collector runs, which would let
    tensors already written pile up in memory.

    What it allocates is bounded by the checkpoint: the metadata was validated
    (``untrusted.validate_metadata``: a tensor's chunks are distinct, disjoint, inside
    it and cover it, each backed by an item at least its size), so the assembled
    tensor is never larger than the items read for it and no part of it is left
    unwritten; each decoded item must be a dense CPU tensor of the chunk's dtype and
    element count (``dcp.items.check_item_tensor``)."""

    def __init__(self, folder_url: str, store, locate, pool: ThreadPoolExecutor, *, verify: bool, piece_size: int,
                 on_bytes=None):
        self.model_url = folder_url
        self.store = store
        self.locate = locate  # entry -> its chunks' items (Located)
        self.pool = pool
        self.verify = verify
        self.piece_size = piece_size
        self.on_bytes = on_bytes
        self.bytes_read = 0

    def _read_range(self, url: str, start: int, length: int) -> bytes:
        if length <= self.piece_size:
            return self.store.get_bytes(url, start=start, end=start + length) if length else b""
        ends = [(s, min(s + self.piece_size, start + length)) for s in range(start, start + length, self.piece_size)]
        futures = [self.pool.submit(self.store.get_bytes, url, start=s, end=e) for s, e in ends]
        try:
            parts = [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()
        del futures
        data = b"".join(parts)
        del parts
        return data

    def read_item(self, fqn: str, rel: str, offset: int, length: int, crc32c: str | None) -> tuple[bytes, str]:
        """The checked bytes of the item of ``fqn`` at ``offset``/``length`` of the shard
        file ``rel``, and its URL."""
        url = urls.join(self.model_url, rel)
        data = self._read_range(url, offset, length)
        if len(data) != length:
            raise CorruptCheckpoint(f"{url}: expected {length} bytes at offset {offset}, "
                                    f"got {len(data)}; it is truncated")
        if self.verify and crc32c is not None and crc32c_bytes(data) != crc32c:
            raise CorruptCheckpoint(f"{url}: CRC32C mismatch in bytes [{offset}, {offset + length}) of "
                                    f"{fqn!r}; the object is corrupt: restore it or export an older step")
        self.bytes_read += len(data)
        if self.on_bytes is not None:
            self.on_bytes(len(data))
        return data, url

    def read(self, e: _Entry) -> torch.Tensor:
        full = None
        chunks = self.locate(e)
        for offsets, sizes, rel, pos, length, crc in chunks:
            data, url = self.read_item(e.fqn, rel, pos, length, crc)
            part = decode_item_tensor(data, url=url, fqn=repr(e.fqn))
            del data
            if part.dtype != e.src_dtype or part.numel() != math.prod(sizes):
                raise CorruptCheckpoint(f"{url}: the item of {e.fqn!r} at offsets {list(offsets)} "
                                        f"does not hold a {e.src_dtype} tensor of {list(sizes)}")
            if tuple(sizes) == e.shape and len(chunks) == 1:
                return part
            if full is None:
                full = torch.empty(e.shape, dtype=e.src_dtype)
            index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
            full[index].copy_(part.reshape(tuple(sizes)))
            del part
        if full is None:  # a tensor with no chunks has no elements
            full = torch.empty(e.shape, dtype=e.src_dtype)
        return full


def read_dcp_state(folder: Location, metadata, *, checksums: dict | None = None, verify: bool = True,
                   piece_size: int = 32 * MiB) -> dict[str, Any]:
    """Every value of the DCP folder ``folder`` (its validated ``metadata``) as a flat
    ``{fqn: tensor or value}``: tensors assembled from their chunks as export reads
    them, byte items unpickled by ``untrusted.load_plain``. Holds the whole state in
    memory once; what it allocates is bounded by the items' bytes (see _TensorReader).
    Raises CorruptCheckpoint / UnsafeCheckpoint, storage errors."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from ..untrusted import load_plain

    checksums = checksums or {}
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="cloudckpt-read") as pool:
        reader = _TensorReader(folder.url, folder.store, _metadata_chunks(metadata, checksums), pool, verify=verify,
                               piece_size=piece_size)
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                out[fqn] = reader.read(_Entry(fqn, fqn, tuple(md.size), md.properties.dtype, md.properties.dtype,
                                              tuple(md.chunks)))
            else:
                info = metadata.storage_data[MetadataIndex(fqn)]
                data, url = reader.read_item(fqn, info.relative_path, info.offset, info.length,
                                             checksums.get(info.relative_path, {}).get((info.offset, info.length)))
                out[fqn] = load_plain(data, url=url, what="DCP byte item")
    return out


def _stored_bytes(metadata, entries: list[_Entry]) -> int:
    """The bytes an export reads: every stored item of every tensor it writes."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return sum(metadata.storage_data[MetadataIndex(e.fqn, c.offsets)].length for e in entries for c in e.chunks)


# ---------------------------------------------------------------- writing
def _header_item_writers(header) -> set[int]:
    """The ranks whose shard files hold the items the index header gives itself (whole
    tensors, the chunks of one-tensor layouts, values)."""
    from ..checkpoint.layout import shard_writer

    items = [t.item for t in header.tensors.values() if t.layout < 0]
    for t in header.tensors.values():
        if t.layout >= 0 and header.layouts[t.layout].items is not None:
            items.extend(header.layouts[t.layout].items)
    items.extend(header.values.values())
    return {shard_writer(item[0]) for item in items}


def _shards(objects: dict) -> dict:
    """``{shard file under model_and_optim/: entry}`` of a rank's manifest entries."""
    from ..checkpoint import layout as step_layout

    prefix = step_layout.MODEL_DIR + "/"
    return {p[len(prefix):]: o for p, o in objects.items() if p.startswith(prefix)}


def _header(entries: list[_Entry], meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    off = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(body)) + body


def _write_tensor(f: BinaryIO, t: torch.Tensor) -> int:
    """Write the tensor's raw little-endian bytes without copying them into Python."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    if n:
        f.write(memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())))
    return n


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _write_safetensors(f: BinaryIO, entries: list[_Entry], reader: _TensorReader, meta: dict[str, str]) -> None:
    f.write(_header(entries, meta))
    for e in entries:
        t = _cast(reader.read(e), e.dtype)
        if _write_tensor(f, t) != e.nbytes:
            raise CorruptCheckpoint(f"{e.fqn!r}: read {tuple(t.shape)} {t.dtype}, "
                                    f"the metadata says {e.shape} {e.dtype}")
        del t


def _write_torch(f: BinaryIO, entries: list[_Entry], reader: _TensorReader) -> None:
    tensors = {e.name: _cast(reader.read(e), e.dtype) for e in entries}
    torch.save(tensors, f)


# ---------------------------------------------------------------- entry point
def _open(ref: StepRef, key_prefix: str, dtype: torch.dtype | None, *, verify: bool, safetensors: bool, spill: str):
    """``(the step, its entries, the non-tensor keys skipped, locate, the bytes the export
    reads, what to close)``. A step with the DCP index: every name, dtype and size from
    its header and each tensor's chunks from a ``_ChunkIndex`` (never ``.metadata``, 1.6
    GB at 4,096 ranks of a 70B model, ~27 GB of memory to unpickle, nor every rank's parts
    at once); else ``.metadata`` with the marker read whole."""
    c = CommittedStep.open(ref, verify=verify)
    if c.header() is None:
        c = CommittedStep.open(ref, whole=True, verify=verify)
        metadata = c.metadata()
        entries, skipped = _plan(metadata, key_prefix, dtype, safetensors=safetensors)
        return c, entries, skipped, _metadata_chunks(metadata, c.item_checksums()), \
            _stored_bytes(metadata, entries), None
    entries, skipped = _plan(c.shapes(), key_prefix, dtype, safetensors=safetensors)
    chunks = _ChunkIndex(c, [e.fqn for e in entries], spill)
    return c, entries, skipped, chunks.locate, chunks.stored, chunks


def export_weights(
    step_url: str,
    dest_url: str,
    *,
    dtype: "str | torch.dtype | None" = None,
    fmt: str = "safetensors",
    key_prefix: str = "model",
    overwrite: bool = False,
    storage_options: StorageOptions | None = None,
    transfer: TransferConfig | None = None,
    work_dir: str | None = None,
    verify_checksums: bool = True,
    piece_size: int = 32 * MiB,
    progress: Any = None,
    read_progress: Any = None,
) -> dict:
    """Export the tensors under ``key_prefix`` of the committed step ``step_url`` to
    ``dest_url`` (a local path, ``file://``, ``s3://`` or ``gs://`` object; a URL
    ending in ``/`` gets ``model.safetensors`` or ``model.pt`` appended).

    ``progress``: a transfer-engine progress subscriber for the upload of a bucket
    ``dest_url``; ``read_progress``: an object with ``start(total_bytes)`` and
    ``update(n)`` (``cloudckpt.ops.Progress``), told the bytes of the step it reads.

    ``dtype`` casts floating-point tensors (``"bfloat16"``, ``"float16"``, a
    ``torch.dtype``; None keeps the stored dtype). ``fmt`` is ``"safetensors"``
    (streaming) or ``"torch"`` (``torch.save`` of a dict; holds every tensor).

    Returns ``{"step_url", "step", "dest", "format", "dtype", "tensors", "bytes",
    "largest_tensor_bytes", "bytes_read", "skipped"}`` (``skipped``: non-tensor
    values under the prefix, which neither format exports).

    Raises NotACheckpoint (no marker), CorruptCheckpoint (bad size or CRC32C),
    MissingKeys (no tensor under ``key_prefix``), ConfigError (a ValueError: bad
    ``fmt`` or ``dtype``, or a dtype safetensors cannot store), AlreadyExists
    (``dest_url`` exists and not ``overwrite``), storage errors.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    out_dtype = parse_dtype(dtype)
    if dest_url.endswith("/"):
        dest_url = dest_url + ("model.safetensors" if fmt == "safetensors" else "model.pt")
    if sys.byteorder != "little":
        raise RuntimeError("export writes raw little-endian tensor bytes; this machine is big-endian")
    dest = Location.of(dest_url, storage_options)
    if not overwrite and dest.store.exists(dest_url):
        raise AlreadyExists(f"{dest_url} already exists; pass overwrite=True (--force) to replace it", url=dest_url)

    local = urls.local_path(dest_url) is not None
    if local:
        final = urls.parse_url(dest_url).key
        tmp_dir = os.path.dirname(final) or "."
    else:
        final = None
        tmp_dir = work_dir or default_work_dir()
    os.makedirs(tmp_dir, exist_ok=True)
    # open(..., "xb"): the umask applies, as for any file
    tmp = os.path.join(tmp_dir, f".export-{uuid.uuid4().hex}.part")
    c, entries, skipped, locate, stored, chunks = _open(
        StepRef.of(step_url, storage_options), key_prefix, out_dtype, verify=verify_checksums,
        safetensors=fmt == "safetensors", spill=tmp[:-len(".part")] + ".chunks")
    if skipped:
        log.warning("export skips %d non-tensor value(s) under %r: %s", len(skipped), key_prefix,
                    ", ".join(skipped[:10]))
    marker = c.marker
    meta = {"format": "pt", "cloudckpt_step": str(marker.step)}
    config = transfer or TransferConfig()
    engine = TransferEngine(config, storage_options=dest.options, progress=progress)
    pool = ThreadPoolExecutor(max_workers=max(1, min(config.max_concurrency, 16)),
                              thread_name_prefix="cloudckpt-export")
    try:
        if read_progress is not None:
            read_progress.start(stored)
        reader = _TensorReader(c.step.model.url, c.step.loc.store, locate, pool, verify=verify_checksums,
                               piece_size=piece_size,
                               on_bytes=read_progress.update if read_progress is not None else None)
        with open(tmp, "xb") as f:
            if fmt == "safetensors":
                _write_safetensors(f, entries, reader, meta)
            else:
                _write_torch(f, entries, reader)
        size = os.path.getsize(tmp)
        if local:
            os.replace(tmp, final)
        else:
            engine.submit_upload(tmp, dest_url).result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        engine.close()
        if chunks is not None:
            chunks.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    result = {
        "step_url": step_url, "step": marker.step, "dest": dest_url, "format": fmt,
        "dtype": str(out_dtype).removeprefix("torch.") if out_dtype else None,
        "tensors": len(entries), "bytes": size, "largest_tensor_bytes": max(e.nbytes for e in entries),
        "bytes_read": reader.bytes_read, "skipped": skipped,
    }
    log.info("exported %d tensors (%.1f MB) of %s to %s", len(entries), size / 1e6, step_url, dest_url)
    return result
