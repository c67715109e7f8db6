"""Every crafted checkpoint of the corpus (corpus.py) through every reader entry
point, on a local folder and on SeaweedFS: each is refused with a typed error (or,
where an entry point does not parse the crafted part, handled harmlessly), no
payload runs (no sentinel file), and nothing outside the folders cloudckpt was
given is created, changed or removed (planted files are checked byte for byte)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os

import pytest
import torch

from cloudckpt import Checkpointer, CheckpointConfig
from cloudckpt.errors import CorruptCheckpoint, NotACheckpoint
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

from . import corpus

REFUSED, OK = "refused", "ok"
ENTRY_POINTS = ["load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify", "cli_export",
                "cli_download", "cli_list", "cli_gc", "cli_prune"]

# which entry points parse which crafted part (the rest never read it: OK)
_PARSES = {
    "metadata": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify", "cli_export"},
    "marker": set(ENTRY_POINTS) - {"cli_gc", "cli_prune"},  # gc and prune leave a step they cannot read alone
    # an entry of a rank's manifest part (format 2): what reads the parts; list reads markers only
    "part": set(ENTRY_POINTS) - {"cli_gc", "cli_prune", "cli_list"},
    "train_state": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify"},
    "byte_item": {"load", "load_pre_download", "resume"},  # the Lightning plugin keeps non-tensors in its train state
    "nested": set(),
}
_OVERRIDES = {
    # only the train state's declared size lies: readers of the train state refuse, and so do
    # verify and download (size compare); export and list do not read it
    "marker-size-lie": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify", "cli_download"},
    "link-as-step": set(),  # step1 itself is honest; the link beside it is never followed (see test_links)
    "link-as-shard": {"load", "load_pre_download", "resume", "lightning", "cli_verify", "cli_export", "cli_download"},
    "link-as-train-dir": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify",
                          "cli_download"},
    "link-as-pointer": set(),  # the pointer is only a hint: discovery lists instead of following it
}


def expected(case: corpus.Case, ep: str) -> str:
    refusing = _OVERRIDES.get(case.name, _PARSES.get(case.target, set()))
    return REFUSED if ep in refusing else OK


def _snapshot(root: str) -> dict:
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


def _cli(*argv: str) -> tuple[int, str]:
    from cloudckpt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue() + err.getvalue()


def run_entry_point(ep: str, step: str, folder: str, work: str, dest: str) -> tuple[str, str]:
    """(REFUSED | OK, message). A refusal is a typed error (CorruptCheckpoint family,
    NotACheckpoint) or a CLI exit code 1/3 or, for resume/list, the step not being used;
    anything else fails the test."""
    try:
        if ep in ("load", "load_pre_download"):
            state = corpus.zero_state()
            with Checkpointer(work_dir=work, pre_download=ep == "load_pre_download") as ck:
                ck.load(step, state)
            assert torch.equal(state["model"]["w"], corpus.honest_state()["model"]["w"]), "an honest load loads"
            return OK, ""
        if ep == "resume":
            mgr = CheckpointConfig(save_folder=folder, work_dir=work, save_interval=1000).build()
            try:
                got = mgr.resume(corpus.zero_state())
            finally:
                mgr.close()
            return (REFUSED, "resume found no usable step") if got is None else (OK, "")
        if ep == "lightning":
            from cloudckpt.integrations.lightning import CloudCheckpointIO

            io_ = CloudCheckpointIO(work_dir=work)
            try:
                io_.load_checkpoint(step)
            finally:
                io_.teardown()
            return OK, ""
        if ep == "cli_list":
            rc, text = _cli("list", folder, "--json")
            assert rc in (0, 1, 3), text
            return (OK, text) if '"step": 1' in text or '"step":1' in text else (REFUSED, text)
        argv = {
            "cli_gc": ["gc", folder, "--older-than", "0", "--yes"],
            "cli_prune": ["prune", folder, "--keep-last", "1", "--yes"],
            "cli_inspect": ["inspect", step],
            "cli_verify": ["verify", step],
            "cli_export": ["export", step, os.path.join(dest, "model.safetensors")],
            "cli_download": ["download", step, os.path.join(dest, "step1")],
        }[ep]
        rc, text = _cli(*argv)
        assert rc in (0, 1, 3), f"{ep} exited {rc} (an untyped error?): {text}"
        return (OK, text) if rc == 0 else (REFUSED, text)
    except (CorruptCheckpoint, NotACheckpoint) as e:
        return REFUSED, f"{type(e).__name__}: {e}"


def _build(case: corpus.Case, root: str, outside: str, work: str) -> tuple[str, str, corpus.Ctx]:
    folder = urls.join(root, case.name)
    step = urls.join(folder, "step1")
    Checkpointer(work_dir=work).save(step, corpus.honest_state(), {"step": 1})
    ctx = corpus.Ctx(sentinel=os.path.join(outside, "SENTINEL"), outside=outside, folder=folder)
    case.apply(corpus.Step(open_store(step), step, urls.join), ctx)
    return folder, step, ctx


def _plant(outside: str) -> None:
    os.makedirs(outside, exist_ok=True)
    for name in ("victim", "victim@0", "obj0-at0", "keep.txt"):
        with open(os.path.join(outside, name), "w") as f:
            f.write(f"planted {name}\n")


CASES_BY_BACKEND = [(c, b) for b in ("local", "s3") for c in corpus.CASES if not (c.local_only and b != "local")]


@pytest.mark.parametrize("case,backend", CASES_BY_BACKEND, ids=[f"{b}-{c.name}" for c, b in CASES_BY_BACKEND])
def test_crafted_checkpoint_is_refused_by_every_entry_point_and_touches_nothing_outside(case, backend, tmp_path, request):
    from torch.distributed.checkpoint import metadata as dcp_md

    root = str(tmp_path / "saves") if backend == "local" else request.getfixturevalue("s3_bucket") + "/saves"
    outside = str(tmp_path / "outside")
    _plant(outside)
    work = str(tmp_path / "work")
    folder, step, ctx = _build(case, root, outside, work)
    before = _snapshot(outside)
    repr_before = dcp_md.Metadata.__dict__.get("__repr__")
    outcomes = {}
    for ep in ENTRY_POINTS:
        dest = str(tmp_path / f"dest-{ep}")
        outcome, msg = run_entry_point(ep, step, folder, work, dest)
        outcomes[ep] = outcome
        assert not os.path.exists(ctx.sentinel), f"{case.name}: a payload ran through {ep}"
        assert _snapshot(outside) == before, f"{case.name}: {ep} created, changed or removed a file outside"
        if os.path.isdir(dest):  # downloads and exports write only inside their destination
            for d, _, files in os.walk(dest):
                for n in files:
                    assert os.path.realpath(os.path.join(d, n)).startswith(os.path.realpath(dest) + os.sep)
        if os.path.isdir(work):
            assert not [n for n in os.listdir(work) if not n.startswith(".")], f"{ep} left files in the work dir"
        if outcome == REFUSED and msg and ep not in ("resume", "cli_list"):
            assert case.name in msg or "step1" in msg or "/" in msg, f"{ep}: the error names no URL: {msg}"
    assert dcp_md.Metadata.__dict__.get("__repr__") is repr_before, "a pickle changed a class (pollution)"
    want = {ep: expected(case, ep) for ep in ENTRY_POINTS}
    assert outcomes == want, f"{case.name} ({case.what})"


def test_a_planted_step_link_is_refused_by_load_and_save_and_nothing_is_written_through_it(tmp_path):
    from cloudckpt.errors import UnsafeCheckpoint

    outside = str(tmp_path / "outside")
    _plant(outside)
    folder = str(tmp_path / "saves")
    Checkpointer(work_dir=str(tmp_path / "w")).save(os.path.join(folder, "step1"), corpus.honest_state(), {"step": 1})
    os.symlink(outside, os.path.join(folder, "step99"))
    os.symlink(outside, os.path.join(folder, "step20"))
    before = _snapshot(outside)
    with pytest.raises((UnsafeCheckpoint, NotACheckpoint)):
        Checkpointer(work_dir=str(tmp_path / "w")).load(os.path.join(folder, "step99"), corpus.zero_state())
    with pytest.raises(Exception) as ei:  # SaveFailed or UnsafeCheckpoint, depending on which step meets the link
        Checkpointer(work_dir=str(tmp_path / "w")).save(os.path.join(folder, "step20"), corpus.honest_state(), {"step": 20})
    assert "link" in str(ei.value), ei.value
    assert _snapshot(outside) == before, "a save wrote through a planted link"
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [1]


def test_the_users_own_link_above_the_save_folder_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "mine")
    step = str(tmp_path / "mine" / "run" / "step1")
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(step, corpus.honest_state(), {"step": 1})
        state = corpus.zero_state()
        assert ck.load(step, state) == {"step": 1}
    assert torch.equal(state["model"]["w"], corpus.honest_state()["model"]["w"])
    assert (real / "run" / "step1" / ".metadata.json").is_file()
    assert Checkpointer.latest_checkpoint(str(tmp_path / "mine" / "run")).endswith("step1")


_SHORT = {"load": "load", "load_pre_download": "pre-dl", "resume": "resume", "lightning": "Lightning",
          "cli_inspect": "inspect", "cli_verify": "verify", "cli_export": "export", "cli_download": "download",
          "cli_list": "list", "cli_gc": "gc", "cli_prune": "prune"}


def corpus_table() -> str:
    """The corpus as the Markdown table of docs/security.md (R: refused with a typed
    error; ok: handled, the crafted part is not read by that entry point)."""
    head = "| case | what | backends | " + " | ".join(_SHORT[e] for e in ENTRY_POINTS) + " |"
    rows = [head, "|" + "---|" * (3 + len(ENTRY_POINTS))]
    for c in corpus.CASES:
        cells = ["R" if expected(c, e) == REFUSED else "ok" for e in ENTRY_POINTS]
        what = c.what.replace("|", "\\|")
        rows.append(f"| `{c.name}` | {what} | {'local' if c.local_only else 'local, S3'} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def test_the_table_in_docs_security_is_the_corpus():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    start, end = "<!-- corpus-table: generated by tests/security/test_corpus.py::corpus_table -->\n", "<!-- /corpus-table -->"
    assert start in text and end in text
    assert text.split(start, 1)[1].split(end, 1)[0] == corpus_table(), "regenerate the table: corpus_table()"
    assert len(corpus.CASES) >= 30


def test_the_documented_corpus_command_writes_every_local_case(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).parents[2]
    out = subprocess.run([sys.executable, "-m", "tests.security.corpus", str(tmp_path / "corpus")], cwd=repo,
                         capture_output=True, text=True, timeout=300, check=True).stdout.split()
    assert out == [c.name for c in corpus.CASES]
    assert (tmp_path / "corpus" / "p4-dotted-through-dcp" / "step1" / ".metadata.json").is_file()
    assert not (tmp_path / "corpus" / "_outside" / "SENTINEL").exists()
