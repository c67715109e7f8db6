"""Train state, DCP byte items and DCP tensor items: ``torch.save`` archives read by
our own allowlist unpickler, never by pickle's or torch's.

Why not ``torch.load(weights_only=True)``: its allowlist admits ``bytearray(n)``,
``torch.Tensor(n)`` and ``UntypedStorage(n)`` (memory never written, or gigabytes
from a few bytes of pickle), it follows compressed zip records past their declared
size, and what it builds can be nested deep enough to overflow the C stack when it is
later hashed or compared. Admitting numpy's arrays to it (for numpy's RNG state)
let a pickle hand ``ndarray.__setstate__`` an object array with fewer items than its
shape (a SIGSEGV).

What this module builds, and nothing else:

- plain data (``plainpickle``): ``None``, bools, ints, floats, complex, strings,
  bytes, ``bytearray`` *of given bytes*, lists, tuples, dicts, sets, frozensets,
  ``OrderedDict``, ``Counter``, ``torch.Size``, ``torch.device``, dtypes, ``io.BytesIO``
  of given bytes;
- tensors and parameters (``torch._utils._rebuild_tensor_v2``/``_v3``,
  ``_rebuild_parameter``): each storage is a copy of its zip record, whose size
  must be exactly what the pickle declares; the dtype is one of ``_DTYPES``; sizes,
  strides and offset must fit inside the storage before any tensor is made (torch's
  ``set_`` would otherwise grow the storage with unwritten memory); views share
  their storage as they did when saved; bool storages hold only 0 and 1;
- numpy's legacy RNG state ``('MT19937', uint32[624], int, int, float)`` and only
  as that exact tuple: the array's state is checked to be one little-endian
  ``uint32`` vector of 624 elements and exactly 2,496 bytes, and the array is
  built by us from those bytes (``numpy.frombuffer``); numpy never sees the
  pickle's state.

The pickle is read by ``plainpickle.PlainUnpickler`` (iterative, bounded while it
parses: see there), extended here with tensors, their storages and numpy's RNG
state. Zip records are located by ``zipread`` (stored records only).

Every refusal is an UnsafeCheckpoint naming the URL and what was refused.
"""

from __future__ import annotations

import collections
import io
import sys
from typing import Any

import torch

from ..errors import UnsafeCheckpoint
from . import zipread
from .plainpickle import MAX_DEPTH, MAX_DIMS, SHORT, Global, PlainUnpickler, Private, Refused, plain_globals

__all__ = ["MAX_DEPTH", "MAX_PICKLE_BYTES", "load"]

MAX_PICKLE_BYTES = 256 << 20  # the archive's data.pkl record

_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}
_V3_DTYPES = frozenset(getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
                       if hasattr(torch, n))
_DTYPES = frozenset(_LEGACY_STORAGES.values()) | _V3_DTYPES
_RNG_STATE_BYTES = 624 * 4
_DTYPE_STATE = (3, "<", None, None, None, -1, -1, 0)  # numpy's pickled state of dtype('<u4')


class _StorageType(Private):
    __slots__ = ("dtype",)  # None: torch.UntypedStorage (bytes; the tensor's dtype comes with it)

    def __init__(self, dtype):
        self.dtype = dtype


class _Storage(Private):
    __slots__ = ("untyped", "dtype", "typed", "nbytes", "bool_checked")

    def __init__(self, untyped, dtype, typed: bool, nbytes: int):
        self.untyped, self.dtype, self.typed, self.nbytes, self.bool_checked = untyped, dtype, typed, nbytes, False


class _PendingDtype(Private):
    __slots__ = ("built",)

    def __init__(self):
        self.built = False


class _PendingArray(Private):
    __slots__ = ("array",)

    def __init__(self):
        self.array = None


_NP_NDARRAY = Global("np_ndarray")


