"""A corpus of crafted checkpoints: what a hostile writer of a bucket or a shared
folder could put in a step. Each case starts from an honest committed step and
rewrites some of its objects *and* the marker's manifest to match them (sizes and
CRC32Cs consistent), so that only the reader's own checks can stop it.

The marker is rewritten as raw JSON from the schema in docs/architecture (not with
the library's Marker class), so these cases do not depend on the code they attack.

Run ``python -m tests.security.corpus OUT`` to write the corpus into a local folder
(one save folder per case) and look at it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Callable

import google_crc32c
import torch

from .tries import honest_state  # the honest step every case starts from

MODEL = "model_and_optim"
META = f"{MODEL}/.metadata"
INDEX_HEADER = "index/header.json"  # the DCP index (cloudckpt/dcp/index/)
TRAIN = "train/rank0.pt"


def crc(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


class Step:
    """Raw access to one committed step: objects by relative path, the marker as JSON."""

    def __init__(self, store, url: str, join: Callable[..., str]):
        self.store, self.url, self.join = store, url, join

    def get(self, rel: str) -> bytes:
        return self.store.get_bytes(self.join(self.url, rel))

    def marker(self) -> dict:
        from cloudckpt.checkpoint.parts import as_part_list  # format 3's part columns, edited as format 2's list

        return as_part_list(json.loads(self.get(".metadata.json")))

    def put_marker(self, d: dict | bytes) -> None:
        body = d if isinstance(d, bytes) else json.dumps(d).encode()
        self.store.put_bytes(self.join(self.url, ".metadata.json"), body)

    def put(self, rel: str, data: bytes, *, listed_as: str | None = None) -> None:
        """Write ``data`` at ``rel`` and make the manifest entry ``listed_as`` (default
        ``rel``) match it: size and CRC32C, no item chunks. A crafted DCP ``.metadata``
        comes without the step's DCP index (an attacker who writes one removes the index
        too): loads then plan from ``.metadata``, as for a step written by another tool."""
        self.store.put_bytes(self.join(self.url, rel), data)
        self.relist(listed_as or rel, len(data), crc(data))
        if (listed_as or rel) == META:
            self.unlist(INDEX_HEADER)

    def unlist(self, rel: str) -> None:
        """Remove ``rel``'s manifest entry (the object stays)."""
        def edit(objects: list) -> bool:
            objects[:] = [o for o in objects if o["path"] != rel]
            return True

        self._edit_entry(rel, edit)

    def relist(self, rel: str, size: int, crc32c: str | None) -> None:
        def edit(objects: list) -> bool:
            for o in objects:
                if o["path"] == rel:
                    o.update(size=size, crc32c=crc32c)
                    o.pop("chunks", None)
                    return True
            return False

        self._edit_entry(rel, edit, add={"path": rel, "size": size, "crc32c": crc32c})

    def _edit_entry(self, rel: str, edit, add: dict | None = None) -> None:
        """Apply ``edit(objects)`` to the list that holds ``rel``: the marker's, or (format
        2) its rank's manifest part, whose reference in the marker is made to match."""
        from cloudckpt.checkpoint.layout import owner_of

        d = self.marker()
        parts = {p["rank"]: p for p in d.get("parts", [])}
        owner = owner_of(rel)
        if owner in parts:
            ref = parts[owner]
            part = json.loads(self.get(ref["path"]))
            if not edit(part["objects"]) and add is not None:
                part["objects"].append(add)
            body = json.dumps(part).encode()
            self.store.put_bytes(self.join(self.url, ref["path"]), body)
            ref.update(size=len(body), crc32c=crc(body), objects=len(part["objects"]),
                       bytes=sum(o["size"] for o in part["objects"]))
        elif not edit(d["objects"]) and add is not None:
            d["objects"].append(add)
        d["total_bytes"] = sum(o["size"] for o in d["objects"]) + sum(p["size"] + p["bytes"] for p in parts.values())
        d["object_count"] = len(d["objects"]) + sum(1 + p["objects"] for p in parts.values())
        self.put_marker(d)

    def rename(self, old: str, new: str) -> None:
        """Move an object to a new name (the crafted name) and list it under that name."""
        data = self.get(old)

        def edit(objects: list) -> bool:
            for o in objects:
                if o["path"] == old:
                    o["path"] = new
            return True

        self._edit_entry(old, edit)
        if "\x00" not in new and not new.startswith("/") and ".." not in new.split("/"):
            try:
                self.store.put_bytes(self.join(self.url, new), data)
            except Exception:  # noqa: BLE001 - some names cannot exist on some stores: the marker still lists it
                pass


