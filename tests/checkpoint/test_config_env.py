"""CLOUDCKPT_* overrides apply however a config is built: keyword arguments (the
README's way) as well as from_dict/from_yaml; a misspelt variable is refused."""

from __future__ import annotations

import logging

import pytest

from cloudckpt import CheckpointConfig
from cloudckpt.config import ENV_PREFIX
from cloudckpt.errors import ConfigError


def test_env_overrides_apply_to_a_config_built_with_keyword_arguments(monkeypatch, caplog):
    monkeypatch.setenv("CLOUDCKPT_SAVE_FOLDER", "s3://other-bucket/run-8")
    monkeypatch.setenv("CLOUDCKPT_SAVE_INTERVAL", "2")
    monkeypatch.setenv("CLOUDCKPT_ENDPOINT_URL", "http://127.0.0.1:9")  # a flat storage name
    with caplog.at_level(logging.INFO, logger="cloudckpt.config"):
        cfg = CheckpointConfig(save_folder="s3://my-bucket/run-7", save_interval=1000)
    assert (cfg.save_folder, cfg.save_interval, cfg.endpoint_url) == ("s3://other-bucket/run-8", 2,
                                                                      "http://127.0.0.1:9")
    assert "CLOUDCKPT_SAVE_FOLDER" in caplog.text and "CLOUDCKPT_SAVE_INTERVAL" in caplog.text
    assert cfg.replace(max_checkpoints=3).save_interval == 2  # a copy keeps the operator's override


def test_a_misspelt_override_is_refused_when_the_config_is_built_with_keyword_arguments(monkeypatch):
    typo = ENV_PREFIX + "SAVE_INTERVALL"
    monkeypatch.setenv(typo, "2")
    with pytest.raises(ConfigError, match=f"{typo} \\(did you mean CLOUDCKPT_SAVE_INTERVAL\\?\\)"):
        CheckpointConfig(save_folder="s3://my-bucket/run-7", save_interval=1000)


def test_a_bad_override_value_names_the_variable_field(monkeypatch):
    monkeypatch.setenv("CLOUDCKPT_SAVE_INTERVAL", "often")
    with pytest.raises(ConfigError, match="save_interval"):
        CheckpointConfig(save_folder="s3://my-bucket/run-7")


def test_from_dict_with_an_explicit_env_ignores_the_process_environment(monkeypatch):
    monkeypatch.setenv("CLOUDCKPT_SAVE_INTERVAL", "7")
    cfg = CheckpointConfig.from_dict({"save_folder": "s3://b-ucket/run", "save_interval": 100},
                                     env={"CLOUDCKPT_ASYNC_SAVE": "true"})
    assert (cfg.save_interval, cfg.async_save) == (100, True)
