"""Reading one object of a checkpoint with a ceiling on what it may allocate."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpoint, NotFound, UnsafeCheckpoint
from ..transfer import crc32c_bytes


def read_capped(store: Any, url: str, *, limit: int, what: str) -> bytes:
    """The whole object at ``url``, refused (UnsafeCheckpoint) if it holds more than
    ``limit`` bytes: at most ``limit + 1`` bytes are ever read. Storage errors
    (NotFound included) propagate."""
    data = store.get_bytes(url, start=0, end=limit + 1)
    if len(data) > limit:
        raise UnsafeCheckpoint(f"{url}: the {what} is larger than {limit} bytes; refusing to read it "
                               "(no honest checkpoint has one that large)")
    return data


def read_checked(store: Any, url: str, entry: Any, *, limit: int, what: str, verify: bool = True) -> bytes:
    """The object at ``url`` checked against its manifest ``entry`` (size, and
    CRC32C when ``verify``), never reading more than ``entry.size + 1`` bytes.
    Raises UnsafeCheckpoint (the manifest declares more than ``limit``),
    CorruptCheckpoint (missing, wrong size or checksum), storage errors."""
    if entry.size > limit:
        raise UnsafeCheckpoint(f"{url}: the marker declares the {what} at {entry.size} bytes, over the "
                               f"{limit}-byte ceiling; refusing to read it")
    try:
        data = store.get_bytes(url, start=0, end=entry.size + 1)
    except NotFound as e:
        if type(e) is not NotFound:
            raise  # a missing bucket is not a damaged checkpoint
        raise CorruptCheckpoint(f"{url}: the {what} is listed in the checkpoint's marker but missing; the "
                                "checkpoint is damaged: restore the object or load an older step") from None
    if len(data) != entry.size:
        raise CorruptCheckpoint(f"{url}: the {what} holds {'more than ' if len(data) > entry.size else ''}{len(data)} "
                                f"bytes, the marker says {entry.size}; the object is corrupt (run `cloudckpt verify`)")
    if verify and entry.crc32c and crc32c_bytes(data) != entry.crc32c:
        raise CorruptCheckpoint(f"{url}: the {what} does not match its CRC32C in the marker; the object is corrupt "
                                "(run `cloudckpt verify`)")
    return data
