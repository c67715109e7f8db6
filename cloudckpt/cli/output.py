"""Formatting for people (sizes, ages, aligned tables, progress bars) and for
scripts (JSON)."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence


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
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> None:
    """Print an aligned table; columns listed in ``right`` are right-aligned; the
    last column is not padded."""
    cells = [[str(c) for c in r] for r in rows]
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

    print(line(list(headers)))
    for r in cells:
        print(line(r))


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
                         disable=self._disable, dynamic_ncols=True, file=sys.stderr)

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
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def emit(args, doc: dict) -> None:
    """A command's one result: one JSON line (``--json``) or indented (``--json-pretty``)."""
    if getattr(args, "json_pretty", False):
        print_json(doc)
    else:
        print(json.dumps(doc))


def emit_records(args, records: Sequence[dict], document: dict) -> None:
    """A listing: one JSON object per line (``--json``), or ``document`` indented
    (``--json-pretty``)."""
    if getattr(args, "json_pretty", False):
        print_json(document)
        return
    for r in records:
        sys.stdout.write(json.dumps(r) + "\n")
