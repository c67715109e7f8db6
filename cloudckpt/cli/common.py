"""What every command shares: exit codes, the one-line error, storage options from
the command line, and the argument types."""

from __future__ import annotations

import argparse
import re

from ..storage import Location, StorageOptions

EXIT_OK, EXIT_NO, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_DENIED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 5, 130


class CliError(Exception):
    """An error the CLI reports as one line with a given exit code."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


def storage_options(args):
    times = {"operation_timeout": args.timeout, "connect_timeout": args.connect_timeout}
    return StorageOptions(endpoint_url=args.endpoint_url, profile=args.profile, region=args.region,
                          **{k: v for k, v in times.items() if v is not None})


def loc(args, url: str):
    """``url`` with the storage options of the command line, as a Location."""
    return Location.of(url, storage_options(args))


def seconds_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: use a number of seconds > 0, e.g. 30")
    return v


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``30m``, ``2h``, ``1d``, ``1h30m``, ``90`` (seconds) -> seconds. Raises ValueError."""
    s = text.strip().lower()
    pos, total, parts = 0, 0.0, 0
    while pos < len(s):
        m = _DURATION_RE.match(s, pos)
        if not m or (m.group(2) == "" and m.end() != len(s)):
            raise ValueError(text)
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos, parts = m.end(), parts + 1
    if not parts:
        raise ValueError(text)
    return total


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with a unit s, m, h, d or w, e.g. 30m, 2h, 1d, 1h30m"
        ) from None


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: use an integer >= 1")
    return v


def yes_opt(s, help: str = "really delete (default: dry run)") -> None:
    """``--yes`` / ``-y`` of the commands that are dry runs unless told otherwise."""
    s.add_argument("--yes", "-y", action="store_true", help=help)
