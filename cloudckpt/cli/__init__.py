"""``cloudckpt`` / ``python -m cloudckpt``: look at runs from a laptop or a script.

Commands: ``list``, ``latest``, ``rm``, ``inspect``, ``verify``, ``download``, ``prune``,
``gc``, ``adopt``, ``export``. The work is done by library functions (:mod:`cloudckpt.ops`,
discovery, retention, adopt, export); the modules here parse arguments, call them and
format what they return: tables for people (human sizes, UTC times beside ages),
``--json`` (JSON Lines: one object per line) or ``--json-pretty`` for scripts.

Every command takes local paths, ``file://``, ``s3://`` and ``gs://`` URLs.
Errors print one line on stderr (``cloudckpt: error: ...``, saying what to do) and
exit non-zero; ``--debug`` adds the traceback and debug logs of cloudckpt (never the
SDKs' wire logs, which carry signed headers). Exit codes:

    0  success
    1  the answer is "no" / a check failed: ``latest`` found no committed step,
       ``verify`` or ``download`` found missing or corrupt objects, an unreadable marker
    2  usage: bad arguments, a malformed URL or duration; ``export`` to a DEST that
       exists without ``--force``, a ``--key`` with no tensors, ``--format hf`` with no
       config saved or given
    3  not found: bucket, folder, local path or object missing; not a committed checkpoint;
       ``latest`` of a folder that holds no step{N} folder at all, ``list`` of a
       prefix with neither step{N} folders nor runs beneath it
    4  access denied or no usable credentials
    5  any other error (network, no answer within ``--timeout``, throttling after
       retries, local I/O)
    130 interrupted

Heavy imports happen only where needed: torch only once ``inspect``, ``verify`` or
``export`` has read the step's marker (a missing step is reported without it), boto3 or
google-cloud-storage only for an s3:// or gs:// URL.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import traceback
from typing import Sequence

from .._version import __version__
from ..errors import (
    AccessDenied,
    CloudCkptError,
    ConfigError,
    CorruptCheckpoint,
    DeleteFailed,
    IncompatibleCheckpoint,
    InvalidURL,
    NotACheckpoint,
    NotFound,
    UnsafeDelete,
)
from ..storage import resolve_local, resolve_step_dir
from . import listing, manage, step
from .common import (
    EXIT_DENIED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NO,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    parse_duration,
    seconds_arg,
)
from .hints import flag_words, not_a_step
from .output import escaped_streams

__all__ = ["CliError", "build_parser", "exit_code", "main", "parse_duration"]


def _add_common(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    """Options accepted before and after the command. On subcommands their default is
    SUPPRESS so a value given before the command is not overwritten."""
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    g = p.add_argument_group("storage and output options")
    g.add_argument("--endpoint-url", default=d(None), metavar="URL",
                   help="S3-compatible endpoint, or GCS API endpoint (default: AWS_ENDPOINT_URL / the SDK's chain; "
                        "STORAGE_EMULATOR_HOST for GCS emulators)")
    g.add_argument("--profile", default=d(None), help="AWS profile (default: AWS_PROFILE)")
    g.add_argument("--region", default=d(None), help="S3 region (default: AWS_REGION)")
    g.add_argument("--timeout", type=seconds_arg, default=d(None), metavar="SECONDS",
                   help="deadline of each request over all its retries; a store that does not answer fails the "
                        "command after about this long (default 60; transfers that make progress are not cut)")
    g.add_argument("--connect-timeout", type=seconds_arg, default=d(None), metavar="SECONDS",
                   help="wait at most this long to open a connection (default 10)")
    g.add_argument("--json", action="store_true", default=d(False),
                   help="print JSON Lines for scripts: one object per step or run for list, one object otherwise")
    g.add_argument("--json-pretty", action="store_true", default=d(False),
                   help="print one indented JSON document instead (list: the rows in one document)")
    g.add_argument("--debug", action="store_true", default=d(False), help="show tracebacks and cloudckpt debug logs")


@functools.cache
def build_parser() -> argparse.ArgumentParser:
    """The command line's parser, built once per process (parsing does not change it;
    building it is 150 ``add_argument`` calls)."""
    p = argparse.ArgumentParser(
        prog="cloudckpt",
        description="Look at and manage cloudckpt checkpoints in local folders, s3:// and gs://.",
        epilog="exit codes: 0 ok, 1 no/check failed, 2 usage, 3 not found, 4 access denied, 5 other error",
    )
    p.add_argument("--version", action="version", version=f"cloudckpt {__version__}")
    _add_common(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func, help: str, description: str | None = None) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=description or help)
        _add_common(s, suppress=True)
        s.set_defaults(func=func)
        return s

    for module in (listing, step, manage):
        module.register(command)
    return p


def exit_code(e: BaseException) -> int:
    """The exit code for an error (see the module docstring)."""
    if isinstance(e, CliError):
        return e.code
    if isinstance(e, DeleteFailed) and isinstance(e.__cause__, CloudCkptError):
        return exit_code(e.__cause__)  # what the objects' own errors say (e.g. 4 when access is denied)
    if isinstance(e, (InvalidURL, ConfigError, UnsafeDelete)):
        return EXIT_USAGE
    if isinstance(e, (CorruptCheckpoint, IncompatibleCheckpoint)):
        return EXIT_NO
    if isinstance(e, (NotFound, NotACheckpoint)):
        return EXIT_NOT_FOUND
    if isinstance(e, AccessDenied):
        return EXIT_DENIED
    return EXIT_ERROR


def _message(e: BaseException, args=None) -> str:
    if isinstance(e, CloudCkptError):
        text = _instead(e, args) or flag_words(str(e))  # the CLI's words, not the Python parameter's
        return " ".join(text.split())  # one line
    if isinstance(e, CliError):
        return " ".join(str(e).split())
    if isinstance(e, OSError):
        return f"{e.strerror or type(e).__name__}: {e.filename or ''}".rstrip(": ") + \
            "; check the local path and its permissions (rerun with --debug for details)"
    return f"unexpected {type(e).__name__}: {' '.join(str(e).split())} (rerun with --debug for the traceback)"


def _instead(e: BaseException, args) -> str | None:
    """For a STEP that is not a committed checkpoint: what is there instead (the path
    does not exist, the save folder's other steps, a run given for a step)."""
    step = getattr(args, "step", None)
    if not isinstance(e, NotACheckpoint) or not isinstance(step, str):
        return None
    try:
        return not_a_step(args, getattr(args, "given", {}).get("step", step), step)
    except Exception:  # noqa: BLE001 - the hint is extra: the error itself is still reported
        return None


def _resolve_local_paths(args) -> None:
    """Local paths given on the command line are resolved to their real path once
    (the local backend follows no link inside a save folder); a STEP's own last
    component is kept, so a step folder that is a planted link is refused."""
    args.given = {}  # as typed, for messages
    for name, resolve in (("step", resolve_step_dir), ("folder", resolve_local), ("dest", resolve_local)):
        value = getattr(args, name, None)
        if isinstance(value, str):
            args.given[name] = value
            setattr(args, name, resolve(value))


def _set_level(name: str, level: int) -> None:
    """``setLevel`` where the level changes: each call clears every logger's cache (thousands
    of loggers where torch and transformers are imported)."""
    lg = logging.getLogger(name)
    if lg.level != level:
        lg.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. What it prints is escaped: a name from a checkpoint or a
    listing never sends a control character to the terminal (:mod:`.output`)."""
    with escaped_streams():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    args.json = args.json or args.json_pretty
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.debug:
        _set_level("cloudckpt", logging.DEBUG)
    # The SDKs' debug logs include signed request headers: never enable them here.
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3", "google"):
        _set_level(noisy, logging.ERROR)
    try:
        _resolve_local_paths(args)
        return args.func(args)
    except KeyboardInterrupt:
        print("cloudckpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of our stdout went away (e.g. `| head`): not an error
        try:
            sys.stdout = open(os.devnull, "w")  # main's caller gets its own stdout back
        except OSError:
            pass
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - every error becomes one line and an exit code
        if args.debug:
            traceback.print_exc()
        print(f"cloudckpt: error: {_message(e, args)}", file=sys.stderr)
        return exit_code(e)
