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

- plain data: ``None``, bools, ints (at most 1 KiB of digits), floats, complex,
  strings, bytes, ``bytearray`` *of given bytes*, lists, tuples, dicts, sets,
  frozensets, ``OrderedDict`` (with string attributes, e.g. ``_metadata``),
  ``Counter``, ``torch.Size``, ``torch.device`` and torch's dtypes, layouts and
  memory formats;
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

Bounds hold while parsing, not after: the pickle is read iteratively (an explicit
stack; nothing recurses on the C stack), every container records its depth and
its size as a tree when it is built, a container cannot change after it was placed
in another (so depths and sizes stay true and there are no cycles), dict keys and
set items are only atoms and tuples of them (hashing is bounded by the depth
limit), and each opcode and copied element spends from a budget. Zip records are
located by ``zipread`` (stored records only).

Every refusal is an UnsafeCheckpoint naming the URL and what was refused.
"""

from __future__ import annotations

import collections
import functools
import io
import pickletools
import struct
import sys
from typing import Any

import torch

from ..errors import UnsafeCheckpoint
from . import zipread

MAX_DEPTH = 100  # nesting of containers (honest train states: about 10)
MAX_CELLS = 16_000_000  # ~16 bytes of memory each: 2 per opcode, 16 per container, 1 per list element, 3 per
#                         dict or set entry, 1 per 4 bytes of text (see _Unpickler: the memory it holds is bounded)
MAX_TUPLE_KEYS = 1_000  # tuples used as dict keys or set items: flat, short, few (their hashes can be made
MAX_TUPLE_KEY_LEN = 16  # to collide, and each collision compares them element by element)
_SMALL_INT = 1 << 61  # ints used as keys stay below this (their hash is themselves: no collisions)
MAX_PICKLE_BYTES = 256 << 20  # the archive's data.pkl record
MAX_DIMS = 64
MAX_INT_BYTES = 1024
_SHORT = 256  # longest storage key, device string, global name

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


class _Refused(Exception):
    """The pickle asks for something outside what plain data needs."""


class _Private:
    """Objects of the unpickler that never leave it."""

    __slots__ = ()


class _Global(_Private):
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _StorageType(_Private):
    __slots__ = ("dtype",)  # None: torch.UntypedStorage (bytes; the tensor's dtype comes with it)

    def __init__(self, dtype):
        self.dtype = dtype


class _Storage(_Private):
    __slots__ = ("untyped", "dtype", "typed", "nbytes", "bool_checked")

    def __init__(self, untyped, dtype, typed: bool, nbytes: int):
        self.untyped, self.dtype, self.typed, self.nbytes, self.bool_checked = untyped, dtype, typed, nbytes, False


class _PendingDtype(_Private):
    __slots__ = ("built",)

    def __init__(self):
        self.built = False


class _PendingArray(_Private):
    __slots__ = ("array",)

    def __init__(self):
        self.array = None


_NAMES = ("set", "frozenset", "bytes", "bytearray", "complex", "encode", "OrderedDict", "Counter", "Size", "device",
          "tensor_v2", "tensor_v3", "parameter", "parameter_with_state", "np_reconstruct", "np_ndarray", "np_dtype")
_G = {n: _Global(n) for n in _NAMES}


def _globals() -> dict[tuple[str, str], Any]:
    g: dict[tuple[str, str], Any] = {}
    for mod in ("builtins", "__builtin__"):  # protocol 2 writes Python 2's module name
        for n in ("set", "frozenset", "bytes", "bytearray", "complex"):
            g[(mod, n)] = _G[n]
    g[("_codecs", "encode")] = _G["encode"]
    g[("collections", "OrderedDict")] = _G["OrderedDict"]
    g[("collections", "Counter")] = _G["Counter"]
    g[("torch", "Size")] = _G["Size"]
    g[("torch", "device")] = _G["device"]
    g[("torch._utils", "_rebuild_tensor_v2")] = _G["tensor_v2"]
    g[("torch._utils", "_rebuild_tensor_v3")] = _G["tensor_v3"]
    g[("torch._utils", "_rebuild_parameter")] = _G["parameter"]
    g[("torch._utils", "_rebuild_parameter_with_state")] = _G["parameter_with_state"]
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        g[(mod, "_reconstruct")] = _G["np_reconstruct"]
    g[("numpy", "ndarray")] = _G["np_ndarray"]
    g[("numpy", "dtype")] = _G["np_dtype"]
    for name, dtype in _LEGACY_STORAGES.items():
        g[("torch", name)] = _StorageType(dtype)
    g[("torch", "UntypedStorage")] = g[("torch.storage", "UntypedStorage")] = _StorageType(None)
    for name in dir(torch):
        v = getattr(torch, name, None)
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            g[("torch", name)] = v
    return g


_GLOBALS = _globals()
_KEYABLE = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.layout, torch.memory_format,
                      torch.device})
# [depth, tree size, sealed, private (never leaves the unpickler), usable as a dict key]
_ATOM = (0, 1, True, False, True)
_LEAF = (0, 1, True, False, False)  # tensors, bytearrays, numpy's RNG keys: not keys
_PRIVATE = (0, 1, True, True, False)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _op_name(op: int) -> str:
    info = pickletools.code2op.get(chr(op))
    return info.name if info else f"0x{op:02x}"


class _Unpickler:
    def __init__(self, data: memoryview, storage_of, max_nodes: int, view_bytes: int):
        self.data, self.pos = data, 0
        self.stack: list = []
        self.metastack: list = []
        self.memo: dict = {}
        self.info: dict[int, list] = {id(()): [1, 1, True, False, True, ()]}
        self.cells = MAX_CELLS
        self.tuple_keys = MAX_TUPLE_KEYS
        self.storage_of = storage_of
        self.max_nodes = max_nodes
        self.view_bytes = view_bytes

    # ------------------------------------------------------------ reading
    def _take(self, n: int) -> memoryview:
        p = self.pos
        if p + n > len(self.data):
            raise _Refused("it ends in the middle of a value (truncated)")
        self.pos = p + n
        return self.data[p:p + n]

    def _unpack(self, fmt: struct.Struct):
        return fmt.unpack(self._take(fmt.size))[0]

    def load(self) -> Any:
        data, dispatch = self.data, self.dispatch
        n = len(data)
        while True:
            if self.pos >= n:
                raise _Refused("it ends before its STOP opcode (truncated)")
            op = data[self.pos]
            self.pos += 1
            if op == 0x2E:  # STOP
                return self._result(self.stack.pop())
            f = dispatch.get(op)
            if f is None:
                raise _Refused(f"it uses the pickle opcode {_op_name(op)}, which plain data never needs")
            f(self)
            self.cells -= 2
            if self.cells < 0:
                raise _Refused(f"it holds more than {MAX_CELLS} values")

    # ------------------------------------------------------------ bookkeeping
    def _meta(self, x: Any, seal: bool = True):
        i = self.info.get(id(x))
        if i is not None:
            if seal:
                i[2] = True
            return i
        if isinstance(x, _Private):
            return _PRIVATE
        if type(x) is int:
            return _ATOM if -_SMALL_INT < x < _SMALL_INT else _LEAF
        return _ATOM if type(x) in _KEYABLE else _LEAF

    def _track(self, obj: Any, depth: int, size: int, private: bool = False, key: bool = False) -> Any:
        if depth > MAX_DEPTH:
            raise _Refused(f"it is nested more than {MAX_DEPTH} deep")
        if size > self.max_nodes:
            raise _Refused("it holds more values than its size allows (objects shared between many places)")
        self.info[id(obj)] = [depth, size, False, private, key, obj]
        self.cells -= 16
        return obj

    def _fill(self, target: Any, items, types: tuple, op: str, keys=()) -> list:
        """Account for ``items`` (and ``keys``) placed into the mutable ``target``."""
        ti = self.info.get(id(target))
        if ti is None or type(target) not in types:
            raise _Refused(f"{op} on a {type(target).__name__} (only on plain lists, dicts and sets)")
        if ti[2]:
            raise _Refused(f"{op} changes a container after it was placed in another (cycles and shared "
                           "containers changed later are not plain data)")
        self._check_keys(keys)
        depth, size = ti[0], ti[1]
        get = self.info.get
        for x in items:
            ci = get(id(x))
            if ci is None:  # an atom or a leaf (inlined _meta: this loop sees every element)
                if isinstance(x, _Private):
                    raise _Refused(f"an internal object placed in a {type(target).__name__}")
                size += 1
                continue
            if x is target:
                raise _Refused("a container that holds itself (a cycle)")
            if ci[3]:
                raise _Refused(f"an internal object placed in a {type(target).__name__}")
            ci[2] = True
            if ci[0] >= depth:
                depth = ci[0] + 1
            size += ci[1]
        if depth > MAX_DEPTH:
            raise _Refused(f"it is nested more than {MAX_DEPTH} deep")
        if size > self.max_nodes:
            raise _Refused("it holds more values than its size allows (objects shared between many places)")
        ti[0], ti[1] = depth, size
        return ti

    def _check_keys(self, keys) -> None:
        for k in keys:
            i = self._meta(k, seal=False)
            if not i[4]:
                raise _Refused(f"a dict key or set item of type {type(k).__name__} (only strings, bytes, "
                               "floats, ints below 2**61 and short flat tuples of them)")
            if i[0]:
                if i[0] > 1 or i[1] > MAX_TUPLE_KEY_LEN + 1:
                    raise _Refused(f"a dict key or set item that is a nested tuple or one of more than "
                                   f"{MAX_TUPLE_KEY_LEN} items")
                self.tuple_keys -= 1
                if self.tuple_keys < 0:
                    raise _Refused(f"more than {MAX_TUPLE_KEYS} tuples used as dict keys or set items")

    def _measure(self, items) -> tuple[int, int, bool, bool]:
        """(depth, tree size, private, usable as a key) of a new immutable container of
        ``items``, checked against the limits before it is built (building a frozenset
        hashes its items)."""
        depth, size, private, key = 1, 1, False, True
        get = self.info.get
        for x in items:
            ci = get(id(x))
            if ci is None:  # an atom or a leaf (inlined _meta: this loop sees every element)
                size += 1
                t = type(x)
                if t is int:
                    if not -_SMALL_INT < x < _SMALL_INT:
                        key = False
                elif t not in _KEYABLE:
                    key = False
                    private = private or isinstance(x, _Private)
                continue
            ci[2] = True
            if ci[0] >= depth:
                depth = ci[0] + 1
            size += ci[1]
            private = private or ci[3]
            key = key and ci[4]
        if depth > MAX_DEPTH:
            raise _Refused(f"it is nested more than {MAX_DEPTH} deep")
        if size > self.max_nodes:
            raise _Refused("it holds more values than its size allows (objects shared between many places)")
        return depth, size, private, key

    def _immutable(self, make, items) -> Any:
        depth, size, private, key = self._measure(items)
        self.cells -= len(items) * (3 if make is frozenset else 1)
        if self.cells < 0:
            raise _Refused(f"it holds more than {MAX_CELLS} values")
        obj = make(items)
        if obj == () and type(obj) is tuple:
            return obj
        return self._track(obj, depth, size, private, key)

    def _result(self, obj: Any) -> Any:
        if self._meta(obj)[3]:
            raise _Refused("its result is an internal object of the unpickler")
        return obj

    def _pop_mark(self) -> list:
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    # ------------------------------------------------------------ opcodes
    def op_mark(self):
        self.cells -= 4
        self.metastack.append(self.stack)
        self.stack = []

    def op_pop(self):
        if self.stack:
            self.stack.pop()
        else:
            self._pop_mark()

    def op_pop_mark(self):
        self._pop_mark()

    def op_dup(self):
        self.stack.append(self.stack[-1])

    def op_proto(self):
        if self._take(1)[0] > 5:
            raise _Refused("an unknown pickle protocol")

    def op_frame(self):
        self._take(8)

    def op_none(self):
        self.stack.append(None)

    def op_true(self):
        self.stack.append(True)

    def op_false(self):
        self.stack.append(False)

    def op_binint(self):
        self.stack.append(self._unpack(_I4))

    def op_binint1(self):
        self.stack.append(self._take(1)[0])

    def op_binint2(self):
        self.stack.append(self._unpack(_U2))

    def op_long1(self):
        self.stack.append(int.from_bytes(self._take(self._take(1)[0]), "little", signed=True))

    def op_long4(self):
        n = self._unpack(_I4)
        if not 0 <= n <= MAX_INT_BYTES:
            raise _Refused(f"an integer longer than {MAX_INT_BYTES} bytes")
        self.stack.append(int.from_bytes(self._take(n), "little", signed=True))

    def op_binfloat(self):
        self.stack.append(self._unpack(_F8))

    def _sized(self, width: int, make) -> None:
        """A string, bytes or bytearray of ``width``-byte length: read only from the bytes given."""
        n = self._take(1)[0] if width == 1 else self._unpack(_U4 if width == 4 else _U8)
        self.cells -= n >> (2 if make is _utf8 else 4)  # text may take 4 bytes of memory per byte
        self.stack.append(make(self._take(n)))

    def op_empty_tuple(self):
        self.stack.append(())

    def _tuple(self, items: list):
        if len(items) == 5 and any(type(x) is _PendingArray for x in items):
            return self._rng_state(items)
        return self._immutable(tuple, items)

    def op_tuple(self):
        t = self._tuple(self._pop_mark())
        self.stack.append(t)

    def _tuple_n(self, n: int):
        if len(self.stack) < n:
            raise _Refused(f"TUPLE{n} with fewer than {n} values on the stack")
        self.stack[-n:] = [self._tuple(self.stack[-n:])]

    def op_tuple1(self):
        self._tuple_n(1)

    def op_tuple2(self):
        self._tuple_n(2)

    def op_tuple3(self):
        self._tuple_n(3)

    def op_empty_list(self):
        self.stack.append(self._track([], 1, 1))

    def op_empty_dict(self):
        self.stack.append(self._track({}, 1, 1))

    def op_empty_set(self):
        self.stack.append(self._track(set(), 1, 1))

    def op_list(self):
        items = self._pop_mark()
        lst = self._track([], 1, 1)
        self._fill(lst, items, (list,), "LIST")
        lst.extend(items)
        self.cells -= len(items)
        self.stack.append(lst)

    def op_dict(self):
        items = self._pop_mark()
        d = self._track({}, 1, 1)
        self.stack.append(d)
        self._setitems(d, items, "DICT")

    def op_append(self):
        x = self.stack.pop()
        target = self.stack[-1]
        self._fill(target, (x,), (list,), "APPEND")
        target.append(x)

    def op_appends(self):
        items = self._pop_mark()
        target = self.stack[-1]
        self._fill(target, items, (list,), "APPENDS")
        target.extend(items)
        self.cells -= len(items)

    _DICTS = (dict, collections.OrderedDict, collections.Counter)

    def _setitems(self, target, items: list, op: str):
        if len(items) % 2:
            raise _Refused(f"{op} with an odd number of items")
        keys = items[0::2]
        self._fill(target, items, self._DICTS, op, keys=keys)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]
        self.cells -= 2 * len(items)

    def op_setitem(self):
        v = self.stack.pop()
        k = self.stack.pop()
        self._setitems(self.stack[-1], [k, v], "SETITEM")

    def op_setitems(self):
        items = self._pop_mark()
        self._setitems(self.stack[-1], items, "SETITEMS")

    def op_additems(self):
        items = self._pop_mark()
        target = self.stack[-1]
        self._fill(target, items, (set,), "ADDITEMS", keys=items)
        self.cells -= 3 * len(items)
        target.update(items)

    def op_frozenset(self):
        items = self._pop_mark()
        self.stack.append(self._frozenset(items))

    def _frozenset(self, items: list) -> frozenset:
        self._check_keys(items)
        return self._immutable(frozenset, items)

    def op_binget(self):
        self.stack.append(self.memo[self._take(1)[0]])

    def op_long_binget(self):
        self.stack.append(self.memo[self._unpack(_U4)])

    def op_binput(self):
        self.memo[self._take(1)[0]] = self.stack[-1]

    def op_long_binput(self):
        self.cells -= 4
        self.memo[self._unpack(_U4)] = self.stack[-1]

    def op_memoize(self):
        self.cells -= 4
        self.memo[len(self.memo)] = self.stack[-1]

    def op_global(self):
        end = bytes(self.data[self.pos:self.pos + 2 * _SHORT]).find(b"\n")
        module = str(self._take(end + 1)[:-1], "utf-8") if end >= 0 else None
        end = bytes(self.data[self.pos:self.pos + 2 * _SHORT]).find(b"\n")
        name = str(self._take(end + 1)[:-1], "utf-8") if end >= 0 and module is not None else None
        if module is None or name is None:
            raise _Refused("a GLOBAL opcode without its name")
        self._push_global(module, name)

    def op_stack_global(self):
        name = self.stack.pop()
        module = self.stack.pop()
        if type(module) is not str or type(name) is not str:
            raise _Refused("STACK_GLOBAL of something other than two strings")
        self._push_global(module, name)

    def _push_global(self, module: str, name: str):
        v = _GLOBALS.get((module, name))
        if v is None:
            shown = f"{module[:_SHORT]}.{name[:_SHORT]}"
            raise _Refused(f"global {shown!r} is not in the allowlist of plain data")
        self.stack.append(v)

    def op_binpersid(self):
        pid = self.stack.pop()
        if not (type(pid) is tuple and len(pid) == 5 and type(pid[0]) is str and pid[0] == "storage"
                and type(pid[1]) is _StorageType and type(pid[2]) is str and type(pid[3]) is str
                and type(pid[4]) is int and len(pid[2]) <= _SHORT and len(pid[3]) <= _SHORT):
            raise _Refused("a persistent id other than a tensor storage")
        self.stack.append(self.storage_of(pid[1], pid[2], pid[4]))

    def op_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if type(func) is not _Global:
            raise _Refused(f"calling a {type(func).__name__} (only the allowlisted constructors)")
        if type(args) is not tuple:
            raise _Refused("REDUCE arguments that are not a tuple")
        self._meta(args)
        self.stack[-1] = getattr(self, "r_" + func.name)(args)

    def op_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        t = type(inst)
        if t is collections.OrderedDict:
            if type(state) is not dict or not all(type(k) is str and not k.startswith("__") for k in state):
                raise _Refused("BUILD of an OrderedDict with a state other than a dict of attribute names")
            self._fill(inst, (state,), (collections.OrderedDict,), "BUILD")
            inst.__dict__.update(state)
        elif t is _PendingDtype and not inst.built:
            if not (type(state) is tuple and len(state) == len(_DTYPE_STATE)
                    and all(type(a) is type(b) and a == b for a, b in zip(state, _DTYPE_STATE))):
                raise _Refused("a numpy dtype other than little-endian uint32")
            inst.built = True
        elif t is _PendingArray and inst.array is None:
            inst.array = self._rng_keys(state)
        else:
            raise _Refused(f"BUILD on a {t.__name__} (only OrderedDict and numpy's RNG state)")

    # ------------------------------------------------------------ the allowlisted constructors
    def r_set(self, args):
        items = self._one_list(args, "set")
        s = self._track(set(), 1, 1)
        self._fill(s, items, (set,), "set()", keys=items)
        self.cells -= 3 * len(items)
        if self.cells < 0:
            raise _Refused(f"it holds more than {MAX_CELLS} values")
        s.update(items)
        return s

    def r_frozenset(self, args):
        return self._frozenset(self._one_list(args, "frozenset"))

    def _one_list(self, args, what: str) -> list:
        if args == ():
            return []
        if len(args) != 1 or type(args[0]) is not list:
            raise _Refused(f"{what}() of something other than a list")
        return args[0]

    def r_bytes(self, args):
        if args != ():
            raise _Refused("bytes() with arguments (only the empty bytes)")
        return b""

    def r_encode(self, args):
        if len(args) != 2 or type(args[0]) is not str or args[1] not in ("latin1", "latin-1") or type(args[1]) is not str:
            raise _Refused("_codecs.encode other than of a latin-1 string (protocol 2 bytes)")
        try:
            return args[0].encode("latin-1")
        except UnicodeEncodeError:
            raise _Refused("bytes that are not latin-1") from None

    def r_bytearray(self, args):
        if args == ():
            return bytearray()
        if len(args) == 1 and type(args[0]) is bytes:
            return bytearray(args[0])
        raise _Refused("bytearray() of something other than bytes (bytearray(n) would allocate from a number)")

    def r_complex(self, args):
        if len(args) != 2 or not all(type(a) is float for a in args):
            raise _Refused("complex() of something other than two floats")
        return complex(*args)

    def r_OrderedDict(self, args):
        if args != ():
            raise _Refused("OrderedDict() with arguments")
        return self._track(collections.OrderedDict(), 1, 1)

    def r_Counter(self, args):
        if args == ():
            return self._track(collections.Counter(), 1, 1)
        if len(args) != 1 or type(args[0]) is not dict:
            raise _Refused("Counter() of something other than a dict")
        di = self._meta(args[0])
        self.cells -= 3 * len(args[0])
        if self.cells < 0:
            raise _Refused(f"it holds more than {MAX_CELLS} values")
        return self._track(collections.Counter(args[0]), di[0], di[1])

    def r_Size(self, args):
        if not (len(args) == 1 and type(args[0]) is tuple and len(args[0]) <= MAX_DIMS
                and all(type(d) is int and -(1 << 63) <= d < (1 << 63) for d in args[0])):
            raise _Refused(f"torch.Size() of something other than at most {MAX_DIMS} 64-bit integers")
        dims = args[0]
        self.cells -= len(dims)
        return self._track(torch.Size(dims), 1, 1 + len(dims), False, all(-_SMALL_INT < d < _SMALL_INT for d in dims))

    def r_device(self, args):
        if not (1 <= len(args) <= 2 and type(args[0]) is str and len(args[0]) <= 64
                and (len(args) == 1 or (type(args[1]) is int and 0 <= args[1] < 1 << 16))):
            raise _Refused("torch.device() of something other than a short name and an index")
        try:
            return torch.device(*args)
        except (RuntimeError, ValueError, TypeError):
            raise _Refused("torch.device() of an unknown device") from None

    def r_tensor_v2(self, args):
        if not 6 <= len(args) <= 7 or type(args[0]) is not _Storage or not args[0].typed:
            raise _Refused("_rebuild_tensor_v2 without a typed storage")
        return self._tensor(args[0], args[0].dtype, *args[1:6], args[6] if len(args) == 7 else None)

    def r_tensor_v3(self, args):
        if not 7 <= len(args) <= 8 or type(args[0]) is not _Storage or args[0].typed:
            raise _Refused("_rebuild_tensor_v3 without an untyped storage")
        if type(args[6]) is not torch.dtype:
            raise _Refused("_rebuild_tensor_v3 without a dtype")
        return self._tensor(args[0], args[6], *args[1:6], args[7] if len(args) == 8 else None)

    def _tensor(self, st: _Storage, dtype, offset, size, stride, requires_grad, hooks, metadata) -> torch.Tensor:
        if dtype not in _DTYPES:
            raise _Refused(f"a tensor of dtype {dtype} (plain numeric dtypes only)")
        if type(requires_grad) is not bool:
            raise _Refused("a tensor whose requires_grad is not a bool")
        if type(hooks) not in (dict, collections.OrderedDict) or hooks:
            raise _Refused("a tensor with backward hooks")
        if metadata is not None and not (type(metadata) is dict and set(metadata) <= {"conj", "neg"}
                                         and all(type(v) is bool for v in metadata.values())):
            raise _Refused("a tensor with metadata other than its conj and neg bits")
        if metadata and metadata.get("neg"):
            raise _Refused("a tensor with its negative bit set")
        if not (type(offset) is int and type(size) is tuple and type(stride) is tuple and len(size) == len(stride)
                and len(size) <= MAX_DIMS and offset >= 0
                and all(type(d) is int and d >= 0 for d in size) and all(type(s) is int and s >= 0 for s in stride)):
            raise _Refused(f"a tensor whose offset, sizes or strides are not {MAX_DIMS} or fewer non-negative integers")
        itemsize = dtype.itemsize
        elements = st.nbytes // itemsize
        numel = 1
        for d in size:
            numel *= d
        if numel == 0:
            fits = offset <= elements
        else:
            fits = numel <= elements and offset + sum((d - 1) * s for d, s in zip(size, stride)) < elements
        if not fits:
            raise _Refused(f"a tensor of {len(size)} dimensions that does not fit in its storage of {st.nbytes} bytes "
                           "(only the bytes present in the archive are loaded)")
        self.view_bytes -= numel * itemsize
        if self.view_bytes < 0:
            raise _Refused("tensors that present far more bytes than the archive stores")
        meta = st.untyped.device.type == "meta"
        if dtype is torch.bool and not st.bool_checked and not meta:
            u8 = torch.empty(0, dtype=torch.uint8).set_(st.untyped, 0, (st.nbytes,), (1,))
            if st.nbytes and int(u8.max()) > 1:
                raise _Refused("a bool tensor holding values other than 0 and 1")
            st.bool_checked = True
        t = torch.empty(0, dtype=dtype, device=st.untyped.device).set_(st.untyped, offset, size, stride)
        if metadata and metadata.get("conj"):
            t = t.conj()
        if requires_grad:
            if not (dtype.is_floating_point or dtype.is_complex):
                raise _Refused("an integer tensor that requires grad")
            t.requires_grad_(True)
        return t

    def r_parameter(self, args):
        if not (len(args) == 3 and type(args[0]) is torch.Tensor and type(args[1]) is bool):
            raise _Refused("_rebuild_parameter of something other than a tensor")
        if type(args[2]) not in (dict, collections.OrderedDict) or args[2]:
            raise _Refused("a parameter with backward hooks")
        if args[1] and not (args[0].dtype.is_floating_point or args[0].dtype.is_complex):
            raise _Refused("an integer parameter that requires grad")
        return torch.nn.Parameter(args[0], args[1])

    def r_parameter_with_state(self, args):
        if len(args) != 4 or not (args[3] is None or (type(args[3]) is dict and not args[3])):
            raise _Refused("a parameter with Python attributes")
        return self.r_parameter(args[:3])

    def r_np_reconstruct(self, args):
        if not (len(args) == 3 and args[0] is _G["np_ndarray"] and type(args[1]) is tuple and args[1] == (0,)
                and type(args[1][0]) is int and type(args[2]) in (bytes, str) and args[2] in (b"b", "b")):
            raise _Refused("a numpy array other than numpy's RNG state")
        return _PendingArray()

    def r_np_dtype(self, args):
        if not (len(args) == 3 and type(args[0]) is str and args[0] == "u4" and args[1] is False and args[2] is True):
            raise _Refused("a numpy dtype other than uint32")
        return _PendingDtype()

    def r_np_ndarray(self, args):
        raise _Refused("numpy.ndarray() called")

    def _rng_keys(self, state):
        """The array of numpy's RNG state from its pickled state, checked before numpy sees it."""
        if not (type(state) is tuple and len(state) == 5 and type(state[0]) is int and state[0] == 1
                and type(state[1]) is tuple and len(state[1]) == 1 and type(state[1][0]) is int
                and state[1][0] == 624 and type(state[2]) is _PendingDtype and state[2].built
                and state[3] is False and type(state[4]) is bytes and len(state[4]) == _RNG_STATE_BYTES):
            raise _Refused("a numpy array other than the 624 uint32 keys of numpy's RNG state")
        try:
            import numpy as np
        except ImportError:
            raise _Refused("numpy's RNG state, and numpy is not installed") from None
        return np.frombuffer(state[4], dtype="<u4").copy()

    def _rng_state(self, items: list) -> tuple:
        kind, keys, pos, has_gauss, gauss = items
        if not (type(kind) is str and kind == "MT19937" and type(keys) is _PendingArray and keys.array is not None
                and type(pos) is int and 0 <= pos <= 624 and type(has_gauss) is int and has_gauss in (0, 1)
                and type(gauss) is float):
            raise _Refused("a numpy array outside numpy's RNG state ('MT19937', uint32[624], int, int, float)")
        return self._track((kind, keys.array, pos, has_gauss, gauss), 1, 6)

    dispatch: dict = {}


