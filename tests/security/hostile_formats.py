"""Crafted objects of the step formats added since the third round (issue: hostile bytes
on the new surface), through every reader that meets them first.

- the DCP index header's newer fields (``index/header.json``, version 2): grid layouts
  with cut rules ``{"every", "end"}``, owner rules ``{"start", "step"}``, dtypes that are
  not names, ``values`` outside the shard files or shadowing a tensor, a version-2 grid
  in a version-1 header, a layout's inline items in another rank's file;
- a rank's DCP index part (``index/rank{R}.json``): fields of the wrong type (``"rank":
  false`` for rank 0 was taken for it), items duplicated or of mismatched sizes, an
  item past its file;
- a rank's manifest part (``manifest/rank{R}.json``): its step, rank and format as a bool
  or a float (``1.0`` was taken for step 1), item chunks that overlap or whose CRC32C
  is not hex, objects not a list;
- the marker's part columns (format 3): a column more, ranks as bools or not runs, part
  sizes over 1 GiB, object counts past what a part can hold;
- a marker mixing format 2 and format 3 fields: format 2 with columns, format 3 with a
  list or without parts, format 1 carrying columns (read as format 1: no parts, so the
  ranks' files are not the step's), format 3 with a rank's file listed beside the parts;
- the same crafted header and part through the node-local tier's resume
  (``tier-*`` cases: a local step whose files and ``part.json`` are made to match).

Each case starts from an honest committed step (``tries.honest_step``, one rank) with
every manifest entry and reference made to match the crafted bytes (the attacker
controls the whole step). Class 9 (typed refusals); a crash, bomb, hang, untyped error
or a change outside is a finding. The part references a load's coordinator hands the
other ranks (``parts.encode_refs``/``decode_refs``) travel over the job's own process
group, which is trusted (docs/security.md, threat model); ``tests/security/
test_format_fuzz.py`` fuzzes every parser here and those references' round trip.
"""

from __future__ import annotations

import json
import os

from .corpus import Step, crc
from .hostile_index import ENTRIES as HEADER_READERS
from .hostile_index import _header, _put_header
from .hostile_manifest import MARKER_READERS, PART_READERS
from .tries import ENTRY_POINTS, OK, REFUSED, NotUsed, Try, honest_step, outside_untouched, run_entry

PART = "manifest/rank0.json"
INDEX_PART = "index/rank0.json"


def _set(field: str, value):
    """A document (a marker, a part) with ``field`` set to ``value``."""
    def edit(p: dict) -> dict:
        p[field] = value
        return p
    return edit


def _ignoring_key(edit):
    """A document edit as a header edit (which is also given the tensor's key)."""
    return lambda doc, key: edit(doc)


# ----------------------------------------------------------------- the DCP index header
def _tensor(doc: dict, key: str) -> list:
    return next(t for t in doc["tensors"] if t[0] == key)


def _layout(layout: dict, *, version: int = 2):
    """``key``'s layout made ``layout`` (1-d; the tensor is [64])."""
    def edit(doc: dict, key: str) -> dict:
        t = _tensor(doc, key)
        doc["layouts"].append({"ndim": 1, **layout})
        t[3], t[4] = len(doc["layouts"]) - 1, None
        doc["version"] = version
        return doc
    return edit


def _set_tensor(i: int, value):
    def edit(doc: dict, key: str) -> dict:
        _tensor(doc, key)[i] = value
        return doc
    return edit


def _add_value(entry_of):
    def edit(doc: dict, key: str) -> dict:
        item = _tensor(doc, key)[4]
        doc["values"].append(entry_of(key, item))
        return doc
    return edit


