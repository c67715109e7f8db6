"""`cloudckpt list` / `latest` / `inspect` / `verify` on a Lightning checkpoint folder (children
named ``epoch=0-step=N.ckpt`` and ``last.ckpt``, each committed by its marker), on SeaweedFS
and fake-gcs-server: list shows each committed one with its step (from the marker), kind and
size, `--all` the uncommitted ones too; latest answers what ``last_checkpoint()`` answers."""

from __future__ import annotations

import json

import pytest
import torch

from cloudckpt.checkpoint import layout
from cloudckpt.cli import main
from cloudckpt.integrations import lightning as cl
from cloudckpt.storage import open_store


def _checkpoint(step: int) -> dict:
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
    return {"epoch": 0, "global_step": step, "state_dict": {"layer.weight": w},
            "optimizer_states": [{"state": {0: {"exp_avg": w * 2, "step": torch.tensor(float(step))}},
                                  "param_groups": [{"lr": 0.1, "params": [0]}]}]}


@pytest.fixture(params=["s3", "gcs"])
def lightning_folder(request) -> str:
    """ModelCheckpoint(save_last=True)'s folder after steps 3 (ephemeral) and 6, and a step-9 save
    that died before its commit."""
    folder = request.getfixturevalue({"s3": "s3_bucket", "gcs": "gcs_bucket"}[request.param]) + "/run/checkpoints"
    io = cl.CloudCheckpointIO()
    io.save_checkpoint(_checkpoint(3), folder + "/epoch=0-step=3.ckpt", storage_options={"ephemeral": True})
    io.save_checkpoint(_checkpoint(6), folder + "/epoch=0-step=6.ckpt")
    io.save_checkpoint(_checkpoint(6), folder + "/last.ckpt")
    io.save_checkpoint(_checkpoint(9), folder + "/epoch=0-step=9.ckpt")
    io.teardown()
    crashed = folder + "/epoch=0-step=9.ckpt"
    open_store(crashed).delete(layout.marker_url(crashed))
    return folder


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_shows_the_committed_checkpoints_of_a_lightning_folder(lightning_folder, capsys):
    code, out, err = _run(capsys, "list", "--json", lightning_folder)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["step"], r["url"].rsplit("/", 1)[-1], r["ephemeral"]) for r in rows] == [
        (3, "epoch=0-step=3.ckpt", True), (6, "epoch=0-step=6.ckpt", False), (6, "last.ckpt", False)]
    assert all(r["status"] == "committed" and r["size_bytes"] > 0 and r["created_unix"] for r in rows)

    code, out, err = _run(capsys, "list", lightning_folder)
    assert code == 0, err
    assert "last.ckpt" in out and "epoch=0-step=9.ckpt" not in out and "3 committed (2 persistent, 1 ephemeral)" in out

    code, out, err = _run(capsys, "list", "--all", "--json", lightning_folder)
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["step"], r["status"]) for r in rows][-1] == (9, "incomplete")


def test_latest_of_a_lightning_folder_is_the_newest_committed_like_last_checkpoint(lightning_folder, capsys):
    code, out, err = _run(capsys, "latest", lightning_folder)
    assert code == 0, err
    assert out.strip() == lightning_folder + "/last.ckpt" == cl.last_checkpoint(lightning_folder)
    code, out, err = _run(capsys, "latest", "--json", lightning_folder)
    assert json.loads(out) == {"folder": lightning_folder, "step": 6, "url": lightning_folder + "/last.ckpt"}


def test_inspect_and_verify_take_a_lightning_checkpoint_folder(lightning_folder, capsys):
    code, out, err = _run(capsys, "verify", lightning_folder + "/last.ckpt")
    assert code == 0, out + err
    code, out, err = _run(capsys, "inspect", "--json", lightning_folder + "/epoch=0-step=6.ckpt")
    assert code == 0, err
    info = json.loads(out)
    assert info["marker"]["step"] == 6 and any(t["key"] == "model.layer.weight" for t in info["tensors"]), \
        info["tensors"]
