"""CheckpointConfig's groups (local tier, retention, shutdown), each set by its flat
names in keyword arguments, YAML and CLOUDCKPT_* or as a group; one rule table per
settings class covering every field; the Checkpointer's one options object."""

from __future__ import annotations

import dataclasses

import pytest

from cloudckpt import CheckpointConfig, TransferConfig
from cloudckpt.config import (
    CHECKPOINTER_RULES,
    CONFIG_RULES,
    GROUPS,
    LOCAL_RULES,
    RETENTION_RULES,
    SHUTDOWN_RULES,
    CheckpointerOptions,
    LocalTierConfig,
    RetentionConfig,
    ShutdownConfig,
)
from cloudckpt.errors import ConfigError
from cloudckpt.transfer.config import RULES as TRANSFER_RULES

RUN = "s3://my-bucket/run-7"


def _yaml(tmp_path, body: str):
    p = tmp_path / "c.yaml"
    p.write_text("checkpoint:\n  save_folder: s3://my-bucket/run-7\n" + body)
    return p


def test_local_tier_group_from_flat_names_yaml_env_and_a_mapping(tmp_path):
    kw = CheckpointConfig(save_folder=RUN, local_dir="/dev/shm/ckpt", local_save_interval=10, keep_last_local=3,
                          _env={})
    assert kw.local == LocalTierConfig(local_dir="/dev/shm/ckpt", local_save_interval=10, keep_last_local=3)
    assert (kw.local_dir, kw.keep_last_local) == ("/dev/shm/ckpt", 3)  # the flat names read back
    y = CheckpointConfig.from_yaml(str(_yaml(tmp_path, "  local_dir: /dev/shm/ckpt\n  replication_factor: 2\n")),
                                   section="checkpoint", env={"CLOUDCKPT_LOCAL_SAVE_INTERVAL": "5",
                                                              "CLOUDCKPT_REPLICATION_JUMP": "4"})
    assert y.local == LocalTierConfig("/dev/shm/ckpt", 5, 2, 2, 4)
    nested = CheckpointConfig.from_dict({"save_folder": RUN, "local": {"local_dir": "/l", "keep_last_local": "4"},
                                         "keep_last_local": 5}, env={})
    assert nested.local == LocalTierConfig(local_dir="/l", keep_last_local=5)  # the flat name given as well wins
    with pytest.raises(ConfigError, match=r"local\.keep_last"):
        CheckpointConfig.from_dict({"save_folder": RUN, "local": {"keep_last": 4}}, env={})


def test_retention_group_from_flat_names_yaml_env_and_the_object(tmp_path):
    y = CheckpointConfig.from_yaml(str(_yaml(tmp_path, "  max_checkpoints: 3\n  keep_every: 1000\n")),
                                   section="checkpoint", env={"CLOUDCKPT_GC_GRACE_SECONDS": "60",
                                                              "CLOUDCKPT_KEEP_LAST_EPHEMERAL": "2"})
    assert y.retention == RetentionConfig(keep_last_ephemeral=2, max_checkpoints=3, keep_every=1000,
                                          gc_grace_seconds=60.0)
    obj = CheckpointConfig(save_folder=RUN, retention=RetentionConfig(max_checkpoints=4), _env={})
    assert obj.max_checkpoints == 4 and obj.replace(max_checkpoints=None).retention == RetentionConfig()


def test_shutdown_group_from_flat_names_yaml_and_env(tmp_path):
    y = CheckpointConfig.from_yaml(str(_yaml(tmp_path, "  sigterm: abandon\n")), section="checkpoint",
                                   env={"CLOUDCKPT_SIGTERM_TIMEOUT": "30"})
    assert y.shutdown == ShutdownConfig(sigterm="abandon", sigterm_timeout=30.0)
    assert CheckpointConfig(save_folder=RUN, shutdown={"sigterm_timeout": "5"}, _env={}).sigterm_timeout == 5.0


@pytest.mark.parametrize("kwargs,says", [
    ({"keep_last_local": 0, "local_dir": "/l"}, "local tier option keep_last_local=0 is not allowed: use a positive "
                                                "integer (0 would delete the newest local step)"),
    ({"local_dir": "s3://b/x"}, "local tier option local_dir='s3://b/x' is not allowed: use a node-local path"),
    ({"local_save_interval": 5}, "local_save_interval=5 needs local_dir"),
    ({"max_checkpoints": 0}, "retention option max_checkpoints=0 is not allowed"),
    ({"gc_grace_seconds": -1}, "retention option gc_grace_seconds=-1.0 is not allowed"),
    ({"sigterm": "ignore"}, "shutdown option sigterm='ignore' is not allowed: use 'finish' or 'abandon'"),
    ({"sigterm_timeout": float("inf")}, "shutdown option sigterm_timeout=inf is not allowed: use a finite "
                                        "non-negative number of seconds"),
    ({"thread_count": 0}, "checkpointer option thread_count=0 is not allowed: use a positive integer"),
    ({"load_exchange": "sometimes"}, "load_exchange='sometimes' is not a boolean"),
    ({"collective_timeout": 0}, "checkpointer option collective_timeout=0.0 is not allowed"),
    ({"max_concurrency": 0}, "transfer option max_concurrency=0 is not allowed"),
    ({"save_interval": 0}, "save_interval=0 is not allowed: use a positive integer, or None to turn it off"),
    ({"load_step": -1}, "load_step=-1 is not allowed: use an integer >= 0"),
    ({"local": 3}, "local=3 is not allowed: use a LocalTierConfig or a mapping of its fields"),
])
def test_every_bad_value_is_one_config_error_naming_field_value_and_what_is_allowed(kwargs, says):
    with pytest.raises(ConfigError) as ei:
        CheckpointConfig(save_folder=RUN, _env={}, **kwargs)
    assert says in str(ei.value)


