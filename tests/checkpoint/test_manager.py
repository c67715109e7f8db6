"""Async saves, the manager (intervals, retention, resume, gc) and its config."""

from __future__ import annotations

import os
import time

import pytest
import torch

from cloudckpt import CheckpointConfig, Checkpointer
from cloudckpt.checkpoint import discovery, layout, retention
from cloudckpt.errors import ConfigError
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls
from cloudckpt.testing.multiprocess import run_ranks

from . import workers
from .test_checkpointer import _assert_bitexact, _env


def test_async_save_multi_rank_round_trip_while_training_collectives_run(s3_bucket, tmp_path):
    step = s3_bucket + "/run/step5"
    outs = run_ranks(2, workers.async_roundtrip, step, str(tmp_path / "work"), env=_env())
    for r, out in enumerate(outs):
        _assert_bitexact(out["tensors"])  # the staged copy, not the state mutated after save_async returned
        assert out["train_state"] == {"rank": r}
    assert os.listdir(tmp_path / "work") == []


def test_async_failure_is_never_committed_and_surfaces_once(s3_bucket, tmp_path):
    step = s3_bucket + "/run/step5"
    outs = run_ranks(2, workers.async_failure, step, str(tmp_path / "work"), env=_env())
    for out in outs:
        assert out["future_error"] == "SaveFailed" and "injected async failure" in out["message"]
        assert out["surfaced_on_next"] is not None and "rank 1" in out["surfaced_on_next"]
    # the third save committed; nothing of the failed attempt is visible
    assert discovery.dir_is_checkpoint(step)


def test_async_error_surfaces_on_wait_and_close(tmp_path, monkeypatch):
    from cloudckpt.errors import AccessDenied, SaveFailed

    root = str(tmp_path / "ckpt")
    store = open_store(root)

    def broken(*a, **kw):
        raise AccessDenied("injected", url=root)

    monkeypatch.setattr(store, "upload_fileobj", broken)
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    ck.save_async(urls.join(root, "step1"), {"w": torch.ones(3)})
    with pytest.raises(SaveFailed, match="injected"):
        ck.wait()
    ck.wait()  # reported once
    ck.save_async(urls.join(root, "step2"), {"w": torch.ones(3)})
    with pytest.raises(SaveFailed, match="injected"):
        ck.close()
    assert not discovery.contains_checkpoint(root)


def _run_30_steps(folder: str, work: str, async_save: bool) -> list[int]:
    cfg = CheckpointConfig(save_folder=folder, work_dir=work, save_interval=10, ephemeral_save_interval=3,
                           keep_last_ephemeral=1, max_checkpoints=1, keep_every=20, async_save=async_save,
                           exact_resume=False)
    mgr = cfg.build()
    sd = {"model": {"w": torch.zeros(16)}}
    for step in range(1, 31):
        sd["model"]["w"].fill_(step)
        mgr.maybe_save(step, sd, {"step": step})
    mgr.close()
    return [s for s, _ in discovery.find_checkpoints(folder)]


@pytest.mark.parametrize("backend,async_save", [("local", False), ("s3", True)])
def test_30_steps_with_intervals_and_retention_leave_exactly_the_policy_steps(backend, async_save, request, tmp_path):
    folder = str(tmp_path / "run") if backend == "local" else request.getfixturevalue("s3_bucket") + "/run"
    # persistent: 10, 20, 30; ephemeral: 3,6,9,...,27. keep_every=20 keeps 20; max_checkpoints=1 keeps 30
    # of the rest; keep_last_ephemeral=1 keeps 27.
    assert _run_30_steps(folder, str(tmp_path / "w"), async_save) == [20, 27, 30]
    ephemeral = [s for s, _ in discovery.find_checkpoints(folder, ephemeral=True)]
    assert ephemeral == [27]
    store = open_store(folder)
    leftovers = {o.url for o in store.walk(urls.as_prefix(folder))} - {urls.join(folder, "latest")}
    assert all(any(f"/step{s}/" in u for s in (20, 27, 30)) for u in leftovers), "pruned steps leave no objects"


