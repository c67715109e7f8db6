"""Classes 1, 4, 6 and 9 in DCP's ``.metadata`` and what is computed from it: crafted
metadata (and the items it points at) through every reader of tensors.

Each case starts from an honest committed step (``tries.honest_step``) and rewrites
``model_and_optim/.metadata`` (and, for the item cases, the shard it points into), the
marker's manifest rewritten to match (sizes and CRC32C), so that only the readers' own
checks can stop it. The metadata is the honest one unpickled, edited as objects and
pickled again (protocol 4 without frames, or 2), then raw pickle fragments replace
placeholder strings or run after its last object is built: a tuple nested 10^6 deep,
a constructor called 2,000 times on one memoised argument, a 4,800-digit integer.

The torchtitan import reads a torchtitan folder (DCP's files at its root): the same
crafted files are copied into ``tmp/titan/step-1`` and imported into the save folder.
torchtitan itself is not installed in the project's environment; the importer's module
needs its checkpointer classes only to define the trainer-side manager, so a minimal
stand-in module is registered when the real one is missing (the import reads and
writes with cloudckpt alone).

Expected: every entry point that parses the metadata or reads the items refuses each
case with a typed error (R); ``inspect`` and ``verify`` do not decode items (ok for
the item cases: the bytes match the manifest). See docs/security.md.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct

from .corpus import META, MODEL, Step
from .tries import OK, REFUSED, Try, outside_untouched

READERS = ["load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify", "cli_export",
           "torchtitan_import"]
ITEM_READERS = {"load", "load_pre_download", "resume", "lightning", "cli_export", "torchtitan_import"}
SHARD0 = "__0_0.distcp"  # extra.n (a byte item), model.w, model.b
SHARD1 = "__0_1.distcp"  # optim.m
DEEP = 10**6


# ----------------------------------------------------------------- raw pickle fragments
def _idx(n: int) -> bytes:
    return struct.pack("<I", n)


def _put(n: int) -> bytes:
    return b"r" + _idx(n)  # LONG_BINPUT


def _get(n: int) -> bytes:
    return b"j" + _idx(n)  # LONG_BINGET


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + _idx(len(b)) + b  # BINUNICODE (every protocol from 1)


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL


def deep_tuple(n: int = DEEP) -> bytes:
    return b"K\x00" + b"\x85" * n


def deep_list(n: int = DEEP) -> bytes:
    return b"]" * n + b"a" * (n - 1)


def deep_dict(n: int = DEEP) -> bytes:
    return b"}" + b"K\x00}" * (n - 1) + b"s" * (n - 1)


def huge_int(digits: int = 4800) -> bytes:
    return pickle.dumps(10**digits, protocol=2)[2:-1]  # LONG4


def repeated_reduce(module: str, name: str, arg: bytes, times: int = 2000) -> bytes:
    """``module.name(ARG)`` called ``times`` times on one memoised argument tuple, each
    result dropped (the stack is as before): 2 MB that unpickle into ``times`` copies."""
    f, a = 10**7, 10**7 + 1
    return (_global(module, name) + _put(f) + b"0" + arg + b"\x85" + _put(a) + b"0"
            + (_get(f) + _get(a) + b"R0") * times)


def int_tuple(n: int, value: int = 1) -> bytes:
    return b"(" + pickle.dumps(value, protocol=2)[2:-1] * n + b"t"


# ----------------------------------------------------------------- metadata edits
class _Unframed(pickle._Pickler):  # type: ignore[name-defined]
    """Protocol 4 without FRAME opcodes: byte edits then keep every length in the pickle valid."""

    def dump(self, obj) -> None:
        self.framer.start_framing = lambda: None
        super().dump(obj)


def _dumps(obj, protocol: int) -> bytes:
    buf = io.BytesIO()
    _Unframed(buf, protocol).dump(obj)
    return buf.getvalue()


def _placeholder(name: str, protocol: int) -> bytes:
    return _dumps(name, protocol)[2:].split(b"\x94" if protocol >= 4 else b"q")[0]


def crafted(md, *, protocol: int = 4, fill: dict[str, bytes] | None = None, tail: bytes = b"") -> bytes:
    """``md`` pickled; each placeholder string (a key of ``fill``) replaced by the raw
    fragment that pushes the hostile value; ``tail`` run after the last object is built,
    before STOP (it leaves the stack as it found it; memo indices past the pickle's own)."""
    data = _dumps(md, protocol)
    for name, frag in (fill or {}).items():
        ph = _placeholder(name, protocol)
        assert data.count(ph) == 1, (name, data.count(ph))
        data = data.replace(ph, frag)
    assert data.endswith(b".")
    return data[:-1] + tail + b"."


def _chunk(offsets, sizes):
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _key(fqn: str, offsets=None):
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(fqn, None if offsets is None else torch.Size(offsets))


def _tensor(md, fqn: str, size, chunks) -> None:
    import torch

    sm = md.state_dict_metadata[fqn]
    sm.size = torch.Size(size)
    sm.chunks = chunks


def _item(md, fqn: str, offsets=(0,)):
    return md.storage_data[_key(fqn, offsets)]


# each case: (class, what, make(md, step) -> .metadata bytes, refusing entry points, also on S3)
CASES: dict[str, tuple[int, str, object, set[str], bool]] = {}


def case(name: str, klass: int, what: str, *, refusing: set[str] | None = None, s3: bool = False):
    def register(make):
        assert name not in CASES, name
        CASES[name] = (klass, what, make, set(READERS) if refusing is None else refusing, s3)
        return make
    return register


# --- class 4: depth, bounded while unpickling, before anything is hashed or printed
@case("md-key-tuple-deep", 4, "planner_data key: a tuple nested 10^6 deep (1 MB; hashing it overflows the C stack)",
      s3=True)
def _(md, s):
    md.planner_data = {"__DEEP__": 1}
    return crafted(md, fill={"__DEEP__": deep_tuple()})


@case("md-key-tuple-deep-p2", 4, "the same deep key in a protocol 2 pickle (DICT built by SETITEMS)")
def _(md, s):
    md.planner_data = {"a": 1, "__DEEP__": 2}
    return crafted(md, protocol=2, fill={"__DEEP__": deep_tuple()})


@case("md-set-member-deep", 4, "a set member nested 10^6 deep (set(list) hashes it)")
def _(md, s):
    md.planner_data = {"s": {"__DEEP__"}}
    return crafted(md, fill={"__DEEP__": deep_tuple()})


@case("md-frozenset-member-deep", 4, "a frozenset member nested 10^6 deep (FROZENSET opcode)")
def _(md, s):
    md.planner_data = {"s": frozenset({"__DEEP__"})}
    return crafted(md, fill={"__DEEP__": deep_tuple()})


@case("md-index-fqn-deep", 4, "a MetadataIndex whose fqn is a tuple nested 10^6 deep, as a storage_data key")
def _(md, s):
    key = _key("model.b", (0,))
    info = md.storage_data.pop(key)
    md.storage_data[_key("__DEEP__", (0,))] = info
    return crafted(md, fill={"__DEEP__": deep_tuple()})


@case("md-value-list-deep", 4, "planner_data value: a list nested 10^6 deep")
def _(md, s):
    md.planner_data = {"x": "__DEEP__"}
    return crafted(md, fill={"__DEEP__": deep_list()})


@case("md-value-dict-deep", 4, "planner_data value: a dict nested 10^5 deep")
def _(md, s):
    md.planner_data = {"x": "__DEEP__"}
    return crafted(md, fill={"__DEEP__": deep_dict(10**5)})


@case("md-key-tuple-33", 4, "planner_data key: a tuple nested 33 deep (one past the bound)")
def _(md, s):
    md.planner_data = {"__DEEP__": 1}
    return crafted(md, fill={"__DEEP__": deep_tuple(33)})


# --- class 6: bombs
@case("md-size-reduce-memo", 6, "REDUCE torch.Size 2,000 times on one memoised 10^6-item argument (16 GB from 2 MB)",
      s3=True)
def _(md, s):
    return crafted(md, tail=repeated_reduce("torch", "Size", int_tuple(DEEP)))


@case("md-size-reduce-64", 6, "REDUCE torch.Size 200,000 times on one memoised 64-dim argument (work past the budget)")
def _(md, s):
    return crafted(md, tail=repeated_reduce("torch", "Size", int_tuple(64), times=200_000))


@case("md-set-reduce-memo", 6, "REDUCE set 2,000 times on one memoised list of 10^6 distinct ints")
def _(md, s):
    distinct = b"(" + b"".join(b"J" + struct.pack("<i", i) for i in range(DEEP)) + b"l"
    return crafted(md, tail=repeated_reduce("builtins", "set", distinct))


@case("md-path-reduce-memo", 6, "REDUCE PurePosixPath 2,000 times on one memoised 1 MB string")
def _(md, s):
    return crafted(md, tail=repeated_reduce("pathlib", "PurePosixPath", _str("a" * (1 << 20))))


@case("md-offset-30k-dims", 6, "30,000 storage keys sharing one 30,000-dimension offset (copied per key)")
def _(md, s):
    import torch

    off = torch.Size([0] * 30_000)  # one object: pickled once, referenced by every key
    info = _item(md, "model.b")
    keys = [_key(f"k{i}") for i in range(30_000)]
    for k in keys:
        md.storage_data[k] = info
    for k in keys:  # after inserting: building the dict here would hash 9*10^8 elements
        object.__setattr__(k, "offset", off)
    return crafted(md)


@case("md-size-2e5-dims", 6, "a size of 200,000 dimensions of 2^62 (quadratic big-int element count)")
def _(md, s):
    md.state_dict_metadata["model.b"].size = "__SIZE__"
    return crafted(md, fill={"__SIZE__": _global("torch", "Size") + int_tuple(200_000, 1 << 62) + b"\x85R"})


@case("md-size-65-dims", 6, "a tensor of 65 dimensions (the bound is 64)")
def _(md, s):
    md.state_dict_metadata["model.b"].size = "__SIZE__"
    return crafted(md, fill={"__SIZE__": _global("torch", "Size") + int_tuple(65, 1) + b"\x85R"})


@case("md-chunks-1e6-one-item", 6, "10^6 chunks of one element, all on one item (DCP planning alone takes hours)")
def _(md, s):
    one = _chunk([0], [1])
    _tensor(md, "model.w", [DEEP], [one] * DEEP)
    return crafted(md)


@case("md-same-item-65536", 6, "the same 1 MiB item listed 65,536 times: 'covers' a 64 GiB tensor that readers "
      "would allocate", refusing=set(READERS))
def _(md, s):
    import torch

    _replace_items(md, s, {"model.w": _saved(torch.zeros(1 << 18))})
    c = _chunk([0], [1 << 18])
    _tensor(md, "model.w", [1 << 34], [c] * 65_536)
    return crafted(md)


@case("md-chunks-overlap", 6, "two chunks with their own items overlapping, leaving a quarter of the tensor unwritten")
def _(md, s):
    _overlap(md, [128], _chunk([0], [64]), _chunk([32], [64]), (32,))
    return crafted(md)


@case("md-chunks-overlap-2d", 6, "two 8x8 chunks of an 8x16 tensor overlapping in 4 columns")
def _(md, s):
    _overlap(md, [8, 16], _chunk([0, 0], [8, 8]), _chunk([0, 4], [8, 8]), (0, 4))
    return crafted(md)


@case("md-hash-flood", 6, "100,000 int keys with one hash value in planner_data (quadratic dict inserts)")
def _(md, s):
    md.planner_data = "__FLOOD__"  # raw: building this dict here would take the quadratic time itself
    keys = b"".join(pickle.dumps(k * ((1 << 61) - 1), protocol=2)[2:-1] + b"K\x00" for k in range(1, 100_001))
    return crafted(md, fill={"__FLOOD__": b"}(" + keys + b"u"})


@case("md-tensor-2e62", 6, "a tensor of 2^62 x 2^62 elements on one small item")
def _(md, s):
    _tensor(md, "model.b", [1 << 62, 1 << 62], [_chunk([0, 0], [1 << 62, 1 << 62])])
    md.storage_data[_key("model.b", (0, 0))] = md.storage_data.pop(_key("model.b", (0,)))
    return crafted(md)


# --- class 9: untyped errors (values a refusal used to print, objects checked outside the try)
def _big_field(field: str):
    def make(md, s):
        setattr(_item(md, "model.b"), field, "__BIG__")
        return crafted(md, fill={"__BIG__": huge_int()})
    return make


case("md-offset-4800-digits", 9, "an item's byte offset of 4,800 digits (formatting it raised ValueError)",
     s3=True)(_big_field("offset"))
case("md-length-4800-digits", 9, "an item's length of 4,800 digits")(_big_field("length"))


@case("md-chunk-4800-digits", 9, "a chunk size of 4,800 digits")
def _(md, s):
    md.state_dict_metadata["model.b"].chunks[0].sizes = "__BIG__"
    return crafted(md, fill={"__BIG__": _global("torch", "Size") + b"(" + huge_int() + b"t\x85R"})


@case("md-offset-deep-list", 9, "an item's byte offset: a list nested 10^6 deep (repr in a refusal)")
def _(md, s):
    _item(md, "model.b").offset = "__DEEP__"
    return crafted(md, fill={"__DEEP__": deep_list()})


@case("md-dtype-deep-list", 9, "a tensor's dtype: a list nested 10^6 deep")
def _(md, s):
    md.state_dict_metadata["model.b"].properties.dtype = "__DEEP__"
    return crafted(md, fill={"__DEEP__": deep_list()})


@case("md-info-no-path", 9, "a _StorageInfo without relative_path (AttributeError outside the try)")
def _(md, s):
    del _item(md, "model.b").__dict__["relative_path"]
    return crafted(md)


@case("md-chunk-no-sizes", 9, "a ChunkStorageMetadata without sizes")
def _(md, s):
    del md.state_dict_metadata["model.b"].chunks[0].__dict__["sizes"]
    return crafted(md)


@case("md-tensor-no-properties", 9, "a TensorStorageMetadata without properties")
def _(md, s):
    del md.state_dict_metadata["model.b"].__dict__["properties"]
    return crafted(md)


@case("md-build-twice", 9, "a storage key's state set twice after it was hashed into storage_data")
def _(md, s):
    data = crafted(md)
    return data[:-1] + _rebuild_first_index(data) + b"."  # a second BUILD of a key, then STOP


@case("md-negative-offset", 9, "a chunk at offset -32 (torch.Size accepts negative values)")
def _(md, s):
    md.state_dict_metadata["model.b"].chunks[0].offsets = "__NEG__"
    return crafted(md, fill={"__NEG__": _global("torch", "Size") + b"(J\xe0\xff\xff\xfft\x85R"})


@case("md-meta-item", 9, "model.w's item holds a tensor on the meta device (export wrote from address 0: SIGSEGV)",
      refusing=ITEM_READERS, s3=True)
def _(md, s):
    import torch

    _replace_items(md, s, {"model.w": _saved(torch.empty(64, device="meta"))})
    return crafted(md)


@case("md-sparse-item", 9, "model.w's item holds a sparse tensor", refusing=ITEM_READERS)
def _(md, s):
    import torch

    _replace_items(md, s, {"model.w": _saved(torch.zeros(64).to_sparse())})
    return crafted(md)


@case("md-short-item", 9, "model.w's item holds 8 elements, its chunk 64", refusing=ITEM_READERS)
def _(md, s):
    import torch

    _replace_items(md, s, {"model.w": _saved(torch.zeros(8))})
    return crafted(md)


@case("md-2d-item", 9, "model.w's item holds a 2x2 tensor for a 1-dimensional chunk", refusing=ITEM_READERS)
def _(md, s):
    import torch

    _replace_items(md, s, {"model.w": _saved(torch.zeros(2, 2))})
    return crafted(md)


# --- torchtitan import only: planner data, links in the folder
TITAN = {"torchtitan_import"}


@case("md-titan-planner-missing-key", 9, "planner_data lacks the path of model.b (KeyError)", refusing=TITAN)
def _(md, s):
    del md.planner_data["model.b"]
    return crafted(md)


@case("md-titan-planner-list-1e10", 6, "planner_data puts extra.n at list index 10^10 (a list extended to 10^10)",
      refusing=TITAN)
def _(md, s):
    md.planner_data["extra.n"] = ("extra", 10**10)
    return crafted(md)


@case("md-titan-planner-conflict", 9, "planner_data puts model.b inside model.w's tensor", refusing=TITAN)
def _(md, s):
    md.planner_data["model.b"] = ("model", "w", "b")
    return crafted(md)


@case("md-titan-planner-list", 9, "planner_data is a list, not DCP's map of paths", refusing=TITAN)
def _(md, s):
    md.planner_data = [("model", "w")]
    return crafted(md)


LINK_CASES = {
    "md-titan-shard-link": (SHARD0, "the torchtitan folder's shard is a link to a file outside (same bytes)"),
    "md-titan-metadata-link": (".metadata", "the torchtitan folder's .metadata is a link to a file outside"),
}


# ----------------------------------------------------------------- helpers for the item cases
def _saved(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


_PENDING: dict[str, bytes] = {}


def _replace_items(md, s: Step, repl: dict[str, bytes]) -> None:
    """Rewrite the shard holding the items of ``repl`` (``{fqn: bytes}``) with those
    bytes, the other items kept, every offset and length in ``md`` updated; the new
    shard is written when the case's metadata is (``attack``)."""
    by_file: dict[str, list] = {}
    for key, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, key, info))
    for rel, items in by_file.items():
        if not any(k.fqn in repl for _, k, _ in items):
            continue
        old = s.get(f"{MODEL}/{rel}")
        out = bytearray()
        for off, key, info in sorted(items, key=lambda x: x[0]):
            data = repl.get(key.fqn, old[off: off + info.length])
            info.offset, info.length = len(out), len(data)
            out += data
        _PENDING[rel] = bytes(out)