HEADER_CASES = {
    "hdr-cut-every-zero": ("a grid's cut rule every 0", _layout({"cuts": [{"every": 0, "end": 64}], "owners": [0]})),
    "hdr-cut-rule-2-62-chunks": ("a cut rule of 2^62 chunks, one owner listed", _layout(
        {"cuts": [{"every": 1, "end": 1 << 62}], "owners": [0]})),
    "hdr-cut-rule-short": ("a cut rule that ends at 48 in a tensor of 64", _layout(
        {"cuts": [{"every": 16, "end": 48}], "owners": [0, 0, 0]})),
    "hdr-cut-rule-extra-key": ("a cut rule with a key more", _layout(
        {"cuts": [{"every": 32, "end": 64, "start": 0}], "owners": [0, 0]})),
    "hdr-owner-rule-past-world": ("an owner rule naming rank 1 in a world of 1", _layout(
        {"cuts": [{"every": 32, "end": 64}], "owners": {"start": 0, "step": 1}})),
    "hdr-owner-rule-past-writers": ("an owner rule for 64 chunks, more than the ranks that wrote parts", _layout(
        {"cuts": [{"every": 1, "end": 64}], "owners": {"start": 0, "step": 1}})),
    "hdr-owner-rule-bools": ("an owner rule of bools (start false, step true)", _layout(
        {"cuts": [{"every": 32, "end": 64}], "owners": {"start": False, "step": True}})),
    "hdr-owner-rule-step-zero": ("an owner rule with step 0 (every chunk rank 0)", _layout(
        {"cuts": [{"every": 32, "end": 64}], "owners": {"start": 0, "step": 0}})),
    "hdr-grid-in-version-1": ("a grid layout in a version-1 header", _layout(
        {"cuts": [[0, 32, 64]], "owners": [0, 0]}, version=1)),
    "hdr-version-true": ("the header's version is true", _ignoring_key(_set("version", True))),
    "hdr-items-other-rank": ("a layout's inline item in rank 1's file for a chunk of rank 0", _layout(
        {"cuts": [[0, 64]], "owners": [0], "items": [["__1_0.distcp", 0, 256]]})),
    "hdr-dtype-torch-name": ("a dtype spelt torch.float32", _set_tensor(1, "torch.float32")),
    "hdr-value-outside": ("a value whose item names ../../outside/victim", _add_value(
        lambda key, item: ["extra.planted", "../../outside/victim", 0, 8])),
    "hdr-value-shadows-tensor": ("a value under a tensor's key", _add_value(lambda key, item: [key, *item])),
    "hdr-value-past-file": ("a value's item 2^40 bytes into its shard file", _add_value(
        lambda key, item: ["extra.planted", item[0], 1 << 40, 8])),
    "hdr-values-object": ("values is an object, not a list", _ignoring_key(_set("values", {"a": 1}))),
}
# Lightning builds its targets from the header and asks for no value outside the model and optimizer: the crafted
# value is never read (left behind, named in a warning)
HEADER_OK = {"hdr-value-past-file": {"lightning"}}


def _apply_header(s: Step, edit) -> None:
    _put_header(s, json.dumps(edit(_header(s), "model.w")).encode())


# ----------------------------------------------------------------- a rank's DCP index part
def _split_with_part(part_doc) -> object:
    """``model.w`` [64] as a grid of one chunk written by rank 0 (the honest item), so that
    the chunk is found in rank 0's index part ``part_doc(rel, off, n)``."""
    def apply(s: Step) -> None:
        doc = _header(s)
        w = _tensor(doc, "model.w")
        rel, off, n = w[4]
        doc["layouts"].append({"ndim": 1, "cuts": [[0, 64]], "owners": [0]})
        w[3], w[4] = len(doc["layouts"]) - 1, None
        doc["version"] = 2
        _put_header(s, json.dumps(doc).encode())
        body = part_doc(rel, off, n)
        s.put(INDEX_PART, body if isinstance(body, bytes) else json.dumps(body).encode())
    return apply


def _index_part(items, **fields) -> object:
    def doc(rel, off, n):
        d = {"format": "cloudckpt-dcp-index", "version": 1, "rank": 0, "items": items(rel, off, n)}
        d.update(fields)
        return d
    return doc


def _whole(rel, off, n):
    return [["model.w", [0], [64], rel, off, n]]


