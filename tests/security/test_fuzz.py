"""Property-based fuzzing of the two parsers that see checkpoint bytes first: the
commit marker (JSON) and DCP's ``.metadata`` (pickle). Whatever the input, only
typed cloudckpt errors may come out, and nothing may run.

CI runs a bounded number of examples; for a longer run set
``CLOUDCKPT_FUZZ_EXAMPLES`` (e.g. ``CLOUDCKPT_FUZZ_EXAMPLES=20000 make test-fast``,
or ``.venv/bin/python -m pytest tests/security/test_fuzz.py``).
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.checkpoint.marker import Marker
from cloudckpt.errors import CloudCkptError, CorruptCheckpoint
from cloudckpt.untrusted import loads_metadata

EXAMPLES = int(os.environ.get("CLOUDCKPT_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_COUNTS: dict[str, int] = {}


def _honest_metadata() -> bytes:
    import tempfile

    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d:
        dcp.save({"model": {"w": torch.ones(4, 3), "b": torch.zeros(2)}, "extra": {"n": 1, "s": "x"}},
                 checkpoint_id=d, no_dist=True)
        with open(os.path.join(d, ".metadata"), "rb") as f:
            return f.read()


HONEST = _honest_metadata()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70) | st.floats()
    | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)
paths = (st.sampled_from(["../x", "/etc/passwd", "a\\b", "a\x00b", "a//b", ".", "..", "x/../y", "\uff0e\uff0e/x",
                          "model_and_optim/.metadata", "model_and_optim/__0_0.distcp", "train/rank0.pt"])
         | st.text(max_size=40))
good_paths = st.from_regex(r"[a-z_]{1,8}(/[a-z0-9_.]{1,8}){0,2}", fullmatch=True).filter(
    lambda p: all(s not in (".", "..") for s in p.split("/")))


@st.composite
def markers(draw):
    """A valid marker, then zero to three fields replaced by arbitrary JSON values or
    hostile names: most examples are close to valid, so the checks behind the first
    ones are reached too."""
    objects = []
    for path in draw(st.lists(good_paths, max_size=5, unique=True)):
        size = draw(st.integers(0, 1 << 40))
        chunks, pos = [], 0
        for n in draw(st.lists(st.integers(0, 1000), max_size=3)):
            if pos + n > size:
                break
            chunks.append([pos, n, "0a1b2c3d"])
            pos += n
        crc = draw(st.sampled_from([None, "0a1b2c3d"]))
        objects.append({"path": path, "size": size, "crc32c": crc, "chunks": chunks})
    d = {"format": "cloudckpt", "format_version": 1, "step": draw(st.integers(0, 1 << 40)),
         "ephemeral": draw(st.booleans()), "world_size": draw(st.integers(1, 1024)),
         "created_unix": draw(st.floats(0, 2e9)), "objects": objects}
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(sorted(d) + ["objects.path", "objects.size", "objects.chunks"]))
        if field.startswith("objects.") and objects:
            o = draw(st.sampled_from(objects))
            key = field.split(".")[1]
            o[key] = draw(paths) if key == "path" else draw(json_values)
        elif not field.startswith("objects."):
            d[field] = draw(json_values)
    return d


def _typed(fn, data: bytes, kind: str) -> None:
    try:
        fn(data)
        _COUNTS[kind + " accepted"] = _COUNTS.get(kind + " accepted", 0) + 1
    except CloudCkptError:
        _COUNTS[kind + " refused"] = _COUNTS.get(kind + " refused", 0) + 1


@FUZZ
@given(markers())
def test_marker_parser_gives_a_marker_with_safe_names_or_a_typed_error(d):
    try:
        data = json.dumps(d).encode()
    except ValueError:  # NaN and the like are still JSON to Python; json.dumps only fails on circular data
        return
    try:
        m = Marker.from_bytes(data, url="fuzz")
    except CloudCkptError:
        _COUNTS["marker refused"] = _COUNTS.get("marker refused", 0) + 1
        return
    _COUNTS["marker accepted"] = _COUNTS.get("marker accepted", 0) + 1
    for o in m.objects:
        assert o.path and not o.path.startswith("/") and ".." not in o.path.split("/") and "\\" not in o.path
        assert isinstance(o.size, int) and o.size >= 0


@FUZZ
@given(st.binary(max_size=400))
def test_marker_parser_on_arbitrary_bytes_gives_only_typed_errors(data):
    _typed(lambda b: Marker.from_bytes(b, url="fuzz"), data, "marker bytes")


@FUZZ
@given(st.binary(max_size=300))
def test_metadata_unpickler_on_arbitrary_bytes_gives_only_typed_errors(data):
    _typed(lambda b: loads_metadata(b, url="fuzz"), data, "metadata bytes")


@FUZZ
@given(st.data())
def test_metadata_unpickler_on_mutated_honest_pickles_gives_only_typed_errors(data):
    """Flip, insert and delete bytes of a real DCP ``.metadata``: close to valid, so the
    unpickler gets deep before it refuses."""
    buf = bytearray(HONEST)
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        i = data.draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif len(buf) > 2:
            del buf[i]
    _typed(lambda b: loads_metadata(b, url="fuzz"), bytes(buf), "mutated metadata")


@FUZZ
@given(st.sampled_from(sorted({(m, n) for m, n in [("os", "system"), ("posix", "system"), ("builtins", "eval"),
                                                      ("builtins", "exec"), ("builtins", "getattr"),
                                                      ("subprocess", "Popen"), ("torch", "load"),
                                                      ("torch.distributed.checkpoint.filesystem", "os.system"),
                                                      ("torch.distributed.checkpoint.metadata", "pickle.loads"),
                                                      ("torch.serialization", "load"), ("pathlib", "Path.write_text"),
                                                      ("collections", "OrderedDict.__init__")]})),
       st.integers(0, 5), st.text(max_size=20))
def test_no_global_outside_the_allowlist_is_ever_resolved(global_, proto, arg):
    from tests.security.corpus import call

    with pytest.raises(CorruptCheckpoint):
        loads_metadata(call(proto, *global_, arg), url="fuzz")


def test_honest_metadata_still_loads():
    md = loads_metadata(HONEST, url="honest")
    assert set(md.state_dict_metadata) == {"model.w", "model.b", "extra.n", "extra.s"}
    assert md == pickle.loads(HONEST)


def test_fuzz_counts_are_reported(capsys):
    """Printed into CI's log (``-ra`` summary shows the test; the counts go to stdout)."""
    with capsys.disabled():
        print(f"\nfuzz examples per test: {EXAMPLES}; outcomes: {dict(sorted(_COUNTS.items()))}")


def test_metadata_naming_olmo_cores_storage_info_loads_as_dcps():
    """OLMo-core pickles its own copy of DCP's ``_StorageInfo``; the allowlist maps that
    exact name to DCP's class (no import of olmo_core, no module prefix)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    old, new = b"torch.distributed.checkpoint.filesystem", b"olmo_core.distributed.checkpoint.filesystem"
    assert HONEST.count(b"\x8c" + bytes([len(old)]) + old) == 1
    olmo = HONEST.replace(b"\x8c" + bytes([len(old)]) + old, b"\x8c" + bytes([len(new)]) + new)
    md = loads_metadata(_unframed(olmo), url="olmo")
    assert all(type(v) is _StorageInfo for v in md.storage_data.values())
    assert md.storage_data == pickle.loads(HONEST).storage_data


def _unframed(data: bytes) -> bytes:
    """Drop protocol 4 FRAME opcodes (their lengths no longer match after an edit)."""
    import pickletools

    out, pos = bytearray(), 0
    for op, _, at in pickletools.genops(data):
        if op.name == "FRAME":
            out += data[pos:at]
            pos = at + 9
    return bytes(out + data[pos:])