def _overlap(md, size, a, b, b_offsets) -> None:
    """model.w of ``size`` in two chunks ``a`` (model.w's item) and ``b`` (optim.m's item,
    optim.m dropped): each chunk has its own item, distinct offsets, sum = numel."""
    info_m = md.storage_data.pop(_key("optim.m", (0,)))
    del md.state_dict_metadata["optim.m"]
    md.planner_data.pop("optim.m", None)
    info_w = md.storage_data.pop(_key("model.w", (0,)))
    md.storage_data[_key("model.w", tuple(a.offsets))] = info_w
    md.storage_data[_key("model.w", b_offsets)] = info_m
    _tensor(md, "model.w", size, [a, b])


def _rebuild_first_index(data: bytes) -> bytes:
    """A fragment that BUILDs the first MetadataIndex of the pickle again with another
    fqn: its memo index is the MEMOIZE after its NEWOBJ."""
    memo = 0
    seen_index = False
    for op, arg, _ in pickletools.genops(data):
        if op.name == "MEMOIZE":
            if seen_index == "newobj":
                break
            memo += 1
        if op.name == "STACK_GLOBAL" and seen_index == "name":
            seen_index = "global"
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE") and arg == "MetadataIndex":
            seen_index = "name"
        if op.name == "NEWOBJ" and seen_index == "global":
            seen_index = "newobj"
    return _get(memo) + b"}" + _str("fqn") + _str("other") + b"sb0"