INDEX_PART_CASES = {
    "ipart-honest-control": ("control: model.w as a grid of one chunk found in rank 0's honest index part (loads)",
                             _split_with_part(_index_part(_whole))),
    "ipart-rank-false": ("the index part's rank is false (for rank 0)", _split_with_part(
        _index_part(_whole, rank=False))),
    "ipart-items-object": ("the index part's items are an object", _split_with_part(
        _index_part(lambda *a: {"model.w": 1}))),
    "ipart-item-twice": ("the index part lists a chunk twice", _split_with_part(
        _index_part(lambda *a: _whole(*a) * 2))),
    "ipart-sizes-disagree": ("an item's sizes have another length than its offsets", _split_with_part(
        _index_part(lambda rel, off, n: [["model.w", [0], [64, 1], rel, off, n]]))),
    "ipart-item-past-file": ("a chunk's item 2^40 bytes into its file", _split_with_part(
        _index_part(lambda rel, off, n: [["model.w", [0], [64], rel, 1 << 40, n]]))),
    "ipart-deep": ("the index part is JSON nested 100,000 deep", _split_with_part(
        lambda *a: b"[" * 100_000 + b"]" * 100_000)),
    "ipart-200k-items": ("the index part lists 200,000 chunks the header does not have", _split_with_part(
        _index_part(lambda rel, off, n: _whole(rel, off, n) + [[f"k{i}", [0], [1], rel, off, 1]
                                                               for i in range(200_000)]))),
}
# the index part's extra chunks are chunks no layout has: never planned from, the load reads what the header gives.
# `cloudckpt inspect` reads the header alone (hostile_index.OK_CASES): what the parts say is for a load and verify
INDEX_PART_OK = {case: {"cli_inspect"} for case in INDEX_PART_CASES} | {
    case: set(HEADER_READERS) for case in ("ipart-200k-items", "ipart-honest-control")}


# ----------------------------------------------------------------- a rank's manifest part
def _edit_part(edit) -> object:
    """Rewrite rank 0's manifest part; the marker's reference (format 3 columns) is made to
    match its bytes and what it declares."""
    def apply(s: Step) -> None:
        part = json.loads(s.get(PART))
        part = edit(part)
        body = json.dumps(part).encode()
        s.store.put_bytes(s.join(s.url, PART), body)
        d = json.loads(s.get(".metadata.json"))
        cols = d["parts"]
        cols["size"], cols["crc32c"] = [len(body)], crc(body)
        objs = part.get("objects")
        if isinstance(objs, list) and all(isinstance(o, dict) for o in objs):
            cols["objects"], cols["bytes"] = [len(objs)], [sum(o.get("size", 0) for o in objs)]
        s.put_marker(d)
    return apply


def _chunks(chunks_of):
    def edit(p: dict) -> dict:
        o = next(o for o in p["objects"] if o["path"].endswith(".distcp"))
        o["chunks"] = chunks_of(o["size"])
        return p
    return edit


MANIFEST_CASES = {
    "mpart-step-float": ("the manifest part's step is 1.0", _edit_part(_set("step", 1.0))),
    "mpart-rank-false": ("the manifest part's rank is false (for rank 0)", _edit_part(_set("rank", False))),
    "mpart-format-float": ("the manifest part's format_version is 2.0", _edit_part(_set("format_version", 2.0))),
    "mpart-objects-object": ("the manifest part's objects are an object", _edit_part(_set("objects", {"a": 1}))),
    "mpart-chunks-overlap": ("a shard's item chunks overlap", _edit_part(_chunks(
        lambda size: [[0, 16, "00000000"], [8, 16, "00000000"]]))),
    "mpart-chunk-crc-not-hex": ("a shard's item chunk CRC32C is not hex", _edit_part(_chunks(
        lambda size: [[0, 16, "zzzzzzzz"]]))),
    "mpart-chunk-past-object": ("a shard's item chunk runs past the object", _edit_part(_chunks(
        lambda size: [[0, size + 1, "00000000"]]))),
}


# ----------------------------------------------------------------- the marker: columns and mixed formats
def _raw(edit) -> object:
    def apply(s: Step) -> None:
        d = json.loads(s.get(".metadata.json"))
        assert d["format_version"] == 3, "the honest step is written in format 3"
        s.put_marker(edit(d))
    return apply


def _columns(**changes):
    def edit(d: dict) -> dict:
        d["parts"].update(changes)
        return d
    return edit


def _as_list(version: int):
    def edit(d: dict) -> dict:
        from cloudckpt.checkpoint.parts import as_part_list

        out = as_part_list(d)
        out["format_version"] = version
        return out
    return edit


