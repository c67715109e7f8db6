"""An unpickler for plain data from a hostile pickle: the core of the train-state
reader (``trainstate`` adds tensors and numpy's RNG state to it).

It reads the pickle iteratively, on an explicit stack: nothing recurses on the C
stack, whatever the nesting. What it builds: ``None``, bools, ints (at most
``MAX_INT_BYTES``), floats, complex, strings, bytes, ``bytearray`` of given bytes,
lists, tuples, dicts, sets, frozensets, ``OrderedDict`` (with string attributes such
as ``_metadata``), ``Counter``, ``torch.Size``, ``torch.device`` and torch's dtypes,
layouts and memory formats, and ``io.BytesIO`` of given bytes (Megatron's
``ShardedObject`` data may be one: ``NEWOBJ`` then one ``BUILD`` of ``(bytes, position,
None)``, done by hand, never by its ``__setstate__``). Globals are looked up in an exact table of
``(module, name)`` pairs whose values are our own markers, never the named objects:
``REDUCE`` calls only our constructors for them, each checking its arguments' exact
types (``bytearray(n)``, for one, is refused: it would allocate from a number).

Bounds hold while parsing, not after:

- every container records its depth and its size as a tree (what a reader walking
  it would visit, shared parts counted each time) when it is built or filled, and is
  refused past ``MAX_DEPTH`` or past ``max_nodes``;
- a container cannot change once it was placed in another or passed to a
  constructor (it is *sealed*): depths and sizes recorded stay true, and there are no
  cycles;
- dict keys and set items are only strings, bytes, floats, bools, ``None``, ints
  below 2^61 and at most ``MAX_TUPLE_KEYS`` flat tuples of at most
  ``MAX_TUPLE_KEY_LEN`` of them: hashing is shallow and cannot be flooded with
  collisions;
- each opcode, container, element copied and byte of text spends from
  ``MAX_CELLS`` (about 16 bytes of memory each), so what the parse holds, garbage
  included, stays under about 128 MiB, and its time under a few seconds.

Objects of the unpickler itself (markers for globals, and a subclass's own) are
``Private``: they never enter a list, dict or set and never come out of ``load``.
"""

from __future__ import annotations

import collections
import functools
import io
import pickletools
import struct
from typing import Any

import torch

MAX_DEPTH = 100  # nesting of containers (honest train states: about 10)
MAX_CELLS = 8_000_000  # ~16 bytes of memory each: 2 per opcode, 16 per container, 1 per list element, 3 per
#                        dict or set entry, 1 per 4 bytes of text (about 2.5 M list elements of plain data)
MAX_TUPLE_KEYS = 1_000  # tuples used as dict keys or set items: flat, short, few (their hashes can be made
MAX_TUPLE_KEY_LEN = 16  # to collide, and each collision compares them element by element)
_SMALL_INT = 1 << 61  # ints used as keys stay below this (their hash is themselves: no collisions)
MAX_DIMS = 64
MAX_INT_BYTES = 1024
SHORT = 256  # longest global name, device string, storage key


class Refused(Exception):
    """The pickle asks for something outside what plain data needs."""


class Private:
    """Objects of the unpickler that never leave it."""

    __slots__ = ()