def test_resume_picks_newest_committed_step_and_clears_newer_uncommitted_leftovers(s3_bucket, tmp_path):
    folder = s3_bucket + "/run"
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    ck.save(urls.join(folder, "step10"), {"model": {"w": torch.full((4,), 10.0)}}, {"step": 10})
    store = open_store(folder)
    leftover = urls.join(folder, "step20", "model_and_optim", "__0_0.distcp")
    store.put_bytes(leftover, b"half-written")
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w"), save_interval=5).build()
    sd = {"model": {"w": torch.zeros(4)}}
    ts = mgr.resume(sd)
    assert ts["step"] == 10 and mgr.resumed_step == 10
    assert torch.equal(sd["model"]["w"], torch.full((4,), 10.0))
    assert not store.exists(leftover), "the crashed attempt's step20 is removed before it is written again"
    mgr.maybe_save(20, sd, {"step": 20})
    mgr.close()
    assert discovery.latest_checkpoint(folder) == urls.join(folder, "step20")


def test_resume_returns_none_on_an_empty_folder(tmp_path):
    mgr = CheckpointConfig(save_folder=str(tmp_path / "run"), work_dir=str(tmp_path / "w")).build()
    assert mgr.resume({"w": torch.zeros(1)}) is None
    mgr.close()


def test_exact_resume_restores_rng_state(tmp_path):
    folder = str(tmp_path / "run")
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w"), save_interval=1).build()
    torch.manual_seed(123)
    mgr.maybe_save(1, {"w": torch.zeros(2)}, {"step": 1})
    expected = torch.rand(5)
    mgr.close()
    torch.manual_seed(999)
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w")).build()
    mgr.resume({"w": torch.zeros(2)})
    assert torch.equal(torch.rand(5), expected)
    mgr.close()


def test_gc_removes_old_uncommitted_folders_and_orphaned_uploads_only(s3_bucket, seaweed, tmp_path):
    folder = s3_bucket + "/run"
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    ck.save(urls.join(folder, "step1"), {"w": torch.ones(2)}, None)
    store = open_store(folder)
    store.put_bytes(urls.join(folder, "step2", "model_and_optim", "__0_0.distcp"), b"x")  # crashed save
    bucket = urls.parse_url(folder).bucket
    seaweed.client().create_multipart_upload(Bucket=bucket, Key="run/step2/big.distcp")
    # nothing is old enough yet
    rep = retention.gc(folder, older_than=3600)
    assert rep.step_dirs == [] and rep.uploads == []
    # an hour later: the uncommitted folder and the upload go; the committed step stays
    rep = retention.gc(folder, older_than=3600, dry_run=True, now=time.time() + 7200)
    assert rep.step_dirs == [urls.join(folder, "step2")] and len(rep.uploads) == 1
    assert store.exists(urls.join(folder, "step2", "model_and_optim", "__0_0.distcp")), "dry run deletes nothing"
    retention.gc(folder, older_than=3600, now=time.time() + 7200)
    assert list(store.walk(urls.as_prefix(urls.join(folder, "step2")))) == []
    assert store.list_multipart_uploads(urls.as_prefix(folder)) == []
    assert discovery.dir_is_checkpoint(urls.join(folder, "step1"))


