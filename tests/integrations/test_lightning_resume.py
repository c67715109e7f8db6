"""Lightning with ``default_root_dir`` in a bucket, the way a user sets it up: a module that
calls ``save_hyperparameters()`` logs through the default CSVLogger into the bucket;
``fit(ckpt_path="last")`` resumes from the newest *committed* checkpoint folder (never an
uncommitted one, never beside it as ``last-v1.ckpt``), or starts from scratch with
Lightning's warning when none is committed; and a fit SIGKILLed after a committed save
resumes (``ckpt_path="last"`` or ``last_checkpoint()``, sync and async plugins) with the
weights, AdamW state and global step of that save, and ends like an uninterrupted run.
On SeaweedFS and fake-gcs-server."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint.test_resume_after_kill import _same
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from cloudckpt.checkpoint import layout
from cloudckpt.integrations import lightning as cl
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

EXAMPLES = Path(__file__).parent / "examples"
_spec = importlib.util.spec_from_file_location("lightning_fit", EXAMPLES / "lightning_fit.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

BUCKETS = {"s3": "s3_bucket", "gcs": "gcs_bucket"}


def _children(folder: str) -> list[str]:
    """Names of the folders under ``folder`` that hold objects (SeaweedFS keeps emptied folders as prefixes)."""
    prefix = urls.as_prefix(folder)
    store = open_store(prefix)
    return sorted(urls.basename(e.url) for e in store.list(prefix)
                  if e.is_prefix and next(iter(store.walk(e.url)), None))


def _committed(path: str) -> bool:
    return open_store(path).exists(layout.marker_url(path))


class _StartStep(Callback):
    def on_train_start(self, trainer, pl_module):
        self.global_step = trainer.global_step


def _fit_with_last(root: str, max_steps: int, ckpt_path=None) -> tuple[Trainer, int]:
    """save_last=True: Lightning re-saves last.ckpt at every checkpoint."""
    start = _StartStep()
    trainer = Trainer(default_root_dir=root, max_steps=max_steps, plugins=[cl.CloudCheckpointIO()], logger=False,
                      callbacks=[ModelCheckpoint(dirpath=f"{root}/checkpoints", every_n_train_steps=4, save_last=True),
                                 start],
                      accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(example.TinyModel(), ckpt_path=ckpt_path)
    return trainer, start.global_step


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_save_hyperparameters_and_the_default_csv_logger_write_into_the_bucket(backend, request):
    root = request.getfixturevalue(BUCKETS[backend]) + "/hp-run"
    example.fit(root, max_steps=4)  # used to fail before training: "Missing folder: …/lightning_logs/version_0"
    store = open_store(root)
    logs = root + "/lightning_logs/version_0"
    assert yaml.safe_load(store.get_bytes(logs + "/hparams.yaml")) == {"lr": 0.01}
    assert store.get_bytes(logs + "/metrics.csv").decode().splitlines()[0].split(",") == ["epoch", "loss", "step"]
    example.fit(root, max_steps=4)  # a second run gets the next version, as on a local disk
    assert _children(root + "/lightning_logs") == ["version_0", "version_1"]


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_ckpt_path_last_resumes_from_the_newest_committed_checkpoint_without_a_v1_copy(backend, request):
    root = request.getfixturevalue(BUCKETS[backend]) + "/last-run"
    _fit_with_last(root, 8)
    assert _children(root + "/checkpoints") == ["epoch=0-step=8.ckpt", "last.ckpt"]  # save_top_k=1 removed step 4
    trainer, started = _fit_with_last(root, 12, ckpt_path="last")
    assert started == 8, "resumed at the newest committed checkpoint, not from step 0"
    assert trainer.ckpt_path == root + "/checkpoints/last.ckpt"  # step 8, committed after epoch=0-step=8.ckpt
    assert trainer.global_step == 12
    assert _children(root + "/checkpoints") == ["epoch=1-step=12.ckpt", "last.ckpt"], \
        "no last-v1.ckpt beside the real one"
    assert cl.CloudCheckpointIO().load_checkpoint(root + "/checkpoints/last.ckpt")["global_step"] == 12


def test_ckpt_path_last_never_picks_an_uncommitted_folder(s3_bucket):
    root = s3_bucket + "/crashed-run"
    example.fit(root, max_steps=8)
    newest = root + "/checkpoints/epoch=0-step=8.ckpt"
    open_store(newest).delete(layout.marker_url(newest))  # as if the job died before the commit
    start = _StartStep()
    trainer = example.fit(root, max_steps=12, ckpt_path="last", callbacks=[start])
    assert trainer.ckpt_path == root + "/checkpoints/epoch=0-step=4.ckpt" and start.global_step == 4


def test_ckpt_path_last_with_nothing_committed_starts_from_scratch_with_lightnings_warning(s3_bucket):
    root = s3_bucket + "/fresh-run"
    example.fit(root, max_steps=4)
    only = root + "/checkpoints/epoch=0-step=4.ckpt"
    open_store(only).delete(layout.marker_url(only))
    start = _StartStep()
    with pytest.warns(UserWarning, match="no last checkpoint available"):
        trainer = example.fit(root, max_steps=4, ckpt_path="last", callbacks=[start])
    assert trainer.ckpt_path is None and start.global_step == 0


# ---------------------------------------------------------------- kill -9 and resume
WORKER = EXAMPLES / "lightning_worker.py"
ROOT = Path(__file__).resolve().parents[2]
_reference: dict = {}


def _worker(root: str, dump_dir: Path, *extra: str) -> subprocess.Popen:
    """The worker in a child process; its output goes to DUMP_DIR/out.log."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    with open(dump_dir / "out.log", "w") as log:
        return subprocess.Popen([sys.executable, str(WORKER), root, "16", str(dump_dir), *extra], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)