# ------------------------------------------------------------------ raw pickles
def _s(proto: int, text: str) -> bytes:
    b = text.encode()
    if proto == 0:
        return b"V" + b + b"\n"
    return b"X" + struct.pack("<I", len(b)) + b


def _global(proto: int, module: str, name: str) -> bytes:
    if proto >= 4:
        return _s(proto, module) + _s(proto, name) + b"\x93"  # STACK_GLOBAL
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def call(proto: int, module: str, name: str, *args: str) -> bytes:
    """A pickle that calls ``module.name(*args)`` (REDUCE)."""
    head = b"" if proto < 2 else b"\x80" + bytes([proto])
    return head + _global(proto, module, name) + b"(" + b"".join(_s(proto, a) for a in args) + b"tR."


def inst(module: str, name: str, *args: str) -> bytes:
    """Protocol 0 INST: ``module.name(*args)`` without REDUCE."""
    return b"(" + b"".join(_s(0, a) for a in args) + b"i" + module.encode() + b"\n" + name.encode() + b"\n."


def obj(module: str, name: str, *args: str) -> bytes:
    """Protocol 1 OBJ: ``cls(*args)``."""
    return b"(" + _global(1, module, name) + b"".join(_s(1, a) for a in args) + b"o."


def newobj_ex(module: str, name: str) -> bytes:
    return b"\x80\x04" + _global(4, module, name) + b")}\x92."


def build_on_class(module: str, name: str) -> bytes:
    """BUILD with slot state on a class object: would set a class attribute (pollution)."""
    return (b"\x80\x04" + _global(4, module, name) + b"N}" + _s(4, "__repr__") + _global(4, "torch", "Size")
            + b"s\x86b.")


def reduce_dataclass() -> bytes:
    """Call DCP's Metadata class through REDUCE (only NEWOBJ+BUILD of it is allowed)."""
    return b"\x80\x04" + _global(4, "torch.distributed.checkpoint.metadata", "Metadata") + b"}\x85R."


