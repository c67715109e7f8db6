"""Every crafted checkpoint of the second-round corpus (corpus.py) through every reader
entry point, on a local folder and on SeaweedFS: each case is built once in this
process, then each entry point runs on it in the sandbox (a forked child under an
address-space and a wall-clock limit, so a crash, a bomb or a hang is noticed, not
only an exception). Each is refused with a typed error (or, where an entry point does
not parse the crafted part, handled harmlessly), no payload runs (no sentinel file),
no class is modified by a pickle, nothing outside the folders cloudckpt was given is
created, changed or removed (planted files are checked byte for byte), the work dir
is left empty and a refusal names the URL. The table of docs/security.md is checked
by test_hostile.py."""

from __future__ import annotations

import os

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.errors import NotACheckpoint
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

from . import corpus
from .sandbox import BOMB, CRASH, HANG, OK, REFUSED, UNTYPED
from .tries import plant, snapshot, zero_state

FINDINGS = (CRASH, BOMB, HANG, UNTYPED)


@pytest.fixture
def sandbox(hostile_sandbox):
    return hostile_sandbox  # one zygote per test process (conftest.py)


def _build(case: corpus.Case, root: str, outside: str, work: str) -> tuple[str, str, corpus.Ctx]:
    folder = urls.join(root, case.name)
    step = urls.join(folder, "step1")
    Checkpointer(work_dir=work).save(step, corpus.honest_state(), {"step": 1})
    ctx = corpus.Ctx(sentinel=os.path.join(outside, "SENTINEL"), outside=outside, folder=folder)
    case.apply(corpus.Step(open_store(step), step, urls.join), ctx)
    return folder, step, ctx


CASES_BY_BACKEND = [(c, b) for b in ("local", "s3") for c in corpus.CASES if not (c.local_only and b != "local")]


@pytest.mark.parametrize("case,backend", CASES_BY_BACKEND, ids=[f"{b}-{c.name}" for c, b in CASES_BY_BACKEND])
def test_crafted_checkpoint_is_refused_by_every_entry_point_and_touches_nothing_outside(case, backend, tmp_path,
                                                                                        request,
                                                                                        sandbox):
    root = str(tmp_path / "saves") if backend == "local" else request.getfixturevalue("s3_bucket") + "/saves"
    outside = plant(str(tmp_path))
    work = str(tmp_path / "work")
    folder, step, ctx = _build(case, root, outside, work)
    before = snapshot(outside)
    outcomes = {}
    for ep in corpus.CORPUS_ENTRIES:
        dest = str(tmp_path / f"dest-{ep}")
        r = sandbox.run("tests.security.corpus:entry_point", tmp=str(tmp_path), step=step, folder=folder, entry=ep,
                        honest=True)
        assert r.outcome not in FINDINGS, f"FINDING: {case.name} through {ep}: {r}"
        assert r.outcome == OK, f"{case.name} through {ep}: an error other than a refusal: {r}"
        outcome, msg = r.value["outcome"], r.value["message"]
        outcomes[ep] = outcome
        assert not os.path.exists(ctx.sentinel), f"{case.name}: a payload ran through {ep}"
        assert snapshot(outside) == before, f"{case.name}: {ep} created, changed or removed a file outside"
        assert not r.value["polluted"], f"{case.name}: a pickle changed a class through {ep} (pollution)"
        if os.path.isdir(dest):  # downloads and exports write only inside their destination
            for d, _, files in os.walk(dest):
                for n in files:
                    assert os.path.realpath(os.path.join(d, n)).startswith(os.path.realpath(dest) + os.sep)
        if os.path.isdir(work):
            assert not [n for n in os.listdir(work) if not n.startswith(".")], f"{ep} left files in the work dir"
        if outcome == REFUSED and msg and ep not in ("resume", "cli_list"):
            assert case.name in msg or "step1" in msg or "/" in msg, f"{ep}: the error names no URL: {msg}"
    want = {ep: corpus.expected(case, ep) for ep in corpus.CORPUS_ENTRIES}
    assert outcomes == want, f"{case.name} ({case.what})"


def test_a_planted_step_link_is_refused_by_load_and_save_and_nothing_is_written_through_it(tmp_path):
    from cloudckpt.errors import UnsafeCheckpoint

    outside = str(tmp_path / "outside")
    plant(str(tmp_path))
    folder = str(tmp_path / "saves")
    Checkpointer(work_dir=str(tmp_path / "w")).save(os.path.join(folder, "step1"), corpus.honest_state(), {"step": 1})
    os.symlink(outside, os.path.join(folder, "step99"))
    os.symlink(outside, os.path.join(folder, "step20"))
    before = snapshot(outside)
    with pytest.raises((UnsafeCheckpoint, NotACheckpoint)):
        Checkpointer(work_dir=str(tmp_path / "w")).load(os.path.join(folder, "step99"), zero_state())
    with pytest.raises(Exception) as ei:  # SaveFailed or UnsafeCheckpoint, depending on which step meets the link
        Checkpointer(work_dir=str(tmp_path / "w")).save(os.path.join(folder, "step20"), corpus.honest_state(),
                                                        {"step": 20})
    assert "link" in str(ei.value), ei.value
    assert snapshot(outside) == before, "a save wrote through a planted link"
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [1]


def test_the_users_own_link_above_the_save_folder_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "mine")
    step = str(tmp_path / "mine" / "run" / "step1")
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(step, corpus.honest_state(), {"step": 1})
        state = zero_state()
        assert ck.load(step, state) == {"step": 1}
    assert torch.equal(state["model"]["w"], corpus.honest_state()["model"]["w"])
    assert (real / "run" / "step1" / ".metadata.json").is_file()
    assert Checkpointer.latest_checkpoint(str(tmp_path / "mine" / "run")).endswith("step1")


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