def test_steps_to_prune_follows_the_policy_and_never_selects_the_newest():
    # (that prune deletes the marker first is proven by request order in tests/faults/test_commit_order.py)
    committed = [(1, False), (2, True), (3, True), (4, False)]
    assert retention.steps_to_prune(committed, retention.Policy(keep_last_ephemeral=1, max_checkpoints=1)) == [1, 2]
    assert retention.steps_to_prune([(5, True)], retention.Policy(keep_last_ephemeral=1, max_checkpoints=1)) == []
    assert retention.steps_to_prune(committed, retention.Policy(max_checkpoints=1), protect=frozenset({1})) == [2]


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"save_interval": -5}, "save_interval"),
        ({"ephemeral_save_interval": 0}, "ephemeral_save_interval"),
        ({"save_interval": "often"}, "save_interval"),
        ({"async_save": "maybe"}, "async_save"),
        ({"max_checkpoints": 0}, "max_checkpoints"),
        ({"keep_last_ephemeral": 0}, "keep_last_ephemeral"),
        ({"save_folder": "s3://bucket-only"}, "save_folder"),
        ({"save_folder": "s3://b/run/step100"}, "save_folder"),
        ({"save_folder": "ftp://host/x"}, "save_folder"),
        ({"addressing_style": "sideways"}, "addressing_style"),
        ({"bandwidth_limit": "fast"}, "bandwidth_limit"),
        ({"sigterm": "ignore"}, "sigterm"),
    ],
)
def test_config_errors_name_the_field_and_value(kwargs, field):
    d = {"save_folder": "s3://bucket/run", **kwargs}
    with pytest.raises(ConfigError) as ei:
        CheckpointConfig.from_dict(d, env={})
    assert field in str(ei.value)


def test_config_unknown_fields_yaml_and_env_overrides(tmp_path):
    with pytest.raises(ConfigError, match="unknown checkpoint config field.*save_intervall"):
        CheckpointConfig.from_dict({"save_folder": "/x", "save_intervall": 3}, env={})
    p = tmp_path / "c.yaml"
    p.write_text("checkpoint:\n  save_folder: s3://bucket/run\n  save_interval: 100\n  bandwidth_limit: 200MB/s\n")
    cfg = CheckpointConfig.from_yaml(str(p), section="checkpoint",
                                     env={"CLOUDCKPT_SAVE_INTERVAL": "50", "CLOUDCKPT_ASYNC_SAVE": "true"})
    assert (cfg.save_interval, cfg.async_save, cfg.bandwidth_limit) == (50, True, 200_000_000)
    assert CheckpointConfig(save_folder="gs://bucket/run", part_size="32MiB").part_size == 32 * 1024 * 1024
    assert CheckpointConfig(save_folder="gs://bucket/run", part_size="null").part_size is None  # the backend default


def test_an_unknown_cloudckpt_env_var_is_an_error_with_did_you_mean():
    from cloudckpt.config import ENV_PREFIX

    typo = ENV_PREFIX + "SAVE_INTERVALL"  # spelled out here, so the repo scan below does not see it
    with pytest.raises(ConfigError) as ei:
        CheckpointConfig.from_dict({"save_folder": "s3://bucket/run"}, env={typo: "5"})
    msg = str(ei.value)
    assert f"{typo} (did you mean CLOUDCKPT_SAVE_INTERVAL?)" in msg and "CLOUDCKPT_OPERATION_TIMEOUT" in msg
    with pytest.raises(ConfigError, match=ENV_PREFIX + "WHATEVER"):
        CheckpointConfig.from_dict({"save_folder": "s3://bucket/run"}, env={ENV_PREFIX + "WHATEVER": "1"})
    cfg = CheckpointConfig.from_dict({"save_folder": "s3://bucket/run"},
                                     env={"CLOUDCKPT_FUZZ_EXAMPLES": "10", "CLOUDCKPT_SAVE_INTERVAL": "5"})
    assert cfg.save_interval == 5  # the test suite's own knobs are not config fields, and not errors


def test_every_cloudckpt_env_var_used_in_the_repo_is_a_field_or_a_listed_knob():
    """A new test or bench knob named CLOUDCKPT_* must be added to NON_CONFIG_ENV, or
    every job that sets it would fail to build its config."""
    import pathlib
    import re

    from cloudckpt.config import ENV_PREFIX, NON_CONFIG_ENV

    root = pathlib.Path(__file__).resolve().parents[2]
    fields = {ENV_PREFIX + n.upper() for n in CheckpointConfig.field_names()}
    used = set()
    for sub in ("cloudckpt", "tests", "bench", "examples", "scripts"):
        for p in (root / sub).rglob("*.py"):
            used |= set(re.findall(r"\bCLOUDCKPT_[A-Z0-9_]+", p.read_text(errors="replace")))
    assert used, "the scan found nothing: wrong root?"
    assert used - fields - NON_CONFIG_ENV == set()