def _utf8(b: memoryview) -> str:
    return str(b, "utf-8", "surrogatepass")


_OPCODES = {o.name: o for o in pickletools.opcodes}
_I4 = struct.Struct("<i")
_U2 = struct.Struct("<H")
_U4 = struct.Struct("<I")
_U8 = struct.Struct("<Q")
_F8 = struct.Struct(">d")

for _name, _fn in {
    "MARK": _Unpickler.op_mark, "POP": _Unpickler.op_pop, "POP_MARK": _Unpickler.op_pop_mark, "DUP": _Unpickler.op_dup,
    "PROTO": _Unpickler.op_proto, "FRAME": _Unpickler.op_frame, "NONE": _Unpickler.op_none,
    "NEWTRUE": _Unpickler.op_true, "NEWFALSE": _Unpickler.op_false, "BININT": _Unpickler.op_binint,
    "BININT1": _Unpickler.op_binint1, "BININT2": _Unpickler.op_binint2, "LONG1": _Unpickler.op_long1,
    "LONG4": _Unpickler.op_long4, "BINFLOAT": _Unpickler.op_binfloat,
    "EMPTY_TUPLE": _Unpickler.op_empty_tuple, "TUPLE": _Unpickler.op_tuple, "TUPLE1": _Unpickler.op_tuple1,
    "TUPLE2": _Unpickler.op_tuple2, "TUPLE3": _Unpickler.op_tuple3, "EMPTY_LIST": _Unpickler.op_empty_list,
    "LIST": _Unpickler.op_list, "APPEND": _Unpickler.op_append, "APPENDS": _Unpickler.op_appends,
    "EMPTY_DICT": _Unpickler.op_empty_dict, "DICT": _Unpickler.op_dict, "SETITEM": _Unpickler.op_setitem,
    "SETITEMS": _Unpickler.op_setitems, "EMPTY_SET": _Unpickler.op_empty_set, "ADDITEMS": _Unpickler.op_additems,
    "FROZENSET": _Unpickler.op_frozenset, "BINGET": _Unpickler.op_binget, "LONG_BINGET": _Unpickler.op_long_binget,
    "BINPUT": _Unpickler.op_binput, "LONG_BINPUT": _Unpickler.op_long_binput, "MEMOIZE": _Unpickler.op_memoize,
    "GLOBAL": _Unpickler.op_global, "STACK_GLOBAL": _Unpickler.op_stack_global,
    "BINPERSID": _Unpickler.op_binpersid, "REDUCE": _Unpickler.op_reduce, "BUILD": _Unpickler.op_build,
    **{name: functools.partial(_Unpickler._sized, width=width, make=make) for name, width, make in (
        ("SHORT_BINUNICODE", 1, _utf8), ("BINUNICODE", 4, _utf8), ("BINUNICODE8", 8, _utf8),
        ("SHORT_BINBYTES", 1, bytes), ("BINBYTES", 4, bytes), ("BINBYTES8", 8, bytes),
        ("BYTEARRAY8", 8, bytearray))},
}.items():
    _Unpickler.dispatch[ord(_OPCODES[_name].code)] = _fn
