"""Decode one DCP tensor item (a ``torch.save`` zip inside a shard file) into its
target tensor.

Direct path: ``untrusted.load_tensor(map_location="meta")`` gives the stored tensor's dtype,
shape and strides without reading its data, the zip directory gives where the
storage's bytes start, and one single-threaded memcpy moves the bytes the target
needs from the fetched buffer into the target's memory. It is taken when the
stored view and the target are contiguous, have the same dtype and shape, the
target is a plain CPU tensor, the storage record is uncompressed and in this
machine's byte order. Anything else takes the general path: ``untrusted.load_tensor``
the tensor, narrow it, ``target.copy_``.

An item is a checkpoint's bytes: before either path uses what it decoded,
``check_item_tensor`` requires a dense CPU tensor (not on the meta device, whose
data pointer is 0; not sparse, quantized or nested) whose dimensions hold the part
the plan reads. Anything else is a CorruptCheckpoint naming the item.

Why: the general path copies every byte twice (into the loaded storage, then
into the target) and ``copy_`` runs on torch's OpenMP pool, whose threads
spin-wait after each copy. On a loaded machine (ranks, download threads and the
store sharing the cores) that spinning cost ~14 % of all CPU in a 2-rank load;
the direct path cut the load's client CPU by ~1/3 (bench/NOTES.md).
"""

from __future__ import annotations

import ctypes
import io
import struct
import sys
import zipfile

import torch

from .._torch_compat import narrow_tensor_by_index
from ..errors import CloudCkptError, CorruptCheckpoint
from ..untrusted.plain import load_tensor

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header (30 bytes)
_PLAIN = (torch.Tensor, torch.nn.Parameter)

_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PyBUF_WRITE = 0x200


class BufferReader(io.RawIOBase):
    """A read-only file over a memoryview for ``torch.load``: its zip reader asks
    for ``readinto``, which copies each record once, straight into the tensor's
    storage (``io.BytesIO(memoryview)`` would copy the whole item first)."""

    def __init__(self, data: memoryview):
        super().__init__()
        self._mv = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:
        chunk = self._mv[self._pos: self._pos + len(b)]
        n = len(chunk)
        memoryview(b).cast("B")[:n] = chunk
        self._pos += n
        return n


def load_tensor_into(data: memoryview, storage_offsets, lengths, target: torch.Tensor, *, url: str, fqn: str) -> bool:
    """Copy the part ``(storage_offsets, lengths)`` of the tensor stored in ``data``
    into ``target`` (same shape). Returns True if the direct path was taken."""
    if _direct(data, storage_offsets, lengths, target):
        return True
    tensor = decode_item_tensor(data, url=url, fqn=fqn)
    if not _holds(tensor, storage_offsets, lengths):
        raise CorruptCheckpoint(f"{url}: the item of {fqn} holds a tensor of shape {tuple(tensor.shape)}, which does "
                                f"not hold the part at offsets {list(storage_offsets)} of sizes {list(lengths)}")
    tensor = narrow_tensor_by_index(tensor, storage_offsets, lengths)
    if target.size() != tensor.size():
        raise CorruptCheckpoint(f"{url}: {fqn} has shape {tuple(tensor.size())}, expected {tuple(target.size())}")
    target.copy_(tensor)
    return False


def decode_item_tensor(data, *, url: str, fqn: str) -> torch.Tensor:
    """The tensor of one DCP item (``torch.save`` bytes), checked by ``check_item_tensor``."""
    try:
        tensor = load_tensor(BufferReader(data if isinstance(data, memoryview) else memoryview(data)), url=url, fqn=fqn)
    except CloudCkptError:
        raise
    except Exception as e:  # noqa: BLE001 - the item's bytes are the checkpoint's: any failure is a bad item
        raise CorruptCheckpoint(f"{url}: the item of {fqn} cannot be decoded ({type(e).__name__}); "
                                "the checkpoint is damaged or was not written by DCP") from None
    return check_item_tensor(tensor, url=url, fqn=fqn)


def check_item_tensor(tensor, *, url: str, fqn: str) -> torch.Tensor:
    """``tensor`` if it is a dense tensor in CPU memory (what DCP writes); else
    CorruptCheckpoint. A meta tensor has no data (its pointer is 0), a sparse,
    quantized or nested one is not a block of elements that can be copied or written."""
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpoint(f"{url}: the item of {fqn} holds a {type(tensor).__name__}, not a tensor")
    if type(tensor) not in _PLAIN or tensor.device.type != "cpu" or tensor.layout != torch.strided \
            or tensor.is_quantized or tensor.is_nested:
        raise CorruptCheckpoint(f"{url}: the item of {fqn} holds a {tensor.layout} tensor on the "
                                f"{tensor.device.type} device; DCP items are dense CPU tensors: the checkpoint "
                                "was tampered with")
    return tensor


def _holds(tensor: torch.Tensor, storage_offsets, lengths) -> bool:
    """Whether ``tensor`` has the dimensions and extent for the part to be narrowed."""
    shape = tensor.shape
    return len(shape) == len(lengths) == len(storage_offsets) and all(
        0 <= o and o + n <= s for o, n, s in zip(storage_offsets, lengths, shape, strict=False))


def _direct(data: memoryview, storage_offsets, lengths, target: torch.Tensor) -> bool:
    if type(target) not in _PLAIN or target.device.type != "cpu" or not target.is_contiguous():
        return False
    located = _storage_record(data)
    if located is None:
        return False
    start, size = located
    try:
        # the allowlist parser, reading none of the storage bytes (torch.load would follow a
        # compressed pickle record or build bytearray(n) before any check)
        meta = load_tensor(data, url="item", fqn="", map_location="meta")
    except Exception:  # noqa: BLE001 - not a plain tensor item: the general path reports what it is
        return False
    if type(meta) is not torch.Tensor or meta.layout != torch.strided or meta.is_quantized \
            or meta.untyped_storage().nbytes() != size or not _holds(meta, storage_offsets, lengths):
        return False  # the general path checks and reports it
    view = narrow_tensor_by_index(meta, storage_offsets, lengths)
    if view.dtype != target.dtype or view.size() != target.size() or not view.is_contiguous():
        return False
    n = view.numel() * view.element_size()
    first = start + view.storage_offset() * view.element_size()
    if view.storage_offset() < 0 or first + n > start + size:
        return False
    if n:
        _from_memory(target.data_ptr(), n, _PyBUF_WRITE)[:] = data[first: first + n]
    torch.autograd.graph.increment_version(target)  # as copy_ would: autograd sees the change
    return True


def _storage_record(data: memoryview) -> tuple[int, int] | None:
    """(offset in ``data``, size) of the item's one storage record, if it is stored
    uncompressed in this machine's byte order; else None."""
    try:
        zf = zipfile.ZipFile(BufferReader(data))
        infos = zf.infolist()
        stored = [i for i in infos if "/data/" in i.filename and "/.data/" not in i.filename]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        # torch.save has written the byte order since 2.1; older files are little-endian
        saved_order = zf.read(order[0]).decode() if order else "little"
    except Exception:  # noqa: BLE001 - a probe: anything unexpected takes the general path, which reports it
        return None
    if len(stored) != 1 or saved_order != sys.byteorder or stored[0].compress_type != zipfile.ZIP_STORED:
        return None
    info = stored[0]
    h = info.header_offset
    if h + _LOCAL_HEADER.size > len(data):
        return None
    sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack(data[h: h + _LOCAL_HEADER.size])
    if sig != b"PK\x03\x04":
        return None
    start = h + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > len(data):
        return None
    return start, info.file_size
