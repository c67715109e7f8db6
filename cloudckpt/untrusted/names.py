"""Names from a checkpoint: checked once, at parse time.

An object path in a marker or a ``relative_path`` in DCP's ``.metadata`` becomes an
object key under the step folder and, for downloads, a local path under a folder
we chose. A name is accepted only if it cannot leave that folder on any system
and reads the same everywhere: ``/``-separated segments of ASCII letters, digits,
``.``, ``_`` and ``-`` (no ``.``/``..``/empty segment, no absolute path, no
backslash, NUL, control or non-ASCII character, so no look-alikes), at most
``MAX_NAME`` characters and ``MAX_DEPTH`` segments. Every tool we know of (our
writer, stock DCP, OLMo-core, torchtitan) writes names of that form.

Local files in work dirs never carry a checkpoint's string: ``local_name``
derives them.
"""

from __future__ import annotations

import re

from ..errors import UnsafeCheckpoint

MAX_NAME = 1024
MAX_SEGMENT = 255
MAX_DEPTH = 16
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")


def check_name(name: object, *, what: str, url: str) -> str:
    """``name`` if it is a safe relative object name; else UnsafeCheckpoint naming
    ``what`` (e.g. "object path in the marker") and ``url`` (the file it came from)."""
    if not isinstance(name, str):
        raise UnsafeCheckpoint(f"{url}: the {what} is a {type(name).__name__}, not a name; refusing the checkpoint")
    reason = _problem(name)
    if reason:
        shown = name if len(name) <= 120 else name[:117] + "..."
        raise UnsafeCheckpoint(f"{url}: the {what} {shown!r} is unsafe ({reason}); refusing to use it: "
                               "the checkpoint was not written by cloudckpt or DCP, or was tampered with")
    return name


def _problem(name: str) -> str | None:
    if not name:
        return "empty"
    if len(name) > MAX_NAME:
        return f"longer than {MAX_NAME} characters"
    if name.startswith("/"):
        return "an absolute path"
    segments = name.split("/")
    if len(segments) > MAX_DEPTH:
        return f"more than {MAX_DEPTH} levels deep"
    for seg in segments:
        if seg in ("", ".", ".."):
            return f"has a {seg or 'empty'!r} segment" if seg else "has an empty segment"
        if len(seg) > MAX_SEGMENT:
            return f"a segment longer than {MAX_SEGMENT} characters"
        if not _SEGMENT.fullmatch(seg):
            bad = next(c for c in seg if not _SEGMENT.fullmatch(c))
            return f"character {bad!r} (U+{ord(bad):04X}) is not allowed"
    return None


def local_name(index: int, start: int = 0) -> str:
    """The local file name for the ``index``-th distinct object of a load (and the
    byte offset its local copy starts at): derived, never the checkpoint's string."""
    return f"obj{int(index)}-at{int(start)}"
