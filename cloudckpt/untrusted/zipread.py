"""The records of a ``torch.save`` zip archive, located without trusting it.

``records(data)`` reads the archive's central directory and returns where each
record's bytes lie in ``data``. Nothing is inflated and nothing is allocated from a
number in the archive: every record must be stored uncompressed (``torch.save``
never compresses; a deflated record could inflate to far more than it declares), not
encrypted, with the same compressed and uncompressed size, a local header that
names it again, and bytes that lie inside ``data``, before the central directory and
apart from every other record. Zip64 sizes and offsets are read (archives over
4 GiB). Raises BadArchive saying what is wrong; the caller names the URL.
"""

from __future__ import annotations

import struct
from itertools import pairwise

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory (22 bytes)
_EOCD64_LOCATOR = struct.Struct("<4sIQI")  # zip64 end of central directory locator (20 bytes)
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory record (56 bytes)
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header (46 bytes)
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header (30 bytes)
_MAX_COMMENT = 0xFFFF
_MAX_NAME = 1024


class BadArchive(ValueError):
    """The bytes are not a zip archive this reader accepts."""


def records(data: memoryview | bytes) -> dict[str, tuple[int, int]]:
    """``{record name: (start, size)}`` of the archive ``data``. Raises BadArchive."""
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    n = len(mv)

    def bad(why: str) -> BadArchive:
        return BadArchive(why)

    if n >= _EOCD.size and mv[n - _EOCD.size:n - _EOCD.size + 4] == b"PK\x05\x06":
        at = n - _EOCD.size  # no archive comment (torch.save writes none)
    else:
        tail_from = max(0, n - _EOCD.size - _MAX_COMMENT)
        at = bytes(mv[tail_from:]).rfind(b"PK\x05\x06")
        if at < 0 or tail_from + at + _EOCD.size > n:
            raise bad("no zip directory at its end")
        at += tail_from
    _, disk, cd_disk, count_here, count, cd_size, cd_offset, comment_len = _EOCD.unpack_from(mv, at)
    if at + _EOCD.size + comment_len != n:
        raise bad("bytes after the zip directory")
    if 0xFFFF in (count_here, count) or 0xFFFFFFFF in (cd_size, cd_offset):  # zip64
        loc = at - _EOCD64_LOCATOR.size
        if loc < 0:
            raise bad("a zip64 directory without its locator")
        sig, disk64, eocd64, _ = _EOCD64_LOCATOR.unpack_from(mv, loc)
        if sig != b"PK\x06\x07" or eocd64 + _EOCD64.size > loc:
            raise bad("a bad zip64 locator")
        sig, _, _, _, disk, cd_disk, count_here, count, cd_size, cd_offset = _EOCD64.unpack_from(mv, eocd64)
        if sig != b"PK\x06\x06":
            raise bad("a bad zip64 directory")
        end_of_cd = eocd64
    else:
        end_of_cd = at
    if disk != 0 or cd_disk != 0 or count_here != count:
        raise bad("a multi-disk archive")
    if cd_offset + cd_size > end_of_cd or count * _CENTRAL.size > cd_size:
        raise bad("its directory does not fit in the file")

    out: dict[str, tuple[int, int]] = {}
    spans: list[tuple[int, int]] = []
    pos = cd_offset
    for _ in range(count):
        if pos + _CENTRAL.size > cd_offset + cd_size:
            raise bad("its directory is truncated")
        (sig, _, _, flags, method, _, _, _, csize, usize, name_len, extra_len, comment_len, disk_start, _, _,
         offset) = _CENTRAL.unpack_from(mv, pos)
        if sig != b"PK\x01\x02":
            raise bad("a bad directory entry")
        name_at = pos + _CENTRAL.size
        extra_at = name_at + name_len
        pos = extra_at + extra_len + comment_len
        if pos > cd_offset + cd_size or name_len > _MAX_NAME:
            raise bad("a directory entry runs past the directory")
        try:
            name = bytes(mv[name_at:extra_at]).decode("utf-8")
        except UnicodeDecodeError:
            raise bad("a record name that is not UTF-8") from None
        if 0xFFFFFFFF in (csize, usize, offset) or disk_start == 0xFFFF:
            usize, csize, offset = _zip64_fields(mv[extra_at:extra_at + extra_len], usize, csize, offset, bad)
        if flags & 0x1:
            raise bad(f"record {name!r} is encrypted")
        if method != 0:
            raise bad(f"record {name!r} is compressed (method {method}); torch.save stores records uncompressed, "
                      "and a compressed record could inflate past its declared size")
        if csize != usize:
            raise bad(f"record {name!r} declares two sizes")
        if name in out:
            raise bad(f"record {name!r} is listed twice")
        if offset + _LOCAL.size > cd_offset:
            raise bad(f"record {name!r} starts outside the file")
        lsig, _, _, _, _, _, _, _, _, lname_len, lextra_len = _LOCAL.unpack_from(mv, offset)
        start = offset + _LOCAL.size + lname_len + lextra_len
        if lsig != b"PK\x03\x04" or bytes(mv[offset + _LOCAL.size:offset + _LOCAL.size + lname_len]) != name.encode():
            raise bad(f"record {name!r} has no matching local header")
        if start + usize > cd_offset:
            raise bad(f"record {name!r} runs past the end of the data")
        out[name] = (start, usize)
        spans.append((offset, start + usize))
    spans.sort()
    for (_, end), (begin, _) in pairwise(spans):
        if begin < end:
            raise bad("two records overlap")
    return out


def _zip64_fields(extra: memoryview, usize: int, csize: int, offset: int, bad) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4:pos + 4 + size]
        pos += 4 + size
        if tag != 0x0001:
            continue
        want = [usize == 0xFFFFFFFF, csize == 0xFFFFFFFF, offset == 0xFFFFFFFF]
        vals = []
        at = 0
        for need in want:
            if need:
                if at + 8 > len(body):
                    raise bad("a short zip64 field")
                vals.append(struct.unpack_from("<Q", body, at)[0])
                at += 8
            else:
                vals.append(None)
        return (vals[0] if want[0] else usize, vals[1] if want[1] else csize, vals[2] if want[2] else offset)
    raise bad("a zip64 size without its zip64 field")