def _output(dump_dir: Path) -> str:
    return (dump_dir / "out.log").read_text()[-4000:]


def _finish(proc: subprocess.Popen, dump_dir: Path, timeout: float = 120) -> str:
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, _output(dump_dir)
    return _output(dump_dir)


def _wait_stalled(proc: subprocess.Popen, dump_dir: Path, timeout: float = 120) -> None:
    """Wait until the worker has written stalled.pt; fail with its output if it exits or runs out of time first."""
    deadline = time.monotonic() + timeout
    while not (dump_dir / "stalled.pt").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the child did not reach its stall point:\n" + _output(dump_dir))
        time.sleep(0.1)


def _uninterrupted(tmp_path_factory) -> dict:
    """Final state of one uninterrupted 16-step run (local folder, sync plugin), computed once."""
    if "final" not in _reference:
        dump = tmp_path_factory.mktemp("reference")
        _finish(_worker(str(dump / "run"), dump), dump)
        _reference["final"] = torch.load(dump / "final.pt", weights_only=True)
    return _reference["final"]


@pytest.mark.parametrize("backend,plugin,resume", [
    ("s3", "sync", "last"), ("s3", "async", "helper"), ("gcs", "sync", "helper"), ("gcs", "async", "last")])
def test_fit_killed_after_a_committed_save_resumes_weights_optimizer_and_step(backend, plugin, resume, request,
                                                                             tmp_path, tmp_path_factory):
    root = request.getfixturevalue(BUCKETS[backend]) + "/killed"
    flags = ["--async"] if plugin == "async" else []
    want_final = _uninterrupted(tmp_path_factory)
    # step 8 ends epoch 0 (8 batches an epoch): Lightning resumes exactly only from an end-of-epoch
    # checkpoint when the data loader is not resumable (mid-epoch it restarts the epoch's batches)
    victim = _worker(root, tmp_path / "victim", *flags, "--stall-at", "8")
    try:
        _wait_stalled(victim, tmp_path / "victim")
        assert _children(root + "/checkpoints") == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
        assert _committed(root + "/checkpoints/epoch=0-step=8.ckpt")
    finally:
        victim.kill()  # SIGKILL, mid-training (it is sleeping at the start of step 9)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    out = _finish(_worker(root, tmp_path / "resumed", *flags, "--resume", resume), tmp_path / "resumed")
    assert f"RESUMED_FROM {root}/checkpoints/epoch=0-step=8.ckpt" in out, out[-4000:]

    stalled = torch.load(tmp_path / "victim" / "stalled.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "resumed.pt", weights_only=True)
    assert stalled["step"] == resumed["step"] == 8
    assert stalled["optim"]["state"], "AdamW has per-parameter state at step 8"
    _same(stalled["model"], resumed["model"], "weights at resume")
    _same(stalled["optim"], resumed["optim"], "optimizer state at resume")
    final = torch.load(tmp_path / "resumed" / "final.pt", weights_only=True)
    assert final["step"] == want_final["step"] == 16
    _same(want_final["model"], final["model"], "final weights vs an uninterrupted run")
    _same(want_final["optim"], final["optim"], "final optimizer state vs an uninterrupted run")
    assert _children(root + "/checkpoints") == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "epoch=1-step=12.ckpt",
                                                "epoch=1-step=16.ckpt"]
    assert all(_committed(f"{root}/checkpoints/{n}") for n in _children(root + "/checkpoints"))
