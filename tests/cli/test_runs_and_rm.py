"""``cloudckpt list`` of a bucket or prefix above runs (the runs beneath, bounded
walk), ``rm`` of one step, UTC times and human sizes in the tables, and export's
progress bar and Hugging Face folder, against SeaweedFS and local folders."""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone

import pytest

from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

from .helpers import cli, save_steps, write_fake_steps, write_incomplete_step


def _tree(root: str) -> None:
    """team-a/run-1 (10 persistent, 20 ephemeral), team-a/run-2 (5), team-b/exp/run-3
    (an uncommitted step only), and a run four levels down: a/b/c/run-deep."""
    write_fake_steps(root + "/team-a/run-1", {10: False, 20: True}, object_size=100)
    write_fake_steps(root + "/team-a/run-2", {5: False}, object_size=2048)
    write_incomplete_step(root + "/team-b/exp/run-3", 1)
    write_fake_steps(root + "/a/b/c/run-deep", {1: False})


@pytest.fixture(scope="module")
def bucket(stores):
    root = stores["seaweed"].create_bucket("runs-" + uuid.uuid4().hex[:12])
    _tree(root)
    return root


def test_list_of_a_bucket_shows_each_run_with_its_newest_committed_step(bucket):
    r = cli("list", bucket)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].split() == ["RUN", "STEPS", "UNCOMMITTED", "NEWEST", "KIND", "SIZE", "CREATED", "(UTC)", "AGE"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:4]}
    assert set(rows) == {bucket + "/team-a/run-1", bucket + "/team-a/run-2", bucket + "/team-b/exp/run-3"}
    assert rows[bucket + "/team-a/run-1"][1:6] == ["2", "-", "20", "ephemeral", "100B"]
    assert rows[bucket + "/team-a/run-2"][1:6] == ["1", "-", "5", "persistent", "2.0KiB"]
    assert rows[bucket + "/team-b/exp/run-3"][1:5] == ["0", "1", "-", "none"]  # a crashed save is not a step
    created = datetime.strptime(rows[bucket + "/team-a/run-2"][6], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert abs(created.timestamp() - time.time()) < 600
    assert lines[4].startswith(f"3 run(s) under {bucket} (searched 3 level(s) down")
    assert "not searched" in r.out and bucket + "/a/b/c" in r.out  # the run four levels down, said so

    r = cli("list", bucket, "--json")  # JSON Lines, one run per line; the bound is noted on stderr
    assert r.code == 0, r.err
    runs = r.lines()
    assert [(x["type"], x["url"], x["newest_step"]) for x in runs] == [
        ("run", bucket + "/team-a/run-1", 20), ("run", bucket + "/team-a/run-2", 5),
        ("run", bucket + "/team-b/exp/run-3", None)]
    assert [(x["steps"], x["step_dirs"]) for x in runs] == [(2, 2), (1, 1), (0, 1)]
    assert runs[1]["size_bytes"] == 2048 and runs[1]["newest_url"] == bucket + "/team-a/run-2/step5"
    assert "not searched" in r.err

    deep = cli("list", bucket, "--depth", "4", "--json").lines()
    assert bucket + "/a/b/c/run-deep" in [x["url"] for x in deep] and len(deep) == 4


def test_list_of_a_prefix_and_the_folder_bound(bucket):
    r = cli("list", bucket + "/team-a", "--json")
    assert [x["url"] for x in r.lines()] == [bucket + "/team-a/run-1", bucket + "/team-a/run-2"]
    # breadth first: the bucket, its 3 folders, then 2 of the 4 folders below them
    r = cli("list", bucket, "--max-folders", "6")
    assert r.code == 0 and "stopped after listing 6 folders" in r.out, r.out + r.err
    assert [ln.split()[0] for ln in r.out.splitlines()[1:2]] == [bucket + "/team-a/run-1"]
    r = cli("list", bucket, "--max-folders", "2")
    assert r.code == 3 and "no run in the 2 folder(s) listed (--max-folders)" in r.err, r.out + r.err
    r = cli("list", bucket + "/team-a/run-1", "--json")  # a run: its steps, as before
    assert [(x["type"], x["step"]) for x in r.lines()] == [("step", 10), ("step", 20)]


def test_list_of_a_prefix_without_runs_exits_3(bucket):
    r = cli("list", bucket + "/nothing-here")
    assert r.code == 3 and r.out == ""
    assert "no run within 3 level(s)" in r.assert_one_line_error()


def test_list_runs_under_a_local_folder(tmp_path):
    _tree(str(tmp_path / "root"))
    r = cli("list", tmp_path / "root", "--json")
    assert r.code == 0, r.err
    assert [x["url"].rsplit("/root/", 1)[1] for x in r.lines()] == ["team-a/run-1", "team-a/run-2", "team-b/exp/run-3"]


@pytest.mark.parametrize("backend", ["s3", "local"])
def test_rm_is_a_dry_run_unless_yes_and_deletes_marker_and_objects(stores, tmp_path, backend):
    root = (stores["seaweed"].create_bucket("rm-" + uuid.uuid4().hex[:12]) if backend == "s3"
            else str(tmp_path / "root"))
    folder = root + "/run"
    write_fake_steps(folder, {1: False, 2: True}, object_size=10)
    step = folder + "/step1"
    r = cli("rm", step)
    assert r.code == 0, r.err
    assert f"would delete {step}: committed persistent step 1" in r.out and "--yes" in r.out
    assert open_store(step).exists(step + "/.metadata.json")

    r = cli("rm", step, "--yes", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert (doc["step"], doc["status"], doc["dry_run"], doc["deleted_objects"]) == (1, "committed", False, 1)
    assert list(open_store(step).walk(urls.as_prefix(step))) == []
    assert [x["step"] for x in cli("list", folder, "--json").lines()] == [2]

    r = cli("rm", step)  # gone: nothing to remove
    assert r.code == 3 and "no step to remove" in r.assert_one_line_error()
    r = cli("rm", folder, "--yes")  # a save folder is refused
    assert r.code == 2 and "not a step folder" in r.assert_one_line_error()
    assert [x["step"] for x in cli("list", folder, "--json").lines()] == [2]


def test_inspect_shows_human_sizes_and_a_utc_time(tmp_path):
    folder = str(tmp_path / "run")
    save_steps(folder, [(4, False)], str(tmp_path / "w"))
    r = cli("inspect", folder + "/step4", "--objects")
    assert r.code == 0, r.err
    objects = [ln.split() for ln in r.out.splitlines() if ln.startswith("model_and_optim/") or ln.startswith("train/")]
    assert len(objects) == 4 and all(row[1].endswith(("B", "KiB")) and not row[1].isdigit() for row in objects)
    assert "Z (" in r.out.splitlines()[2]  # committed 2026-...Z (3s ago)


def test_export_shows_an_upload_progress_bar_and_writes_a_hugging_face_folder(stores, tmp_path):
    root = stores["seaweed"].create_bucket("exp-" + uuid.uuid4().hex[:12])
    folder = root + "/run"
    save_steps(folder, [(8, False)], str(tmp_path / "w"))
    r = cli("export", folder + "/step8", root + "/out/", "--progress")
    assert r.code == 0, r.err
    assert "export upload" in r.err and "100%" in r.err
    assert open_store(root).exists(root + "/out/model.safetensors")

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "toy", "hidden_size": 4}))
    out = tmp_path / "hf"
    r = cli("export", folder + "/step8", out, "--format", "hf", "--config", cfg, "--dtype", "bfloat16", "--json")
    assert r.code == 0, r.out + r.err
    assert r.json()["tensors"] == 2 and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    r = cli("export", folder + "/step8", root + "/x.safetensors", "--config", cfg)
    assert r.code == 2 and "--format hf" in r.assert_one_line_error()