# ----------------------------------------------------------------- the try
def _titan_available() -> None:
    """Register a stand-in for torchtitan's checkpointer module when torchtitan is not
    installed (see the module docstring); the real one is used when it is."""
    import dataclasses
    import sys
    import types

    try:
        import torchtitan.components.checkpointer  # noqa: F401
        return
    except ImportError:
        pass
    m = types.ModuleType("torchtitan.components.checkpointer")
    for n in ("DATALOADER", "LR_SCHEDULER", "MODEL", "OPTIMIZER"):
        setattr(m, n, n.lower())

    class _Manager:
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config:
            enable: bool = False

            def __post_init__(self) -> None:
                pass

    m.BaseCheckpointManager, m.CheckpointManager, m.ModelWrapper = object, _Manager, object
    for name in ("torchtitan", "torchtitan.components"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["torchtitan.components.checkpointer"] = m


def _titan_folder(tmp: str, s: Step) -> str:
    src = os.path.join(tmp, "titan", "step-1")
    os.makedirs(src)
    for name in (".metadata", SHARD0, SHARD1):
        with open(os.path.join(src, name), "wb") as f:
            f.write(s.get(f"{MODEL}/{name}"))
    return src


def _import(tmp: str, root: str, src: str) -> None:
    _titan_available()
    from cloudckpt.integrations.torchtitan import import_torchtitan_step
    from cloudckpt.storage import url as urls

    import_torchtitan_step(src, urls.join(root, "imported"), work_dir=os.path.join(tmp, "work"))


def attack(tmp: str, root: str, case: str, entry: str) -> None:
    import pickle as stock

    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    from .tries import cached, honest_step, run_entry

    step = honest_step(root)
    s = Step(open_store(step), step, urls.join)

    def make() -> bytes:
        md = stock.loads(s.get(META))  # our own honest metadata: safe to unpickle
        _PENDING.clear()
        return stock.dumps((CASES[case][2](md, s), dict(_PENDING)))

    # built once per sandbox: every try starts from the same honest step, so the crafted bytes are the same
    data, pending = stock.loads(cached(f"metadata-{case}", make))  # our own pickle of bytes: safe
    for rel, shard in pending.items():
        s.put(f"{MODEL}/{rel}", shard)
    s.put(META, data)
    with outside_untouched(tmp):
        if entry == "torchtitan_import":
            _import(tmp, root, _titan_folder(tmp, s))
        else:
            run_entry(entry, step=step, folder=root, tmp=tmp)


def attack_link(tmp: str, root: str, case: str) -> None:
    """A torchtitan folder whose file is a link to a copy outside: a reader that follows
    it imports the step (ok); one that does not refuses."""
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    from .tries import honest_step

    step = honest_step(root)
    s = Step(open_store(step), step, urls.join)
    src = _titan_folder(tmp, s)
    name = LINK_CASES[case][0]
    target = os.path.join(tmp, "outside", f"titan-{name.lstrip('.')}")
    os.replace(os.path.join(src, name), target)  # before the snapshot: it is a planted file
    os.symlink(target, os.path.join(src, name))
    with outside_untouched(tmp):
        _import(tmp, root, src)


def honest_import(tmp: str, root: str) -> dict:
    """The control: an untouched torchtitan folder imports and loads back."""
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    from .tries import honest_step

    step = honest_step(root)
    src = _titan_folder(tmp, Step(open_store(step), step, urls.join))
    with outside_untouched(tmp):
        _import(tmp, root, src)
    return {"imported": True}


# Cases whose refusal costs seconds of parsing in each try (a budget reached, a structure
# 10^6 deep walked): through one entry point of each reader of ``.metadata`` instead of
# all eight: Lightning for the library (a crafted ``.metadata`` comes without the DCP index,
# so Checkpointer.load_with parses it whole, as a plain load does), inspect for the CLI
# (inspect, verify and export parse it in step_files), the torchtitan import (its own
# reader). Every entry point meets each class through the cheaper cases.
PARSER_BUDGET = {"md-set-reduce-memo", "md-size-reduce-64", "md-chunks-1e6-one-item",
                 "md-dtype-deep-list", "md-offset-deep-list", "md-value-list-deep"}
ONE_PER_READER = ["lightning", "cli_inspect", "torchtitan_import"]


def _entries(name: str) -> list[str]:
    """The planner-data cases concern the torchtitan import alone (DCP's own load never
    reads planner data back); the costly parser cases go through one entry point per
    reader (:data:`PARSER_BUDGET`); every other case goes through every reader."""
    refusing = CASES[name][3]
    return sorted(TITAN) if refusing == TITAN else ONE_PER_READER if name in PARSER_BUDGET else READERS


TRIES: list[Try] = [
    Try(klass=klass, case=name, what=what, entry=entry, target="tests.security.hostile_metadata:attack",
        kwargs={"case": name, "entry": entry}, expect=REFUSED if entry in refusing else OK, backend=backend,
        timeout=60.0)
    for name, (klass, what, _, refusing, s3) in CASES.items()
    for backend in (("local", "s3") if s3 else ("local",))
    for entry in _entries(name)
] + [
    Try(klass=1, case=name, what=what, entry="torchtitan_import", target="tests.security.hostile_metadata:attack_link",
        kwargs={"case": name}, expect=REFUSED, backend=backend, timeout=60.0)
    for name, (_, what) in LINK_CASES.items() for backend in ("local", "s3")
] + [
    Try(klass=9, case="md-titan-honest", what="control: an honest torchtitan folder is imported and loads back",
        entry="torchtitan_import", target="tests.security.hostile_metadata:honest_import", expect=OK,
        backend=backend, timeout=60.0)
    for backend in ("local", "s3")
]
