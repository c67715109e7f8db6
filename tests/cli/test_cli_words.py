"""Issue 34, the CLI points: prune's words agree with its table (5); a step that is not
there is reported before torch is imported, and the commands that need no torch never
import it (8); errors name the flag, not the Python parameter, and say what is there
instead of a missing step (9); the bucket-level ``list`` counts committed steps, not
leftover step folders (10)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import uuid

import pytest

from cloudckpt.cli.hints import FLAG_WORDS

from .helpers import cli, save_steps, write_fake_steps, write_incomplete_step

HEAVY = ("torch", "boto3", "botocore", "google.cloud.storage")


def imported(*args: str, cwd: str | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the CLI under ``-X importtime``: its result and the top-level names of the
    modules it imported."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "cloudckpt", *map(str, args)], capture_output=True,
                       text=True, timeout=120, cwd=cwd)
    mods = {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+([\w.]+)$", p.stderr, re.M)}
    p.stderr = "\n".join(ln for ln in p.stderr.splitlines() if not ln.startswith("import time:"))
    return p, mods


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    """A local run with real steps 10, 20 (persistent), 30 (ephemeral), 40 (persistent)."""
    tmp = tmp_path_factory.mktemp("words")
    folder = str(tmp / "run")
    save_steps(folder, [(10, False), (20, False), (30, True), (40, False)], str(tmp / "w"))
    return folder


# ------------------------------------------------------------------ point 5
def test_prune_says_how_many_it_deletes_and_keeps_and_its_table_marks_each_step(tmp_path):
    folder = str(tmp_path / "run")
    write_fake_steps(folder, {10: False, 20: False, 30: True, 40: False}, object_size=3)
    r = cli("prune", folder, "--keep-last", "1")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith("would delete 2 of 4 committed step(s) (6B) and keep 2"), lines[0]
    assert lines[1].split() == ["STEP", "ACTION", "KIND", "SIZE", "URL"]
    rows = {int(ln.split()[0]): ln.split()[1] for ln in lines[2:6]}
    assert rows == {10: "delete", 20: "delete", 30: "keep", 40: "keep"}  # every committed step, each marked
    assert "delete the 2 step(s) marked delete" in lines[6]
    r = cli("prune", folder, "--keep-last", "1", "--yes")
    assert r.code == 0 and r.out.splitlines()[0].startswith("deleting 2 of 4 committed step(s)")
    assert [ln.split()[-1] for ln in r.out.splitlines() if ln.startswith("deleted ")] == [f"{folder}/step10",
                                                                                        f"{folder}/step20"]


# ------------------------------------------------------------------ point 8
@pytest.mark.parametrize("command", [["list", "{run}"], ["latest", "{run}"], ["prune", "{run}", "--keep-last", "9"],
                                     ["gc", "{run}"], ["rm", "{run}/step10"], ["inspect", "{run}/step99"],
                                     ["verify", "{run}/step99"], ["export", "{run}/step99", "{tmp}/x.safetensors"],
                                     ["export", "{run}/step40", "{run}/step40/.metadata.json"], ["--help"]])
def test_commands_that_need_no_torch_or_cloud_sdk_import_none(run, tmp_path, command):
    p, mods = imported(*[a.format(run=run, tmp=tmp_path) for a in command])
    assert p.returncode in (0, 2, 3), p.stderr
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))
    assert len(mods) < 400, len(mods)  # the CLI and the standard library; torch alone is over 1,500


def test_inspect_of_a_step_imports_torch_only_after_its_marker_is_read(run):
    p, mods = imported("inspect", run + "/step40")
    assert p.returncode == 0 and "torch" in mods  # it needs torch to parse the DCP metadata


# ------------------------------------------------------------------ point 9
def test_export_to_an_existing_dest_names_force_and_is_a_usage_error(run, tmp_path):
    dest = tmp_path / "m.safetensors"
    dest.write_bytes(b"mine")
    r = cli("export", run + "/step40", dest)
    line = r.assert_one_line_error()
    assert r.code == 2 and "--force" in line and "overwrite" not in line, line
    assert dest.read_bytes() == b"mine"
    assert cli("export", run + "/step40", dest, "--force", "--no-progress").code == 0


def test_export_errors_name_key_dtype_and_config_flags_and_print_nothing_else(run, tmp_path):
    r = cli("export", run + "/step40", tmp_path / "a.safetensors", "--key", "nope")
    line = r.assert_one_line_error()
    assert r.code == 2 and "--key" in line and "key_prefix" not in line, line
    r = cli("export", run + "/step40", tmp_path / "b.safetensors", "--dtype", "int8")
    line = r.assert_one_line_error()
    assert r.code == 2 and "--dtype" in line and "export dtype" not in line, line
    r = cli("export", run + "/step40", tmp_path / "hf", "--format", "hf")
    line = r.assert_one_line_error()  # one line: no warning about world sizes or anything else
    assert r.code == 2 and "--config PATH" in line and "config=" not in line, line
    r = cli("export", run + "/step40", "s3://some-bucket/hf", "--format", "hf")
    assert r.code == 2 and "local folder" in r.assert_one_line_error()
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 4}))
    r = cli("export", run + "/step40", tmp_path / "hf2", "--format", "hf", "--config", cfg)
    line = r.assert_one_line_error()
    assert r.code == 1 and "--config is not a Hugging Face model config" in line, line


def test_export_hf_uses_the_config_saved_with_the_step_without_warnings(tmp_path):
    import torch

    from cloudckpt import Checkpointer

    step = str(tmp_path / "run" / "step5")
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(step, {"model": {"w": torch.ones(3)}}, {"hf": {"config": json.dumps({"model_type": "toy"})}})
    out = tmp_path / "hf"
    r = cli("export", step, out, "--format", "hf", "--no-progress")
    assert r.code == 0 and r.err == "", r.err
    assert json.loads((out / "config.json").read_text())["model_type"] == "toy"
    r = cli("export", step, out, "--format", "hf")
    assert r.code == 2 and "--force" in r.assert_one_line_error()


def test_a_step_that_is_not_there_is_said_with_what_is_there_instead(run, tmp_path):
    r = cli("verify", run)  # a run given for a step
    line = r.assert_one_line_error()
    assert r.code == 3 and "is a save folder (a run), not a step" in line \
        and f"the newest is {run}/step40" in line, line
    assert f"the committed steps of {run}: step10, step20, step30, step40;" in line
    for command in ("inspect", "verify"):  # a step that is gone (pruned, removed, mistyped)
        r = cli(command, run + "/step99")
        line = r.assert_one_line_error()
        assert r.code == 3 and f"{run}/step99 does not exist" in line and f"the newest is {run}/step40" in line
    pruned = pathlib.Path(run + "/step25")
    pruned.mkdir()  # what a prune can leave: the folder, no marker
    try:
        line = cli("inspect", str(pruned)).assert_one_line_error()
        assert "has no .metadata.json (a pruned or removed step" in line and "step25" not in line.split(";", 1)[1]
        assert f"the committed steps of {run}: step10, step20, step30, step40; the newest is {run}/step40" in line
    finally:
        pruned.rmdir()
    r = cli("inspect", tmp_path / "nothing" / "step3")
    assert r.code == 3 and r.assert_one_line_error() == f"cloudckpt: error: {tmp_path}/nothing/step3 does not exist"


def test_a_local_path_that_does_not_exist_says_so_and_a_relative_one_hints_at_buckets(tmp_path):
    p, _ = imported("list", "mlruns/run-d", cwd=str(tmp_path))
    assert p.returncode == 3
    assert p.stderr.strip() == (f"cloudckpt: error: {tmp_path}/mlruns/run-d does not exist "
                                "(`mlruns/run-d` is read as a "
                                f"local path relative to {tmp_path}; for a bucket write s3://mlruns/run-d or "
                                "gs://mlruns/run-d)"), p.stderr
    r = cli("latest", tmp_path / "nope")
    assert r.code == 3 and r.assert_one_line_error() == f"cloudckpt: error: {tmp_path}/nope does not exist"
    # an explicitly local path, or a first folder no bucket can be named: a local-path hint only
    for given, where in (("./no/such/run", "no/such/run"), ("../no/such/run", "../no/such/run"),
                         ("no/such/run", "no/such/run"), ("Runs/run-d", "Runs/run-d")):
        p, _ = imported("list", given, cwd=str(tmp_path))
        assert p.returncode == 3 and "s3://" not in p.stderr and "gs://" not in p.stderr, p.stderr
        assert p.stderr.strip() == (f"cloudckpt: error: {os.path.normpath(os.path.join(tmp_path, where))} does not "
                                    f"exist (`{given}` is read as a local path relative to {tmp_path})"), p.stderr


def test_gc_with_nothing_old_enough_names_the_young_leftovers_it_kept(tmp_path):
    folder = str(tmp_path / "run")
    write_fake_steps(folder, {1: False}, object_size=3)
    young = write_incomplete_step(folder, 2)
    r = cli("gc", folder)
    assert r.code == 0, r.err
    assert "nothing to collect" in r.out and f"left 1 uncommitted step folder(s) younger than that ({young}" in r.out
    assert "--older-than" in r.out
    assert cli("gc", folder, "--json").json()["young"] == [young]
    r = cli("gc", folder, "--older-than", "0s", "--json")
    assert r.json()["step_dirs"] == [young] and r.json()["young"] == []


def test_every_translated_phrase_is_still_one_the_library_says():
    """A translation whose Python phrase the library no longer says is dead: fail."""
    root = pathlib.Path(__file__).resolve().parents[2] / "cloudckpt"
    source = "".join(p.read_text() for p in root.rglob("*.py") if "cli" not in p.parts)
    flat = re.sub(r'"\s*\n\s*f?"', "", source)  # join implicitly concatenated string literals
    composed = {"config= is not a Hugging Face model config": ('"config="', "is not a Hugging Face model config")}
    for python, flag in FLAG_WORDS:
        assert all(part in flat for part in composed.get(python, (python,))), python
        assert "--" in flag or not flag


# ------------------------------------------------------------------ point 10
def test_list_of_a_bucket_counts_committed_steps_not_leftover_folders(stores):
    root = stores["seaweed"].create_bucket("words-" + uuid.uuid4().hex[:12])
    write_fake_steps(root + "/run", {s: False for s in range(1, 13)}, object_size=3)
    assert cli("prune", root + "/run", "--keep-last", "4", "--yes").code == 0  # SeaweedFS lists the emptied folders
    write_incomplete_step(root + "/run", 13)
    [row] = cli("list", root, "--json").lines()
    assert (row["steps"], row["step_dirs"], row["newest_step"]) == (4, 13, 12), row
    r = cli("list", root)
    header, line = r.out.splitlines()[:2]
    assert header.split()[:4] == ["RUN", "STEPS", "UNCOMMITTED", "NEWEST"]
    assert line.split()[:4] == [root + "/run", "4", "9", "12"], line