def _globals() -> dict[tuple[str, str], Any]:
    g = plain_globals()
    for fn, name in (("_rebuild_tensor_v2", "tensor_v2"), ("_rebuild_tensor_v3", "tensor_v3"),
                     ("_rebuild_parameter", "parameter"), ("_rebuild_parameter_with_state", "parameter_with_state")):
        g[("torch._utils", fn)] = Global(name)
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        g[(mod, "_reconstruct")] = Global("np_reconstruct")
    g[("numpy", "ndarray")] = _NP_NDARRAY
    g[("numpy", "dtype")] = Global("np_dtype")
    for name, dtype in _LEGACY_STORAGES.items():
        g[("torch", name)] = _StorageType(dtype)
    g[("torch", "UntypedStorage")] = g[("torch.storage", "UntypedStorage")] = _StorageType(None)
    return g


class _Unpickler(PlainUnpickler):
    """Plain data, tensors from the archive's storage records, numpy's RNG state."""

    GLOBALS = _globals()
    dispatch = dict(PlainUnpickler.dispatch)

    def __init__(self, data: memoryview, storage_of, max_nodes: int, view_bytes: int):
        super().__init__(data, max_nodes)
        self.storage_of = storage_of
        self.view_bytes = view_bytes

    def op_binpersid(self):
        pid = self.stack.pop()
        if not (type(pid) is tuple and len(pid) == 5 and type(pid[0]) is str and pid[0] == "storage"
                and type(pid[1]) is _StorageType and type(pid[2]) is str and type(pid[3]) is str
                and type(pid[4]) is int and len(pid[2]) <= SHORT and len(pid[3]) <= SHORT):
            raise Refused("a persistent id other than a tensor storage")
        self.stack.append(self.storage_of(pid[1], pid[2], pid[4]))

    def _build(self, inst: Any, state: Any) -> None:
        t = type(inst)
        if t is _PendingDtype and not inst.built:
            if not (type(state) is tuple and len(state) == len(_DTYPE_STATE)
                    and all(type(a) is type(b) and a == b for a, b in zip(state, _DTYPE_STATE, strict=True))):
                raise Refused("a numpy dtype other than little-endian uint32")
            inst.built = True
        elif t is _PendingArray and inst.array is None:
            inst.array = self._rng_keys(state)
        else:
            raise Refused(f"BUILD on a {t.__name__} (only on an OrderedDict and numpy's RNG state)")

    def _special_tuple(self, items: list):
        if len(items) == 5 and any(type(x) is _PendingArray for x in items):
            return self._rng_state(items)
        return None

    def r_tensor_v2(self, args):
        if not 6 <= len(args) <= 7 or type(args[0]) is not _Storage or not args[0].typed:
            raise Refused("_rebuild_tensor_v2 without a typed storage")
        return self._tensor(args[0], args[0].dtype, *args[1:6], args[6] if len(args) == 7 else None)

    def r_tensor_v3(self, args):
        if not 7 <= len(args) <= 8 or type(args[0]) is not _Storage or args[0].typed:
            raise Refused("_rebuild_tensor_v3 without an untyped storage")
        if type(args[6]) is not torch.dtype:
            raise Refused("_rebuild_tensor_v3 without a dtype")
        return self._tensor(args[0], args[6], *args[1:6], args[7] if len(args) == 8 else None)

    def _tensor(self, st: _Storage, dtype, offset, size, stride, requires_grad, hooks, metadata) -> torch.Tensor:
        if dtype not in _DTYPES:
            raise Refused(f"a tensor of dtype {dtype} (plain numeric dtypes only)")
        if type(requires_grad) is not bool:
            raise Refused("a tensor whose requires_grad is not a bool")
        if type(hooks) not in (dict, collections.OrderedDict) or hooks:
            raise Refused("a tensor with backward hooks")
        if metadata is not None and not (type(metadata) is dict and set(metadata) <= {"conj", "neg"}
                                         and all(type(v) is bool for v in metadata.values())):
            raise Refused("a tensor with metadata other than its conj and neg bits")
        if metadata and metadata.get("neg"):
            raise Refused("a tensor with its negative bit set")
        if not (type(offset) is int and type(size) is tuple and type(stride) is tuple and len(size) == len(stride)
                and len(size) <= MAX_DIMS and offset >= 0
                and all(type(d) is int and d >= 0 for d in size) and all(type(s) is int and s >= 0 for s in stride)):
            raise Refused(f"a tensor whose offset, sizes or strides are not {MAX_DIMS} or fewer non-negative integers")
        itemsize = dtype.itemsize
        elements = st.nbytes // itemsize
        numel = 1
        for d in size:
            numel *= d
        if numel == 0:
            fits = offset <= elements
        else:
            fits = numel <= elements and offset + sum((d - 1) * s for d, s in zip(size, stride, strict=True)) < elements
        if not fits:
            raise Refused(f"a tensor of {len(size)} dimensions that does not fit in its storage of {st.nbytes} bytes "
                           "(only the bytes present in the archive are loaded)")
        self.view_bytes -= numel * itemsize
        if self.view_bytes < 0:
            raise Refused("tensors that present far more bytes than the archive stores")
        meta = st.untyped.device.type == "meta"
        if dtype is torch.bool and not st.bool_checked and not meta:
            u8 = torch.empty(0, dtype=torch.uint8).set_(st.untyped, 0, (st.nbytes,), (1,))
            if st.nbytes and int(u8.max()) > 1:
                raise Refused("a bool tensor holding values other than 0 and 1")
            st.bool_checked = True
        t = torch.empty(0, dtype=dtype, device=st.untyped.device).set_(st.untyped, offset, size, stride)
        if metadata and metadata.get("conj"):
            t = t.conj()
        if requires_grad:
            if not (dtype.is_floating_point or dtype.is_complex):
                raise Refused("an integer tensor that requires grad")
            t.requires_grad_(True)
        return t

    def r_parameter(self, args):
        if not (len(args) == 3 and type(args[0]) is torch.Tensor and type(args[1]) is bool):
            raise Refused("_rebuild_parameter of something other than a tensor")
        if type(args[2]) not in (dict, collections.OrderedDict) or args[2]:
            raise Refused("a parameter with backward hooks")
        if args[1] and not (args[0].dtype.is_floating_point or args[0].dtype.is_complex):
            raise Refused("an integer parameter that requires grad")
        return torch.nn.Parameter(args[0], args[1])

    def r_parameter_with_state(self, args):
        if len(args) != 4 or not (args[3] is None or (type(args[3]) is dict and not args[3])):
            raise Refused("a parameter with Python attributes")
        return self.r_parameter(args[:3])

    def r_np_reconstruct(self, args):
        if not (len(args) == 3 and args[0] is _NP_NDARRAY and type(args[1]) is tuple and args[1] == (0,)
                and type(args[1][0]) is int and type(args[2]) in (bytes, str) and args[2] in (b"b", "b")):
            raise Refused("a numpy array other than numpy's RNG state")
        return _PendingArray()

    def r_np_dtype(self, args):
        if not (len(args) == 3 and type(args[0]) is str and args[0] == "u4" and args[1] is False and args[2] is True):
            raise Refused("a numpy dtype other than uint32")
        return _PendingDtype()

    def r_np_ndarray(self, args):
        raise Refused("numpy.ndarray() called")

    def _rng_keys(self, state):
        """The array of numpy's RNG state from its pickled state, checked before numpy sees it."""
        if not (type(state) is tuple and len(state) == 5 and type(state[0]) is int and state[0] == 1
                and type(state[1]) is tuple and len(state[1]) == 1 and type(state[1][0]) is int
                and state[1][0] == 624 and type(state[2]) is _PendingDtype and state[2].built
                and state[3] is False and type(state[4]) is bytes and len(state[4]) == _RNG_STATE_BYTES):
            raise Refused("a numpy array other than the 624 uint32 keys of numpy's RNG state")
        try:
            import numpy as np
        except ImportError:
            raise Refused("numpy's RNG state, and numpy is not installed") from None
        return np.frombuffer(state[4], dtype="<u4").copy()

    def _rng_state(self, items: list) -> tuple:
        kind, keys, pos, has_gauss, gauss = items
        if not (type(kind) is str and kind == "MT19937" and type(keys) is _PendingArray and keys.array is not None
                and type(pos) is int and 0 <= pos <= 624 and type(has_gauss) is int and has_gauss in (0, 1)
                and type(gauss) is float):
            raise Refused("a numpy array outside numpy's RNG state ('MT19937', uint32[624], int, int, float)")
        return self._track((kind, keys.array, pos, has_gauss, gauss), 1, 6)


