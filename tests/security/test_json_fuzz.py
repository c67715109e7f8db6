"""Property-based fuzzing of the small JSON readers: ``untrusted.loads_json`` itself, the
``latest`` pointer (``pointer.parse``), the commit marker (``marker.parse_marker``, ours
and another tool's) and a config saved in a step (``hf_export.saved_json``). Whatever
the bytes, only typed cloudckpt errors come out, and what is accepted is within the
bounds: nesting at most the reader's depth (measured before parsing, and equal to the
real depth of what parsed), finite numbers, integers of at most 20 digits, a pointer
step in [0, 2**63), a marker time that formats as a date.

The documents are built as text from JSON tokens (so that ``Infinity``, ``NaN``,
5,000-digit integers, strings full of brackets and escaped quotes, and nesting past the
limit all occur), then sometimes cut or spliced.

CI runs a bounded number of examples (``CLOUDCKPT_FUZZ_EXAMPLES``, default 200 per test,
a few seconds in all); for a longer run:
``CLOUDCKPT_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/security/test_json_fuzz.py``.
"""

from __future__ import annotations

import json
import math
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.checkpoint import pointer
from cloudckpt.checkpoint.foreign import ForeignMarker, parse_marker
from cloudckpt.checkpoint.marker import MARKER_MAX_DEPTH, Marker
from cloudckpt.errors import CloudCkptError
from cloudckpt.integrations.hf_export import JSON_MAX_DEPTH, saved_json
from cloudckpt.untrusted import loads_json
from cloudckpt.untrusted.jsondoc import MAX_INT_DIGITS, nesting_depth