def _without_parts(d: dict) -> dict:
    d.pop("parts")
    return d


def _rank_file_beside_columns(d: dict) -> dict:
    d["objects"].append({"path": "train/rank0.pt", "size": 1, "crc32c": "00000000"})
    return d


MARKER_CASES = {
    "columns-extra-column": ("format 3: a column more (paths)", _raw(_columns(path=["../../outside/victim"]))),
    "columns-ranks-bools": ("format 3: the rank runs are bools ([[false, true]])",
                            _raw(_columns(ranks=[[False, True]]))),
    "columns-ranks-flat": ("format 3: the ranks a flat list, not runs", _raw(_columns(ranks=[0]))),
    "columns-size-over-1gib": ("format 3: a part declared 2 GiB (over the 1 GiB a part may be)",
                               _raw(_columns(size=[2 << 30]))),
    "columns-objects-past-max": ("format 3: a part declaring 2^40 objects", _raw(_columns(objects=[1 << 40]))),
    "mix-v2-with-columns": ("format_version 2 with format 3's part columns", _raw(_set("format_version", 2))),
    "mix-v3-with-list": ("format_version 3 with format 2's list of part references", _raw(_as_list(3))),
    "mix-v3-without-parts": ("format_version 3 without parts", _raw(_without_parts)),
    "mix-v1-with-columns": ("format_version 1 carrying format 3's columns (read as format 1: the ranks' files are "
                            "not the step's)", _raw(_set("format_version", 1))),
    "mix-v3-rank-file-inline": ("format 3: a rank's file listed beside the part columns",
                                _raw(_rank_file_beside_columns)),
    "mix-version-float": ("format_version 3.0", _raw(_set("format_version", 3.0))),
    "mix-version-true": ("format_version true (was read as format 1)", _raw(_set("format_version", True))),
}
# format 1 with columns is a format 1 marker (no parts): it parses, so the folder commands show and handle it and
# `download` copies the two objects it lists; the readers that open its files find the ranks' files unlisted and
# refuse the step. A float version is refused by every
# reader of markers (IncompatibleCheckpoint)
MARKER_OK = {"mix-v1-with-columns": {"cli_list", "cli_latest", "cli_download"}}


# ----------------------------------------------------------------- the entry points
CASES: dict[str, tuple[str, object]] = {
    **{k: (w, lambda s, e=e: _apply_header(s, e)) for k, (w, e) in HEADER_CASES.items()},
    **INDEX_PART_CASES, **MANIFEST_CASES, **MARKER_CASES,
}


def attack(tmp: str, root: str, case: str, entry: str) -> None:
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    step = honest_step(root)
    CASES[case][1](Step(open_store(step), step, urls.join))
    with outside_untouched(tmp):
        run_entry(entry, step=step, folder=root, tmp=tmp)


