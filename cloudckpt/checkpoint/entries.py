"""A manifest entry (:class:`ObjectEntry`): one object of a step, its size, CRC32C and
item ranges, as the marker (checkpoint/marker.py) and the ranks' manifest parts
(checkpoint/parts.py) list it; and the checks of the JSON fields both levels read
(every field is untrusted until checked)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import UnsafeCheckpoint
from ..untrusted.names import check_name


@dataclass(frozen=True)
class ObjectEntry:
    path: str  # relative to the step folder, "/"-separated
    size: int
    crc32c: str | None
    chunks: tuple = ()  # ((offset, length, crc32c), ...)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"path": self.path, "size": self.size, "crc32c": self.crc32c}
        if self.chunks:
            d["chunks"] = [list(c) for c in self.chunks]
        return d


def check_int(v: Any, name: str) -> int:
    """A non-negative JSON integer (not a bool, float or string)."""
    if type(v) is not int or v < 0:
        raise ValueError(f"{name} is {v!r}, not a non-negative integer")
    return v


_CRC = re.compile(r"[0-9a-f]{8}")


def check_crc(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if type(v) is not str or not _CRC.fullmatch(v):
        raise ValueError(f"the CRC32C of {what} is {v!r}, not 8 hex digits")
    return v


def parse_entry(o: Any, url: str) -> ObjectEntry:
    """One manifest entry, checked: a safe name (untrusted.names), a size, a CRC32C,
    and item ranges inside the object that do not overlap."""
    if type(o) is not dict:
        raise TypeError("an object entry is not a JSON object")
    path = check_name(o["path"], what="object path in the marker", url=url)
    size = check_int(o["size"], f"the size of {path!r}")
    crc = check_crc(o.get("crc32c"), repr(path))
    raw_chunks = o.get("chunks", [])
    if type(raw_chunks) is not list:
        raise TypeError(f"the chunks of {path!r} are not a list")
    chunks = []
    end = 0
    for c in raw_chunks:
        if type(c) is not list or len(c) != 3:
            raise TypeError(f"a chunk of {path!r} is not [offset, length, crc32c]")
        off, n = check_int(c[0], "a chunk offset"), check_int(c[1], "a chunk length")
        if off < end or off + n > size:
            raise UnsafeCheckpoint(f"commit marker {url}: the item ranges of {path!r} overlap or run past its "
                                   f"{size} bytes (at [{off}, {off + n})); refusing the checkpoint")
        end = off + n
        chunks.append((off, n, check_crc(c[2], f"a chunk of {path!r}")))
    return ObjectEntry(path, size, crc, tuple(chunks))