class Global(Private):
    """What a global of the table stands for: ``REDUCE`` calls ``r_<name>``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def plain_globals() -> dict[tuple[str, str], Any]:
    g: dict[tuple[str, str], Any] = {}
    for mod in ("builtins", "__builtin__"):  # protocol 2 writes Python 2's module name
        for n in ("set", "frozenset", "bytes", "bytearray", "complex"):
            g[(mod, n)] = Global(n)
    g[("_codecs", "encode")] = Global("encode")
    g[("collections", "OrderedDict")] = Global("OrderedDict")
    g[("collections", "Counter")] = Global("Counter")
    g[("_io", "BytesIO")] = Global("BytesIO")
    g[("torch", "Size")] = Global("Size")
    g[("torch", "device")] = Global("device")
    for name in dir(torch):
        v = getattr(torch, name, None)
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            g[("torch", name)] = v
    return g


_KEYABLE = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.layout, torch.memory_format,
                      torch.device})
# [depth, tree size, sealed, private (never leaves the unpickler), usable as a dict key]
_ATOM = (0, 1, True, False, True)
_LEAF = (0, 1, True, False, False)  # tensors, bytearrays, numpy's RNG keys: not keys
_PRIVATE = (0, 1, True, True, False)


_TOO_MANY = (f"it holds more than {MAX_CELLS} units of plain data (about 2.5 million values); keep data this "
             "large in the model state as tensors")


def _op_name(op: int) -> str:
    info = pickletools.code2op.get(chr(op))
    return info.name if info else f"0x{op:02x}"


class PlainUnpickler:
    """A pickle of plain data, read from ``data`` with the bounds of this module.
    ``load()`` returns the object or raises Refused (or, for a malformed pickle, an
    IndexError, KeyError or the like: the caller says it is malformed)."""

    GLOBALS: dict[tuple[str, str], Any] = {}  # set below; a subclass adds its own
    dispatch: dict = {}  # opcode -> function(self), set below; a subclass copies and extends it

    def __init__(self, data: memoryview, max_nodes: int):
        self.data, self.pos = data, 0
        self.stack: list = []
        self.metastack: list = []
        self.memo: dict = {}
        self.unbuilt: set[int] = set()  # ids of the io.BytesIO made by NEWOBJ whose BUILD has not come
        self.info: dict[int, list] = {id(()): [1, 1, True, False, True, ()]}
        self.cells = MAX_CELLS
        self.tuple_keys = MAX_TUPLE_KEYS
        self.max_nodes = max_nodes

    # ------------------------------------------------------------ reading
    def _take(self, n: int) -> memoryview:
        p = self.pos
        if p + n > len(self.data):
            raise Refused("it ends in the middle of a value (truncated)")
        self.pos = p + n
        return self.data[p:p + n]

    def _unpack(self, fmt: struct.Struct):
        return fmt.unpack(self._take(fmt.size))[0]

    def load(self) -> Any:
        data, dispatch = self.data, self.dispatch
        n = len(data)
        while True:
            if self.pos >= n:
                raise Refused("it ends before its STOP opcode (truncated)")
            op = data[self.pos]
            self.pos += 1
            if op == 0x2E:  # STOP
                return self._result(self.stack.pop())
            f = dispatch.get(op)
            if f is None:
                raise Refused(f"it uses the pickle opcode {_op_name(op)}, which plain data never needs")
            f(self)
            self.cells -= 2
            if self.cells < 0:
                raise Refused(_TOO_MANY)

    # ------------------------------------------------------------ bookkeeping
    def _meta(self, x: Any, seal: bool = True):
        i = self.info.get(id(x))
        if i is not None:
            if seal:
                i[2] = True
            return i
        if isinstance(x, Private):
            return _PRIVATE
        if type(x) is int:
            return _ATOM if -_SMALL_INT < x < _SMALL_INT else _LEAF
        return _ATOM if type(x) in _KEYABLE else _LEAF

    def _track(self, obj: Any, depth: int, size: int, private: bool = False, key: bool = False) -> Any:
        if depth > MAX_DEPTH:
            raise Refused(f"it is nested more than {MAX_DEPTH} deep")
        if size > self.max_nodes:
            raise Refused("it holds more values than its size allows (objects shared between many places)")
        self.info[id(obj)] = [depth, size, False, private, key, obj]
        self.cells -= 16
        return obj

    def _fill(self, target: Any, items, types: tuple, op: str, keys=()) -> list:
        """Account for ``items`` (and ``keys``) placed into the mutable ``target``."""
        ti = self.info.get(id(target))
        if ti is None or type(target) not in types:
            raise Refused(f"{op} on a {type(target).__name__} (only on plain lists, dicts and sets)")
        if ti[2]:
            raise Refused(f"{op} changes a container after it was placed in another (cycles and shared "
                           "containers changed later are not plain data)")
        self._check_keys(keys)
        depth, size = ti[0], ti[1]
        get = self.info.get
        for x in items:
            ci = get(id(x))
            if ci is None:  # an atom or a leaf (inlined _meta: this loop sees every element)
                if isinstance(x, Private):
                    raise Refused(f"an internal object placed in a {type(target).__name__}")
                size += 1
                continue
            if x is target:
                raise Refused("a container that holds itself (a cycle)")
            if ci[3]:
                raise Refused(f"an internal object placed in a {type(target).__name__}")
            ci[2] = True
            if ci[0] >= depth:
                depth = ci[0] + 1
            size += ci[1]
        if depth > MAX_DEPTH:
            raise Refused(f"it is nested more than {MAX_DEPTH} deep")
        if size > self.max_nodes:
            raise Refused("it holds more values than its size allows (objects shared between many places)")
        ti[0], ti[1] = depth, size
        return ti

    def _check_keys(self, keys) -> None:
        for k in keys:
            i = self._meta(k, seal=False)
            if not i[4]:
                raise Refused(f"a dict key or set item of type {type(k).__name__} (only strings, bytes, "
                               "floats, ints below 2**61 and short flat tuples of them)")
            if i[0]:
                if i[0] > 1 or i[1] > MAX_TUPLE_KEY_LEN + 1:
                    raise Refused(f"a dict key or set item that is a nested tuple or one of more than "
                                   f"{MAX_TUPLE_KEY_LEN} items")
                self.tuple_keys -= 1
                if self.tuple_keys < 0:
                    raise Refused(f"more than {MAX_TUPLE_KEYS} tuples used as dict keys or set items")

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
                    private = private or isinstance(x, Private)
                continue
            ci[2] = True
            if ci[0] >= depth:
                depth = ci[0] + 1
            size += ci[1]
            private = private or ci[3]
            key = key and ci[4]
        if depth > MAX_DEPTH:
            raise Refused(f"it is nested more than {MAX_DEPTH} deep")
        if size > self.max_nodes:
            raise Refused("it holds more values than its size allows (objects shared between many places)")
        return depth, size, private, key

    def _immutable(self, make, items) -> Any:
        depth, size, private, key = self._measure(items)
        self.cells -= len(items) * (3 if make is frozenset else 1)
        if self.cells < 0:
            raise Refused(_TOO_MANY)
        obj = make(items)
        if obj == () and type(obj) is tuple:
            return obj
        return self._track(obj, depth, size, private, key)

    def _result(self, obj: Any) -> Any:
        if self._meta(obj)[3]:
            raise Refused("its result is an internal object of the unpickler")
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
            raise Refused("an unknown pickle protocol")

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
            raise Refused(f"an integer longer than {MAX_INT_BYTES} bytes")
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
        special = self._special_tuple(items)
        return self._immutable(tuple, items) if special is None else special

    def _special_tuple(self, items: list):
        """A subclass's hook: a tuple it builds itself from ``items``, or None."""
        return None

    def op_tuple(self):
        t = self._tuple(self._pop_mark())
        self.stack.append(t)

    def _tuple_n(self, n: int):
        if len(self.stack) < n:
            raise Refused(f"TUPLE{n} with fewer than {n} values on the stack")
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
            raise Refused(f"{op} with an odd number of items")
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
        end = bytes(self.data[self.pos:self.pos + 2 * SHORT]).find(b"\n")
        module = str(self._take(end + 1)[:-1], "utf-8") if end >= 0 else None
        end = bytes(self.data[self.pos:self.pos + 2 * SHORT]).find(b"\n")
        name = str(self._take(end + 1)[:-1], "utf-8") if end >= 0 and module is not None else None
        if module is None or name is None:
            raise Refused("a GLOBAL opcode without its name")
        self._push_global(module, name)

    def op_stack_global(self):
        name = self.stack.pop()
        module = self.stack.pop()
        if type(module) is not str or type(name) is not str:
            raise Refused("STACK_GLOBAL of something other than two strings")
        self._push_global(module, name)

    def _push_global(self, module: str, name: str):
        v = self.GLOBALS.get((module, name))
        if v is None:
            shown = f"{module[:SHORT]}.{name[:SHORT]}"
            raise Refused(f"global {shown!r} is not in the allowlist of plain data")
        self.stack.append(v)

    def op_binpersid(self):
        raise Refused("a persistent id (only tensor storages, which plain data without tensors never holds)")

    def op_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if type(func) is not Global:
            raise Refused(f"calling a {type(func).__name__} (only the allowlisted constructors)")
        if type(args) is not tuple:
            raise Refused("REDUCE arguments that are not a tuple")
        self._meta(args)
        self.stack[-1] = getattr(self, "r_" + func.name)(args)

    def op_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if type(cls) is not Global or cls.name != "BytesIO" or args != ():
            raise Refused(f"the pickle opcode NEWOBJ on a {type(cls).__name__} (only for io.BytesIO(), whose bytes "
                          "BUILD gives)")
        buf = self._track(io.BytesIO(), 0, 1)
        self.unbuilt.add(id(buf))
        self.stack.append(buf)

    def _build_bytesio(self, buf: io.BytesIO, state: Any) -> None:
        """``io.BytesIO.__setstate__`` done by hand: ``(bytes, position, None or {})``, once."""
        if id(buf) not in self.unbuilt:
            raise Refused("the state of an io.BytesIO is set twice")
        if not (type(state) is tuple and len(state) == 3 and type(state[0]) is bytes and type(state[1]) is int
                and 0 <= state[1] <= len(state[0]) and (state[2] is None or state[2] == {})):
            raise Refused("BUILD of an io.BytesIO with a state other than (bytes, position, None)")
        self.unbuilt.discard(id(buf))
        self.cells -= len(state[0]) // 4  # copied
        if self.cells < 0:
            raise Refused(_TOO_MANY)
        buf.write(state[0])
        buf.seek(state[1])

    def op_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is io.BytesIO:
            self._build_bytesio(inst, state)
        elif type(inst) is collections.OrderedDict:
            if type(state) is not dict or not all(type(k) is str and not k.startswith("__") for k in state):
                raise Refused("BUILD of an OrderedDict with a state other than a dict of attribute names")
            self._fill(inst, (state,), (collections.OrderedDict,), "BUILD")
            inst.__dict__.update(state)
        else:
            self._build(inst, state)

    def _build(self, inst: Any, state: Any) -> None:
        """A subclass's hook: BUILD on one of its own objects."""
        raise Refused(f"BUILD on a {type(inst).__name__} (only on an OrderedDict)")

    # ------------------------------------------------------------ the allowlisted constructors
    def r_set(self, args):
        items = self._one_list(args, "set")
        s = self._track(set(), 1, 1)
        self._fill(s, items, (set,), "set()", keys=items)
        self.cells -= 3 * len(items)
        if self.cells < 0:
            raise Refused(_TOO_MANY)
        s.update(items)
        return s

    def r_frozenset(self, args):
        return self._frozenset(self._one_list(args, "frozenset"))

    def _one_list(self, args, what: str) -> list:
        if args == ():
            return []
        if len(args) != 1 or type(args[0]) is not list:
            raise Refused(f"{what}() of something other than a list")
        return args[0]

    def r_bytes(self, args):
        if args != ():
            raise Refused("bytes() with arguments (only the empty bytes)")
        return b""

    def r_encode(self, args):
        if (len(args) != 2 or type(args[0]) is not str or args[1] not in ("latin1", "latin-1")
                or type(args[1]) is not str):
            raise Refused("_codecs.encode other than of a latin-1 string (protocol 2 bytes)")
        try:
            return args[0].encode("latin-1")
        except UnicodeEncodeError:
            raise Refused("bytes that are not latin-1") from None

    def r_bytearray(self, args):
        if args == ():
            return bytearray()
        if len(args) == 1 and type(args[0]) is bytes:
            return bytearray(args[0])
        raise Refused("bytearray() of something other than bytes (bytearray(n) would allocate from a number)")

    def r_complex(self, args):
        if len(args) != 2 or not all(type(a) is float for a in args):
            raise Refused("complex() of something other than two floats")
        return complex(*args)

    def r_BytesIO(self, args):
        if args == ():
            return self._track(io.BytesIO(), 0, 1)
        if len(args) != 1 or type(args[0]) is not bytes:
            raise Refused("io.BytesIO() of something other than bytes")
        self.cells -= len(args[0]) // 4  # copied
        if self.cells < 0:
            raise Refused(_TOO_MANY)
        return self._track(io.BytesIO(args[0]), 0, 1)

    def r_OrderedDict(self, args):
        if args != ():
            raise Refused("OrderedDict() with arguments")
        return self._track(collections.OrderedDict(), 1, 1)

    def r_Counter(self, args):
        if args == ():
            return self._track(collections.Counter(), 1, 1)
        if len(args) != 1 or type(args[0]) is not dict:
            raise Refused("Counter() of something other than a dict")
        di = self._meta(args[0])
        self.cells -= 3 * len(args[0])
        if self.cells < 0:
            raise Refused(_TOO_MANY)
        return self._track(collections.Counter(args[0]), di[0], di[1])

    def r_Size(self, args):
        if not (len(args) == 1 and type(args[0]) is tuple and len(args[0]) <= MAX_DIMS
                and all(type(d) is int and -(1 << 63) <= d < (1 << 63) for d in args[0])):
            raise Refused(f"torch.Size() of something other than at most {MAX_DIMS} 64-bit integers")
        dims = args[0]
        self.cells -= len(dims)
        return self._track(torch.Size(dims), 1, 1 + len(dims), False, all(-_SMALL_INT < d < _SMALL_INT for d in dims))

    def r_device(self, args):
        if not (1 <= len(args) <= 2 and type(args[0]) is str and len(args[0]) <= 64
                and (len(args) == 1 or (type(args[1]) is int and 0 <= args[1] < 1 << 16))):
            raise Refused("torch.device() of something other than a short name and an index")
        try:
            return torch.device(*args)
        except (RuntimeError, ValueError, TypeError):
            raise Refused("torch.device() of an unknown device") from None


