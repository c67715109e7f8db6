"""The library operations behind the CLI (cloudckpt.ops), called in process on local
folders and SeaweedFS: what they return, and what download leaves on disk."""

from __future__ import annotations

import json
import os

import pytest

from cloudckpt import ops
from cloudckpt.errors import CorruptCheckpoint
from cloudckpt.ops.downloads import STAGING
from cloudckpt.storage import open_store

from .helpers import new_root, save_steps, write_fake_steps, write_incomplete_step


def _files(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


class _Recorder:
    def __init__(self):
        self.total, self.moved = None, 0

    def start(self, total):
        self.total = total

    def update(self, n):
        self.moved += n


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_download_resumes_removes_an_interrupted_runs_staging_and_leaves_only_the_step(stores, tmp_path_factory,
                                                                                      tmp_path, backend):
    folder = new_root(backend, stores, tmp_path_factory) + "/run"
    save_steps(folder, [(5, False)], str(tmp_path / "w"))
    dest = tmp_path / "copy" / "step5"
    # what an interrupted run leaves: its staging folder (with a partial file in it)
    # and one complete file already renamed into place
    first = ops.download(folder + "/step5", str(dest))
    assert first.ok and first.bytes_downloaded == first.total_bytes
    (dest / ".metadata.json").unlink()
    (dest / "train" / "rank0.pt").unlink()
    (dest / STAGING).mkdir()
    (dest / STAGING / "3").write_bytes(b"half of a shard")

    progress = _Recorder()
    plan = ops.prepare_download(folder + "/step5", str(dest))
    assert not (dest / STAGING).exists()  # removed before anything is fetched
    # the part and the DCP index header too
    assert [i.entry.path for i in plan.todo] == ["train/rank0.pt"] and len(plan.skipped) == 5
    rep = ops.run_download(plan, progress=progress)
    assert rep.ok and rep.downloaded == ["train/rank0.pt"]
    assert progress.total == progress.moved == plan.bytes_to_fetch > 0
    assert _files(dest) == {".metadata.json", "train/rank0.pt", "model_and_optim/.metadata", "manifest/rank0.json",
                            "index/header.json",
                            "model_and_optim/__0_0.distcp", "model_and_optim/__0_1.distcp"}


def test_download_refuses_a_marker_listing_an_object_in_its_staging_folder(tmp_path):
    step = tmp_path / "run" / "step1"
    body = b"abc"
    store = open_store(str(step))
    store.put_bytes(str(step / STAGING / "x"), body)
    marker = {"format": "cloudckpt", "format_version": 1, "step": 1, "ephemeral": False, "world_size": 1,
              "created": "2026-01-01T00:00:00+00:00", "created_unix": 0.0, "library_version": "test",
              "torch_version": "", "save_id": "", "total_bytes": 3, "object_count": 1,
              "objects": [{"path": f"{STAGING}/x", "size": 3, "crc32c": None}]}
    store.put_bytes(str(step / ".metadata.json"), json.dumps(marker).encode())
    with pytest.raises(CorruptCheckpoint, match="staging folder"):
        ops.prepare_download(str(step), str(tmp_path / "dest"))


def test_verify_step_reports_each_bad_object_and_inspect_step_describes_the_step(tmp_path):
    folder = str(tmp_path / "run")
    save_steps(folder, [(3, True)], str(tmp_path / "w"))
    step = folder + "/step3"
    rep = ops.inspect_step(step)
    assert rep.has_metadata and {t["key"] for t in rep.tensors} == {"model.w", "model.b"}
    assert rep.non_tensor_keys == ["optim.lr"] and rep.train_state["keys"][0] == {
        "key": "step", "type": "int", "value": 3, "summary": "3"}
    assert ops.verify_step(step).ok

    os.unlink(os.path.join(step, "train", "rank0.pt"))
    with open(os.path.join(step, "model_and_optim", "__0_0.distcp"), "r+b") as f:
        f.write(b"\xff")
    rep = ops.verify_step(step, jobs=2)
    assert not rep.ok and rep.checked == "size+crc32c"
    assert {b["path"]: b["problem"] for b in rep.bad} == {"train/rank0.pt": "missing",
                                                          "model_and_optim/__0_0.distcp": "crc32c"}
    assert [b["path"] for b in ops.verify_step(step, size_only=True).bad] == ["train/rank0.pt"]


def test_list_steps_returns_committed_rows_and_on_request_the_incomplete_ones(tmp_path):
    folder = str(tmp_path / "run")
    write_fake_steps(folder, {1: False, 2: True}, object_size=4)
    write_incomplete_step(folder, 3)
    listing = ops.list_steps(folder)
    assert listing.step_dirs == 3 and [(r.step, r.status) for r in listing.rows] == [(1, "committed"), (2, "committed")]
    listing = ops.list_steps(folder, include_uncommitted=True, ephemeral=True)
    assert [(r.step, r.status) for r in listing.rows] == [(2, "committed"), (3, "incomplete")]
    assert listing.rows[1].object_count == 1 and listing.rows[1].size_bytes == len(b"partial")


def test_plan_prune_composes_retention_and_apply_deletes_only_the_plan(tmp_path):
    folder = str(tmp_path / "run")
    write_fake_steps(folder, {100: False, 200: False, 250: True, 300: False, 350: True, 400: False, 450: True})
    plan = ops.plan_prune(folder, keep_last=2)
    assert [i.step for i in plan.prune] == [100, 200, 250, 350] and plan.kept == [300, 400, 450]
    # ephemeral-only: persistent steps are no candidates, multiples of keep_every are kept and not counted
    plan = ops.plan_prune(folder, keep_last=1, ephemeral_only=True, keep_every=350)
    assert [i.step for i in plan.prune] == [250]
    assert plan.to_json(dry_run=True)["policy"] == {"keep_last": 1, "keep_every": 350, "ephemeral_only": True,
                                                    "keep_last_ephemeral": None}
    with pytest.raises(ValueError):
        ops.plan_prune(folder, keep_last=1, ephemeral_only=True, keep_last_ephemeral=2)
    assert ops.apply_prune(plan) == [250]
    assert [r.step for r in ops.list_steps(folder).rows] == [100, 200, 300, 350, 400, 450]