def test_timeouts_are_config_fields_with_env_overrides_and_reach_the_storage_options():
    cfg = CheckpointConfig.from_dict({"save_folder": "s3://bucket/run", "read_timeout": 20},
                                     env={"CLOUDCKPT_OPERATION_TIMEOUT": "5", "CLOUDCKPT_CONNECT_TIMEOUT": "2.5"})
    so = cfg.storage
    assert (so.connect_timeout, so.read_timeout, so.operation_timeout) == (2.5, 20.0, 5.0)
    assert so.attempt_timeouts == (2.5, 5.0)  # no single wait is longer than the deadline
    d = CheckpointConfig(save_folder="s3://bucket/run").storage
    assert (d.connect_timeout, d.read_timeout, d.operation_timeout) == (10.0, 30.0, 60.0)
    for bad in (0, -1, "soon", float("inf")):
        with pytest.raises(ConfigError, match="operation_timeout"):
            CheckpointConfig(save_folder="s3://bucket/run", operation_timeout=bad)


@pytest.mark.parametrize("kwargs,says", [
    ({"endpoint_url": "127.0.0.1:9000"}, "has no scheme: write http://127.0.0.1:9000"),
    ({"endpoint_url": "ftp://127.0.0.1:9000"}, "is not an http:// or https:// URL"),
    ({"save_folder": "http://127.0.0.1:9000/bucket/run"},
     "write s3://bucket/run and put the endpoint http://127.0.0.1:9000 into endpoint_url"),
    ({"save_folder": "https://storage.googleapis.com/bucket/run"}, "write gs://bucket/run"),
])
def test_endpoint_and_http_folder_mistakes_are_config_errors_saying_what_to_write(kwargs, says):
    with pytest.raises(ConfigError) as ei:
        CheckpointConfig(**{"save_folder": "s3://bucket/run", **kwargs})
    assert says in str(ei.value) and "invalid bucket name" not in str(ei.value)


