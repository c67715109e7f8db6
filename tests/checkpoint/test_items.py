"""Decoding one DCP tensor item into its target: the direct path (bytes straight
into the target) must give exactly what ``torch.load`` + ``copy_`` gives, and must
step aside for everything it does not handle."""

from __future__ import annotations

import io
import sys
import zipfile

import pytest
import torch

from cloudckpt.dcp import items
from cloudckpt.errors import CorruptCheckpoint


def _saved(t: torch.Tensor) -> memoryview:
    buf = io.BytesIO()
    torch.save(t, buf)
    return memoryview(buf.getvalue())  # read-only, like a fetched range


def _expected(t, offsets, lengths):
    for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        t = t.narrow(dim, o, n)
    return t


g = torch.Generator().manual_seed(0)
CASES = {
    # name: (stored tensor, storage_offsets, lengths, direct path expected)
    "fp32 whole": (torch.randn(64, 33, generator=g), (0, 0), (64, 33), True),
    "fp32 rows 10..40 (resharding)": (torch.randn(64, 33, generator=g), (10, 0), (30, 33), True),
    "bf16": (torch.randn(17, 5, generator=g).to(torch.bfloat16), (0, 0), (17, 5), True),
    "int64 1-d tail": (torch.arange(1000, dtype=torch.int64), (900,), (100,), True),
    "0-d": (torch.tensor(3.25), (), (), True),
    "empty": (torch.empty(0, 4), (0, 0), (0, 4), True),
    "columns (non-contiguous view)": (torch.randn(8, 6, generator=g), (0, 2), (8, 3), False),
    "stored transposed": (torch.randn(6, 8, generator=g).t(), (0, 0), (8, 6), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_direct_path_matches_torch_load_and_copy(name):
    stored, offsets, lengths, direct = CASES[name]
    data = _saved(stored)
    want = _expected(stored, offsets, lengths)
    target = torch.full(want.shape, -7, dtype=want.dtype)
    v0 = target._version
    took_direct = items.load_tensor_into(data, offsets, lengths, target, url="s3://b/x.distcp", fqn="w")
    assert took_direct is direct
    assert torch.equal(target, want)
    assert target._version > v0  # autograd sees the write either way


def test_direct_path_writes_into_a_slice_of_a_larger_tensor_only():
    full = torch.zeros(10, 4)
    stored = torch.randn(3, 4, generator=g)
    target = full[4:7]  # resharding onto fewer ranks: a contiguous row block of the local tensor
    assert items.load_tensor_into(_saved(stored), (0, 0), (3, 4), target, url="u", fqn="w")
    assert torch.equal(full[4:7], stored)
    assert full[:4].eq(0).all() and full[7:].eq(0).all()


def test_non_contiguous_or_other_dtype_targets_take_the_general_path():
    stored = torch.randn(4, 6, generator=g)
    target = torch.zeros(6, 4).t()
    assert not items.load_tensor_into(_saved(stored), (0, 0), (4, 6), target, url="u", fqn="w")
    assert torch.equal(target, stored)
    as_f64 = torch.zeros(4, 6, dtype=torch.float64)
    assert not items.load_tensor_into(_saved(stored), (0, 0), (4, 6), as_f64, url="u", fqn="w")
    assert torch.equal(as_f64, stored.double())


def test_shape_mismatch_is_a_corrupt_checkpoint_naming_the_url_and_key():
    with pytest.raises(CorruptCheckpoint, match=r"s3://b/__0_0\.distcp: layers\.0\.w has shape \(4, 6\)"):
        items.load_tensor_into(_saved(torch.randn(4, 6)), (0, 0), (4, 6), torch.zeros(4, 5),
                               url="s3://b/__0_0.distcp", fqn="layers.0.w")


def _rewritten(data: memoryview, *, byteorder: str | None = None, swap: bool = False,
               compress: int = zipfile.ZIP_STORED) -> memoryview:
    """The same item re-zipped, with another byte order record (and data) or compression."""
    src = zipfile.ZipFile(io.BytesIO(bytes(data)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = src.read(info)
            if info.filename.endswith("/byteorder") and byteorder:
                body = byteorder.encode()
            if "/data/" in info.filename and "/.data/" not in info.filename:
                if swap:
                    body = bytes(_swap32(body))
                dst.writestr(info.filename, body, compress_type=compress)
            else:
                dst.writestr(info.filename, body)
    return memoryview(out.getvalue())


def _swap32(b: bytes) -> bytearray:
    """Reverse the bytes of every 4-byte word (int32 data in the other byte order)."""
    out = bytearray(len(b))
    out[0::4], out[1::4], out[2::4], out[3::4] = b[3::4], b[2::4], b[1::4], b[0::4]
    return out


def test_an_item_in_the_other_byte_order_is_byteswapped_by_the_general_path():
    stored = torch.arange(24, dtype=torch.int32).reshape(4, 6) * 1000003
    other = "big" if sys.byteorder == "little" else "little"
    data = _rewritten(_saved(stored), byteorder=other, swap=True)
    assert items._storage_record(data) is None  # the direct path would copy the bytes unswapped
    target = torch.zeros(4, 6, dtype=torch.int32)
    assert not items.load_tensor_into(data, (0, 0), (4, 6), target, url="u", fqn="w")
    assert torch.equal(target, stored)


def test_a_compressed_storage_record_is_not_copied_raw():
    data = _rewritten(_saved(torch.randn(64, 64, generator=g)), compress=zipfile.ZIP_DEFLATED)
    assert items._storage_record(data) is None


def test_the_direct_path_finds_the_same_offset_torch_does():
    data = _saved(torch.randn(128, 16, generator=g))
    start, size = items._storage_record(data)
    meta = torch.load(items.BufferReader(data), map_location="meta", weights_only=True)
    # torch's own (private) record of where the storage starts, when this version has it
    assert getattr(meta.untyped_storage(), "_checkpoint_offset", start) == start
    assert size == 128 * 16 * 4
    raw = torch.frombuffer(bytearray(data[start:start + size]), dtype=torch.float32).reshape(128, 16)
    assert torch.equal(raw, torch.load(io.BytesIO(bytes(data)), weights_only=True))


def test_not_a_zip_goes_to_torch_load_whose_refusal_is_typed_and_names_the_item():
    from cloudckpt.errors import UnsafeCheckpoint

    with pytest.raises(UnsafeCheckpoint, match="u: refused to load the tensor 'w'"):
        items.load_tensor_into(memoryview(b"not a tensor at all" * 10), (0,), (3,), torch.zeros(3), url="u", fqn="w")


def test_a_byte_order_record_in_an_unknown_compression_takes_the_general_path():
    data = bytearray(_saved(torch.arange(12, dtype=torch.int32)))
    zf = zipfile.ZipFile(io.BytesIO(bytes(data)))
    info = next(i for i in zf.infolist() if i.filename.endswith("/byteorder"))
    # compression method 99 in its central directory entry: zipfile cannot read the record
    entry = bytes(data).find(b"PK\x01\x02")
    while entry != -1:
        name_len = int.from_bytes(data[entry + 28:entry + 30], "little")
        if bytes(data[entry + 46:entry + 46 + name_len]).decode() == info.filename:
            data[entry + 10:entry + 12] = (99).to_bytes(2, "little")
            break
        entry = bytes(data).find(b"PK\x01\x02", entry + 4)
    assert items._storage_record(memoryview(bytes(data))) is None