class _Runs:
    """Unpickling this calls ``open(path, "w")``: a file appears if code ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _BigArray:
    """A numpy array constructor call with a huge shape (an allocation bomb)."""

    def __reduce__(self):
        import numpy as np

        try:
            from numpy._core.multiarray import _reconstruct
        except ImportError:  # numpy 1
            from numpy.core.multiarray import _reconstruct
        return (_reconstruct, (np.ndarray, (1 << 40,), b"b"))


class _RandomState:
    def __reduce__(self):
        import numpy as np

        return (np.random.RandomState, (1,))


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ------------------------------------------------------------------ metadata edits
def edited_metadata(step: Step, edit: Callable) -> None:
    """Unpickle our own honest .metadata (we wrote it), edit the objects, pickle again."""
    md = pickle.loads(step.get(META))
    edit(md)
    step.put(META, pickle.dumps(md, protocol=4))


def _first_info(md):
    key = sorted(md.storage_data, key=lambda k: k.fqn)[0]
    return key, md.storage_data[key]


def set_path(path: str):
    def edit(md):
        for info in md.storage_data.values():
            info.relative_path = path
    return edit


def set_range(offset: int | None = None, length: int | None = None):
    def edit(md):
        _, info = _first_info(md)
        if offset is not None:
            info.offset = offset
        if length is not None:
            info.length = length
    return edit


def overlap(md):
    infos = sorted(md.storage_data.values(), key=lambda i: (i.relative_path, i.offset))
    infos[1].relative_path, infos[1].offset = infos[0].relative_path, infos[0].offset + 1


def huge_tensor(md):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    sm = md.state_dict_metadata["model.w"]
    old = sm.chunks[0].offsets
    big = torch.Size([1 << 40])
    sm.size = big
    sm.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=big)]
    info = md.storage_data.pop(MetadataIndex("model.w", old))
    md.storage_data[MetadataIndex("model.w", torch.Size([0]))] = info


def chunk_outside(md):
    sm = md.state_dict_metadata["model.w"]
    sm.chunks[0].offsets = torch.Size([10])


def field_injection(md):
    _, info = _first_info(md)
    info.__dict__["evil"] = "x"


def storage_not_dict(md):
    md.storage_data = list(md.storage_data.values())


def planner_bomb(md):
    shared = list(range(20_000))
    md.planner_data = {f"k{i}": shared for i in range(20_000)}


def planner_deep(md):
    x: list = []
    for _ in range(400):
        x = [x]
    md.planner_data = x


def nested_pickle_factory(sentinel: str):
    def edit(md):
        md.planner_data = {"inner": pickle.dumps(_Runs(sentinel))}  # bytes: never unpickled by us
    return edit


# ------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    name: str
    target: str  # "metadata" | "marker" | "train_state" | "byte_item" | "link" | "nested"
    what: str
    apply: Callable  # (step: Step, ctx: Ctx) -> None
    local_only: bool = False


@dataclass
class Ctx:
    sentinel: str  # a path a payload would create if code ran
    outside: str  # a local folder outside every folder cloudckpt was given
    folder: str  # the save folder (local cases: a plain path)


def _meta(fn):
    return lambda step, ctx: step.put(META, fn(ctx))


CASES: list[Case] = [
    # --- pickle gadgets in DCP .metadata
    Case("p0-global-call", "metadata", "protocol 0 GLOBAL posix.system + REDUCE",
         _meta(lambda c: call(0, "posix", "system", f"touch {c.sentinel}"))),
    Case("p2-global-call", "metadata", "protocol 2 GLOBAL builtins.open + REDUCE",
         _meta(lambda c: call(2, "builtins", "open", c.sentinel, "w"))),
    Case("p3-global-call", "metadata", "protocol 3 GLOBAL os.system + REDUCE",
         _meta(lambda c: call(3, "os", "system", f"touch {c.sentinel}"))),
    Case("p4-dotted-through-dcp", "metadata",
         "protocol 4 STACK_GLOBAL torch.distributed.checkpoint.filesystem + 'os.system' (attribute walk)",
         _meta(lambda c: call(4, "torch.distributed.checkpoint.filesystem", "os.system", f"touch {c.sentinel}"))),
    Case("p4-dotted-through-metadata-module", "metadata",
         "protocol 4 STACK_GLOBAL torch.distributed.checkpoint.metadata + 'torch.serialization.os.system'",
         _meta(lambda c: call(4, "torch.distributed.checkpoint.metadata", "torch.serialization.os.system",
                              f"touch {c.sentinel}"))),
    Case("p5-builtins-eval", "metadata", "protocol 5 STACK_GLOBAL builtins.eval",
         _meta(lambda c: call(5, "builtins", "eval", f"open({c.sentinel!r}, 'w')"))),
    Case("p2-dotted-global", "metadata", "protocol 2 GLOBAL with a dotted name (torch + _C._dl... style)",
         _meta(lambda c: call(2, "torch.distributed.checkpoint.filesystem", "os.system", f"touch {c.sentinel}"))),
    Case("inst-opcode", "metadata", "protocol 0 INST posix.system",
         _meta(lambda c: inst("posix", "system", f"touch {c.sentinel}"))),
    Case("obj-opcode-allowed-class", "metadata", "protocol 1 OBJ on an allowed class (pathlib.PosixPath)",
         _meta(lambda c: obj("pathlib", "PosixPath", c.sentinel))),
    Case("newobj-ex", "metadata", "NEWOBJ_EX on an allowed dataclass",
         _meta(lambda c: newobj_ex("torch.distributed.checkpoint.metadata", "Metadata"))),
    Case("build-on-class", "metadata", "BUILD with slot state on the Metadata class (class pollution)",
         _meta(lambda c: build_on_class("torch.distributed.checkpoint.metadata", "Metadata"))),
    Case("reduce-dataclass", "metadata", "REDUCE calling the Metadata class",
         _meta(lambda c: reduce_dataclass())),
    Case("persistent-id", "metadata", "BINPERSID (persistent load)",
         _meta(lambda c: b"\x80\x02" + _s(2, "storage") + b"Q.")),
    Case("ext-registry", "metadata", "EXT1 (copyreg extension registry)",
         _meta(lambda c: b"\x80\x02\x82\x01.")),
    Case("reduce-in-pickle", "metadata", "a __reduce__ gadget (builtins.open) pickled by pickle itself",
         _meta(lambda c: pickle.dumps(_Runs(c.sentinel), protocol=4))),
    # --- hostile names and fields in a well-formed .metadata
    Case("meta-path-dotdot", "metadata", "relative_path climbing out with ../",
         lambda s, c: edited_metadata(s, set_path(f"../../{os.path.basename(c.outside)}/victim"))),
    Case("meta-path-absolute", "metadata", "relative_path absolute",
         lambda s, c: edited_metadata(s, set_path(os.path.join(c.outside, "victim")))),
    Case("meta-path-backslash", "metadata", "relative_path with backslashes",
         lambda s, c: edited_metadata(s, set_path("..\\..\\victim"))),
    Case("meta-path-nul", "metadata", "relative_path with a NUL byte",
         lambda s, c: edited_metadata(s, set_path("__0_0.distcp\x00.txt"))),
    Case("meta-path-long", "metadata", "relative_path of 5000 characters",
         lambda s, c: edited_metadata(s, set_path("a" * 5000))),
    Case("meta-path-lookalike", "metadata", "relative_path with unicode look-alikes of ../ (U+FF0E, U+2215)",
         lambda s, c: edited_metadata(s, set_path("\uff0e\uff0e\u2215victim"))),
    Case("meta-negative-offset", "metadata", "an item with a negative offset",
         lambda s, c: edited_metadata(s, set_range(offset=-8))),
    Case("meta-length-past-file", "metadata", "an item running past the end of its file (size lie)",
         lambda s, c: edited_metadata(s, set_range(length=1 << 40))),
    Case("meta-overlap", "metadata", "two items overlapping in one file",
         lambda s, c: edited_metadata(s, overlap)),
    Case("meta-huge-tensor", "metadata", "a tensor claiming 2^40 elements (allocation bomb)",
         lambda s, c: edited_metadata(s, huge_tensor)),
    Case("meta-chunk-outside", "metadata", "a chunk lying outside its tensor",
         lambda s, c: edited_metadata(s, chunk_outside)),
    Case("meta-field-injection", "metadata", "a _StorageInfo with a field DCP does not have",
         lambda s, c: edited_metadata(s, field_injection)),
    Case("meta-storage-not-dict", "metadata", "storage_data of the wrong type",
         lambda s, c: edited_metadata(s, storage_not_dict)),
    Case("meta-shared-bomb", "metadata", "one 20k-element list shared by 20k keys (4e8 elements to walk)",
         lambda s, c: edited_metadata(s, planner_bomb)),
    Case("meta-deep", "metadata", "planner data nested 400 deep",
         lambda s, c: edited_metadata(s, planner_deep)),
    Case("meta-nested-pickle", "nested", "a pickle gadget as bytes inside the metadata (never unpickled)",
         lambda s, c: edited_metadata(s, nested_pickle_factory(c.sentinel))),
    # --- the marker
    Case("marker-path-dotdot", "part", "an object path climbing out with ../",
         lambda s, c: s.rename(TRAIN, "../../victim")),
    Case("marker-path-absolute", "part", "an absolute object path",
         lambda s, c: s.rename(TRAIN, os.path.join(c.outside, "victim"))),
    Case("marker-path-backslash", "part", "an object path with backslashes",
         lambda s, c: s.rename(TRAIN, "train\\..\\..\\victim")),
    Case("marker-path-control", "part", "an object path with a NUL and an escape character",
         lambda s, c: s.rename(TRAIN, "train/rank0\x00\x1b.pt")),
    Case("marker-path-long", "part", "an object path of 5000 characters",
         lambda s, c: s.rename(TRAIN, "t/" + "a" * 5000)),
    Case("marker-duplicate", "marker", "the same object path listed twice",
         lambda s, c: _duplicate(s)),
    Case("marker-size-lie", "marker", "the train state declared at 2^40 bytes (allocation bomb)",
         lambda s, c: s.relist(TRAIN, 1 << 40, None)),
    Case("marker-chunks-overlap", "part", "item ranges in the manifest overlapping",
         lambda s, c: _chunks_overlap(s)),
    Case("marker-json-deep", "marker", "a marker nested 100000 deep (JSON bomb)",
         lambda s, c: s.put_marker(b"[" * 100_000 + b"]" * 100_000)),
    Case("marker-big-int", "marker", "a step of 100000 digits",
         lambda s, c: s.put_marker(s.get(".metadata.json").replace(
             b'"step":', b'"step":' + b"9" * 100_000 + b", \"x\":"))),
    # --- train state and DCP byte items
    Case("train-state-gadget", "train_state", "a train state whose pickle calls builtins.open",
         lambda s, c: s.put(TRAIN, torch_saved({"step": 1, "x": _Runs(c.sentinel)}))),
    Case("train-state-numpy-bomb", "train_state", "numpy's _reconstruct with 2^40 elements",
         lambda s, c: s.put(TRAIN, torch_saved({"step": 1, "rng": _BigArray()}))),
    Case("train-state-numpy-other", "train_state", "a numpy global outside the exact list (RandomState)",
         lambda s, c: s.put(TRAIN, torch_saved({"step": 1, "rng": _RandomState()}))),
    Case("byte-item-gadget", "byte_item", "a DCP byte item (non-tensor value) whose pickle calls builtins.open",
         lambda s, c: _byte_item_gadget(s, c)),
    # --- links planted in a local save folder
    Case("link-as-step", "link", "a link step99 -> a folder outside, beside the committed step",
         lambda s, c: os.symlink(c.outside, os.path.join(c.folder, "step99")), local_only=True),
    Case("link-as-shard", "link", "a shard replaced by a link to a file outside",
         lambda s, c: _link_object(s, c, f"{MODEL}/__0_0.distcp"), local_only=True),
    Case("link-as-train-dir", "link", "the train/ folder replaced by a link to a folder outside",
         lambda s, c: _link_dir(s, c, "train"), local_only=True),
    Case("link-as-pointer", "link", "the latest pointer replaced by a link to a file outside",
         lambda s, c: _link_pointer(c), local_only=True),
]


# ------------------------------------------------------------------ expected outcomes
CORPUS_ENTRIES = ["load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify", "cli_export",
                  "cli_download", "cli_list", "cli_gc", "cli_prune"]

# which entry points parse which crafted part (the rest never read it: ok)
_PARSES = {
    "metadata": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify", "cli_export"},
    "marker": set(CORPUS_ENTRIES) - {"cli_gc", "cli_prune"},  # gc and prune leave a step they cannot read alone
    # an entry of a rank's manifest part (format 2): what reads the parts; list reads markers only
    "part": set(CORPUS_ENTRIES) - {"cli_gc", "cli_prune", "cli_list"},
    "train_state": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify"},
    "byte_item": {"load", "load_pre_download", "resume"},  # the Lightning plugin keeps non-tensors in its train state
    "nested": set(),
}
_OVERRIDES = {
    # only the train state's declared size lies: readers of the train state refuse, and so do
    # verify and download (size compare); export and list do not read it
    "marker-size-lie": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify",
                        "cli_download"},
    "link-as-step": set(),  # step1 itself is honest; the link beside it is never followed (see test_links)
    "link-as-shard": {"load", "load_pre_download", "resume", "lightning", "cli_verify", "cli_export", "cli_download"},
    "link-as-train-dir": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify",
                          "cli_download"},
    "link-as-pointer": set(),  # the pointer is only a hint: discovery lists instead of following it
}


def expected(case: Case, entry: str) -> str:
    """"refused" (a typed error; resume and list: the step is not used) or "ok" (that
    entry point does not read the crafted part)."""
    refusing = _OVERRIDES.get(case.name, _PARSES.get(case.target, set()))
    return "refused" if entry in refusing else "ok"


def entry_point(tmp: str, step: str, folder: str, entry: str, honest: bool) -> dict:
    """Run in the sandbox by test_corpus: ``entry`` on the crafted ``step``. Returns
    ``{"outcome": "ok" | "refused", "message": ..., "polluted": ...}``; a refusal is
    CorruptCheckpoint, NotACheckpoint, a CLI exit 1 or 3, or the step not being used;
    any other error escapes (the test fails with the sandbox's result)."""
    from torch.distributed.checkpoint import metadata as dcp_md

    from cloudckpt.errors import CorruptCheckpoint, NotACheckpoint

    from .tries import CliRefused, NotUsed, run_entry

    repr_before = dcp_md.Metadata.__dict__.get("__repr__")
    try:
        outcome, message = "ok", run_entry(entry, step=step, folder=folder, tmp=tmp, check_honest=honest)
    except (CorruptCheckpoint, NotACheckpoint, NotUsed) as e:
        outcome, message = "refused", f"{type(e).__name__}: {e}"
    except CliRefused as e:
        if e.code not in (1, 3):
            raise
        outcome, message = "refused", str(e)
    return {"outcome": outcome, "message": message[:4000],
            "polluted": dcp_md.Metadata.__dict__.get("__repr__") is not repr_before}


def _duplicate(s: Step) -> None:
    d = s.marker()
    d["objects"].append(dict(d["objects"][0]))
    s.put_marker(d)


def _chunks_overlap(s: Step) -> None:
    def edit(objects: list) -> bool:
        for o in objects:
            if o.get("chunks") and len(o["chunks"]) >= 2:
                o["chunks"][1][0] = o["chunks"][0][0]
                return True
        raise AssertionError("no object with two item chunks")

    s._edit_entry(f"{MODEL}/__0_0.distcp", edit)  # in rank 0's manifest part (format 2)


def _byte_item_gadget(s: Step, c: Ctx) -> None:
    import tempfile

    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d:
        state = honest_state()
        state["extra"] = {"n": _Runs(c.sentinel)}
        dcp.save(state, checkpoint_id=d, no_dist=True)
        names = sorted(os.listdir(d))
        marker = s.marker()
        marker["objects"] = [o for o in marker["objects"] if not o["path"].startswith(MODEL + "/")]
        s.put_marker(marker)
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                s.put(f"{MODEL}/{n}", f.read())


def _link_object(s: Step, c: Ctx, rel: str) -> None:
    path = os.path.join(s.url, rel)
    target = os.path.join(c.outside, "victim")
    with open(path, "rb") as f, open(target, "wb") as g:
        g.write(f.read())  # same bytes: size and CRC32C match, only the link decides
    os.unlink(path)
    os.symlink(target, path)


def _link_dir(s: Step, c: Ctx, rel: str) -> None:
    import shutil

    path = os.path.join(s.url, rel)
    target = os.path.join(c.outside, rel)
    shutil.copytree(path, target)
    shutil.rmtree(path)
    os.symlink(target, path)


def _link_pointer(c: Ctx) -> None:
    target = os.path.join(c.outside, "latest-target")
    with open(target, "w") as f:
        f.write("1")
    path = os.path.join(c.folder, "latest")
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)


def write_corpus(out: str) -> list[str]:
    """Write every case that works on a local folder into ``out/<case>/step1``."""
    from cloudckpt import Checkpointer
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    outside = os.path.join(out, "_outside")
    os.makedirs(outside, exist_ok=True)
    done = []
    for case in CASES:
        folder = os.path.join(out, case.name)
        step = os.path.join(folder, "step1")
        Checkpointer(work_dir=os.path.join(out, "_work")).save(step, honest_state(), {"step": 1})
        case.apply(Step(open_store(step), step, urls.join),
                   Ctx(sentinel=os.path.join(outside, "SENTINEL"), outside=outside, folder=folder))
        done.append(case.name)
    return done


if __name__ == "__main__":  # pragma: no cover - a tool for people
    import sys

    print("\n".join(write_corpus(sys.argv[1])))