def test_config_nests_storage_and_transfer_and_keeps_the_flat_names():
    from cloudckpt.storage import StorageOptions
    from cloudckpt.transfer import TransferConfig

    cfg = CheckpointConfig(save_folder="s3://bucket/run", part_size="32MiB", max_concurrency=3, endpoint_url="http://127.0.0.1:1")
    assert isinstance(cfg.storage, StorageOptions) and isinstance(cfg.transfer, TransferConfig)
    assert cfg.part_size == cfg.storage.part_size == 32 * 1024 * 1024
    assert cfg.max_concurrency == cfg.transfer.max_concurrency == 3
    assert cfg.replace(save_interval=5).storage == cfg.storage  # replace keeps the nested objects
    assert cfg.replace(operation_timeout=7).storage.operation_timeout == 7
    nested = CheckpointConfig(save_folder="s3://bucket/run", storage=StorageOptions(max_attempts=2),
                              transfer={"max_bytes_in_flight": "1GiB"})
    assert nested.storage.max_attempts == 2 and nested.transfer.max_bytes_in_flight == 1024**3
    d = CheckpointConfig.from_dict({"save_folder": "s3://bucket/run", "storage": {"max_attempts": "3"}},
                                   env={"CLOUDCKPT_ENDPOINT_URL": "http://127.0.0.1:2", "CLOUDCKPT_THREAD_COUNT": "4"})
    assert d.storage.max_attempts == 3 and d.storage.endpoint_url == "http://127.0.0.1:2" and d.thread_count == 4
    with pytest.raises(ConfigError, match=r"storage\.max_attemps"):
        CheckpointConfig.from_dict({"save_folder": "s3://bucket/run", "storage": {"max_attemps": 3}}, env={})
    with pytest.raises(ConfigError, match="unknown checkpoint config field"):
        CheckpointConfig(save_folder="s3://bucket/run", max_concurency=3)
    for bad in ({"thread_count": 0}, {"stale_lock_seconds": -1}, {"collective_timeout": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            CheckpointConfig(save_folder="s3://bucket/run", **bad)


def test_manager_hands_every_checkpointer_knob_and_one_default_work_dir(tmp_path):
    from cloudckpt.config import default_work_dir
    from cloudckpt.storage import StorageOptions

    cfg = CheckpointConfig(save_folder=str(tmp_path / "run"), thread_count=3, stale_lock_seconds=30,
                           collective_timeout=45, storage=StorageOptions(max_attempts=2))
    mgr = cfg.build()
    try:
        ck = mgr.checkpointer
        assert (ck.options.thread_count, ck.options.stale_lock_seconds, ck.work_dir) == (3, 30, default_work_dir())
        assert ck.storage_options is cfg.storage and mgr.save_location.options is cfg.storage
    finally:
        mgr.close()
    from cloudckpt import Checkpointer

    with Checkpointer() as ck:
        assert ck.work_dir == default_work_dir()


def test_resume_load_step_loads_that_committed_step_or_names_the_nearest(tmp_path):
    from cloudckpt.errors import NotACheckpoint

    folder = str(tmp_path / "run")
    # save_overwrite: rewinding below committed steps is decided at resume (test_resume_fallback.py)
    cfg = CheckpointConfig(save_folder=folder, save_interval=10, work_dir=str(tmp_path / "w"), exact_resume=False,
                           save_overwrite=True)
    mgr = cfg.build()
    for step in (10, 20, 30):
        mgr.maybe_save(step, {"w": torch.full((3,), float(step))}, {"step": step})
    mgr.close()
    for how in ("argument", "config"):
        m = (cfg if how == "argument" else cfg.replace(load_step=20)).build()
        sd = {"w": torch.zeros(3)}
        ts = m.resume(sd, load_step=20) if how == "argument" else m.resume(sd)
        assert ts == {"step": 20} and torch.equal(sd["w"], torch.full((3,), 20.0)) and m.resumed_step == 20
        assert m.checkpointer.read_train_state(layout.step_dir(folder, 30)) == {"step": 30}
        m.close()
    m = cfg.build()
    with pytest.raises(NotACheckpoint, match=r"load_step=25: .*step25 is not a committed checkpoint; "
                                             r"the nearest committed steps are \[10, 20, 30\]"):
        m.resume({"w": torch.zeros(3)}, load_step=25)
    m.close()
    with pytest.raises(ConfigError, match="load_step=-1"):
        cfg.replace(load_step=-1)


def test_gc_keep_above_leaves_uncommitted_folders_of_saves_in_progress(tmp_path):
    """Background maintenance runs gc with keep_above = the newest committed step: a save
    that started after maintenance took its snapshot of the steps being written is
    above that step, so even gc_grace_seconds=0 never removes it under the save."""
    folder = str(tmp_path / "run")
    with Checkpointer(work_dir=str(tmp_path / "w"), distributed=False) as ck:
        ck.save(layout.step_dir(folder, 10), {"w": torch.ones(2)})
    store = open_store(folder)
    for step in (5, 20):  # uncommitted: a crashed attempt below, a save in progress above
        store.put_bytes(urls.join(layout.step_dir(folder, step), "model_and_optim/__0_0.distcp"), b"x")
    rep = retention.gc(folder, older_than=0, keep_above=10, now=time.time() + 5)
    assert rep.step_dirs == [layout.step_dir(folder, 5)]
    assert store.exists(urls.join(layout.step_dir(folder, 20), "model_and_optim/__0_0.distcp"))
