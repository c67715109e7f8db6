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
import uuid
from pathlib import Path

import pytest

from . import corpus
from .sandbox import BOMB, CRASH, HANG, OK, REFUSED, UNTYPED, Sandbox
from .tries import CLASSES, ENTRY_POINTS, PLANTED, Try, plant

HERE = Path(__file__).parent
FINDINGS = (CRASH, BOMB, HANG, UNTYPED)
MAX_TIMEOUT = 60.0


class BadTries(Exception):
    """A hostile_*.py module that cannot run: named, never skipped."""


def _check(module: str, tries) -> list[Try]:
    where = f"tests/security/{module.rsplit('.', 1)[-1]}.py"
    if not isinstance(tries, list) or not tries:
        raise BadTries(f"{where}: TRIES must be a non-empty list of tries.Try, got {type(tries).__name__}")
    for t in tries:
        if not isinstance(t, Try):
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
            except Exception as e:  # noqa: BLE001 - the module named by the target does not import: say so
                raise BadTries(f"{where}: the target {t.target} of {t.case} does not import: "
                               f"{type(e).__name__}: {e}") from e
            problem = "" if ok else f"target {t.target!r} is not module:function"
        if problem:
            raise BadTries(f"{where}: try {t.case!r} ({t.entry}, {t.backend}): {problem}")
    return tries


def collect_tries() -> list[Try]:
    """The TRIES of every tests/security/hostile_*.py, in file order."""
    out: list[Try] = []
    for path in sorted(HERE.glob("hostile_*.py")):
        name = f"{__package__}.{path.stem}"
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a broken module fails the collection, named
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


TRIES = collect_tries()


def warm_up() -> None:
    """The zygote's warm-up: importing this module imported every hostile_*.py (their
    module-level work happens once), then one honest save, load and inspect."""
    from .tries import warm_up as honest_round

    honest_round()


@pytest.fixture(scope="module")
def sandbox(seaweed):
    with Sandbox(env=seaweed.env(), warm_up=f"{__name__}:warm_up") as sb:
        yield sb


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


@pytest.mark.parametrize("t", TRIES, ids=[try_id(t) for t in TRIES])
def test_hostile_try(t: Try, sandbox, tmp_path, request):
    tmp = str(tmp_path)
    outside = plant(tmp)
    root = f"{tmp}/saves" if t.backend == "local" else f"{request.getfixturevalue('bucket')}/{uuid.uuid4().hex}"
    r = sandbox.run(t.target, timeout=t.timeout, tmp=tmp, root=root, **t.kwargs)
    head = f"{try_id(t)} ({t.what}) through {t.entry} on {t.backend}"
    assert r.outcome not in FINDINGS, f"FINDING: {head}: {r}"
    assert r.outcome == t.expect, f"{head}: expected {t.expect}, got {r}"
    changed = _planted_changed(outside)
    assert not changed, f"FINDING: {head}: the planted {changed} in {outside} changed"


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
    return (f"**{hostile + runs} runs**, each in its own sandboxed process: {hostile} tries of {cases} cases in "
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
    out.append("| class | case | what | backends | " + " | ".join(ENTRY_POINTS.get(e) or HEADERS.get(e, e) for e in cols) + " |")
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
