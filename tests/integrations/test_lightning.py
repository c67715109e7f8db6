"""The Lightning plugins against real stores: fit with checkpoints in the bucket, resume from the
bucket with ckpt_path and continue; the async variant commits in finalize and every checkpoint
is committed when fit() returns; remove_checkpoint deletes the marker first."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

try:
    import lightning  # noqa: F401
except ImportError as e:  # a declared test dependency: missing means a broken install, not a reason to skip
    raise ImportError("lightning is not installed; it is in the test extra: pip install -e '.[test]'") from e

from lightning.pytorch.callbacks import Callback

from cloudckpt.checkpoint import discovery, layout
from cloudckpt.errors import BucketNotFound, NotACheckpoint
from cloudckpt.integrations import lightning as cl
from cloudckpt.ops.export import export_weights
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

_spec = importlib.util.spec_from_file_location("lightning_fit", Path(__file__).parent / "examples" / "lightning_fit.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


class _AtTrainStart(Callback):
    """Records what the resumed run starts from."""

    def on_train_start(self, trainer, pl_module):
        self.global_step = trainer.global_step
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.exp_avg = [s["exp_avg"].clone() for s in trainer.optimizers[0].state.values()]


def _committed(path: str) -> bool:
    return open_store(path).exists(layout.marker_url(path))


def _names(root: str) -> list[str]:
    prefix = urls.as_prefix(root + "/checkpoints")
    return sorted(urls.basename(e.url) for e in open_store(prefix).list(prefix) if e.is_prefix)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_fit_checkpoints_to_the_bucket_then_resume_from_it_and_continue(backend, request):
    root = request.getfixturevalue({"s3": "s3_bucket", "gcs": "gcs_bucket"}[backend]) + "/run"
    first = example.fit(root, max_steps=8)
    assert first.global_step == 8
    assert _names(root) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    last = cl.last_checkpoint(root + "/checkpoints")
    assert last == root + "/checkpoints/epoch=0-step=8.ckpt" and _committed(last)
    marker = discovery.read_marker(last)
    assert marker.step == 8 and {"train/rank0.pt", "model_and_optim/.metadata"} <= {o.path for o in marker.objects}

    saved = cl.CloudCheckpointIO().load_checkpoint(last)
    assert saved["global_step"] == 8 and saved["state_dict"].keys() == first.lightning_module.state_dict().keys()
    for k, v in first.lightning_module.state_dict().items():
        assert torch.equal(saved["state_dict"][k], v), k

    start = _AtTrainStart()
    second = example.fit(root, max_steps=12, ckpt_path=last, callbacks=[start])
    assert start.global_step == 8, "global_step continues from the checkpoint"
    for k, v in saved["state_dict"].items():
        assert torch.equal(start.weights[k], v), f"{k} at resume equals the checkpoint's"
    want_exp_avg = [s["exp_avg"] for s in saved["optimizer_states"][0]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(start.exp_avg, want_exp_avg, strict=True)), "optimizer state restored"
    assert second.global_step == 12
    assert _names(root)[-1] == "epoch=1-step=12.ckpt" and _committed(root + "/checkpoints/epoch=1-step=12.ckpt")
    # Lightning's CSVLogger wrote through the fsspec shim into the same bucket
    assert open_store(root).exists(root + "/lightning_logs/version_0/metrics.csv")


def test_async_saves_commit_in_finalize_and_all_are_committed_when_fit_returns(s3_bucket, monkeypatch):
    root = s3_bucket + "/async-run"
    at_return: dict[str, bool] = {}
    real_save = cl.AsyncCloudCheckpointIO.save_checkpoint

    def spy(self, checkpoint, path, storage_options=None):
        real_save(self, checkpoint, path, storage_options)
        at_return[path] = _committed(path)

    monkeypatch.setattr(cl.AsyncCloudCheckpointIO, "save_checkpoint", spy)
    trainer = example.fit(root, max_steps=12, async_save=True)
    assert sorted(urls.basename(p) for p in at_return) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt",
                                                           "epoch=1-step=12.ckpt"]
    assert not any(at_return.values()), "save_checkpoint returns before the commit (it happens in finalize)"
    assert all(_committed(p) for p in at_return), "every checkpoint is committed when fit() returns"
    io = trainer.strategy.checkpoint_io
    assert isinstance(io, cl.AsyncCloudCheckpointIO) and io.in_flight == []

    resumed = example.fit(root, max_steps=16, ckpt_path=cl.last_checkpoint(root + "/checkpoints"), async_save=True)
    assert resumed.global_step == 16 and _committed(root + "/checkpoints/epoch=1-step=16.ckpt")


def _tiny_checkpoint(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(4, 4, generator=g)
    return {"epoch": 0, "global_step": step, "state_dict": {"layer.weight": w},
            "optimizer_states": [{"state": {0: {"exp_avg": w * 2, "step": torch.tensor(float(step))}},
                                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]}],
            "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 0}}}}, "hyper_parameters": {"width": 4}}


def test_split_and_join_round_trip_a_lightning_checkpoint(s3_bucket):
    ckpt = _tiny_checkpoint(3)
    io = cl.CloudCheckpointIO()
    io.save_checkpoint(ckpt, s3_bucket + "/c/epoch=0-step=3.ckpt", storage_options={"ephemeral": True})
    assert discovery.read_marker(s3_bucket + "/c/epoch=0-step=3.ckpt").ephemeral
    got = io.load_checkpoint(s3_bucket + "/c/epoch=0-step=3.ckpt")
    io.teardown()
    assert got["hyper_parameters"] == {"width": 4} and got["loops"] == ckpt["loops"]
    assert torch.equal(got["state_dict"]["layer.weight"], ckpt["state_dict"]["layer.weight"])
    group = got["optimizer_states"][0]["param_groups"][0]
    assert group == {"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}
    assert torch.equal(got["optimizer_states"][0]["state"][0]["exp_avg"],
                       ckpt["optimizer_states"][0]["state"][0]["exp_avg"])
    # the model tensors are the DCP "model" key, so export works on Lightning checkpoints
    info = export_weights(s3_bucket + "/c/epoch=0-step=3.ckpt", s3_bucket + "/c/export/")
    assert info["tensors"] == 1


def test_remove_checkpoint_deletes_the_marker_first(s3_bucket, monkeypatch):
    path = s3_bucket + "/c/epoch=0-step=5.ckpt"
    io = cl.CloudCheckpointIO()
    io.save_checkpoint(_tiny_checkpoint(5), path)
    store = open_store(path)
    calls: list[str] = []
    real_delete, real_many = store.delete, store.delete_many
    monkeypatch.setattr(store, "delete", lambda u: (calls.append(urls.relative(u, path)), real_delete(u))[1])
    monkeypatch.setattr(store, "delete_many",
                        lambda us: real_many([calls.append(urls.relative(u, path)) or u for u in us]))
    io.remove_checkpoint(path)
    assert calls[0] == layout.MARKER, calls
    assert list(store.walk(urls.as_prefix(path))) == []
    with pytest.raises(NotACheckpoint):
        io.load_checkpoint(path)


def test_async_removal_waits_until_the_newer_save_is_committed(s3_bucket):
    old, new = s3_bucket + "/c/epoch=0-step=1.ckpt", s3_bucket + "/c/epoch=0-step=2.ckpt"
    io = cl.AsyncCloudCheckpointIO()
    io.save_checkpoint(_tiny_checkpoint(1), old)
    assert io.maybe_finalize_save_checkpoint(blocking=True) == 1 and _committed(old)
    io.save_checkpoint(_tiny_checkpoint(2), new)
    io.remove_checkpoint(old)  # what ModelCheckpoint does right after saving a better one
    assert _committed(old), "the old checkpoint stays until the new one is committed"
    io.maybe_finalize_save_checkpoint(blocking=True)
    assert _committed(new) and not _committed(old)
    io.teardown()


def test_a_failed_async_save_raises_at_finalize_commits_nothing_and_keeps_the_old_checkpoint(s3_bucket):
    old = s3_bucket + "/c/epoch=0-step=1.ckpt"
    bad = "s3://no-such-bucket-cloudckpt/c/epoch=0-step=2.ckpt"
    io = cl.AsyncCloudCheckpointIO()
    io.save_checkpoint(_tiny_checkpoint(1), old)
    io.maybe_finalize_save_checkpoint(blocking=True)
    io.save_checkpoint(_tiny_checkpoint(2), bad)
    io.remove_checkpoint(old)
    with pytest.raises(BucketNotFound):
        io.maybe_finalize_save_checkpoint(blocking=True)
    assert _committed(old), "the removal after a failed save is skipped: the old checkpoint stays"
    assert io.in_flight == []
    io.teardown()


def test_finalizer_callback_needs_the_async_plugin():
    class _Strategy:
        checkpoint_io = cl.CloudCheckpointIO()

    class _Trainer:
        strategy = _Strategy()

    with pytest.raises(ValueError, match="AsyncCloudCheckpointIO"):
        cl.AsyncFinalizerCallback().on_train_batch_end(_Trainer())


def test_lightning_example_script_resumes_from_the_bucket(s3_bucket):
    import os
    import subprocess
    import sys

    root = s3_bucket + "/script-run"
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "examples" / "lightning_fit.py"), root, "--async"],
                       env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from {root}/checkpoints/epoch=0-step=8.ckpt, now at global_step 12" in r.stdout


def test_load_checkpoint_plans_from_the_dcp_index_and_never_reads_the_whole_metadata(tmp_path, monkeypatch):
    # the shapes Lightning builds its targets from come from the index header, which the
    # load reads anyway; .metadata (R x T chunks) is not read at all
    from cloudckpt.storage.local import LocalStore

    path = str(tmp_path / "epoch=0-step=5.ckpt")
    io = cl.CloudCheckpointIO()
    io.save_checkpoint(_tiny_checkpoint(5), path)
    reads: list[str] = []
    real = LocalStore.get_bytes

    def counting(self, url, *args, **kwargs):
        reads.append(url)
        return real(self, url, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "get_bytes", counting)
    got = io.load_checkpoint(path)
    io.teardown()
    assert torch.equal(got["state_dict"]["layer.weight"], _tiny_checkpoint(5)["state_dict"]["layer.weight"])
    assert not any(u.endswith("model_and_optim/.metadata") for u in reads), reads
    assert sum(u.endswith("index/header.json") for u in reads) == 1, reads
    assert sum(u.endswith(".metadata.json") for u in reads) == 1, reads
