"""Every hostile try of ``tests/security/hostile_*.py`` (contract: ``tries.py``) run in the
sandbox (``sandbox.py``: a forked child under a 4 GiB address-space limit and a wall-clock
limit), on a local folder or a fresh prefix of a SeaweedFS bucket: its outcome is the
one it expects, never a crash, a bomb, a hang or an untyped error, and the files planted
outside the folders it was given are untouched. The table of docs/security.md is
generated from these tries and the second-round corpus (``corpus.py``) and checked here.

A ``hostile_*.py`` module that does not import, or lists a malformed try, fails the
collection of this file, naming the module: its tries are never skipped silently.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from . import corpus
from .sandbox import BOMB, CRASH, HANG, OK, REFUSED, UNTYPED
from .tries import CLASSES, ENTRY_POINTS, PLANTED, Try, plant

HERE = Path(__file__).parent
ROOT = HERE.parents[1]  # the sandbox's working directory
FINDINGS = (CRASH, BOMB, HANG, UNTYPED)
MAX_TIMEOUT = 60.0


class BadTries(Exception):
    """A hostile_*.py module that cannot run: named, never skipped."""


def _check(module: str, tries) -> list[Try]:
    where = f"tests/security/{module.rsplit('.', 1)[-1]}.py"
    if not isinstance(tries, list) or not tries:
        raise BadTries(f"{where}: TRIES must be a non-empty list of tries.Try, got {type(tries).__name__}")
    for t in tries:
        if not isinstance(t, Try) and not (type(t).__qualname__ == "Try" and  # the same module, imported as
                                           type(t).__module__.endswith("security.tries")):  # tests.security.tries
            raise BadTries(f"{where}: {t!r} is not a tries.Try")
        problem = (
            f"class {t.klass} is not one of the issue's classes 1..10" if t.klass not in CLASSES or t.klass == 0 else
            f"expect {t.expect!r} is neither {OK!r} nor {REFUSED!r}" if t.expect not in (OK, REFUSED) else
            f"backend {t.backend!r} is neither 'local' nor 's3'" if t.backend not in ("local", "s3") else
            f"timeout {t.timeout} is not in (0, {MAX_TIMEOUT:g}]" if not 0 < t.timeout <= MAX_TIMEOUT else
            "kwargs name tmp or root (the runner passes them)" if {"tmp", "root"} & set(t.kwargs) else
            "a case name is empty or holds characters other than letters, digits, '-', '_', '.'"
            if not t.case or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in t.case) else ""
        )
        if not problem:
            try:
                json.dumps(t.kwargs)
            except (TypeError, ValueError) as e:
                problem = f"kwargs are not JSON ({e})"
        if not problem:
            mod, _, fn = t.target.partition(":")
            try:
                ok = callable(getattr(importlib.import_module(mod), fn, None))
            except Exception as e:
                raise BadTries(f"{where}: the target {t.target} of {t.case} does not import: "
                               f"{type(e).__name__}: {e}") from e
            problem = "" if ok else f"target {t.target!r} is not module:function"
        if problem:
            raise BadTries(f"{where}: try {t.case!r} ({t.entry}, {t.backend}): {problem}")
    return tries


def collect_tries(folder: Path = HERE, package: str = __package__) -> list[Try]:
    """The TRIES of every hostile_*.py of ``folder`` (the package ``package``), in file order."""
    out: list[Try] = []
    for path in sorted(folder.glob("hostile_*.py")):
        name = f"{package}.{path.stem}"
        try:
            mod = importlib.import_module(name)
        except Exception as e:
            raise BadTries(f"tests/security/{path.name} does not import: {type(e).__name__}: {e}") from e
        out += _check(name, getattr(mod, "TRIES", None))
    seen: dict[str, Try] = {}
    for t in out:
        if try_id(t) in seen:
            raise BadTries(f"two tries are {try_id(t)}: {seen[try_id(t)].target} and {t.target}")
        seen[try_id(t)] = t
    return out


def try_id(t: Try) -> str:
    return f"c{t.klass}-{t.case}-{t.entry}-{t.backend}"


# sorted: a module that builds its list from a set would otherwise order it differently in each
# xdist worker (string hashes are salted per process), and xdist refuses differing collections
TRIES = sorted(collect_tries(), key=try_id)


def warm_up() -> None:
    """The zygote's warm-up: importing this module imported every hostile_*.py (their
    module-level work happens once), then one honest save, load and inspect."""
    from .tries import warm_up as honest_round

    honest_round()


@pytest.fixture
def sandbox(hostile_sandbox):
    return hostile_sandbox  # one zygote per test process (conftest.py)


@pytest.fixture(scope="module")
def bucket(seaweed):
    return seaweed.create_bucket("hostile-" + uuid.uuid4().hex[:16])


def _planted_changed(outside: str) -> list[str]:
    bad = []
    for name in PLANTED:
        p = os.path.join(outside, name)
        try:
            intact = not os.path.islink(p) and Path(p).read_text() == f"planted {name}\n"
        except OSError:
            intact = False
        if not intact:
            bad.append(name)
    return bad


def share(part: int) -> list[Try]:
    """Every PARTS-th try from the ``part``-th: this file runs share 0, test_hostile_share1.py
    and test_hostile_share2.py the others, so that the suite's workers (one file each at a
    time: --dist loadfile) run them side by side. Together they are TRIES, each once."""
    return TRIES[part::PARTS]


PARTS = 3


@pytest.mark.parametrize("t", share(0), ids=[try_id(t) for t in share(0)])
def test_hostile_try(t: Try, sandbox, tmp_path, request):
    run_try(t, sandbox, tmp_path, request)


def test_the_shares_are_every_try_once():
    ids = [try_id(t) for part in range(PARTS) for t in share(part)]
    assert sorted(ids) == sorted(try_id(t) for t in TRIES) and len(set(ids)) == len(TRIES)
    here = HERE.glob("test_hostile_share*.py")
    assert sorted(p.name for p in here) == [f"test_hostile_share{i}.py" for i in range(1, PARTS)]


# tries in flight per test process: while a test waits for its try, the tries of the next
# tests of its file already run beside it (each in a fork of its own, its own folder, limits
# and wall clock), so that a try's waits (fsync, the S3 server, the zygote's round trip) are
# another's work; each test still asserts on its own try. HOSTILE_AHEAD=0: one at a time.
AHEAD = int(os.environ.get("HOSTILE_AHEAD", "1"))
_STARTED: dict[str, tuple[int, str, str]] = {}  # test node id -> (sandbox number, tmp, outside)


def _start(t: Try, sandbox, tmp: str, request) -> tuple[int, str, str]:
    outside = plant(tmp)
    root = f"{tmp}/saves" if t.backend == "local" else f"{request.getfixturevalue('bucket')}/{uuid.uuid4().hex}"
    return sandbox.submit(t.target, timeout=t.timeout, tmp=tmp, root=root, **t.kwargs), tmp, outside


def _start_next(sandbox, request) -> None:
    """Submit the tries of the next ``AHEAD`` tests of this file that this process will run
    (the collected items after this one: --dist loadfile runs a file in one process, in order)."""
    items = request.session.items
    try:
        i = items.index(request.node)
    except ValueError:
        return
    for item in items[i + 1:i + 1 + AHEAD]:
        spec = getattr(item, "callspec", None)
        t = spec.params.get("t") if spec else None
        if item.module is not request.node.module or not isinstance(t, Try) and type(t).__name__ != "Try":
            break
        if item.nodeid not in _STARTED:
            tmp = str(request.getfixturevalue("tmp_path_factory").mktemp("ahead", numbered=True))
            _STARTED[item.nodeid] = _start(t, sandbox, tmp, request)


def run_try(t: Try, sandbox, tmp_path, request) -> None:
    """One try in the sandbox: the expected outcome, never a finding, the planted files intact."""
    started = _STARTED.pop(request.node.nodeid, None) or _start(t, sandbox, str(tmp_path), request)
    _start_next(sandbox, request)
    number, tmp, outside = started
    r = sandbox.result(number)
    head = f"{try_id(t)} ({t.what}) through {t.entry} on {t.backend}"
    assert r.outcome not in FINDINGS, f"FINDING: {head}: {r}"
    assert r.outcome == t.expect, f"{head}: expected {t.expect}, got {r}"
    changed = _planted_changed(outside)
    assert not changed, f"FINDING: {head}: the planted {changed} in {outside} changed"


# ----------------------------------------------------------------- the machinery itself
def _segv(tmp: str, root: str) -> None:
    import ctypes

    ctypes.string_at(0)  # reads address 0


def _allocate(tmp: str, root: str) -> None:
    _ = bytearray(8 << 30)  # over the 4 GiB address space


def _touch_rss(tmp: str, root: str) -> None:
    block = bytearray(2 << 30)  # under the address space, over the RSS limit once touched
    for i in range(0, len(block), 4096):
        block[i] = 1


def _disk(tmp: str, root: str) -> None:
    with open(f"{tmp}/big", "wb") as f:
        f.truncate(0)
        chunk = b"x" * (1 << 20)
        for _ in range(64):  # 64 MiB against a 16 MiB limit
            f.write(chunk)


def _sleep(tmp: str, root: str) -> None:
    import time

    time.sleep(30)


def _untyped(tmp: str, root: str) -> None:
    raise RecursionError("deep")


def _typed(tmp: str, root: str) -> None:
    from cloudckpt.errors import UnsafeCheckpoint

    raise UnsafeCheckpoint(f"{root}/step1: refused")


def _touch_outside(tmp: str, root: str) -> None:
    from .tries import outside_untouched

    with outside_untouched(tmp) as outside:
        Path(outside, "victim").write_text("changed")


def _raw_escape(tmp: str, root: str) -> None:
    import cloudckpt.cli

    from .tries import cli

    cloudckpt.cli.main = lambda argv: print("run\x1b[31m") or 0  # a CLI that sends an escape to the terminal
    cli("list", root)


@pytest.mark.parametrize("fresh", [False, True], ids=["runner", "fresh-fork"])
@pytest.mark.parametrize("fn,outcome,limits", [
    ("_segv", CRASH, {}), ("_allocate", BOMB, {}), ("_touch_rss", BOMB, {"rss_limit": 512 << 20}),
    ("_disk", BOMB, {"fsize_limit": 16 << 20}), ("_sleep", HANG, {"timeout": 1.0}), ("_untyped", UNTYPED, {}),
    ("_typed", REFUSED, {}), ("_touch_outside", UNTYPED, {}), ("_raw_escape", UNTYPED, {}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_sandbox_tells_each_finding_apart(fn, outcome, limits, fresh, sandbox, tmp_path):
    """The sandbox's own oracle, in a shared runner and in a fork of its own: a SIGSEGV,
    an allocation past the address space, a peak RSS or a file past their limits, a
    hang, an untyped error, a change outside and a raw escape printed by the CLI are
    each reported as what they are; and the next try of the runner still runs."""
    plant(str(tmp_path))
    r = sandbox.run(f"tests.security.test_hostile:{fn}", tmp=str(tmp_path), root=str(tmp_path / "saves"),
                    fresh=fresh, **limits)
    assert r.outcome == outcome, r
    if fn in ("_touch_outside", "_raw_escape"):
        assert r.error.endswith({"_touch_outside": "OutsideTouched", "_raw_escape": "TerminalInjection"}[fn]), r
    after = sandbox.run("tests.security.test_hostile:_sees", tmp=str(tmp_path), root="")
    assert after.outcome == OK and after.value["clean"], after


def _leave(tmp: str, root: str, what: str) -> int:
    """A try that returns ok and leaves ``what`` behind in its process; returns its pid."""
    import threading

    import cloudckpt.cli

    if what == "name":
        cloudckpt.cli.exit_code = lambda e: 0  # a monkeypatch never undone
    elif what == "env":
        os.environ["HOSTILE_LEFT_BEHIND"] = "1"
    elif what == "thread":
        threading.Thread(target=time.sleep, args=(30,), daemon=True, name="left-behind").start()
    elif what == "cwd":
        os.chdir(tmp)
    elif what == "signal":
        signal.signal(signal.SIGUSR1, lambda *_: None)
    return os.getpid()


def _sees(tmp: str, root: str) -> dict:
    """What the next try of a runner finds: nothing any try before it left behind."""
    import threading

    import cloudckpt.cli

    clean = cloudckpt.cli.exit_code.__name__ == "exit_code" and "HOSTILE_LEFT_BEHIND" not in os.environ and \
        threading.active_count() == 1 and os.getcwd() == str(ROOT) and \
        signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    return {"pid": os.getpid(), "clean": clean}


@pytest.mark.parametrize("what", ["nothing", "name", "env", "thread", "cwd", "signal"])
def test_a_runner_that_a_try_changed_takes_no_other_try(what, sandbox, tmp_path):
    """A try that leaves its process changed (a name rebound, the environment, a thread,
    the working directory, a signal handler) ends its runner: the next try runs in a
    fresh fork of the zygote and sees none of it; one that changed nothing shares it."""
    first = sandbox.run("tests.security.test_hostile:_leave", tmp=str(tmp_path), root="", what=what)
    assert first.outcome == OK, first
    nxt = sandbox.run("tests.security.test_hostile:_sees", tmp=str(tmp_path), root="")
    assert nxt.outcome == OK and nxt.value["clean"], (what, nxt)
    assert (nxt.value["pid"] == first.value) == (what == "nothing"), (what, first.value, nxt.value)


# every 40th try: the same answer in a runner (after the tries before it there) and in a fork of its own
PARITY = TRIES[::40]


def test_a_runner_answers_every_try_as_a_fresh_fork_does(sandbox, tmp_path, request):
    """The tries run in shared runners (sandbox.py); a sample of them, one in 40 across
    every class and entry point, gives the same outcome and error type in a fork of its
    own (``HOSTILE_FRESH_FORKS=1`` runs every try so)."""
    differ = []
    for i, t in enumerate(PARITY):
        answers = []
        for fresh in (False, True):
            tmp = tmp_path / f"{i}-{fresh}"
            tmp.mkdir()
            outside = plant(str(tmp))
            root = f"{tmp}/saves" if t.backend == "local" else f"{request.getfixturevalue('bucket')}/{uuid.uuid4().hex}"
            r = sandbox.run(t.target, timeout=t.timeout, tmp=str(tmp), root=root, fresh=fresh, **t.kwargs)
            answers.append((r.outcome, r.error, _planted_changed(outside)))
        if answers[0] != answers[1]:
            differ.append((try_id(t), answers))
    assert len(PARITY) > 50 and not differ, differ


def test_a_broken_or_malformed_hostile_module_fails_the_collection_naming_it(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    (pkg / "hostile_broken.py").write_text("raise NameError('half-written')\n")
    with pytest.raises(BadTries, match="hostile_broken.py does not import: NameError: half-written"):
        collect_tries(pkg, "fakepkg")
    (pkg / "hostile_broken.py").unlink()
    one = "Try(9, 'a', 'w', 'load', 'tests.security.hostile_generic:attack'"
    bad = {  # what the error says: the module's TRIES
        "expect 'crash'": f"[{one}, expect='crash')]",
        "must be a non-empty list": "None",
        "is not module:function": "[Try(9, 'a', 'w', 'load', 'tests.security.hostile_generic:nothing')]",
        "kwargs name tmp": f"[{one}, {{'tmp': 1}})]",
        "two tries are c9-a-load-local": f"[{one}), {one})]",
    }
    for i, (problem, tries) in enumerate(bad.items()):
        (pkg / f"hostile_bad{i}.py").write_text(f"from {__package__}.tries import Try\nTRIES = {tries}\n")
        with pytest.raises(BadTries, match=problem):
            collect_tries(pkg, "fakepkg")
        (pkg / f"hostile_bad{i}.py").unlink()


# ----------------------------------------------------------------- the table of docs/security.md
START = "<!-- hostile-table: generated by tests/security/test_hostile.py::corpus_table -->\n"
END = "<!-- /hostile-table -->"
_BACKEND = {"local": "local", "s3": "S3"}
# column headers of entry points that tries call themselves (tries.ENTRY_POINTS has the rest);
# an entry point named nowhere gets its own name as its header
HEADERS = {
    "cli_list_all": "list --all", "cli_latest_pointer": "latest --pointer", "cli_inspect_other": "inspect (other)",
    "cli_adopt": "adopt", "discovery": "discovery", "manager_save": "save", "local_tier_save": "tier save",
    "local_tier_retention": "tier retention", "local_tier_resume": "tier resume", "torchtitan_import": "titan import",
    "hf_export": "HF export", "hf_resume": "HF resume",
}
_CELL = {OK: "ok", REFUSED: "R"}


def _rows() -> list[tuple[int, str, str, dict[str, dict[str, str]]]]:
    """(class, case, what, {entry: {backend: outcome}}) for the second-round corpus and every try."""
    rows: dict[tuple[int, str], tuple[str, dict]] = {}
    for c in corpus.CASES:
        cells = rows.setdefault((0, c.name), (c.what, {}))[1]
        for backend in ("local",) if c.local_only else ("local", "s3"):
            for e in corpus.CORPUS_ENTRIES:
                cells.setdefault(e, {})[backend] = corpus.expected(c, e)
    for t in TRIES:
        rows.setdefault((t.klass, t.case), (t.what, {}))[1].setdefault(t.entry, {})[t.backend] = t.expect
    return [(k, case, what, cells) for (k, case), (what, cells) in sorted(rows.items(), key=lambda kv: kv[0][0])]


def _columns(rows) -> list[str]:
    used = {e for *_, cells in rows for e in cells}
    known = [*ENTRY_POINTS, *HEADERS]
    return [e for e in known if e in used] + sorted(used - set(known))


def _cell(by_backend: dict[str, str] | None) -> str:
    if not by_backend:
        return "–"
    if len(set(by_backend.values())) == 1:
        return _CELL[next(iter(by_backend.values()))]
    return ", ".join(f"{_BACKEND[b]} {_CELL[o]}" for b, o in sorted(by_backend.items()))


def summary() -> str:
    hostile = len(TRIES)
    runs = sum(len(corpus.CORPUS_ENTRIES) * (1 if c.local_only else 2) for c in corpus.CASES)
    refused = sum(t.expect == REFUSED for t in TRIES) + sum(
        corpus.expected(c, e) == REFUSED for c in corpus.CASES for e in corpus.CORPUS_ENTRIES
        for _ in range(1 if c.local_only else 2))
    cases = len({(t.klass, t.case) for t in TRIES})
    return (f"**{hostile + runs} runs**, each in a sandboxed process: {hostile} tries of {cases} cases in "
            f"classes 1-10 and {runs} runs of the second-round corpus ({len(corpus.CASES)} cases); {refused} refused "
            f"with a typed error, {hostile + runs - refused} handled. **0 crashes, 0 bombs, 0 hangs, 0 untyped "
            "errors, 0 changes to files outside the folders given.**")


def corpus_table() -> str:
    """The Markdown of docs/security.md between the hostile-table markers: the summary,
    the classes, and one row per case (class, case, backends; a column per entry point:
    R refused with a typed error, ok handled, – not run through that entry point)."""
    rows = _rows()
    cols = _columns(rows)
    out = [summary(), "", "Classes: " + "; ".join(f"{k} {v}" for k, v in CLASSES.items()) + ".", ""]
    heads = " | ".join(ENTRY_POINTS.get(e) or HEADERS.get(e, e) for e in cols)
    out.append("| class | case | what | backends | " + heads + " |")
    out.append("|" + "---|" * (4 + len(cols)))
    for k, case, what, cells in rows:
        backends = sorted({b for by in cells.values() for b in by}, key=list(_BACKEND).index)
        what = what.replace("|", "\\|")
        out.append(f"| {k} | `{case}` | {what} | {', '.join(_BACKEND[b] for b in backends)} | "
                   + " | ".join(_cell(cells.get(e)) for e in cols) + " |")
    return "\n".join(out) + "\n"


def test_the_table_in_docs_security_is_the_corpus():
    text = (HERE.parents[1] / "docs" / "security.md").read_text()
    assert START in text and END in text, f"docs/security.md lacks the markers {START.strip()} ... {END}"
    assert text.split(START, 1)[1].split(END, 1)[0] == corpus_table(), (
        "regenerate the table: .venv/bin/python -m tests.security.test_hostile --write")
    assert len(corpus.CASES) >= 30 and len(TRIES) >= 100


def write_table(path: Path = HERE.parents[1] / "docs" / "security.md") -> None:
    text = path.read_text()
    head, rest = text.split(START, 1)
    path.write_text(head + START + corpus_table() + END + rest.split(END, 1)[1])


if __name__ == "__main__":  # pragma: no cover - a tool: rewrite the table after changing tries
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.security.test_hostile --write")
    write_table()
