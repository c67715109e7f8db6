"""Property-based fuzzing of the parsers of the step formats added since the third round
(issue: hostile bytes on the new surface), as ``test_trainstate_parser.py`` fuzzes the
train-state parser:

- the DCP index header (``index.parse_header``: layouts as boxes or grids, cut rules
  ``{"every", "end"}``, owner rules ``{"start", "step"}``, dtypes, values) and what its
  readers do with a header that parsed (``check_owners``, ``check_tensor_bytes``,
  ``check_items``, ``select``);
- a rank's DCP index part (``index.parse_part``) and ``check_part`` against a header;
- a rank's manifest part (``ManifestPart.from_bytes``, its bytes matching the reference);
- the marker's part columns (``parse_part_columns``) and list (``parse_part_list``);
- the marker with format 1, 2 and 3 fields mixed (``Marker.from_bytes``, ``parse_marker``),
  and the part references a load's coordinator hands out (``encode_refs``/``decode_refs``:
  every reference of a marker that parsed comes back as it was).

Each example is an honest document of its kind, generated, then changed in 0 to 4 places
(a value replaced by an extreme integer, a bool, a float, a path outside the step, a
deep or long list, another type), or of another format's fields. Whatever the bytes, only
typed cloudckpt errors come out, within a deadline; what is accepted builds nothing
larger than its bytes carry (chunks counted against the bytes and the writers).

CI runs a bounded number of examples (``CLOUDCKPT_FUZZ_EXAMPLES``, default 120 per test,
a few seconds in all); for a longer run:
``CLOUDCKPT_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/security/test_format_fuzz.py``.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.checkpoint.entries import ObjectEntry
from cloudckpt.checkpoint.foreign import parse_marker
from cloudckpt.checkpoint.marker import Marker
from cloudckpt.checkpoint.parts import (
    PART_FORMAT,
    ManifestPart,
    PartRef,
    decode_refs,
    encode_refs,
    parse_part_columns,
    parse_part_list,
    parts_columns,
)
from cloudckpt.dcp import index
from cloudckpt.errors import CloudCkptError
from cloudckpt.transfer import crc32c_bytes

EXAMPLES = int(os.environ.get("CLOUDCKPT_FUZZ_EXAMPLES", "120"))
# a deadline per example: a parser that loops on what it was given fails here, not in a user's job
FUZZ = settings(max_examples=EXAMPLES, deadline=5000, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.data_too_large])
COUNTS: dict[str, int] = {}
URL = "s3://b/run/step1/index/header.json"


def _count(what: str) -> None:
    COUNTS[what] = COUNTS.get(what, 0) + 1


def _parse(kind: str, fn):
    """``fn()``, counted as accepted (its value) or refused (None) by ``kind``; an error
    that is not a cloudckpt error fails the test."""
    try:
        v = fn()
    except CloudCkptError:
        _count(f"{kind} refused")
        return None
    _count(f"{kind} accepted")
    return v


# ----------------------------------------------------------------- changing an honest document
_JUNK = st.one_of(
    st.sampled_from([0, 1, -1, 2, 63, 64, 65, (1 << 24) - 1, 1 << 24, 1 << 31, 1 << 40, 1 << 62, (1 << 63) - 1,
                     1 << 63, 10 ** 19, True, False, None, 0.0, 1.0, 2.5, -0.0, 1e300, "", "0", "float32", "qint8",
                     "../../outside/victim", "__1_0.distcp", "__0_0.distcp", "/etc/passwd", "a\x00b", "\x1b[2J",
                     "model.w", "1a2b3c4d", "ZZZZZZZZ", [], {}, [0], [[0, 1]], [0, 64], {"every": 1, "end": 1 << 62},
                     {"start": 0, "step": 1}, {"every": 0, "end": 64}, [[[[[[[[[[0]]]]]]]]]], [0] * 70]),
    st.integers(-(1 << 64), 1 << 64), st.text(max_size=12), st.lists(st.integers(-2, 80), max_size=6),
)


def _paths(doc, at=()):
    """Every place in a JSON document: (container path, key)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield at, k
            yield from _paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield at, i
            yield from _paths(v, (*at, i))