_Unpickler.dispatch[ord(b"Q")] = _Unpickler.op_binpersid  # BINPERSID


# ---------------------------------------------------------------- the archive
def _buffer(data: Any) -> memoryview:
    if isinstance(data, (bytes, bytearray)):
        return memoryview(data)
    if isinstance(data, memoryview):
        return data if data.format == "B" and data.ndim == 1 else data.cast("B")
    if isinstance(data, io.BytesIO):
        return data.getbuffer()
    return memoryview(data.read())


def load(data: Any, *, url: str, what: str, meta: bool = False) -> Any:
    """The object of the ``torch.save`` archive ``data`` (bytes, a memoryview or a
    binary file), built on the CPU from what it stores (``meta``: tensors on the meta
    device, their storages' bytes not read). Raises UnsafeCheckpoint naming ``url`` and
    ``what`` (e.g. "train state", "value of 'extra.n'", "tensor 'w'")."""
    from ..collector import collector_paused

    try:
        with collector_paused():  # millions of containers would make each collection walk them all
            return _load(_buffer(data), meta)
    except Refused as e:
        why = str(e)
    except UnsafeCheckpoint:
        raise
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed pickle: stack underflow, a missing memo entry, ...
        why = f"it is malformed ({type(e).__name__})"
    raise UnsafeCheckpoint(f"{url}: refused to load the {what}: {why}. Only plain data is loaded (the weights_only "
                           "rules of torch.load, tightened: see docs/security.md); nothing of it was run") from None


