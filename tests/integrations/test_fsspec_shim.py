"""The fsspec shim Lightning uses for s3:// and gs:// bookkeeping (folder checks, CSV logs)
when s3fs/gcsfs are not installed; it never replaces a registered implementation."""

from __future__ import annotations

import importlib

import fsspec
import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import layout
from cloudckpt.errors import UnsafeCheckpoint
from cloudckpt.integrations import _fsspec
from cloudckpt.storage import open_store

_reg = importlib.import_module("fsspec.registry")  # the attribute fsspec.registry is the mapping, not the module


@pytest.fixture(autouse=True)
def _registered():
    """The shim registered for each test; afterwards fsspec's registry (process-global), the
    shim's default options and its cached instances are as they were before the test."""
    registry, options, made = dict(_reg._registry), _fsspec._default_options, set(_fsspec._made)
    try:
        _fsspec.register()
        yield
    finally:
        _reg._registry.clear()
        _reg._registry.update(registry)
        _fsspec.set_default_storage_options(options)
        _fsspec._made.clear()
        _fsspec._made.update(made)
        for cls, _ in _fsspec._SHIMS:
            cls.clear_instance_cache()


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_shim_reads_writes_appends_lists_and_removes(backend, request):
    root = request.getfixturevalue({"s3": "s3_bucket", "gcs": "gcs_bucket"}[backend]) + "/logs"
    fs, _ = fsspec.core.url_to_fs(root)
    assert isinstance(fs, _fsspec._ObjectStoreFS)
    assert not fs.exists(root) and not fs.isdir(root)
    fs.makedirs(root + "/version_0", exist_ok=True)  # writes nothing: folders appear with their first object
    with fs.open(root + "/version_0/metrics.csv", "w", newline="") as f:
        f.write("step,loss\n0,1.5\n")
    with fs.open(root + "/version_0/metrics.csv", "a", newline="") as f:
        f.write("1,1.25\n")
    with fs.open(root + "/version_0/metrics.csv", "r") as f:
        assert f.read() == "step,loss\n0,1.5\n1,1.25\n"
    assert fs.isdir(root) and fs.isdir(root + "/version_0") and fs.isfile(root + "/version_0/metrics.csv")
    assert fs.info(root + "/version_0/metrics.csv")["size"] == len("step,loss\n0,1.5\n1,1.25\n")
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] == ["version_0"]
    assert fs.modified(root + "/version_0/metrics.csv").year >= 2024
    with pytest.raises(FileExistsError):
        fs.open(root + "/version_0/metrics.csv", "xb")
    fs.pipe_file(root + "/hparams.yaml", b"lr: 0.1\n")
    assert fs.cat_file(root + "/hparams.yaml", start=4) == b"0.1\n"
    fs.rm_file(root + "/hparams.yaml")
    assert not fs.exists(root + "/hparams.yaml")
    with pytest.raises(FileNotFoundError):
        fs.ls(root + "/nothing-here")


def test_writes_inside_a_transaction_land_on_commit_only(s3_bucket):
    fs, _ = fsspec.core.url_to_fs(s3_bucket)
    with fs.transaction:
        with fs.open(s3_bucket + "/t/a.txt", "wb") as f:
            f.write(b"x")
        assert not fs.exists(s3_bucket + "/t/a.txt")
    assert fs.cat_file(s3_bucket + "/t/a.txt") == b"x"


def test_register_leaves_an_implementation_registered_before(monkeypatch):
    class Other(fsspec.AbstractFileSystem):
        protocol = "s3"

    monkeypatch.setitem(_reg._registry, "s3", Other)
    served = _fsspec.register()
    assert "s3" not in served and fsspec.get_filesystem_class("s3") is Other


def test_register_defers_to_installed_s3fs_and_gcsfs(monkeypatch):
    for proto in ("s3", "s3a", "gs", "gcs"):
        monkeypatch.delitem(_reg._registry, proto, raising=False)
    monkeypatch.setattr(_fsspec.importlib.util, "find_spec",
                        lambda name: object() if name in ("s3fs", "gcsfs") else None)
    assert _fsspec.register() == []
    assert "s3" not in _reg.registry and "gs" not in _reg.registry


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_a_folder_made_by_makedirs_exists_for_this_process_before_its_first_object(backend, request):
    """What CSVLogger and save_hyperparameters check (Lightning skips the check only for s3fs/gcsfs/adlfs)."""
    bucket = request.getfixturevalue({"s3": "s3_bucket", "gcs": "gcs_bucket"}[backend])
    fs, _ = fsspec.core.url_to_fs(bucket)
    logs = bucket + "/run/lightning_logs/version_0"
    fs.makedirs(logs, exist_ok=False)
    fs.makedirs(logs, exist_ok=False)  # as s3fs: no FileExistsError for a folder
    assert fs.isdir(logs) and fs.exists(logs) and fs.isdir(bucket + "/run") and not fs.isfile(logs)
    assert fs.ls(logs) == []
    assert list(open_store(bucket).walk(bucket + "/")) == [], "makedirs wrote nothing to the store"
    assert not fs.isdir(bucket + "/run/lightning_logs/version_1"), "only the folders made are seen"
    fs.rmdir(logs)
    assert not fs.isdir(logs)


def test_modified_of_a_committed_checkpoint_folder_is_its_commit_time(s3_bucket):
    dir = s3_bucket + "/c/last.ckpt"
    with Checkpointer(distributed=False) as ckpt:
        ckpt.save(dir, {"model": {"w": torch.ones(2)}}, {"global_step": 1}, step=1)
    fs, _ = fsspec.core.url_to_fs(dir)
    marker = layout.marker_url(dir)
    assert fs.modified(dir).timestamp() == open_store(marker).stat(marker).mtime
    with pytest.raises(IsADirectoryError):
        fs.modified(s3_bucket + "/c")


def test_reads_larger_than_the_cap_are_refused(s3_bucket, monkeypatch):
    fs, _ = fsspec.core.url_to_fs(s3_bucket)
    fs.pipe_file(s3_bucket + "/big.csv", b"x" * 100)
    monkeypatch.setattr(_fsspec, "MAX_FILE_BYTES", 99)
    with pytest.raises(UnsafeCheckpoint):
        fs.cat_file(s3_bucket + "/big.csv")
    with pytest.raises(UnsafeCheckpoint):
        fs.open(s3_bucket + "/big.csv", "ab")
