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

``validate_metadata`` then walks the result: exact types, names (``names.py``),
non-negative offsets and lengths, chunks inside their tensor and covering it,
items inside their file and not overlapping, every file in the manifest, and a
bound on the work (a crafted pickle can share one big list between many keys).
It is pure Python: ~3x slower than the C unpickler (about 5 s against 2 s for a
16 MB ``.metadata`` with 115k chunks), paid once per rank per load.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from .._torch_compat import MEM_FORMAT_ENCODING, StorageInfo as _StorageInfo, get_layout
from ..errors import CorruptCheckpoint, UnsafeCheckpoint
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
_PATHS = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)


def _globals() -> dict[tuple[str, str], Any]:
    g: dict[tuple[str, str], Any] = {}
    for cls in _DATACLASSES:
        g[(cls.__module__, cls.__qualname__)] = cls
    # OLMo-core writes its own copy of DCP's _StorageInfo (same fields): read it as DCP's
    g[("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
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
_CALLABLE = (torch.Size, torch.device, get_layout, MEM_FORMAT_ENCODING,
             collections.OrderedDict, set, frozenset, *_PATHS)
# identity, not equality (a crafted object's __eq__/__hash__ never runs); these objects
# live as long as the process, so their ids are stable
_CALLABLE_IDS = frozenset(map(id, _CALLABLE))
_DATACLASS_IDS = frozenset(map(id, _DATACLASSES))


class _Refused(pickle.UnpicklingError):
    """The pickle asks for something outside the allowlist."""


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        obj = _GLOBALS.get((module, name))
        if obj is None:
            raise _Refused(f"global {module}.{name} is not in the allowlist of DCP metadata")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("persistent ids are not allowed in DCP metadata")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if id(func) not in _CALLABLE_IDS:
            raise _Refused(f"calling {_what(func)} is not allowed in DCP metadata")
        if type(args) is not tuple:
            raise _Refused("REDUCE arguments are not a tuple")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if id(cls) not in _DATACLASS_IDS or args != ():
            raise _Refused(f"creating {_what(cls)} is not allowed in DCP metadata")
        self.append(cls.__new__(cls))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if id(cls) not in _DATACLASS_IDS:
            raise _Refused(f"setting the state of {_what(inst)} is not allowed in DCP metadata")
        if cls in _SETSTATE:
            if type(state) is not tuple or len(state) != _SETSTATE[cls]:
                raise _Refused(f"bad state for {cls.__name__}")
            inst.__setstate__(state)
            return
        if type(state) is not dict or not all(type(k) is str and k in _FIELDS[cls] for k in state):
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
        _need(self.stack[-1], (dict, collections.OrderedDict), "SETITEM")[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        d = _need(self.stack[-1], (dict, collections.OrderedDict), "SETITEMS")
        for i in range(0, len(items) - 1, 2):
            d[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        _need(self.stack[-1], set, "ADDITEMS").update(items)

    def _refuse(self) -> None:
        raise _Refused("the pickle uses an opcode DCP metadata never needs (INST, OBJ, NEWOBJ_EX, EXT, buffers)")

    for _op, _fn in ((pickle.REDUCE, load_reduce), (pickle.NEWOBJ, load_newobj), (pickle.BUILD, load_build),
                     (pickle.APPEND, load_append), (pickle.APPENDS, load_appends), (pickle.SETITEM, load_setitem),
                     (pickle.SETITEMS, load_setitems), (pickle.ADDITEMS, load_additems)):
        dispatch[_op[0]] = _fn
    for _op in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2, pickle.EXT4,
                pickle.PERSID, pickle.BINPERSID, pickle.NEXT_BUFFER, pickle.READONLY_BUFFER):
        dispatch[_op[0]] = _refuse
    del _op, _fn


def _need(obj: Any, types: Any, op: str) -> Any:
    if type(obj) not in (types if isinstance(types, tuple) else (types,)):
        raise _Refused(f"{op} on {_what(obj)} is not allowed in DCP metadata")
    return obj


def _what(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None)
    return f"{getattr(obj, '__module__', '?')}.{name}" if isinstance(name, str) else f"a {type(obj).__name__}"


def loads_metadata(data: bytes, *, url: str, files: dict[str, int] | None = None) -> dcp_md.Metadata:
    """Unpickle DCP metadata with the allowlist and validate it (``validate_metadata``;
    ``files``: the manifest's ``{relative path: size}`` of the DCP folder, when known).
    Raises UnsafeCheckpoint (something refused), CorruptCheckpoint (unreadable)."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise UnsafeCheckpoint(f"DCP metadata {url} refused: {e}; nothing of it was run. It was tampered with or "
                               "written by a tool cloudckpt does not know") from None
    except RecursionError:
        raise UnsafeCheckpoint(f"DCP metadata {url} refused: nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - any decode failure means the file is unusable
        raise CorruptCheckpoint(f"DCP metadata {url} cannot be read ({type(e).__name__}: {e}); it may be truncated") from None
    validate_metadata(md, url=url, files=files, budget=4 * len(data) + 10_000)
    return md


class _Budget:
    def __init__(self, n: int, url: str):
        self.left, self.url = n, url

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise UnsafeCheckpoint(f"DCP metadata {self.url} refused: it holds more entries than its size allows "
                                   "(objects shared between many keys)")


def validate_metadata(md: Any, *, url: str, files: dict[str, int] | None = None, budget: int = 10**8) -> None:
    """Check an unpickled ``Metadata`` before DCP uses it. Raises UnsafeCheckpoint."""
    b = _Budget(budget, url)

    def bad(why: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(f"DCP metadata {url} refused: {why}")

    if type(md) is not dcp_md.Metadata:
        raise bad(f"it holds a {type(md).__name__}, not DCP Metadata")
    sdm = md.state_dict_metadata
    if type(sdm) is not dict:
        raise bad("state_dict_metadata is not a dict")
    sd = md.storage_data
    if type(sd) is not dict:
        raise bad("storage_data is not a dict")
    _plain(md.planner_data, b, bad, depth=0)
    if md.storage_meta is not None:
        sm = md.storage_meta
        if type(sm) is not dcp_md.StorageMeta:
            raise bad("storage_meta is not DCP StorageMeta")
        _plain((sm.save_id, sm.load_id, sm.modules), b, bad, depth=0)
        if not (sm.checkpoint_id is None or isinstance(sm.checkpoint_id, (str, pathlib.PurePath))):
            raise bad("storage_meta.checkpoint_id is not a string or path")
    if md.version is not None and type(md.version) is not str:
        raise bad("version is not a string")

    # storage items: names, ranges per file
    items: dict[tuple[str, tuple | None], int] = {}  # (fqn, offsets) -> length
    per_file: dict[str, list[tuple[int, int]]] = {}
    for key, info in sd.items():
        b.spend()
        if type(key) is not dcp_md.MetadataIndex or type(key.fqn) is not str:
            raise bad("a storage_data key is not a MetadataIndex")
        if key.offset is not None and type(key.offset) is not torch.Size:
            raise bad(f"the offset of {key.fqn!r} is not a torch.Size")
        if key.index is not None and type(key.index) is not int:
            raise bad(f"the index of {key.fqn!r} is not an int")
        if type(info) is not _StorageInfo:
            raise bad(f"the storage info of {key.fqn!r} is not DCP's _StorageInfo")
        rel = check_name(info.relative_path, what=f"relative_path of {key.fqn!r}", url=url)
        off, length = info.offset, info.length
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise bad(f"{key.fqn!r} has a bad byte range (offset {off!r}, length {length!r})")
        td = getattr(info, "transform_descriptors", None)
        if td is not None:
            if type(td) not in (list, tuple) or not all(type(t) is str and len(t) < 256 for t in td):
                raise bad(f"transform_descriptors of {key.fqn!r} are not a list of short strings")
            b.spend(len(td))
        if files is not None:
            if rel not in files:
                raise bad(f"{key.fqn!r} is stored in {rel!r}, which is not in the checkpoint's manifest")
            if off + length > files[rel]:
                raise bad(f"{key.fqn!r} runs past the end of {rel!r} (bytes [{off}, {off + length}), file size {files[rel]})")
        per_file.setdefault(rel, []).append((off, length))
        items[(key.fqn, None if key.offset is None else tuple(key.offset))] = length
    for rel, ranges in per_file.items():
        ranges.sort()
        for (o1, n1), (o2, _) in zip(ranges, ranges[1:]):
            if o1 + n1 > o2:
                raise bad(f"items overlap in {rel!r} (bytes [{o1}, {o1 + n1}) and one starting at {o2})")

    for fqn, sm_ in sdm.items():
        b.spend()
        if type(fqn) is not str:
            raise bad("a state_dict_metadata key is not a string")
        if type(sm_) is dcp_md.BytesStorageMetadata:
            if (fqn, None) not in items:
                raise bad(f"the value {fqn!r} has no storage item")
            continue
        if type(sm_) is not dcp_md.TensorStorageMetadata:
            raise bad(f"the entry of {fqn!r} is a {type(sm_).__name__}")
        _check_tensor(fqn, sm_, items, b, bad)


def _check_tensor(fqn: str, sm: Any, items: dict, b: _Budget, bad) -> None:
    p = sm.properties
    if type(p) is not dcp_md.TensorProperties or not isinstance(p.dtype, torch.dtype):
        raise bad(f"{fqn!r} has bad tensor properties")
    if type(sm.size) is not torch.Size or type(sm.chunks) is not list:
        raise bad(f"{fqn!r} has a bad size or chunk list")
    nd = len(sm.size)
    numel = _numel(sm.size)
    covered = 0
    itemsize = p.dtype.itemsize
    for c in sm.chunks:
        b.spend(1 + nd)
        if type(c) is not dcp_md.ChunkStorageMetadata or type(c.offsets) is not torch.Size or type(c.sizes) is not torch.Size:
            raise bad(f"a chunk of {fqn!r} is not a ChunkStorageMetadata of torch.Sizes")
        if len(c.offsets) != nd or len(c.sizes) != nd:
            raise bad(f"a chunk of {fqn!r} has {len(c.offsets)} dimensions, the tensor {nd}")
        if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, sm.size)):
            raise bad(f"a chunk of {fqn!r} (offsets {list(c.offsets)}, sizes {list(c.sizes)}) lies outside its size {list(sm.size)}")
        n = _numel(c.sizes)
        covered += n
        length = items.get((fqn, tuple(c.offsets)))
        if length is None:
            raise bad(f"the chunk of {fqn!r} at offsets {list(c.offsets)} has no storage item")
        if n * itemsize > length:
            raise bad(f"the chunk of {fqn!r} at offsets {list(c.offsets)} claims {n * itemsize} bytes, its item holds {length}")
    if covered != numel:
        raise bad(f"the chunks of {fqn!r} hold {covered} elements, its size {list(sm.size)} has {numel}")


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes)


def _plain(obj: Any, b: _Budget, bad, depth: int) -> None:
    """Plain data only (planner_data, storage_meta fields)."""
    b.spend()
    if depth > 64:
        raise bad("planner data is nested too deeply")
    t = type(obj)
    if t in _PLAIN_LEAVES or isinstance(obj, pathlib.PurePath) or t is torch.Size:
        return
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