def _load(mv: memoryview, meta: bool) -> Any:
    try:
        recs = zipread.records(mv)
    except zipread.BadArchive as e:
        raise Refused(f"it is not a readable torch.save archive ({e})") from None
    prefixes = [n[:-len("/data.pkl")] for n in recs if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(prefixes) != 1:
        raise Refused("the archive has no single data.pkl record")
    prefix = prefixes[0]
    order = recs.get(f"{prefix}/byteorder")  # absent before torch 2.1: little-endian
    saved_order = bytes(mv[order[0]:order[0] + min(order[1], 8)]) if order is not None else b"little"
    if saved_order not in (b"little", b"big"):
        raise Refused("an unknown byte order")
    swap = saved_order != sys.byteorder.encode()
    start, size = recs[f"{prefix}/data.pkl"]
    if size > MAX_PICKLE_BYTES:
        raise Refused(f"its pickle holds {size} bytes, more than the {MAX_PICKLE_BYTES} plain data may")
    data_dir = f"{prefix}/data/"
    stored = sum(s for n, (_, s) in recs.items() if n.startswith(data_dir))
    storages: dict[str, _Storage] = {}

    def storage_of(stype: _StorageType, key: str, numel: int) -> _Storage:
        typed = stype.dtype is not None
        dtype = stype.dtype if typed else torch.uint8
        st = storages.get(key)
        if st is not None:
            if st.dtype is not dtype or st.typed != typed:
                raise Refused("one storage read as two types")
            return st
        rec = recs.get(data_dir + key)
        if rec is None:
            raise Refused("a tensor whose storage record is missing")
        r_start, r_size = rec
        if numel < 0 or numel * dtype.itemsize != r_size:
            raise Refused(f"a storage that declares another size than its record's {r_size} bytes")
        if meta:
            untyped = torch.UntypedStorage(r_size, device="meta")
        elif r_size:
            untyped = torch.UntypedStorage.from_buffer(mv[r_start:r_start + r_size], dtype=torch.uint8)
        else:
            untyped = torch.UntypedStorage(0)
        if swap and dtype.itemsize > 1 and not meta:
            untyped.byteswap(dtype)  # as torch.load does: each element of the storage's dtype
        st = storages[key] = _Storage(untyped, dtype, typed, r_size)
        return st

    up = _Unpickler(mv[start:start + size], storage_of, max_nodes=4 * size + 100_000,
                    view_bytes=4 * stored + (16 << 20))
    return up.load()
