"""Formatting for people (sizes, ages, aligned tables, progress bars) and for
scripts (JSON).

Names printed by the CLI come from checkpoints and bucket listings (tensor names,
train-state keys, marker strings, object keys, run folders): hostile until shown.
Every command runs inside :func:`escaped_streams`, so nothing it prints sends a
control character to the terminal: C0 (but newline and tab), DEL, C1 and the other
non-printable characters (bidi overrides, separators) are shown as ``\\xNN`` /
``\\uNNNN`` (:func:`shown`). JSON output is ASCII (``ensure_ascii``): every
control and non-ASCII character of a name is a ``\\u`` escape.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from datetime import datetime, timezone
from typing import Any, Iterator, Sequence


def _escape_char(c: str) -> str:
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def shown(text: Any, *, keep: str = "") -> str:
    """``text`` with every non-printable character (``str.isprintable``: control,
    format, separator and unassigned characters; the ASCII space is printable) shown as
    an escape, except those in ``keep``."""
    s = str(text)
    plain = s
    for k in keep:
        plain = plain.replace(k, "")
    if plain.isprintable():
        return s
    return "".join(c if c.isprintable() or c in keep else _escape_char(c) for c in s)


class EscapingStream(io.TextIOBase):
    """A text stream that writes to ``raw`` with :func:`shown` applied (newlines and
    tabs pass)."""

    def __init__(self, raw):
        self.raw_stream = raw

    def write(self, s: str) -> int:
        self.raw_stream.write(shown(s, keep="\n\t"))
        return len(s)

    def flush(self) -> None:
        self.raw_stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.raw_stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self.raw_stream.fileno()

    @property
    def encoding(self):  # what print() and logging look at
        return getattr(self.raw_stream, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


@contextlib.contextmanager
def escaped_streams() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` escaped (:class:`EscapingStream`) for the block."""
    out, err = sys.stdout, sys.stderr
    wrapped = sys.stdout, sys.stderr = EscapingStream(out), EscapingStream(err)
    try:
        yield
    finally:
        for name, s, orig in (("stdout", wrapped[0], out), ("stderr", wrapped[1], err)):
            if getattr(sys, name) is not s:
                continue  # replaced meanwhile (a broken pipe's stdout goes to /dev/null): left so
            try:
                s.flush()
            except (OSError, ValueError):
                pass  # a closed or broken pipe: nothing more to show
            setattr(sys, name, orig)


def raw_stderr():
    """The terminal's stderr under :func:`escaped_streams` (for the progress bar, whose
    carriage returns are ours)."""
    return getattr(sys.stderr, "raw_stream", sys.stderr)


def age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f}{unit}"
    return f"{seconds:.0f}s"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=1, ensure_ascii=True)
    sys.stdout.write("\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> None:
    """Print an aligned table; columns listed in ``right`` are right-aligned; the
    last column is not padded."""
    cells = [[shown(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals):
        out = []
        for i, v in enumerate(vals):
            if i == len(vals) - 1:
                out.append(v)
            elif i in right:
                out.append(v.rjust(widths[i]))
            else:
                out.append(v.ljust(widths[i]))
        return "  ".join(out).rstrip()

    sys.stdout.write("\n".join([line(list(headers)), *(line(r) for r in cells)]) + "\n")  # one escaping pass


class Bar:
    """A tqdm bar of bytes on stderr, made when the operation says its total
    (:class:`cloudckpt.ops.Progress`): shown on a terminal, or when ``--progress``
    forces it. ``close()`` when done."""

    def __init__(self, args, desc: str):
        self._disable = True if args.progress is False else (False if args.progress else None)
        self._desc = desc
        self._bar = None

    def start(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=self._desc,
                         disable=self._disable, dynamic_ncols=True, file=raw_stderr())

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def utc(ts: float | None) -> str:
    """An absolute time in UTC, one token: ``2026-11-22T00:04:06Z`` (``-`` when unknown)."""
    if ts is None:
        return "-"

    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def emit(args, doc: dict) -> None:
    """A command's one result: one JSON line (``--json``) or indented (``--json-pretty``)."""
    if getattr(args, "json_pretty", False):
        print_json(doc)
    else:
        print(json.dumps(doc, ensure_ascii=True))


def emit_records(args, records: Sequence[dict], document: dict) -> None:
    """A listing: one JSON object per line (``--json``), or ``document`` indented
    (``--json-pretty``)."""
    if getattr(args, "json_pretty", False):
        print_json(document)
        return
    for r in records:
        sys.stdout.write(json.dumps(r, ensure_ascii=True) + "\n")