EXAMPLES = int(os.environ.get("CLOUDCKPT_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COUNTS: dict[str, int] = {}


def _count(what: str) -> None:
    COUNTS[what] = COUNTS.get(what, 0) + 1


_REFUSED = object()


def _parse(kind: str, fn):
    """``fn()``, counted as accepted; a typed refusal is counted and gives _REFUSED; any
    other exception fails the test."""
    try:
        v = fn()
    except CloudCkptError:
        _count(f"{kind} refused")
        return _REFUSED
    _count(f"{kind} accepted")
    return v


# ----------------------------------------------------------------- documents as text
_numbers = st.sampled_from(["0", "-0", "7", "-1", "1e400", "-1e400", "1e308", "2.5", "Infinity", "-Infinity", "NaN",
                            "9223372036854775807", "9223372036854775808", "253402300800", "1.7e9", "00", "01",
                            "1" * 21, "9" * 5000, "0." + "1" * 70, "1e" + "9" * 30]) \
    | st.integers(min_value=-(1 << 70), max_value=1 << 70).map(str) \
    | st.floats(allow_nan=False, allow_infinity=False).map(repr)
_strings = st.text(max_size=12).map(json.dumps) | st.sampled_from(
    ['"["', '"]]]"', '"{"', '"\\"["', '"\\\\"', '"\\\\\\"[["', '"\\u005b"', '"\\ud800"', '"a\\"b\\\\"', '"\\x"'])
_keys = st.sampled_from(["step", "pending", "format", "format_version", "ephemeral", "world_size", "created_unix",
                         "objects", "path", "size", "crc32c", "chunks", "version", "model_type", "adopted",
                         "writer", "["]).map(json.dumps) | _strings
_leaves = _numbers | _strings | st.sampled_from(["null", "true", "false"])


def _containers(children):
    lists = st.lists(children, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
    objects = st.lists(st.tuples(_keys, children), max_size=4).map(
        lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")
    deep = st.tuples(st.integers(1, 80), children).map(lambda nc: "[" * nc[0] + nc[1] + "]" * nc[0])
    return lists | objects | deep


json_texts = st.recursive(_leaves, _containers, max_leaves=25)


@st.composite
def documents(draw, near=None):
    """JSON-like text: built from tokens, then sometimes cut, spliced with raw bytes or
    wrapped in more brackets. ``near``: an object whose fields take their first (valid)
    value, except up to three that are dropped, or take another listed value or any text:
    most examples are close to valid, so the checks behind the first ones are reached."""
    if near is not None:
        odd = draw(st.lists(st.sampled_from(sorted(near)), max_size=3, unique=True))
        fields = []
        for k, vs in near.items():
            how = draw(st.sampled_from(["drop", "listed", "listed", "any"])) if k in odd else "valid"
            if how != "drop":
                v = vs[0] if how == "valid" else draw(st.sampled_from(vs[1:] or vs)) if how == "listed" \
                    else draw(json_texts)
                fields.append(f"{json.dumps(k)}:{v}")
        text = "{" + ",".join(fields) + "}"
    else:
        text = draw(json_texts)
    data = text.encode("utf-8", "surrogatepass")
    op = draw(st.sampled_from(["as is", "as is", "as is", "as is", "cut", "splice", "wrap"]))
    if op == "cut" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif op == "splice":
        i = draw(st.integers(0, len(data)))
        junk = draw(st.binary(max_size=6) | st.sampled_from([b"[", b"]", b'"', b"\\", b"\xff", b"{"]))
        data = data[:i] + junk + data[i:]
    elif op == "wrap":
        n = draw(st.integers(1, 200))
        data = b"[" * n + data + b"]" * n
    return data


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


def _bounded(v) -> None:
    """Every number finite, every integer of at most MAX_INT_DIGITS digits."""
    if isinstance(v, list):
        for x in v:
            _bounded(x)
    elif isinstance(v, dict):
        for x in v.values():
            _bounded(x)
    elif type(v) is float:
        assert math.isfinite(v), v
    elif type(v) is int:
        assert len(str(abs(v))) <= MAX_INT_DIGITS, v


# ----------------------------------------------------------------- loads_json
@FUZZ
@given(documents(), st.integers(1, 40))
def test_loads_json_accepts_only_bounded_documents_and_refuses_the_rest_typed(data, max_depth):
    v = _parse("loads_json", lambda: loads_json(data, url="fuzz", what="document", limit=4096, max_depth=max_depth))
    if v is _REFUSED:
        return
    assert len(data) <= 4096
    assert _depth(v) <= max_depth
    every = json.loads(data, object_pairs_hook=lambda pairs: [v for _, v in pairs])  # duplicate keys kept
    assert nesting_depth(data) == _depth(every), "the depth measured before parsing is the depth parsed"
    _bounded(v)
    assert v == json.loads(data) or v != v  # the same document Python's parser reads (NaN never gets here)


@FUZZ
@given(st.binary(max_size=300))
def test_loads_json_on_arbitrary_bytes_gives_only_typed_errors(data):
    _parse("loads_json bytes", lambda: loads_json(data, url="fuzz", what="document", limit=256, max_depth=8))


# ----------------------------------------------------------------- the latest pointer
POINTER_FIELDS = {"step": ["0", "9", "9223372036854775807", "9223372036854775808", "-1", "Infinity", "NaN", "1e400",
                           '"9"', "true", "9.0"],
                  "pending": ["true", "false", '"no"', "0", "null"], "dir": ['"step9"'], "updated_unix": ["1.7e9"]}


@FUZZ
@given(documents(near=POINTER_FIELDS) | documents(near=POINTER_FIELDS) | documents() | st.binary(max_size=200))
def test_pointer_parse_gives_a_step_in_range_or_a_typed_error(data):
    got = _parse("pointer", lambda: pointer.parse(data, url="fuzz/latest"))
    if got is _REFUSED:
        return
    step, pending = got
    assert type(step) is int and 0 <= step <= pointer.MAX_STEP
    assert type(pending) is bool


# ----------------------------------------------------------------- the commit marker
MARKER_FIELDS = {"format": ['"cloudckpt"', '"other"'], "format_version": ["1", "2", "0", "1.0", "true"],
                 "step": ["3", "-3", "1" * 25, '"3"'], "ephemeral": ["false", "true", "0", "null"],
                 "world_size": ["1", "0", "16777217", "1e400"],
                 "created_unix": ["1.7e9", "0", "Infinity", "-Infinity", "NaN", "1e308", "253402300800", "-1",
                                  '"nan"', "true", "9" * 4000],
                 "objects": ["[]", '[{"path": "train/rank0.pt", "size": 4, "crc32c": "0a1b2c3d"}]',
                             '[{"path": "a", "size": 10, "crc32c": null, '
                             '"chunks": [[0, 4, "0a1b2c3d"], [2, 4, null]]}]',
                             '[{"path": "../x", "size": 1, "crc32c": null}]'],
                 "adopted": ['{"writer": "olmo-core", "marker_crc32c": "0a1b2c3d"}', '{"writer": "../x"}'],
                 "version": ['"3.0.0"', "3", '"\\u001b[31m"']}


@FUZZ
@given(documents(near=MARKER_FIELDS) | documents(near=MARKER_FIELDS) | documents() | st.binary(max_size=300))
def test_marker_parse_gives_a_marker_within_bounds_or_a_typed_error(data):
    m = _parse("marker", lambda: parse_marker(data, url="fuzz/step3/.metadata.json"))
    if m is _REFUSED:
        return
    if isinstance(m, ForeignMarker):
        _count("marker: another tool's")
        assert type(m.ephemeral) is bool and type(m.version) is str and len(m.version) <= 64
        return
    assert isinstance(m, Marker) and nesting_depth(data) <= MARKER_MAX_DEPTH
    assert m.created  # the time formats as a date
    assert 1 <= m.world_size and m.step >= 0
    assert all(o.size >= 0 and not o.path.startswith("/") and ".." not in o.path.split("/") for o in m.objects)


# ----------------------------------------------------------------- a config saved in a step
CONFIG_FIELDS = {"model_type": ['"gpt2"', "1"], "vocab_size": ["50257", "Infinity", "1e400", "9" * 30],
                 "rope_scaling": ['{"type": "linear", "factor": 2.0}', "[" * 40 + "]" * 40]}


@FUZZ
@given(documents(near=CONFIG_FIELDS) | documents(near=CONFIG_FIELDS) | documents(), st.booleans())
def test_saved_json_gives_a_bounded_object_or_a_typed_error(data, non_finite):
    text = data.decode("utf-8", "surrogateescape")
    v = _parse("saved config", lambda: saved_json(text, url="fuzz/step1", what="model config", limit=4096,
                                                  non_finite=non_finite))
    if v is _REFUSED:
        return
    assert type(v) is dict and _depth(v) <= JSON_MAX_DEPTH
    if not non_finite:
        _bounded(v)


def test_fuzz_counts_are_reported(capsys):
    """The outcomes of the tests above, into the test log (``-s`` or CI's output)."""
    assert COUNTS, "run with the fuzz tests above"
    with capsys.disabled():
        print(f"\njson fuzz examples per test: {EXAMPLES}; outcomes: {dict(sorted(COUNTS.items()))}")
