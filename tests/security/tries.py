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
import json
import os
import re
from dataclasses import dataclass, field

from .sandbox import CACHE_ENV, OK, REFUSED


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

# the entry points, in the order of the table's columns, with their column headers; a try
# may name another entry point (it gets a column of its own, after these)
ENTRY_POINTS = {
    "load": "load", "load_pre_download": "pre-dl", "resume": "resume", "lightning": "Lightning",
    "cli_inspect": "inspect", "cli_verify": "verify", "cli_export": "export", "cli_download": "download",
    "cli_list": "list", "cli_latest": "latest", "cli_gc": "gc", "cli_prune": "prune", "cli_rm": "rm",
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
            raise CliRefused(f"exit {rc}: {text.strip()}", rc)
        raise e  # typed: refused; anything else: a finding
    if rc != 0:
        raise CliRefused(f"exit {rc}: {text.strip()}", rc)
    return text


def warm_up() -> None:
    """For ``Sandbox(warm_up="tests.security.tries:warm_up")``: one honest save, load and
    ``inspect`` in a scratch folder, so that what cloudckpt, DCP and argparse set up on
    first use is set up once in the zygote, not in every try."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="cloudckpt-warm-up-")
    try:
        step = honest_step(os.path.join(tmp, "saves"))
        for entry in ("load", "cli_inspect", "cli_list"):
            run_entry(entry, step=step, folder=os.path.join(tmp, "saves"), tmp=tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------- the entry points
def _json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a warning on stderr
        if isinstance(row, dict):
            rows.append(row)
    return rows


def run_entry(entry: str, *, step: str, folder: str, tmp: str, check_honest: bool = False) -> str:
    """Call the reader ``entry`` (a key of :data:`ENTRY_POINTS`) on ``step`` in the save
    folder ``folder``, with its work dir ``tmp/work`` and its destination under
    ``tmp/dest-<entry>``. Returns what it printed (or "") when it handled the step;
    raises a typed error when it refused it (:class:`NotUsed` when ``resume`` found no
    usable step or ``list`` did not show it; :class:`CliRefused` for a CLI exit); anything
    else it raises is a finding. Wrap the call in :func:`outside_untouched`.
    ``check_honest``: a load must load :func:`honest_state`'s weights (AssertionError if not)."""
    work, dest = os.path.join(tmp, "work"), os.path.join(tmp, f"dest-{entry}")
    if entry in ("load", "load_pre_download"):
        from cloudckpt import Checkpointer

        state = zero_state()
        with Checkpointer(work_dir=work, pre_download=entry == "load_pre_download") as ck:
            ck.load(step, state)
        if check_honest:
            import torch

            assert torch.equal(state["model"]["w"], honest_state()["model"]["w"]), f"{step}: an honest load loads"
        return ""
    if entry == "resume":
        from cloudckpt import CheckpointConfig

        mgr = CheckpointConfig(save_folder=folder, work_dir=work, save_interval=1000).build()
        try:
            got = mgr.resume(zero_state())
        finally:
            mgr.close()
        if got is None:
            raise NotUsed(f"{folder}: resume found no usable step")
        return ""
    if entry == "lightning":
        from cloudckpt.integrations.lightning import CloudCheckpointIO

        io_ = CloudCheckpointIO(work_dir=work)
        try:
            io_.load_checkpoint(step)
        finally:
            io_.teardown()
        return ""
    if entry == "cli_list":
        text = cli("list", folder, "--json")
        name = "/" + step.rstrip("/").rsplit("/", 1)[-1]
        if not any(row.get("url", "").rstrip("/").endswith(name) for row in _json_lines(text)):
            raise NotUsed(f"{folder}: list does not show {step}: {text[:300]}")
        return text
    argv = {
        "cli_inspect": ["inspect", step],
        "cli_verify": ["verify", step],
        "cli_export": ["export", step, os.path.join(dest, "model.safetensors")],
        "cli_download": ["download", step, os.path.join(dest, "step")],
        "cli_latest": ["latest", folder],
        "cli_gc": ["gc", folder, "--older-than", "0", "--yes"],
        "cli_prune": ["prune", folder, "--keep-last", "1", "--yes"],
        "cli_rm": ["rm", step, "--yes"],
    }[entry]
    return cli(*argv)


def _cli_refused_base():
    from cloudckpt.errors import CloudCkptError

    return CloudCkptError


class CliRefused(_cli_refused_base()):  # type: ignore[misc]
    """The CLI said no with a typed error of its own (usage, not found, check failed)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class NotUsed(_cli_refused_base()):  # type: ignore[misc]
    """The entry point went on without the hostile step (``resume`` found no usable step,
    ``list`` did not show it): refused, the way these entry points refuse."""


# ----------------------------------------------------------------- honest steps
def honest_state() -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    return {"model": {"w": torch.randn(64, generator=g), "b": torch.randn(8, generator=g)},
            "optim": {"m": torch.randn(64, generator=g)}, "extra": {"n": 3}}


def zero_state() -> dict:
    import torch

    return {"model": {"w": torch.zeros(64), "b": torch.zeros(8)}, "optim": {"m": torch.zeros(64)}, "extra": {"n": 0}}


def _build_honest(folder: str, step: int, work: str) -> None:
    from cloudckpt import Checkpointer

    with Checkpointer(work_dir=work) as ck:
        ck.save(f"{folder}/step{step}", honest_state(), {"step": step})


_CACHE: list[str] = []


def _process_cache() -> str:
    """Outside a sandbox: a cache folder for this process (removed when it exits)."""
    if not _CACHE:
        import atexit
        import shutil
        import tempfile

        _CACHE.append(tempfile.mkdtemp(prefix="cloudckpt-tries-"))
        atexit.register(shutil.rmtree, _CACHE[0], True)
    return _CACHE[0]


def cached(name: str, make) -> bytes:
    """``make()`` (bytes), built once per sandbox (or process) and read back from the
    cache folder afterwards: a crafted object that costs seconds to build (a deflate
    bomb, 30,000 storage keys) is built by the first try that needs it, not by each of
    the entry points that read it. ``make`` must return the same bytes every time it
    is called in one sandbox (it may depend on :func:`honest_step`'s objects, which
    are built once per sandbox too)."""
    path = os.path.join(os.environ.get(CACHE_ENV) or _process_cache(), "crafted-" + hashlib.sha256(
        name.encode()).hexdigest()[:24])
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        pass
    data = make()
    with open(f"{path}.{os.getpid()}", "wb") as f:
        f.write(data)
    os.rename(f"{path}.{os.getpid()}", path)
    return data


def honest_step(root: str, step: int = 1) -> str:
    """Put an honest committed ``step{step}`` of :func:`honest_state` (train state
    ``{"step": step}``) and the ``latest`` pointer under the save folder ``root`` (local
    or ``s3://``), and return the step's URL. In a sandbox it is saved once, into the
    sandbox's cache folder, and copied object by object afterwards (a copy costs a few
    milliseconds, a save a tenth of a second); the objects are the same bytes either
    way (nothing in a step names where it lives)."""
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    cache = os.environ.get(CACHE_ENV) or _process_cache()
    template = os.path.join(cache, f"honest-step{step}")
    if not os.path.isdir(template):
        building = f"{template}.{os.getpid()}"
        _build_honest(os.path.join(building, "run"), step, os.path.join(building, "work"))
        try:
            os.rename(building, template)
        except OSError:  # a try running beside this one built it first: the same bytes
            if not os.path.isdir(template):
                raise
            import shutil

            shutil.rmtree(building, ignore_errors=True)
    run = os.path.join(template, "run")
    if "://" not in root or root.startswith("file://"):  # a plain copy: the local backend would fsync every file
        import shutil

        shutil.copytree(run, root.removeprefix("file://"), dirs_exist_ok=True)
        return urls.join(root, f"step{step}")
    store = open_store(root)
    for d, _, files in os.walk(run):
        for n in sorted(files, key=lambda n: n == ".metadata.json"):  # the marker last, as a save does
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                store.put_bytes(urls.join(root, *os.path.relpath(p, run).split(os.sep)), f.read())
    return urls.join(root, f"step{step}")


__all__ = ["Try", "CLASSES", "ENTRY_POINTS", "OK", "REFUSED", "plant", "snapshot", "outside_untouched", "cli",
           "CliRefused", "NotUsed", "OutsideTouched", "TerminalInjection", "honest_state", "zero_state",
           "honest_step", "run_entry", "cached"]
