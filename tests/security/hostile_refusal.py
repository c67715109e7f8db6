"""Class 5 (and 4, 10): planted refusal notes (``{save_folder}/.cloudckpt/refused/step{N}.json``,
``cloudckpt.checkpoint.refusals``).

A note only informs: whatever is planted there (a 512 MiB document, deep or non-finite
JSON, another step's note, a reason full of terminal escapes, a note for a marker the step
does not have, a well-formed note for a healthy step, names that are not ``step{N}.json``,
a link on a local folder), a resume still loads the newest healthy step, a save still
commits, and ``list``, ``verify``, ``prune``, ``gc`` and ``rm`` still work, reading no more
than the note's ceiling and printing no raw control character. Only a note that describes
the step's marker as it is marks the step REFUSED in ``list`` (a resume that then loads the
step removes it with a log line).
"""

from __future__ import annotations

import json
import os

from .hostile_json import _bounded_memory, _join, _resumes, _save_with_manager, _store
from .tries import OK, Try, cli, honest_step, outside_untouched, run_entry

MiB = 1 << 20
NOTE = ".cloudckpt/refused"


def _note(step: int, **edit) -> bytes:
    d = {"format": "cloudckpt-refusal", "version": 1, "step": step, "refused_unix": 1_700_000_000.0,
         "reason": "rank 0: planted", "marker_size": 10, "marker_crc32c": "00000000"}
    d.update(edit)
    return json.dumps(d).encode()


def _describing(root: str, step: int, **edit) -> bytes:
    """A well-formed note bound to the step's marker as it is."""
    from cloudckpt.checkpoint import refusals

    size, crc = refusals.fingerprint(_join(root, f"step{step}"))
    return _note(step, marker_size=size, marker_crc32c=crc, **edit)


NOTES: dict[str, str] = {
    "huge": "a 512 MiB note (sparse on local)",
    "deep": "a note nested 1,000,000 deep",
    "not-json": "random bytes",
    "infinity": "refused_unix: Infinity",
    "long-int": "a marker_size of 5,000 digits",
    "wrong-step": "step1.json holding a note for step 2",
    "extra-field": "a note with a field more",
    "escape-reason": "a reason holding terminal escapes (ESC [2J, BEL)",
    "long-reason": "a reason of 100,000 characters",
    "stale": "a well-formed note for a marker the step does not have",
    "healthy": "a well-formed note bound to the healthy newest step",
    "leading-zero": "a note named step01.json",
    "folder": "a folder named step1.json holding a note",
    "link": "step1.json a link to a file outside (local)",
}


def _plant(root: str, tmp: str, case: str) -> None:
    url = _join(root, NOTE, "step1.json")
    store = _store(root)
    if case == "huge":
        import tempfile

        local = "://" not in root
        with tempfile.NamedTemporaryFile(dir=None if not local else root, delete=False) as f:
            f.write(b'{"format": "cloudckpt-refusal", "pad": "')
            f.truncate(512 * MiB)
        if local:
            os.makedirs(os.path.join(root, NOTE), exist_ok=True)
            os.replace(f.name, os.path.join(root, NOTE, "step1.json"))
        else:
            store.upload_file(f.name, url)
            os.unlink(f.name)
        return
    if case == "link":
        os.makedirs(os.path.join(root, NOTE), exist_ok=True)
        os.symlink(os.path.join(tmp, "outside", "victim"), os.path.join(root, NOTE, "step1.json"))
        return
    data = {
        "deep": b"[" * 1_000_000 + b"]" * 1_000_000,
        "not-json": os.urandom(300),
        "infinity": _note(1).replace(b"1700000000.0", b"Infinity"),
        "long-int": _note(1).replace(b'"marker_size": 10', b'"marker_size": ' + b"7" * 5000),
        "wrong-step": _note(2),
        "extra-field": _note(1, extra=1),
        "escape-reason": _describing(root, 1, reason="\x1b[2J\x07gone"),
        "long-reason": _describing(root, 1, reason="x" * 100_000),
        "stale": _note(1),
        "healthy": _describing(root, 1),
    }.get(case)
    if case == "leading-zero":
        store.put_bytes(_join(root, NOTE, "step01.json"), _describing(root, 1))
    elif case == "folder":
        store.put_bytes(_join(root, NOTE, "step1.json", "step1.json"), _describing(root, 1))
    else:
        store.put_bytes(url, data)


def note_attack(tmp: str, root: str, case: str, entry: str) -> None:
    """Step 1 honest, a note planted for it; ``entry`` must handle the folder as if the
    note were not there (``healthy``: list marks it, resume still loads it)."""
    from cloudckpt.checkpoint import refusals

    honest_step(root, 1)
    _plant(root, tmp, case)
    with outside_untouched(tmp), _bounded_memory():
        if entry == "resume":
            _resumes(root, tmp, 1)  # a note never hides a step from a load
            if case == "healthy":
                assert refusals.read(root, 1) is None, "the note of a step that loads is removed"
            return
        if entry == "manager_save":
            _save_with_manager(root, tmp, 2)
            return
        if entry == "cli_list":
            text = cli("list", root)
            marked = "REFUSED" in text
            assert marked == (case == "healthy"), f"list {'marks' if marked else 'does not mark'} step1: {text[:400]}"
            return
        if entry == "cli_verify":
            text = cli("verify", _join(root, "step1"))
            assert ("REFUSED" in text) == (case == "healthy"), text[:400]
            return
        run_entry(entry, step=_join(root, "step1"), folder=root, tmp=tmp)


T = "tests.security.hostile_refusal"
TRIES: list[Try] = []
_S3 = ("huge", "deep", "escape-reason", "healthy", "wrong-step")
for _case, _what in NOTES.items():
    for _entry in ("resume", "manager_save", "cli_list", "cli_verify", "cli_gc", "cli_prune", "cli_rm"):
        _backends = ("local",) if _case == "link" else (("local", "s3") if _case in _S3 and not (
            _case == "huge" and _entry not in ("resume", "cli_list")) else ("local",))
        for _backend in _backends:
            TRIES.append(Try(klass=4 if _case == "deep" else (10 if _case == "escape-reason" else 5),
                             case=f"refusal-{_case}", what=f"a planted refusal note: {_what}", entry=_entry,
                             target=f"{T}:note_attack", kwargs={"case": _case, "entry": _entry}, expect=OK,
                             backend=_backend, timeout=60.0))
