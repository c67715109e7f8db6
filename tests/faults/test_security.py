"""Security: no credential in any log line or error message (the autouse scan of this
folder, and a check that the scan catches a leak), code-running pickles refused,
private work dirs."""

from __future__ import annotations

import io
import logging
import os
import stat

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.errors import CorruptCheckpoint
from cloudckpt.storage import url as urls

from . import checks, oracle
from .conftest import SecretScan


class _RunsCode:
    """Unpickling this calls a function of our choosing: what a hostile checkpoint would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # any callable runs; this one leaves a file behind as evidence


def _replace_object(step: str, rel: str, data: bytes) -> None:
    """Put ``data`` at ``rel`` and rewrite the marker's manifest (raw JSON, oracle.py) to
    match it, so size and CRC32C checks pass and only the unpickling decides."""
    oracle.relist(step, rel, data)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_train_state_pickle_that_would_run_code_is_refused_and_the_code_does_not_run(backend, request, tmp_path,
                                                                                     secret_scan):
    root = str(tmp_path / "ckpt") if backend == "local" else request.getfixturevalue("s3_bucket") + "/run"
    step = urls.join(root, "step1")
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, checks.step_state(1, 0), {"step": 1, "rank": 0})
    evidence = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"step": 1, "payload": _RunsCode(str(evidence))}, buf)
    _replace_object(step, "train/rank0.pt", buf.getvalue())
    assert checks.verify_step(step) == [], "the hostile file is a consistent part of a committed step"
    for verify in (True, False):
        with pytest.raises(CorruptCheckpoint) as ei:
            Checkpointer(verify_checksums=verify).load(step, checks.zero_state(1))
        secret_scan.add(str(ei.value))
        assert "train/rank0.pt" in str(ei.value) and "weights_only" in str(ei.value)
    assert not evidence.exists(), "the pickle's code ran"


def test_dcp_metadata_pickle_that_would_run_code_is_refused(tmp_path, secret_scan):
    import pickle

    step = str(tmp_path / "ckpt" / "step1")
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, checks.step_state(1, 0), {"step": 1, "rank": 0})
    evidence = tmp_path / "pwned"
    _replace_object(step, "model_and_optim/.metadata", pickle.dumps(_RunsCode(str(evidence))))
    oracle.unlist_index(step)  # without the DCP index, a load plans from .metadata
    with pytest.raises(CorruptCheckpoint) as ei:
        Checkpointer().load(step, checks.zero_state(1))
    secret_scan.add(str(ei.value))
    assert ".metadata" in str(ei.value)
    assert not evidence.exists(), "the pickle's code ran"


@pytest.mark.parametrize("pre_download", [False, True])
def test_temporary_work_dirs_are_private_and_removed(pre_download, s3_bucket, tmp_path, monkeypatch):
    """Every per-save (and pre-download) work dir is mode 0700 while it exists, and is gone afterwards."""
    work = tmp_path / "work"
    seen: dict[str, int] = {}
    from cloudckpt.storage.nofollow import private_dir

    def spy(*a, **kw):
        d = private_dir(*a, **kw)
        seen[d] = stat.S_IMODE(os.stat(d).st_mode)
        return d

    monkeypatch.setattr("cloudckpt.checkpoint.saving.private_dir", spy)
    monkeypatch.setattr("cloudckpt.checkpoint.loading.private_dir", spy)
    old_umask = os.umask(0o000)  # even a permissive umask must not open them up
    try:
        ck = Checkpointer(work_dir=str(work), pre_download=pre_download)
        step = s3_bucket + "/run/step1"
        ck.save(step, checks.step_state(1, 0), {"step": 1, "rank": 0})
        ck.load(step, checks.zero_state(1))
        ck.close()
    finally:
        os.umask(old_umask)
    assert seen, "the checkpointer made its work dirs with storage.nofollow.private_dir"
    assert len(seen) == (2 if pre_download else 1)
    for d, mode in seen.items():
        assert mode == 0o700, f"{d} was created with mode {oct(mode)}"
        assert not os.path.exists(d), f"{d} was not removed"


def test_the_credential_scan_catches_a_leak():
    """The scan every test of this folder runs under really fails on a credential."""
    scan = SecretScan()
    scan.secrets.add("AKSECRETFORTEST")
    scan.records.append(logging.LogRecord("cloudckpt.x", logging.INFO, __file__, 1, "using key %s",
                                          ("AKSECRETFORTEST",), None))
    with pytest.raises(AssertionError, match="credential leaked"):
        scan.check()
    scan2 = SecretScan()
    scan2.secrets.add("s3cr3t")
    scan2.add("AccessDenied: ... s3cr3t ...")
    with pytest.raises(AssertionError, match="credential leaked"):
        scan2.check()


def test_the_scan_sees_the_server_credentials_and_scans_real_log_lines(s3_bucket, seaweed, secret_scan, tmp_path):
    assert {seaweed.access_key, seaweed.secret_key} <= secret_scan.secrets
    Checkpointer(work_dir=str(tmp_path / "w")).save(s3_bucket + "/run/step1", checks.step_state(1, 0), None)
    assert any("committed" in line for line in secret_scan.lines()), "cloudckpt's log lines are captured"
