"""The library's errors said in the CLI's words: the flag instead of the Python
parameter (``--force``, not ``overwrite=True``), and for a STEP or FOLDER that is not
one, what is there instead (the path does not exist; the step folders of the save
folder; a save folder given where a step was expected).

The library's messages are written for Python callers and stay as they are; they are
translated here, at the CLI boundary. A hint costs at most one LIST and the marker
reads of finding the newest committed step, and only when a command has already failed.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from ..checkpoint import discovery, layout
from ..errors import InvalidURL
from ..storage import url as urls
from .common import loc

# Python parameter -> flag, in the library's messages (exact fragments, longest first where
# one contains another).
FLAG_WORDS: tuple[tuple[str, str], ...] = (
    ("pass overwrite=True (--force) to replace it", "rerun with --force to replace it"),
    ("pass config= a PretrainedConfig, a dict or a config.json path",
     "pass --config PATH (the model's config.json, or a folder holding one)"),
    ("config= is not a Hugging Face model config", "--config is not a Hugging Face model config"),
    ("use fmt='torch'", "use --format torch"),
    ("pass key_prefix= one of them", "pass --key with one of them"),
    ("unknown export dtype", "unknown --dtype"),
    ("export dtype must be", "--dtype must be"),
    ("storage option endpoint_url=", "--endpoint-url "),
    (" (--endpoint-url, CLOUDCKPT_ENDPOINT_URL)", ""),
    ("(AWS_ENDPOINT_URL / endpoint_url)", "(--endpoint-url / AWS_ENDPOINT_URL)"),
    ("(endpoint_url / AWS_ENDPOINT_URL)", "(--endpoint-url / AWS_ENDPOINT_URL)"),
    ("(STORAGE_EMULATOR_HOST / endpoint_url)", "(STORAGE_EMULATOR_HOST / --endpoint-url)"),
    ("raise operation_timeout (--timeout)", "raise --timeout"),
    ("within operation_timeout=", "within --timeout "),
)


def flag_words(text: str) -> str:
    """``text`` with the library's parameter names replaced by the CLI's flags."""
    for python, flag in FLAG_WORDS:
        text = text.replace(python, flag)
    return text


def _local_path(url: str) -> str | None:
    """``url.local_path``, and None for a malformed URL too (a hint never raises)."""
    try:
        return urls.local_path(url)
    except InvalidURL:
        return None


def is_local(url: str) -> bool:
    """Whether ``url`` names a local path (a plain path or ``file://``)."""
    return _local_path(url) is not None


def missing_local(given: str, resolved: str) -> str | None:
    """When ``resolved`` is a local path that does not exist: one line saying so (for a
    relative path without a scheme, also how to name a bucket). None otherwise."""
    path = _local_path(resolved)
    if path is None or os.path.lexists(path):
        return None
    text = f"{resolved} does not exist"
    if _local_path(given) == given and not os.path.isabs(given):  # a plain path as typed, relative
        first, _, rest = given.partition("/")
        text += f" (`{given}` is read as a local path relative to {os.getcwd()}"
        if _BUCKET.fullmatch(first):  # it could have meant a bucket: say how to name one
            bucket = f"{first}/{rest}" if rest else first
            text += f"; for a bucket write s3://{bucket} or gs://{bucket}"
        text += ")"
    return text


# a first path component that could be a bucket name (S3's and GCS's common rules: 3-63 lowercase
# letters, digits, dots, hyphens, starting and ending with a letter or digit); `.`, `..`, `~` never are
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


HINT_DIRS = 200  # step folders checked for a marker in a hint (the newest ones)


def _committed(args, folder: str, *, skip: int | None = None) -> tuple[list[int], int]:
    """The committed steps among the newest ``HINT_DIRS`` step folders of ``folder``
    (one LIST, one HEAD each, 16 at a time), and how many step folders it holds."""

    where = loc(args, folder)
    dirs = [d for d in discovery.list_step_dirs(where) if d[0] != skip]
    newest = dirs[-HINT_DIRS:]
    with ThreadPoolExecutor(max_workers=16) as pool:
        has = list(pool.map(lambda d: where.store.exists(layout.marker_url(d[1])), newest))
    return [s for (s, _), yes in zip(newest, has, strict=True) if yes], len(dirs)


def _steps_text(folder: str, steps: list[int], dirs: int, *, other: str = "") -> str:
    """"its committed steps: step300, step400 (newest: URL)" or what there is instead."""
    if not dirs:
        return f"{folder} holds no {other}step{{N}} folder (is the path right?)"
    if not steps:
        return f"none of the {dirs} {other}step folder(s) of {folder} is committed (`cloudckpt list --all {folder}`)"
    shown = ", ".join(f"step{s}" for s in steps[-10:])
    more = f"..., {shown} ({len(steps)} of the newest {min(dirs, HINT_DIRS)} step folders)" if len(steps) > 10 \
        else shown
    return (f"the committed steps of {folder}: {more}; the newest is {urls.join(folder, f'step{steps[-1]}')}")


def not_a_step(args, given: str, url: str) -> str | None:
    """What is at ``url`` instead of a committed step (``given``: as typed), or None
    when nothing more can be said."""
    name_step = layout.step_of_name(urls.basename(url))
    parent = urls.parent(url)
    gone = missing_local(given, url)
    if gone and (name_step is None or not os.path.isdir(_local_path(parent) or "")):
        return gone
    if name_step is None:
        steps, dirs = _committed(args, url)
        if not dirs:
            return None
        return f"{url} is a save folder (a run), not a step: give one of its steps; {_steps_text(url, steps, dirs)}"
    what = (f"{url} does not exist" if gone else
            f"{url} is not a committed checkpoint: it has no {layout.MARKER} (a pruned or removed step, a save "
            "that never finished, or a wrong path)")
    steps, dirs = _committed(args, parent, skip=name_step)
    return f"{what}; {_steps_text(parent, steps, dirs, other='other ')}"
