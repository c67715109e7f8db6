"""``io.BytesIO`` in plain data (untrusted/plainpickle.py): Megatron's ``ShardedObject`` data
may be one (its own unit tests save one). What this proves on crafted archives: an honest
one loads (shared, positioned, empty, protocols 2 and 4); it is built only by ``NEWOBJ``
with no arguments then one ``BUILD`` of ``(bytes, position, None)`` done by hand, or by
``io.BytesIO(bytes)``; any other state, a second ``BUILD``, ``NEWOBJ`` of anything else,
and copies past the parse budget are refused."""

from __future__ import annotations

import io

import pytest
import torch

from cloudckpt.errors import UnsafeCheckpoint
from cloudckpt.untrusted import load_plain

from . import hostile_trainstate as h

PROTO = b"\x80\x02"
NEW = h.glob("_io", "BytesIO") + b")\x81"  # io.BytesIO.__new__ (NEWOBJ, no arguments)


def _load(pkl: bytes):
    return load_plain(h.archive(pkl), url="s3://b/step1/train/rank0.pt", what="Megatron object")


@pytest.mark.parametrize("protocol", [2, 4])
def test_honest_bytesio_loads_with_its_bytes_and_position_and_shared_stays_shared(protocol):
    inner = io.BytesIO()
    torch.save({"some": "dict"}, inner)
    buf = io.BytesIO()
    torch.save({"a": inner, "b": inner, "empty": io.BytesIO(), "at": _at(b"abcdef", 2)}, buf, pickle_protocol=protocol)
    v = load_plain(buf.getvalue(), url="x", what="Megatron object")
    assert type(v["a"]) is io.BytesIO and v["a"] is v["b"] and v["a"].getvalue() == inner.getvalue()
    assert v["a"].tell() == inner.tell() and v["empty"].getvalue() == b"" and v["at"].tell() == 2
    v["a"].seek(0)
    assert torch.load(v["a"], weights_only=True) == {"some": "dict"}


def _at(data: bytes, pos: int) -> io.BytesIO:
    b = io.BytesIO(data)
    b.seek(pos)
    return b


def test_bytesio_of_bytes_by_reduce_loads():
    assert _load(PROTO + h.glob("_io", "BytesIO") + b"(" + h.glob("_codecs", "encode") + b"(" + h.s("xy")
                 + h.s("latin1") + b"tRtR.").getvalue() == b"xy"


@pytest.mark.parametrize("pkl,match", [
    (PROTO + NEW + b"(" + h.i(1) + h.i(0) + b"NtbN.", r"state other than \(bytes, position, None\)"),
    (PROTO + NEW + b"(" + b"C\x02ab" + h.i(3) + b"Ntb.", r"state other than \(bytes, position, None\)"),
    (PROTO + NEW + b"(" + b"C\x02ab" + h.i(0) + b"}" + h.s("x") + h.i(1) + b"stb.",
     r"state other than \(bytes, position, None\)"),
    (PROTO + NEW + b"(" + b"C\x02ab" + h.i(0) + b"Ntb" + b"(" + b"C\x02cd" + h.i(0) + b"Ntb.", "set twice"),
    (PROTO + h.glob("collections", "OrderedDict") + b")\x81.", r"opcode NEWOBJ on a Global \(only for io.BytesIO"),
    (PROTO + h.glob("_io", "BytesIO") + b"(" + h.i(8) + b"t\x81.", r"only for io.BytesIO\(\)"),
    (PROTO + h.glob("_io", "BytesIO") + b"(" + h.i(10**9) + b"tR.", "of something other than bytes"),
    (PROTO + h.glob("_io", "StringIO") + b")\x81.", "StringIO"),
    (PROTO + h.glob("io", "BytesIO") + b")\x81.", "io.BytesIO|io BytesIO|BytesIO"),
])
def test_a_bytesio_is_built_only_from_given_bytes_and_once(pkl, match):
    with pytest.raises(UnsafeCheckpoint, match=match):
        _load(pkl)


def test_copies_of_one_large_bytes_into_many_bytesio_are_charged_to_the_budget():
    big = b"B" + (1 << 20).to_bytes(4, "little") + b"\x00" * (1 << 20)  # BINBYTES of 1 MiB, memoised once
    one = h.glob("_io", "BytesIO") + b"q\x01" + big + b"\x85q\x02" + b"0"
    assert _load(PROTO + one + b"h\x01h\x02R.").getvalue() == b"\x00" * (1 << 20)
    with pytest.raises(UnsafeCheckpoint, match="units of plain data"):
        _load(PROTO + one + b"(" + b"h\x01h\x02R" * 200 + b"l.")
