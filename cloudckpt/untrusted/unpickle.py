"""Unpickling DCP's ``.metadata`` from a checkpoint without letting it run code,
then checking what came out before anyone uses it.

Why a hand-written unpickler and not torch's weights-only one (``torch.load(...,
weights_only=True)`` with ``torch.serialization.safe_globals``): DCP writes
``.metadata`` with ``pickle.dump`` at the default protocol (4 on Python 3.11),
and torch's weights-only unpickler reads protocol 2 only (torch 2.13 stops at the
``FRAME`` opcode of protocol 4). So this module keeps its own, built the same way
as torch's: the pure-Python ``pickle._Unpickler`` with every opcode that can look
up, call or mutate something replaced by a checked version:

- ``GLOBAL``/``STACK_GLOBAL``: only the exact ``(module, name)`` pairs of
  ``_GLOBALS``; no module prefixes and no dotted names (protocol 4 resolves
  ``a.b`` by walking attributes: a module that imports ``os`` would hand out
  ``os.system``). The object returned is ours, never looked up by name.
- ``REDUCE``: only the constructors in ``_CALLABLE`` (``torch.Size``, sets, paths,
  ...), with a tuple of arguments.
- ``NEWOBJ``: only DCP's metadata dataclasses, with no arguments.
- ``BUILD``: only on instances of those dataclasses, with a dict whose keys are
  the class's fields (``TensorProperties`` keeps its own ``__setstate__``: a
  5-tuple unpacked, nothing called). Never on a class or a function.
- ``APPEND(S)``/``SETITEM(S)``/``ADDITEMS``: only on plain lists, dicts and sets.
- ``INST``, ``OBJ``, ``NEWOBJ_EX``, ``EXT*``, persistent ids, out-of-band
  buffers: refused.
- Megatron-core's save keeps its ranks' ``SavePlan`` objects in the metadata
  (``Metadata.all_local_plans``): the four plan classes of
  ``torch.distributed.checkpoint.planner`` it needs (``SavePlan``, ``WriteItem``,
  ``TensorWriteData``, ``BytesIOWriteData``) and ``WriteItemType`` (a small int) are
  read as inert stand-ins (``_PlanPart``: NEWOBJ and one BUILD with the class's own
  fields, never hashed or called), admitted only in that attribute, which is dropped
  once the pickle is read: DCP's own plan classes are never built and nothing of a
  plan is used.

Bounds while unpickling, before the value is used (a pickle is a program: 2 MB
can describe 16 GB by calling a constructor 2,000 times on one memoised list):

- every value is measured before it is hashed (a dict key, a set member, an
  argument that a constructor hashes): nested at most ``MAX_KEY_DEPTH`` deep (hashing
  a tuple nested 10^6 deep overflows the C stack), and no more than ``MAX_SAME_HASH``
  keys of one dict or set share a hash value (hash flooding);
- each constructor gets only the arguments it is written with (``torch.Size`` of
  at most ``MAX_TENSOR_DIMS`` ints in ``[0, 2^63)``, short strings for devices,
  layouts and paths, nothing for ``OrderedDict``);
- the elements copied by constructors and hashed into dicts are charged to one
  budget proportional to the pickle's size; the state of an object is set once.

``validate_metadata`` then walks the result: exact types, names (``names.py``),
sizes, offsets and lengths in ``[0, 2^63)`` checked before anything is multiplied,
the chunks of each tensor distinct, inside it, not overlapping and covering it,
each chunk's item large enough for it, items inside their file and not
overlapping, every file in the manifest, all under the same work budget. So a
tensor's bytes are at most the bytes of its items: what a reader allocates for
the metadata is bounded by the checkpoint's size. Refusal messages show only
values already checked (names quoted and shortened, numbers in range).
It is pure Python: ~3x slower than the C unpickler (about 5 s against 2 s for a
16 MB ``.metadata`` with 115k chunks), paid once per rank per load.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import io
import pathlib
import pickle
from itertools import pairwise
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from .._torch_compat import MEM_FORMAT_ENCODING, get_layout
from .._torch_compat import StorageInfo as _StorageInfo
from ..errors import CloudCkptError, CorruptCheckpoint, UnsafeCheckpoint
from .limits import MAX_DIM, MAX_KEY_DEPTH, MAX_PLAIN_DEPTH, MAX_SAME_HASH, MAX_TENSOR_DIMS
from .names import check_name

_DATACLASSES = (
    dcp_md.Metadata,
    dcp_md.MetadataIndex,
    dcp_md.TensorStorageMetadata,
    dcp_md.BytesStorageMetadata,
    dcp_md.ChunkStorageMetadata,
    dcp_md.TensorProperties,
    dcp_md.StorageMeta,
    _StorageInfo,
)
_SETSTATE = {dcp_md.TensorProperties: 5}  # classes whose own __setstate__ takes a tuple of this length
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _DATACLASSES}
# Megatron-core's save (dist_checkpointing, torch_dist) keeps every rank's SavePlan in the
# metadata, as the attribute ``all_local_plans`` (its cached-plan reuse): admitted there only
_FIELDS[dcp_md.Metadata] |= {"all_local_plans"}
_PLAN_MODULE = "torch.distributed.checkpoint.planner"


class _PlanPart:
    """What one of DCP's save-plan dataclasses (``SavePlan``, ``WriteItem``, …) in
    Megatron's ``all_local_plans`` becomes: an inert stand-in, built by NEWOBJ and one
    BUILD with the class's own fields, never hashed (``__hash__`` is None: it cannot be a
    dict key or a set member), never called, and dropped with ``all_local_plans`` once
    the metadata is unpickled (``loads_metadata``): nothing of a plan is ever used."""

    __slots__ = ("state",)
    __hash__ = None  # type: ignore[assignment]
    FIELDS: frozenset = frozenset()


def _plan_parts() -> dict[str, type]:
    from torch.distributed.checkpoint import planner

    return {name: type(name, (_PlanPart,), {"__slots__": (), "FIELDS": frozenset(
        f.name for f in dataclasses.fields(getattr(planner, name)))})
        for name in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")}


_PLAN_PARTS = _plan_parts()
_PLAN_PART_IDS = frozenset(map(id, _PLAN_PARTS.values()))


def _write_item_type(value: int) -> int:
    """``WriteItemType(value)`` of a stand-in WriteItem: the number itself (checked by _enum_args)."""
    return value
_PATHS = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)


def _globals() -> dict[tuple[str, str], Any]:
    g: dict[tuple[str, str], Any] = {}
    for cls in _DATACLASSES:
        g[(cls.__module__, cls.__qualname__)] = cls
    # OLMo-core writes its own copy of DCP's _StorageInfo (same fields): read it as DCP's
    g[("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    for name, part in _PLAN_PARTS.items():  # Megatron's all_local_plans: stand-ins, never DCP's classes
        g[(_PLAN_MODULE, name)] = part
    g[(_PLAN_MODULE, "WriteItemType")] = _write_item_type
    g[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = MEM_FORMAT_ENCODING
    for name in dir(torch):
        v = getattr(torch, name, None)
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            g[("torch", name)] = v
    g[("torch", "Size")] = torch.Size
    g[("torch", "device")] = torch.device
    g[("torch.serialization", "_get_layout")] = get_layout
    for cls in _PATHS:  # StorageMeta.checkpoint_id may be a path (pathlib._local on Python 3.13+)
        g[("pathlib", cls.__name__)] = cls
        g[("pathlib._local", cls.__name__)] = cls
    g[("collections", "OrderedDict")] = collections.OrderedDict
    g[("builtins", "set")] = set
    g[("builtins", "frozenset")] = frozenset
    return g


_GLOBALS = _globals()
# identity, not equality (a crafted object's __eq__/__hash__ never runs); these objects
# live as long as the process, so their ids are stable
_DATACLASS_IDS = frozenset(map(id, _DATACLASSES))


_INT = frozenset((int,))
_STR = frozenset((str,))
# values whose hash never descends into other values (str and int hashes are linear at worst)
_HASH_LEAVES = frozenset((str, int, float, bool, type(None), bytes, frozenset, torch.dtype, torch.layout,
                          torch.memory_format, torch.device, MEM_FORMAT_ENCODING, *_PATHS))
_SHORT = 256  # characters of a device or layout name; of a path, each part


class _Refused(pickle.UnpicklingError):
    """The pickle asks for something outside the allowlist."""


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: Any, *, work: int):
        super().__init__(file)
        self._work = work  # elements constructors may copy and hashes may visit, in all
        self._measured: dict[int, tuple[Any, int, int]] = {}  # id(tuple) -> (tuple, weight, height); keeps it alive
        self._same_hash: dict[int, tuple[Any, collections.Counter]] = {}  # id(dict or set) -> (it, keys per hash)

    def _spend(self, n: int) -> None:
        self._work -= n
        if self._work < 0:
            raise _Refused("it asks for more work than its size allows (one object shared between many keys or "
                           "constructor calls)")

    # ------------------------------------------------------------ hashing
    def _measure(self, obj: Any, depth: int) -> tuple[int, int]:
        """(the elements hashing ``obj`` visits, its nesting); refused past MAX_KEY_DEPTH."""
        t = type(obj)
        if t in _HASH_LEAVES:
            return 1, 0
        if t is torch.Size:
            return 1 + len(obj), 1
        if id(t) in _PLAN_PART_IDS:
            raise _Refused(f"a {t.__name__} is used as a dict key or set member")
        if depth >= MAX_KEY_DEPTH:
            raise _Refused(f"a dict key or set member is nested more than {MAX_KEY_DEPTH} deep")
        if t is tuple:
            seen = self._measured.get(id(obj))
            if seen is None:
                weight, height = 1, 0
                for v in obj:
                    w, h = self._measure(v, depth + 1)
                    weight += w
                    height = max(height, h)
                seen = self._measured[id(obj)] = (obj, weight, height + 1)
            if depth + seen[2] > MAX_KEY_DEPTH:
                raise _Refused(f"a dict key or set member is nested more than {MAX_KEY_DEPTH} deep")
            return seen[1], seen[2]
        if t is dcp_md.MetadataIndex:  # its hash is the hash of its fields
            weight, height = 1, 0
            for v in obj.__dict__.values():
                w, h = self._measure(v, depth + 1)
                weight += w
                height = max(height, h)
            return weight, height + 1
        return 1, 0  # unhashable (lists, dicts, other dataclasses): hash() raises without descending

    def _keys(self, keys: Any, container: Any = None) -> None:
        """Check ``keys`` before they are hashed into ``container`` (a dict or a set;
        None: a new one made of ``keys`` alone):
        each measured (nesting, elements hashing visits), and at most MAX_SAME_HASH of
        them, with the keys it already holds, sharing one hash value. Strings pass
        untouched (their hash is randomised: no flooding; not nested). C-level loops
        where the keys are leaves, so the check costs a fraction of the insert."""
        kinds = set(map(type, keys))
        if _STR.issuperset(kinds):
            return
        self._spend(len(keys))
        if not _HASH_LEAVES.issuperset(kinds):
            for k in keys:
                if type(k) not in _HASH_LEAVES:
                    self._spend(self._measure(k, 0)[0])
        hashes = list(map(hash, keys))
        if container is None:
            counts = collections.Counter(hashes)
        else:
            held = self._same_hash.get(id(container))
            if held is None:
                held = self._same_hash[id(container)] = (container, collections.Counter())  # keeps the id taken
            counts = held[1]
            counts.update(hashes)
        if hashes and max(map(counts.__getitem__, hashes)) > MAX_SAME_HASH:
            raise _Refused(f"more than {MAX_SAME_HASH} keys of one dict or set share a hash value (hash flooding)")

    # ------------------------------------------------------------ opcodes
    def find_class(self, module: str, name: str) -> Any:
        obj = _GLOBALS.get((module, name))
        if obj is None:
            raise _Refused(f"global {_short(module)}.{_short(name)} is not in the allowlist of DCP metadata")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("persistent ids are not allowed in DCP metadata")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        check = _REDUCE.get(id(func))
        if check is None:
            raise _Refused(f"calling {_what(func)} is not allowed in DCP metadata")
        if type(args) is not tuple:
            raise _Refused("REDUCE arguments are not a tuple")
        check(self, args)
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if id(cls) not in _DATACLASS_IDS and id(cls) not in _PLAN_PART_IDS or type(args) is not tuple or args:
            raise _Refused(f"creating {_what(cls)} is not allowed in DCP metadata")
        self.append(cls.__new__(cls))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if id(cls) in _PLAN_PART_IDS:
            if hasattr(inst, "state"):
                raise _Refused(f"the state of a {cls.__name__} is set twice")
            if type(state) is not dict or not cls.FIELDS.issuperset(state):
                raise _Refused(f"bad state for {cls.__name__}: only its fields {sorted(cls.FIELDS)} may be set")
            inst.state = state
            return
        if id(cls) not in _DATACLASS_IDS:
            raise _Refused(f"setting the state of {_what(inst)} is not allowed in DCP metadata")
        if inst.__dict__:  # a second BUILD would change an object already hashed into a dict
            raise _Refused(f"the state of a {cls.__name__} is set twice")
        if cls in _SETSTATE:
            if type(state) is not tuple or len(state) != _SETSTATE[cls]:
                raise _Refused(f"bad state for {cls.__name__}")
            inst.__setstate__(state)
            return
        if type(state) is not dict or not _FIELDS[cls].issuperset(state):  # keys measured when hashed into it
            raise _Refused(f"bad state for {cls.__name__}: only its fields {sorted(_FIELDS[cls])} may be set")
        inst.__dict__.update(state)

    def load_append(self) -> None:
        value = self.stack.pop()
        _need(self.stack[-1], list, "APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        _need(self.stack[-1], list, "APPENDS").extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        d = _need(self.stack[-1], (dict, collections.OrderedDict), "SETITEM")
        if type(key) is not str:
            self._keys((key,), d)
        d[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        d = _need(self.stack[-1], (dict, collections.OrderedDict), "SETITEMS")
        keys = items[::2]
        self._keys(keys, d)
        d.update(zip(keys, items[1::2], strict=False))  # an odd count (no pickler writes one): the last key is dropped

    def load_dict(self) -> None:
        items = self.pop_mark()
        d: dict = {}
        keys = items[::2]
        self._keys(keys, d)
        d.update(zip(keys, items[1::2], strict=False))  # as in load_setitems
        self.append(d)

    def load_additems(self) -> None:
        items = self.pop_mark()
        s = _need(self.stack[-1], set, "ADDITEMS")
        self._keys(items, s)
        s.update(items)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self._keys(items)
        self.append(frozenset(items))

    def _refuse(self) -> None:
        raise _Refused("the pickle uses an opcode DCP metadata never needs (INST, OBJ, NEWOBJ_EX, EXT, buffers)")

    for _op, _fn in ((pickle.REDUCE, load_reduce), (pickle.NEWOBJ, load_newobj), (pickle.BUILD, load_build),
                     (pickle.APPEND, load_append), (pickle.APPENDS, load_appends), (pickle.SETITEM, load_setitem),
                     (pickle.SETITEMS, load_setitems), (pickle.DICT, load_dict), (pickle.ADDITEMS, load_additems),
                     (pickle.FROZENSET, load_frozenset)):
        dispatch[_op[0]] = _fn
    for _op in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2, pickle.EXT4,
                pickle.PERSID, pickle.BINPERSID, pickle.NEXT_BUFFER, pickle.READONLY_BUFFER):
        dispatch[_op[0]] = _refuse
    del _op, _fn


# ---------------------------------------------------------------- what each constructor may be called with
def _size_args(u: _MetadataUnpickler, args: tuple) -> None:
    dims = args[0] if len(args) == 1 else None
    if type(dims) not in (tuple, list) or len(dims) > MAX_TENSOR_DIMS or not _INT.issuperset(map(type, dims)) \
            or (dims and (min(dims) < 0 or max(dims) > MAX_DIM)):
        raise _Refused(f"torch.Size takes at most {MAX_TENSOR_DIMS} ints in [0, 2^63) in DCP metadata")
    u._spend(len(dims))


def _name_args(u: _MetadataUnpickler, args: tuple) -> None:  # torch.device("cpu"[, 0]), _get_layout("torch.strided")
    if not (1 <= len(args) <= 2 and type(args[0]) is str and len(args[0]) <= _SHORT
            and (len(args) == 1 or (type(args[1]) is int and 0 <= args[1] < 1 << 16))):
        raise _Refused("a device or layout is not given by a short name")


def _enum_args(u: _MetadataUnpickler, args: tuple) -> None:
    if len(args) != 1 or type(args[0]) is not int or not 0 <= args[0] < 256:
        raise _Refused("a memory format or a write item type is not given by a small int")


def _no_args(u: _MetadataUnpickler, args: tuple) -> None:
    if args:
        raise _Refused("OrderedDict takes no arguments in DCP metadata (its items follow)")


def _set_args(u: _MetadataUnpickler, args: tuple) -> None:
    if len(args) > 1 or (args and type(args[0]) not in (list, tuple)):
        raise _Refused("a set takes one list of members in DCP metadata")
    if args:
        u._spend(len(args[0]))  # copied
        u._keys(args[0])


def _path_args(u: _MetadataUnpickler, args: tuple) -> None:
    if len(args) > 64 or not _STR.issuperset(map(type, args)) or any(len(a) > 4096 for a in args):
        raise _Refused("a path takes at most 64 strings of at most 4096 characters in DCP metadata")
    u._spend(len(args) + sum(map(len, args)))


_REDUCE = {id(f): check for f, check in (
    (torch.Size, _size_args), (torch.device, _name_args), (get_layout, _name_args), (MEM_FORMAT_ENCODING, _enum_args),
    (collections.OrderedDict, _no_args), (set, _set_args), (frozenset, _set_args), (_write_item_type, _enum_args),
    *((cls, _path_args) for cls in _PATHS))}


def _need(obj: Any, types: Any, op: str) -> Any:
    if type(obj) not in (types if isinstance(types, tuple) else (types,)):
        raise _Refused(f"{op} on {_what(obj)} is not allowed in DCP metadata")
    return obj


def _what(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) if isinstance(obj, type) or callable(obj) else None
    if isinstance(name, str):
        return f"{_short(str(getattr(obj, '__module__', '?')))}.{_short(name)}"
    return f"a {type(obj).__name__}"


def _short(text: str, n: int = 120) -> str:
    """``text`` for a message: at most ``n`` characters, control characters escaped."""
    shown = text if len(text) <= n else text[: n - 3] + "..."
    return repr(shown)[1:-1]


def _q(text: str) -> str:
    """A checked string (a tensor's name) quoted for a message, shortened and escaped."""
    return "'" + _short(text) + "'"


def loads_metadata(data: bytes, *, url: str, files: dict[str, int] | None = None) -> dcp_md.Metadata:
    """Unpickle DCP metadata with the allowlist and validate it (``validate_metadata``;
    ``files``: the manifest's ``{relative path: size}`` of the DCP folder, when known).
    Raises UnsafeCheckpoint (something refused), CorruptCheckpoint (unreadable)."""
    budget = 2 * len(data) + 10_000
    gc_was_on = gc.isenabled()
    gc.disable()  # millions of new objects and no garbage: collections would only cost (a third of the time)
    try:
        md = _MetadataUnpickler(io.BytesIO(data), work=budget).load()
        _drop_plans(md)
        validate_metadata(md, url=url, files=files, budget=budget)
    except _Refused as e:
        raise UnsafeCheckpoint(f"DCP metadata {url} refused: {e}; nothing of it was run. It was tampered with or "
                               "written by a tool cloudckpt does not know") from None
    except RecursionError:
        raise UnsafeCheckpoint(f"DCP metadata {url} refused: nested too deeply") from None
    except CloudCkptError:
        raise  # validate_metadata's refusal
    except Exception as e:  # noqa: BLE001 - any decode failure means the file is unusable
        raise CorruptCheckpoint(f"DCP metadata {url} cannot be read ({type(e).__name__}: {_error_text(e)}); "
                                "it may be truncated") from None
    finally:
        if gc_was_on:
            gc.enable()
    return md


def _drop_plans(md: Any) -> None:
    """Remove Megatron's ``all_local_plans`` from ``md``: a list of stand-in SavePlans
    (or None), never used. Raises _Refused (anything else there)."""
    if type(md) is not dcp_md.Metadata:
        return  # validate_metadata refuses it
    plans = md.__dict__.pop("all_local_plans", None)
    if plans is not None and (type(plans) is not list or not all(type(p) is _PLAN_PARTS["SavePlan"] for p in plans)):
        raise _Refused("all_local_plans is not a list of SavePlans")


def _error_text(e: BaseException) -> str:
    try:
        return _short(str(e), 200)
    except Exception:  # noqa: BLE001 - str() of an error about hostile data may itself fail
        return "?"


class _Budget:
    def __init__(self, n: int, url: str):
        self.left, self.url = n, url

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise UnsafeCheckpoint(f"DCP metadata {self.url} refused: it holds more entries than its size allows "
                                   "(objects shared between many keys)")


def validate_metadata(md: Any, *, url: str, files: dict[str, int] | None = None, budget: int = 10**8) -> None:
    """Check an unpickled ``Metadata`` before DCP uses it (see the module docstring);
    ``budget``: the entries it may visit (2 per byte of the pickle). Raises
    UnsafeCheckpoint, whatever the object holds."""
    try:
        _validate(md, url, files, _Budget(budget, url))
    except CloudCkptError:
        raise
    except Exception as e:  # noqa: BLE001 - a value no check above foresaw: refused, typed
        raise UnsafeCheckpoint(f"DCP metadata {url} refused: it could not be checked ({type(e).__name__})") from None


def _validate(md: Any, url: str, files: dict[str, int] | None, b: _Budget) -> None:
    def bad(why: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(f"DCP metadata {url} refused: {why}")

    if type(md) is not dcp_md.Metadata:
        raise bad(f"it holds a {type(md).__name__}, not DCP Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if type(sdm) is not dict:
        raise bad("state_dict_metadata is not a dict")
    sd = getattr(md, "storage_data", None)
    if type(sd) is not dict:
        raise bad("storage_data is not a dict")
    _plain(getattr(md, "planner_data", None), b, bad, depth=0)
    sm = getattr(md, "storage_meta", None)
    if sm is not None:
        if type(sm) is not dcp_md.StorageMeta:
            raise bad("storage_meta is not DCP StorageMeta")
        _plain((sm.save_id, sm.load_id, sm.modules), b, bad, depth=0)
        if not (sm.checkpoint_id is None or type(sm.checkpoint_id) is str or type(sm.checkpoint_id) in _PATHS):
            raise bad("storage_meta.checkpoint_id is not a string or path")
    version = getattr(md, "version", None)
    if version is not None and type(version) is not str:
        raise bad("version is not a string")

    items = _check_items(sd, url, files, b, bad)
    for fqn, entry in sdm.items():
        b.spend()
        if type(fqn) is not str:
            raise bad("a state_dict_metadata key is not a string")
        if type(entry) is dcp_md.BytesStorageMetadata:
            if (fqn, None) not in items:
                raise bad(f"the value {_q(fqn)} has no storage item")
            continue
        if type(entry) is not dcp_md.TensorStorageMetadata:
            raise bad(f"the entry of {_q(fqn)} is a {type(entry).__name__}")
        _check_tensor(fqn, entry, items, b, bad)


def _check_items(sd: dict, url: str, files: dict[str, int] | None, b: _Budget, bad) -> dict:
    """``{(fqn, offsets or None): item length}`` of the storage items, each checked."""
    items: dict[tuple[str, Any], int] = {}
    per_file: dict[str, list[tuple[int, int]]] = {}
    names: dict[str, str] = {}  # relative paths already checked (a few files hold every item)
    for key, info in sd.items():
        b.spend()
        if type(key) is not dcp_md.MetadataIndex or type(key.fqn) is not str:
            raise bad("a storage_data key is not a MetadataIndex")
        fqn = key.fqn
        if key.offset is not None and (type(key.offset) is not torch.Size or not _dims_ok(key.offset)):
            raise bad(f"the offset of {_q(fqn)} is not a torch.Size of at most {MAX_TENSOR_DIMS} values in [0, 2^63)")
        if key.index is not None and type(key.index) is not int:
            raise bad(f"the index of {_q(fqn)} is not an int")
        if type(info) is not _StorageInfo:
            raise bad(f"the storage info of {_q(fqn)} is not DCP's _StorageInfo")
        rel = info.relative_path
        if type(rel) is not str or rel not in names:
            rel = names[rel] = check_name(rel, what=f"relative_path of {_q(fqn)}", url=url)
        off, length = info.offset, info.length
        if type(off) is not int or type(length) is not int or not (0 <= off <= MAX_DIM and 0 <= length <= MAX_DIM):
            raise bad(f"{_q(fqn)} has a byte range that is not two ints in [0, 2^63)")
        td = getattr(info, "transform_descriptors", None)
        if td is not None:
            if type(td) not in (list, tuple) or len(td) > 64 or not all(type(t) is str and len(t) < 256 for t in td):
                raise bad(f"transform_descriptors of {_q(fqn)} are not a short list of short strings")
            b.spend(len(td))
        if files is not None:
            if rel not in files:
                raise bad(f"{_q(fqn)} is stored in {rel!r}, which is not in the checkpoint's manifest")
            if off + length > files[rel]:
                raise bad(f"{_q(fqn)} runs past the end of {rel!r} (bytes [{off}, {off + length}), "
                          f"file size {files[rel]})")
        per_file.setdefault(rel, []).append((off, length))
        items[(fqn, key.offset)] = length  # MetadataIndex ignores index: one item per (fqn, offset)
    for rel, ranges in per_file.items():
        ranges.sort()
        for (o1, n1), (o2, _) in pairwise(ranges):
            if o1 + n1 > o2:
                raise bad(f"items overlap in {rel!r} (bytes [{o1}, {o1 + n1}) and one starting at {o2})")
    return items


def _dims_ok(size: Any) -> bool:
    """At most MAX_TENSOR_DIMS ints in [0, 2^63): checked before anything is multiplied or shown."""
    return len(size) <= MAX_TENSOR_DIMS and _INT.issuperset(map(type, size)) and (
        not size or (min(size) >= 0 and max(size) <= MAX_DIM))


def _check_tensor(fqn: str, sm: Any, items: dict, b: _Budget, bad) -> None:
    """Shape in range; chunks distinct, inside the tensor, each backed by an item large
    enough for it, not overlapping, and covering it."""
    p = getattr(sm, "properties", None)
    if type(p) is not dcp_md.TensorProperties or type(getattr(p, "dtype", None)) is not torch.dtype:
        raise bad(f"{_q(fqn)} has bad tensor properties")
    size, chunks = getattr(sm, "size", None), getattr(sm, "chunks", None)
    if type(size) is not torch.Size or type(chunks) is not list:
        raise bad(f"{_q(fqn)} has a bad size or chunk list")
    if not _dims_ok(size):
        raise bad(f"the size of {_q(fqn)} is not at most {MAX_TENSOR_DIMS} dimensions in [0, 2^63)")
    nd = len(size)
    b.spend(len(chunks) * (2 + nd))
    numel = _numel(size)
    itemsize = p.dtype.itemsize
    covered = 0
    starts: set = set()
    boxes = []
    for c in chunks:
        if type(c) is not dcp_md.ChunkStorageMetadata or type(getattr(c, "offsets", None)) is not torch.Size \
                or type(getattr(c, "sizes", None)) is not torch.Size:
            raise bad(f"a chunk of {_q(fqn)} is not a ChunkStorageMetadata of torch.Sizes")
        off, sz = c.offsets, c.sizes
        if len(off) != nd or len(sz) != nd:
            raise bad(f"a chunk of {_q(fqn)} does not have the tensor's {nd} dimensions")
        if not (_dims_ok(off) and _dims_ok(sz)):
            raise bad(f"a chunk of {_q(fqn)} has offsets or sizes outside [0, 2^63)")
        if any(o + s > d for o, s, d in zip(off, sz, size, strict=True)):
            raise bad(f"a chunk of {_q(fqn)} (offsets {list(off)}, sizes {list(sz)}) "
                      f"lies outside its size {list(size)}")
        if off in starts:
            raise bad(f"two chunks of {_q(fqn)} start at offsets {list(off)}")
        starts.add(off)
        n = _numel(sz)
        length = items.get((fqn, off))
        if length is None:
            raise bad(f"the chunk of {_q(fqn)} at offsets {list(off)} has no storage item")
        if n * itemsize > length:
            raise bad(f"the chunk of {_q(fqn)} at offsets {list(off)} claims {n * itemsize} bytes, "
                      f"its item holds {length}")
        covered += n
        if n:
            boxes.append((off, sz))
    if covered != numel:
        raise bad(f"the chunks of {_q(fqn)} hold {covered} elements, its size {list(size)} has {numel}")
    if len(boxes) > 1 and not _disjoint(boxes, 0, nd, b):
        raise bad(f"chunks of {_q(fqn)} overlap (and so leave part of it unwritten)")


def _disjoint(boxes: list, d: int, nd: int, b: _Budget) -> bool:
    """Whether the boxes ``(offsets, sizes)`` (none empty) are pairwise disjoint in
    dimensions ``d..nd-1``. A sweep along dimension ``d``: at each start, the boxes
    open there are checked against each other in the remaining dimensions. Linear
    and logarithmic for the grids that sharding makes (a row of 64 chunks: one pass);
    every step is charged to the budget."""
    if len(boxes) <= 1:
        return True
    if d == nd:
        return False  # two boxes that overlap in every dimension
    b.spend(len(boxes))
    boxes.sort(key=lambda x: x[0][d])
    active: list = []
    i, n = 0, len(boxes)
    while i < n:
        x = boxes[i][0][d]
        if active:
            b.spend(len(active))
            active = [a for a in active if a[0][d] + a[1][d] > x]
        while i < n and boxes[i][0][d] == x:
            active.append(boxes[i])
            i += 1
        if len(active) > 1 and not _disjoint(list(active), d + 1, nd, b):
            return False
    return True


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, torch.Size, *_PATHS)


def _plain(obj: Any, b: _Budget, bad, depth: int) -> None:
    """Plain data only (planner_data, storage_meta fields), at most MAX_PLAIN_DEPTH deep."""
    b.spend()
    t = type(obj)
    if t in _PLAIN_LEAVES:
        return
    if depth >= MAX_PLAIN_DEPTH:
        raise bad(f"planner data is nested more than {MAX_PLAIN_DEPTH} deep")
    if t in (list, tuple, set, frozenset):
        for v in obj:
            _plain(v, b, bad, depth + 1)
        return
    if t in (dict, collections.OrderedDict):
        for k, v in obj.items():
            _plain(k, b, bad, depth + 1)
            _plain(v, b, bad, depth + 1)
        return
    raise bad(f"planner data holds a {t.__name__}")
