"""Small JSON documents from a checkpoint folder or a bucket, parsed with bounds.

The ``latest`` pointer, a step's ``.lock``, the node-local tier's run file, a saved
Hugging Face ``config.json``, a commit marker: each is JSON that anyone with write
access to the folder may have planted. :func:`loads_json` parses one under the rules
of docs/security.md, checked before the parser runs or while it runs, never after:

- its size is at most ``limit`` bytes (the caller read at most ``limit + 1``);
- nesting is at most ``max_depth`` levels, measured on the raw bytes before parsing
  (so a document nested 10^6 deep never reaches the recursive parser);
- numbers are finite and integers have at most 20 digits (no ``NaN``/``Infinity``,
  no 4,000-digit integer whose conversion or formatting is quadratic);
- it is UTF-8.

Every refusal is a :class:`~cloudckpt.errors.CorruptCheckpoint` naming the URL and
the document.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import CorruptCheckpoint

MAX_DEPTH = 32
MAX_INT_DIGITS = 20

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes.maketrans(b"", b"")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in ``data`` outside JSON strings (linear time,
    no recursion; unbalanced input gives a bound, the parser then refuses it)."""
    return _depth(_STRINGS.sub(b"", data))


def _depth(outside_strings: bytes) -> int:
    brackets = outside_strings.translate(_BRACKETS, _NOT_BRACKETS)
    depth = deepest = 0
    for c in brackets:
        if c in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


class _Refused(ValueError):
    pass


def _constant(name: str) -> Any:
    raise _Refused(f"the non-finite number {name}")


# an integer of more than MAX_INT_DIGITS digits, outside strings: a run of digits that is
# not a fraction, an exponent or a mantissa (the number's own parser sees those: _float)
_LONG_INT = re.compile(rb"(?<![0-9.eE+])(?<![eE]-)[0-9]{%d,}(?![0-9.eE])" % (MAX_INT_DIGITS + 1))


def _float(text: str) -> float:
    if len(text) > 64:
        raise _Refused(f"a number written with {len(text)} characters")
    v = float(text)
    if v != v or v in (float("inf"), float("-inf")):
        raise _Refused("a number too large to be finite")
    return v


def loads_json(data: bytes, *, url: str, what: str, limit: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data`` (the document ``what`` at ``url``) under the bounds above.

    Raises:
        CorruptCheckpoint: larger than ``limit`` bytes, nested deeper than ``max_depth``,
            not UTF-8 JSON, or holding a non-finite number or an over-long integer.
    """
    if len(data) > limit:
        raise CorruptCheckpoint(f"{url}: the {what} is larger than {limit} bytes; refusing to parse it "
                                "(no honest one is that large): remove or restore it")
    outside = _STRINGS.sub(b"", data)  # integers are parsed by json's C scanner: their length is checked here
    depth = _depth(outside)
    if depth > max_depth:
        raise CorruptCheckpoint(f"{url}: the {what} is nested {depth} levels deep (at most {max_depth}); "
                                "refusing to parse it: remove or restore it")
    long = _LONG_INT.search(outside)
    if long:
        n = len(long.group())
        raise CorruptCheckpoint(f"{url}: the {what} holds an integer of {n} digits (at most {MAX_INT_DIGITS}); "
                                "refusing it: remove or restore it")
    try:
        return json.loads(data, parse_constant=_constant, parse_float=_float)
    except _Refused as e:
        raise CorruptCheckpoint(f"{url}: the {what} holds {e}; refusing it: remove or restore it") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8
        msg = str(e)[:200]
        raise CorruptCheckpoint(f"{url}: the {what} is not valid JSON ({msg}); remove or restore it") from None


__all__ = ["MAX_DEPTH", "loads_json", "nesting_depth"]