def test_every_field_of_every_settings_class_has_exactly_one_rule():
    def names(cls):
        return {f.name for f in dataclasses.fields(cls)}

    assert set(LOCAL_RULES) == names(LocalTierConfig)
    assert set(RETENTION_RULES) == names(RetentionConfig)
    assert set(SHUTDOWN_RULES) == names(ShutdownConfig)
    assert set(CHECKPOINTER_RULES) == names(CheckpointerOptions)
    assert set(TRANSFER_RULES) == names(TransferConfig)
    assert set(CONFIG_RULES) == names(CheckpointConfig)  # the Checkpointer's settings: the checkpointer group
    # the groups' objects check themselves: built directly, a bad value is refused the same way
    with pytest.raises(ConfigError, match="local tier option replication_factor=0"):
        LocalTierConfig(replication_factor=0)
    with pytest.raises(ConfigError, match="transfer option min_concurrency=9 is not allowed: use at most"):
        TransferConfig(min_concurrency=9)


def test_field_names_cover_every_flat_name_and_each_is_an_environment_variable():
    names = CheckpointConfig.field_names()
    for group, (cls, flat) in GROUPS.items():
        assert group in names and set(flat) <= set(names)
        for name in flat:
            assert name in {f.name for f in dataclasses.fields(cls)}
    env = {f"CLOUDCKPT_{n.upper()}": "1" for n in ("keep_last_local", "max_checkpoints", "sigterm_timeout")}
    cfg = CheckpointConfig.from_dict({"save_folder": RUN}, env=env)
    assert (cfg.keep_last_local, cfg.max_checkpoints, cfg.sigterm_timeout) == (1, 1, 1.0)
    with pytest.raises(ConfigError, match="CLOUDCKPT_LOCAL"):  # a group is not one variable
        CheckpointConfig.from_dict({"save_folder": RUN}, env={"CLOUDCKPT_LOCAL": "x"})


def test_the_checkpointer_gets_one_options_object_from_the_config_or_keywords(tmp_path):
    from cloudckpt import Checkpointer
    from cloudckpt.storage import StorageOptions

    cfg = CheckpointConfig(save_folder=str(tmp_path / "run"), work_dir=str(tmp_path / "w"), thread_count=3,
                           load_exchange=False, max_in_flight=2, storage=StorageOptions(max_attempts=2), _env={})
    opts = cfg.checkpointer_options()
    assert (opts.thread_count, opts.load_exchange, opts.max_in_flight, opts.work_dir) == (3, False, 2,
                                                                                          str(tmp_path / "w"))
    assert opts.storage_options is cfg.storage and opts.transfer is cfg.transfer
    mgr = cfg.build()
    try:
        assert mgr.checkpointer.options == opts
    finally:
        mgr.close()
    with Checkpointer(opts, thread_count=4, distributed=False) as ck:  # a keyword replaces the option's value
        assert ck.options == dataclasses.replace(opts, thread_count=4) and ck.work_dir == str(tmp_path / "w")
    with Checkpointer(work_dir=str(tmp_path / "w2"), storage_options=None, distributed=False) as ck:
        assert ck.options.storage_options == StorageOptions() and ck.options.load_exchange is True
        assert ck.last_load_info is None and ck.last_save_stats is None
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['thread_cout'\]"):
        Checkpointer(thread_cout=4)
    with pytest.raises(ConfigError, match="checkpointer option max_in_flight=0"):
        Checkpointer(max_in_flight=0)


def test_last_save_stats_and_last_load_info_are_frozen_records(tmp_path):
    import torch

    from cloudckpt import Checkpointer
    from cloudckpt.checkpoint.checkpointer import LoadInfo, SaveStats

    step = str(tmp_path / "run" / "step3")
    with Checkpointer(work_dir=str(tmp_path / "w"), distributed=False) as ck:
        ck.save(step, {"model": {"w": torch.arange(6.0)}}, {"step": 3})
        stats = ck.last_save_stats
        assert isinstance(stats, SaveStats) and (stats.step, stats.retries) == (3, 0)
        assert stats.objects >= 3 and stats.bytes > 24 and stats.seconds > 0
        target = {"model": {"w": torch.zeros(6)}}
        assert ck.load(step, target) == {"step": 3} and torch.equal(target["model"]["w"], torch.arange(6.0))
        info = ck.last_load_info
        assert isinstance(info, LoadInfo) and (info.step, info.saved_world_size, info.writer, info.verified) == (
            3, 1, "cloudckpt", True)
        assert info.bytes_read >= 24 and info.not_loaded == [] and info.dir == step
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.step = 4
