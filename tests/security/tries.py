"""The contract of the hostile-input tries (issue: hostile checkpoints, third round).

Each ``tests/security/hostile_<topic>.py`` module lists ``TRIES: list[Try]``.
``test_hostile.py`` collects them all, runs each in the sandbox (``sandbox.py``: a
forked child with a 4 GiB address-space limit and a wall-clock limit), asserts the
outcome it expects, and renders the table of docs/security.md from them.

A try's ``target`` is ``"tests.security.hostile_<topic>:function"``. The runner calls
it in the sandbox as ``function(tmp=..., root=..., **kwargs)``:

- ``tmp``: a fresh local folder for this try, with ``tmp/outside/`` holding planted
  files (``planted()`` lists them). Nothing may create, change or remove anything in
  ``outside/`` (wrap the entry point in ``with outside_untouched(tmp): ...``).
- ``root``: where the try builds its checkpoints: ``{tmp}/saves`` for ``backend="local"``,
  a fresh ``s3://bucket/prefix`` on SeaweedFS for ``backend="s3"`` (the sandbox has the
  endpoint and credentials in its environment).

The function builds its crafted input (with cloudckpt's own writer, then rewrites
bytes) and calls ONE entry point. Returning means the entry point handled it
(``ok``); a :class:`cloudckpt.errors.CloudCkptError` means refused with a typed error;
anything else is a finding (``untyped``), as are a signal (``crash``), running out of
memory (``bomb``) and running out of time (``hang``). Use ``cli()`` for CLI entry
points: it turns the CLI's exit into the same outcomes and refuses raw control
characters in what the CLI printed (terminal injection).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
from dataclasses import dataclass, field

from .sandbox import OK, REFUSED


@dataclass(frozen=True)
class Try:
    klass: int  # the class of the issue (1..10); 0 for the second round's corpus
    case: str  # short and unique within the class
    what: str  # one line for the table
    entry: str  # the entry point, e.g. "load", "resume", "cli_inspect", "local_tier_save"
    target: str  # "module:function" run in the sandbox
    kwargs: dict = field(default_factory=dict)
    expect: str = REFUSED  # REFUSED or OK
    backend: str = "local"  # "local" | "s3"
    timeout: float = 60.0


CLASSES = {
    0: "second-round corpus",
    1: "links in local folders",
    2: "memory safety of the train-state allowlist",
    3: "uninitialised memory",
    4: "depth",
    5: "planted pointer / lock",
    6: "bombs",
    7: "step names and retention",
    8: "reads outside (https)",
    9: "untyped errors",
    10: "terminal injection",
}

PLANTED = ("victim", "victim@0", "obj0-at0", "keep.txt")


def plant(tmp: str) -> str:
    outside = os.path.join(tmp, "outside")
    os.makedirs(outside, exist_ok=True)
    for name in PLANTED:
        with open(os.path.join(outside, name), "w") as f:
            f.write(f"planted {name}\n")
    return outside


def snapshot(root: str) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out[p] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[p] = ("file", hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mtime_ns)
            else:
                out[p] = ("dir",)
    return out


class OutsideTouched(AssertionError):
    """A finding: something outside the folders cloudckpt was given changed."""


class TerminalInjection(AssertionError):
    """A finding: the CLI printed a raw control character."""


@contextlib.contextmanager
def outside_untouched(tmp: str):
    """Fails (untyped) if the entry point created, changed or removed anything in
    ``tmp/outside``, whether it returned or raised."""
    outside = os.path.join(tmp, "outside")
    before = snapshot(outside)
    try:
        yield outside
    finally:
        if snapshot(outside) != before:
            raise OutsideTouched(f"something under {outside} changed")


_RAW_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def cli(*argv: str) -> str:
    """Run ``cloudckpt ARGV`` in this process. Exit 0 returns its output; a typed error
    is re-raised (refused); an untyped one is re-raised as itself (a finding). A raw
    control character in the output is a finding too."""
    import cloudckpt.cli as cli_mod
    from cloudckpt.errors import CloudCkptError

    seen: list[BaseException] = []
    real = cli_mod.exit_code

    def spy(e):
        seen.append(e)
        return real(e)

    cli_mod.exit_code = spy
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_mod.main(list(argv))
    finally:
        cli_mod.exit_code = real
    text = out.getvalue() + err.getvalue()
    bad = _RAW_CONTROL.search(text)
    if bad:
        raise TerminalInjection(f"cloudckpt {' '.join(argv[:1])} printed a raw control character "
                                f"{bad.group()!r}: {text[:300]!r}")
    if seen:
        e = seen[-1]
        if isinstance(e, cli_mod.CliError) and not isinstance(e, CloudCkptError):
            raise CliRefused(f"exit {rc}: {text.strip()}")
        raise e  # typed: refused; anything else: a finding
    if rc != 0:
        raise CliRefused(f"exit {rc}: {text.strip()}")
    return text


def _cli_refused_base():
    from cloudckpt.errors import CloudCkptError

    return CloudCkptError


class CliRefused(_cli_refused_base()):  # type: ignore[misc]
    """The CLI said no with a typed error of its own (usage, not found, check failed)."""


__all__ = ["Try", "CLASSES", "OK", "REFUSED", "plant", "snapshot", "outside_untouched", "cli", "CliRefused",
           "OutsideTouched", "TerminalInjection"]