def tier_attack(tmp: str, root: str, case: str) -> None:
    """The crafted header (a ``hdr-*`` case) or index part (``ipart-*``) in the node-local
    tier's only local step (the bucket empty), ``part.json`` made to match (sizes, CRC32Cs):
    its resume must refuse the step (typed) or resume none, never load it."""
    from cloudckpt.checkpoint.local.parts import PART_MANIFEST

    from .hostile_links import N, _cfg, _local, _save, _state

    with _cfg(tmp, root).build() as mgr:
        _save(mgr, [N])
    part = _local(tmp, f"step{N}", "rank0")

    class LocalPart(Step):
        """The local part as a step: its files, its ``part.json`` (a marker with every object inline)."""

        def __init__(self):
            super().__init__(None, part, os.path.join)

        def get(self, rel: str) -> bytes:
            with open(os.path.join(part, rel), "rb") as f:
                return f.read()

        def marker(self) -> dict:
            return json.loads(self.get(PART_MANIFEST))

        def put_marker(self, d) -> None:
            self._write(PART_MANIFEST, d if isinstance(d, bytes) else json.dumps(d).encode())

        def put(self, rel: str, data: bytes, *, listed_as: str | None = None) -> None:
            self._write(rel, data)
            d = self.marker()
            o = next((o for o in d["objects"] if o["path"] == rel), None)
            if o is None:
                d["objects"].append(o := {"path": rel})
            o.update(size=len(data), crc32c=crc(data))
            o.pop("chunks", None)
            self.put_marker(d)

        def _write(self, rel: str, data: bytes) -> None:
            path = os.path.join(part, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

    s = LocalPart()
    if case in HEADER_CASES:
        _put_header(s, json.dumps(HEADER_CASES[case][1](_header(s), "w")).encode())
    else:
        doc = _header(s)
        w = _tensor(doc, "w")
        rel, off, n = w[4]
        doc["layouts"].append({"ndim": 1, "cuts": [[0, 64]], "owners": [0]})
        w[3], w[4], doc["version"] = len(doc["layouts"]) - 1, None, 2
        _put_header(s, json.dumps(doc).encode())
        body = TIER_INDEX_PARTS[case](rel, off, n)
        s.put(INDEX_PART, json.dumps(body).encode())
    with outside_untouched(tmp):
        with _cfg(tmp, root).build() as mgr:
            ts = mgr.resume(_state())
    if case == "ipart-honest-control":  # the crafting alone changes nothing a resume sees
        assert mgr.resumed_step == N and ts == {"step": N}, (mgr.resumed_step, ts)
        return
    if ts is None:
        raise NotUsed(f"resume found no usable step ({case})")
    raise AssertionError(f"resumed local step {mgr.resumed_step} with the crafted {case}: {ts}")


TIER_INDEX_PARTS = {
    "ipart-honest-control": lambda rel, off, n: {"format": "cloudckpt-dcp-index", "version": 1, "rank": 0,
                                                 "items": [["w", [0], [64], rel, off, n]]},
    "ipart-rank-false": lambda rel, off, n: {"format": "cloudckpt-dcp-index", "version": 1, "rank": False,
                                             "items": [["w", [0], [64], rel, off, n]]},
    "ipart-item-past-file": lambda rel, off, n: {"format": "cloudckpt-dcp-index", "version": 1, "rank": 0,
                                                 "items": [["w", [0], [64], rel, 1 << 40, n]]},
}
TIER_CASES = ("hdr-cut-rule-2-62-chunks", "hdr-owner-rule-past-world", "hdr-value-outside", "hdr-dtype-torch-name",
              *TIER_INDEX_PARTS)


def _expect(name: str, entry: str) -> str:
    if name in HEADER_CASES:
        return OK if entry in HEADER_OK.get(name, ()) else REFUSED
    if name in INDEX_PART_CASES:
        return OK if entry in INDEX_PART_OK.get(name, ()) else REFUSED
    if name in MANIFEST_CASES:
        return REFUSED if entry in PART_READERS else OK
    return OK if entry in MARKER_OK.get(name, ()) or entry not in MARKER_READERS else REFUSED


# the manifest parts are read by the readers of a step's files; `list` (which reads markers only) shows the step
MANIFEST_ENTRIES = (*sorted(PART_READERS, key=list(ENTRY_POINTS).index), "cli_list")


def _entries(name: str) -> tuple[str, ...]:
    # the header and the index parts are read by the readers that plan a load (hostile_index.ENTRIES); the
    # manifest parts and the marker by every entry point (the folder commands read markers only)
    if name in HEADER_CASES or name in INDEX_PART_CASES:
        return HEADER_READERS
    return MANIFEST_ENTRIES if name in MANIFEST_CASES else tuple(ENTRY_POINTS)


S3_CASES = {"hdr-cut-rule-2-62-chunks", "ipart-rank-false", "mpart-rank-false", "mix-v2-with-columns"}

TRIES: list[Try] = [
    Try(klass=9, case=name, what=what, entry=entry, target="tests.security.hostile_formats:attack",
        kwargs={"case": name, "entry": entry}, expect=_expect(name, entry), backend=backend, timeout=60.0)
    for name, (what, _) in CASES.items()
    for backend in (("local", "s3") if name in S3_CASES else ("local",))
    for entry in _entries(name)
] + [
    Try(klass=9, case=name, what=CASES[name][0], entry="local_tier_resume",
        target="tests.security.hostile_formats:tier_attack", kwargs={"case": name},
        expect=OK if name == "ipart-honest-control" else REFUSED, timeout=60.0)
    for name in TIER_CASES
]