def _utf8(b: memoryview) -> str:
    return str(b, "utf-8", "surrogatepass")


_OPCODES = {o.name: o for o in pickletools.opcodes}
_I4 = struct.Struct("<i")
_U2 = struct.Struct("<H")
_U4 = struct.Struct("<I")
_U8 = struct.Struct("<Q")
_F8 = struct.Struct(">d")

for _name, _fn in {
    "MARK": PlainUnpickler.op_mark, "POP": PlainUnpickler.op_pop, "POP_MARK": PlainUnpickler.op_pop_mark,
    "DUP": PlainUnpickler.op_dup,
    "PROTO": PlainUnpickler.op_proto, "FRAME": PlainUnpickler.op_frame, "NONE": PlainUnpickler.op_none,
    "NEWTRUE": PlainUnpickler.op_true, "NEWFALSE": PlainUnpickler.op_false, "BININT": PlainUnpickler.op_binint,
    "BININT1": PlainUnpickler.op_binint1, "BININT2": PlainUnpickler.op_binint2, "LONG1": PlainUnpickler.op_long1,
    "LONG4": PlainUnpickler.op_long4, "BINFLOAT": PlainUnpickler.op_binfloat,
    "EMPTY_TUPLE": PlainUnpickler.op_empty_tuple, "TUPLE": PlainUnpickler.op_tuple, "TUPLE1": PlainUnpickler.op_tuple1,
    "TUPLE2": PlainUnpickler.op_tuple2, "TUPLE3": PlainUnpickler.op_tuple3, "EMPTY_LIST": PlainUnpickler.op_empty_list,
    "LIST": PlainUnpickler.op_list, "APPEND": PlainUnpickler.op_append, "APPENDS": PlainUnpickler.op_appends,
    "EMPTY_DICT": PlainUnpickler.op_empty_dict, "DICT": PlainUnpickler.op_dict, "SETITEM": PlainUnpickler.op_setitem,
    "SETITEMS": PlainUnpickler.op_setitems, "EMPTY_SET": PlainUnpickler.op_empty_set,
    "ADDITEMS": PlainUnpickler.op_additems, "FROZENSET": PlainUnpickler.op_frozenset,
    "BINGET": PlainUnpickler.op_binget, "LONG_BINGET": PlainUnpickler.op_long_binget,
    "BINPUT": PlainUnpickler.op_binput, "LONG_BINPUT": PlainUnpickler.op_long_binput,
    "MEMOIZE": PlainUnpickler.op_memoize,
    "GLOBAL": PlainUnpickler.op_global, "STACK_GLOBAL": PlainUnpickler.op_stack_global,
    "BINPERSID": PlainUnpickler.op_binpersid, "REDUCE": PlainUnpickler.op_reduce, "BUILD": PlainUnpickler.op_build,
    "NEWOBJ": PlainUnpickler.op_newobj,
    **{name: functools.partial(PlainUnpickler._sized, width=width, make=make) for name, width, make in (
        ("SHORT_BINUNICODE", 1, _utf8), ("BINUNICODE", 4, _utf8), ("BINUNICODE8", 8, _utf8),
        ("SHORT_BINBYTES", 1, bytes), ("BINBYTES", 4, bytes), ("BINBYTES8", 8, bytes),
        ("BYTEARRAY8", 8, bytearray))},
}.items():
    PlainUnpickler.dispatch[ord(_OPCODES[_name].code)] = _fn
del _name, _fn


PlainUnpickler.GLOBALS = plain_globals()