def _changed(data, doc, n_max: int = 4):
    """``doc`` changed in 0 to ``n_max`` places (a value replaced by junk, or dropped)."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(0, n_max))):
        places = list(_paths(doc))
        if not places:
            break
        at, key = data.draw(st.sampled_from(places))
        node = doc
        for k in at:
            node = node[k]
        if isinstance(node, dict) and data.draw(st.integers(0, 5)) == 0:
            del node[key]
        else:
            # a copy: sampled_from hands out the same list or dict every time, and a later change made inside
            # it would alter the strategy itself (and could put a container inside itself)
            node[key] = copy.deepcopy(data.draw(_JUNK))
    return doc


def _bytes(doc) -> bytes:
    return json.dumps(doc, allow_nan=False).encode()


# ----------------------------------------------------------------- the DCP index header
@st.composite
def honest_headers(draw):
    """(a header of version 2 in the form encode writes, the number of ranks that wrote it,
    the shard files and their sizes)."""
    writers = draw(st.integers(1, 4))
    files = {f"__{r}_0.distcp": 1 << 20 for r in range(writers)}
    layouts, tensors, values = [], [], []
    for i in range(draw(st.integers(0, 4))):
        dims = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int64", "bool", "float8_e4m3fn"]))
        form = draw(st.sampled_from(["whole", "boxes", "cuts", "rule"]))
        if form == "whole":
            tensors.append([f"t{i}", dtype, dims, -1, [f"__{draw(st.integers(0, writers - 1))}_0.distcp", 0, 16]])
            continue
        if form == "boxes":  # split along dimension 0 at a cut
            cut = draw(st.integers(0, dims[0]))
            boxes, owners = [], []
            for lo, hi in ((0, cut), (cut, dims[0])):
                if hi > lo:
                    boxes += [lo, *[0] * (len(dims) - 1), hi - lo, *dims[1:]]
                    owners.append(draw(st.integers(0, writers - 1)))
            layouts.append({"ndim": len(dims), "boxes": boxes, "owners": owners})
        else:
            cuts = []
            for d in dims:
                every = draw(st.integers(1, d))
                cuts.append({"every": every, "end": d} if draw(st.booleans()) else
                            sorted({0, d, *range(every, d, every)}))
            n = 1
            for c in cuts:
                n *= -(-c["end"] // c["every"]) if isinstance(c, dict) else len(c) - 1
            if form == "rule" and n <= writers:
                owners = {"start": 0, "step": 1}
            else:
                owners = [draw(st.integers(0, writers - 1)) for _ in range(n)]
            layouts.append({"ndim": len(dims), "cuts": cuts, "owners": owners})
        tensors.append([f"t{i}", dtype, dims, len(layouts) - 1, None])
    for i in range(draw(st.integers(0, 2))):
        values.append([f"v{i}", f"__{draw(st.integers(0, writers - 1))}_0.distcp", 0, 8])
    doc = {"format": index.FORMAT, "version": 2, "dcp_version": "2.13", "layouts": layouts, "tensors": tensors,
           "values": values}
    return doc, writers, files


def _use_header(h, writers: int, files: dict, stored: int) -> None:
    """What the readers do with a header that parsed: the checks of CommittedStep.header
    and a selection of every tensor whole (a load of it)."""
    chunks = sum(lay.n for lay in h.layouts)
    for lay in h.layouts:
        if lay.cuts is not None:  # nothing built beyond the chunks counted
            assert sum(len(c) for c in lay.cuts) <= lay.ndim * (lay.n + 1)
    assert chunks <= (1 << 20) * len(h.layouts) + 1, chunks
    index.check_owners(h, writers)
    index.check_tensor_bytes(h, stored)
    index.check_items(h, files)
    wanted = {k: [((0,) * len(t.size), tuple(t.size))] for k, t in h.tensors.items()}
    wanted.update((k, None) for k in h.values)
    index.select(h, wanted)


@FUZZ
@given(st.data())
def test_fuzzed_headers_are_parsed_or_refused_with_a_typed_error(data):
    doc, writers, files = data.draw(honest_headers())
    doc = _changed(data, doc)
    if data.draw(st.integers(0, 9)) == 0:
        doc["version"] = data.draw(st.sampled_from([1, True, 2.0, 3, "2"]))
    body = _bytes(doc)
    h = _parse("header", lambda: index.parse_header(body, url=URL, writers=writers))
    if h is not None:
        _parse("header checks", lambda: _use_header(h, writers, files, 1 << 30))


# ----------------------------------------------------------------- a rank's DCP index part
@st.composite
def honest_index_parts(draw):
    rank = draw(st.integers(0, 3))
    items = []
    for i in range(draw(st.integers(0, 5))):
        nd = draw(st.integers(1, 3))
        items.append([f"t{i}", [draw(st.integers(0, 8)) for _ in range(nd)], [draw(st.integers(0, 8))
                                                                               for _ in range(nd)],
                      f"__{rank}_{draw(st.integers(0, 2))}.distcp", draw(st.integers(0, 99)),
                      draw(st.integers(0, 99))])
    return {"format": index.FORMAT, "version": 1, "rank": rank, "items": items}, rank


@FUZZ
@given(st.data())
def test_fuzzed_index_parts_are_parsed_or_refused_with_a_typed_error(data):
    doc, rank = data.draw(honest_index_parts())
    doc = _changed(data, doc)
    body = _bytes(doc)
    part = _parse("index part", lambda: index.parse_part(body, url="s3://b/run/step1/index/rank0.json", rank=rank))
    if part is not None:
        for (fqn, offs), (sizes, rel, _off, _n) in part.items():
            assert type(fqn) is str and len(offs) == len(sizes) and index.decode._owner(rel) == rank
        header, writers, files = data.draw(honest_headers())
        h = _parse("header", lambda: index.parse_header(_bytes(header), url=URL, writers=writers))
        if h is not None:
            _parse("index part checks", lambda: index.check_part(h, rank, part, files))


# ----------------------------------------------------------------- a rank's manifest part
@st.composite
def honest_manifest_parts(draw):
    rank, step = draw(st.integers(0, 3)), draw(st.integers(0, 10 ** 6))
    objects = []
    for k in range(draw(st.integers(0, 4))):
        size = draw(st.integers(0, 1000))
        cuts = sorted(draw(st.lists(st.integers(0, size), max_size=4)))
        chunks = [[a, b - a, f"{draw(st.integers(0, 0xFFFFFFFF)):08x}"] for a, b in zip(cuts, cuts[1:], strict=False)]
        objects.append({"path": f"model_and_optim/__{rank}_{k}.distcp", "size": size,
                        "crc32c": f"{draw(st.integers(0, 0xFFFFFFFF)):08x}", "chunks": chunks})
    if draw(st.booleans()):
        objects.append({"path": f"train/rank{rank}.pt", "size": 10, "crc32c": "00000000"})
    return {"format": PART_FORMAT, "format_version": 2, "step": step, "rank": rank, "save_id": "a" * 32,
            "objects": objects}


@FUZZ
@given(st.data())
def test_fuzzed_manifest_parts_are_parsed_or_refused_with_a_typed_error(data):
    doc = data.draw(honest_manifest_parts())
    rank, step = doc["rank"], doc["step"]
    n = len(doc["objects"])
    declared = sum(o["size"] for o in doc["objects"])
    doc = _changed(data, doc)
    body = _bytes(doc)
    # the reference matches the bytes (the attacker rewrote the marker too): the parse itself is what is fuzzed
    ref = PartRef(rank, f"manifest/rank{rank}.json", len(body), crc32c_bytes(body), n, declared)
    part = _parse("manifest part", lambda: ManifestPart.from_bytes(body, url="s3://b/run/step1/manifest/rank0.json",
                                                                  ref=ref, step=step, save_id="a" * 32))
    if part is not None:
        assert part.rank == rank and part.step == step and len(part.objects) == n
        assert sum(o.size for o in part.objects) == declared
    wrong = PartRef(rank, ref.path, len(body), f"{int(ref.crc32c, 16) ^ 1:08x}", n, declared)
    with pytest.raises(CloudCkptError):  # bytes that do not match the reference are never parsed
        ManifestPart.from_bytes(body, url="s3://b/x", ref=wrong, step=step, save_id="a" * 32)


# ----------------------------------------------------------------- the marker's part references
@st.composite
def honest_refs(draw):
    world = draw(st.integers(1, 12))
    ranks = sorted(draw(st.sets(st.integers(0, world - 1), max_size=world)))
    refs = [PartRef(r, f"manifest/rank{r}.json", draw(st.integers(0, 1 << 30)),
                    f"{draw(st.integers(0, 0xFFFFFFFF)):08x}", draw(st.integers(0, 1000)),
                    draw(st.integers(0, 1 << 40))) for r in ranks]
    return refs, world


@FUZZ
@given(st.data())
def test_fuzzed_part_columns_and_lists_are_parsed_or_refused_with_a_typed_error(data):
    refs, world = data.draw(honest_refs())
    cols = _changed(data, parts_columns(refs))
    if data.draw(st.integers(0, 5)) == 0:
        cols = [p.to_json() for p in refs]  # format 2's list where columns are expected
    world_seen = data.draw(st.sampled_from([world, 1, 1 << 20, 10 ** 19]))

    def parse(parser, raw):
        try:
            return parser(raw, world_seen)
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # what Marker.from_json turns typed
            raise CloudCkptError(str(e)) from None

    got = _parse("part columns", lambda: parse(parse_part_columns, json.loads(_bytes(cols))))
    if got is not None:
        assert len(got) <= max(1, len(_bytes(cols))) and len({p.rank for p in got}) == len(got)
        assert all(0 <= p.rank < world_seen for p in got)
    lst = _changed(data, [p.to_json() for p in refs])
    got = _parse("part list", lambda: parse(parse_part_list, json.loads(_bytes(lst))))
    if got is not None:
        assert len({p.rank for p in got}) == len(got) and all(0 <= p.rank < world_seen for p in got)


# ----------------------------------------------------------------- the marker, formats mixed
@st.composite
def honest_markers(draw):
    refs, world = draw(honest_refs())
    version = draw(st.sampled_from([1, 2, 3]))
    objects = [ObjectEntry("model_and_optim/.metadata", 100, "1a2b3c4d"), ObjectEntry("index/header.json", 10, None)]
    if version == 1 or not refs:
        objects.append(ObjectEntry("model_and_optim/__0_0.distcp", 64, "00000000", ((0, 32, "00000001"),)))
        refs = []
    m = Marker(step=draw(st.integers(0, 10 ** 6)), ephemeral=draw(st.booleans()), world_size=world,
               objects=tuple(objects), created_unix=1.7e9, save_id="b" * 32, format_version=version,
               parts=tuple(refs))
    return json.loads(m.to_bytes()), refs


_MIXES = [
    lambda d, refs: d,
    lambda d, refs: {**d, "format_version": 2},  # columns or none, read as format 2
    lambda d, refs: {**d, "format_version": 3},  # a list or none, read as format 3
    lambda d, refs: {**d, "format_version": 1},  # parts ignored: objects only
    lambda d, refs: {**d, "parts": parts_columns(refs)},
    lambda d, refs: {**d, "parts": [p.to_json() for p in refs]},
    lambda d, refs: {k: v for k, v in d.items() if k != "parts"},
    lambda d, refs: {**d, "format_version": True},
    lambda d, refs: {**d, "format_version": 3.0},
    lambda d, refs: {**d, "objects": [*d["objects"], {"path": "train/rank0.pt", "size": 1, "crc32c": "00000000"}]},
    lambda d, refs: {**d, "adopted": {"writer": "olmo-core", "marker_crc32c": "00000000"}},
]


@FUZZ
@given(st.data())
def test_fuzzed_markers_mixing_formats_are_parsed_or_refused_with_a_typed_error(data):
    d, refs = data.draw(honest_markers())
    d = data.draw(st.sampled_from(_MIXES))(d, refs)
    d = _changed(data, d, n_max=2)
    body = _bytes(d)
    m = _parse("marker", lambda: Marker.from_bytes(body, url="s3://b/run/step1/.metadata.json"))
    _parse("marker or foreign", lambda: parse_marker(body, url="s3://b/run/step1/.metadata.json"))
    if m is None:
        return
    assert 1 <= m.world_size and len(m.parts) <= m.world_size
    if m.parts:  # a marker with parts lists no rank's file itself
        assert not any(o.path.startswith(("train/", "model_and_optim/__", "manifest/")) for o in m.objects)
    # the coordinator hands each rank the references it asks for: back as they were, "no part" as None
    asked = sorted({0, m.world_size - 1, *(p.rank for p in m.parts)})
    got = decode_refs(encode_refs(m, asked))
    assert got == {r: m.part_of(f"train/rank{r}.pt") for r in asked}
    _count("part refs round trip")
    m.total_bytes, m.object_count  # noqa: B018 - derived from what parsed: no error


def test_fuzz_counts_are_reported(capsys):
    """The outcomes of the tests above, into the test log (``-s`` or CI's output); each
    parser both accepted and refused examples (a fuzz that never gets past the first
    check, or never refuses, says little)."""
    assert COUNTS, "run with the fuzz tests above"
    with capsys.disabled():
        print(f"\nformat fuzz examples per test: {EXAMPLES}; outcomes: {dict(sorted(COUNTS.items()))}")
    for kind in ("header", "index part", "manifest part", "part columns", "marker"):
        assert COUNTS.get(f"{kind} refused", 0) > 0, (kind, COUNTS)
        assert COUNTS.get(f"{kind} accepted", 0) > 0, (kind, COUNTS)