del _name, _fn


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
    from ..checkpoint.gcpause import gc_paused  # here: untrusted/ is imported by checkpoint/

    try:
        with gc_paused():  # millions of containers would make each collection walk them all
            return _load(_buffer(data), meta)
    except _Refused as e:
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
        raise _Refused(f"it is not a readable torch.save archive ({e})") from None
    prefixes = [n[:-len("/data.pkl")] for n in recs if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(prefixes) != 1:
        raise _Refused("the archive has no single data.pkl record")
    prefix = prefixes[0]
    order = recs.get(f"{prefix}/byteorder")  # absent before torch 2.1: little-endian
    saved_order = bytes(mv[order[0]:order[0] + min(order[1], 8)]) if order is not None else b"little"
    if saved_order not in (b"little", b"big"):
        raise _Refused("an unknown byte order")
    swap = saved_order != sys.byteorder.encode()
    start, size = recs[f"{prefix}/data.pkl"]
    if size > MAX_PICKLE_BYTES:
        raise _Refused(f"its pickle holds {size} bytes, more than the {MAX_PICKLE_BYTES} plain data may")
    data_dir = f"{prefix}/data/"
    stored = sum(s for n, (_, s) in recs.items() if n.startswith(data_dir))
    storages: dict[str, _Storage] = {}

    def storage_of(stype: _StorageType, key: str, numel: int) -> _Storage:
        typed = stype.dtype is not None
        dtype = stype.dtype if typed else torch.uint8
        st = storages.get(key)
        if st is not None:
            if st.dtype is not dtype or st.typed != typed:
                raise _Refused("one storage read as two types")
            return st
        rec = recs.get(data_dir + key)
        if rec is None:
            raise _Refused("a tensor whose storage record is missing")
        r_start, r_size = rec
        if numel < 0 or numel * dtype.itemsize != r_size:
            raise _Refused(f"a storage that declares another size than its record's {r_size} bytes")
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

    up = _Unpickler(mv[start:start + size], storage_of, max_nodes=4 * size + 100_000, view_bytes=4 * stored + (16 << 20))
    return up.load()
