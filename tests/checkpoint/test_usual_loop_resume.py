"""Exact resume with the usual loop shape: resume(), then sampler.set_epoch(e) and
iter(loader) with a loader that seeds itself from the global torch RNG. The first
iter() after resume must not shift the RNG that resume restored (dropout masks would
differ from an uninterrupted run); a plain DataLoader is refused when registered."""

from __future__ import annotations

import uuid

import pytest
import torch

from cloudckpt import CheckpointConfig
from cloudckpt.errors import ConfigError
from cloudckpt.testing.multiprocess import run_ranks

from . import loop_workers
from .test_checkpointer import _env

STEPS = 13


@pytest.fixture(scope="module")
def straight(seaweed, tmp_path_factory) -> list:
    """2 ranks training STEPS steps straight (saving every 2, blocking): the run that both
    the sync and the async stop-and-resume must equal (how a save runs changes nothing)."""
    bucket = seaweed.create_bucket("straight-" + uuid.uuid4().hex[:16])
    return run_ranks(2, loop_workers.train, bucket + "/straight", str(tmp_path_factory.mktemp("straight")), STEPS,
                     None, False, env=dict(_env(), **seaweed.env()))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_then_set_epoch_and_iter_is_bit_identical_to_training_straight(s3_bucket, tmp_path, async_save,
                                                                             straight):
    steps, work = STEPS, str(tmp_path / "w")
    first = run_ranks(2, loop_workers.train, s3_bucket + "/resumed", work, steps, 7, async_save, env=_env())
    assert max(first[0]["losses"]) == 7  # preempted mid-epoch 2, after step 7; the last save is step 6
    second = run_ranks(2, loop_workers.train, s3_bucket + "/resumed", work, steps, None, async_save, env=_env())
    for r in range(2):
        assert second[r]["resumed"] == 6
        assert {s: second[r]["losses"][s] for s in range(7, steps + 1)} == \
            {s: straight[r]["losses"][s] for s in range(7, steps + 1)}, r
        for k, v in straight[r]["weights"].items():
            assert torch.equal(second[r]["weights"][k], v), k
        assert torch.equal(second[r]["rng"], straight[r]["rng"])


def test_a_plain_dataloader_is_refused_when_registered_not_at_the_first_save(tmp_path):
    from torch.utils.data import DataLoader

    mgr = CheckpointConfig(save_folder=str(tmp_path / "run"), work_dir=str(tmp_path / "w"), save_interval=1000).build()
    try:
        with pytest.raises(ConfigError, match="StatefulDataLoader.*pip install torchdata"):
            mgr.register_data_loader(DataLoader(list(range(8)), batch_size=2))
        with pytest.raises(ConfigError, match="name"):
            mgr.register_data_loader(object(), name="")
        from torchdata.stateful_dataloader import StatefulDataLoader

        mgr.register_data_loader(StatefulDataLoader(list(range(8)), batch_size=2))
        with pytest.raises(ConfigError, match="already registered"):
            mgr.register_data_loader(StatefulDataLoader(list(range(8)), batch_size=2))
    finally:
        mgr.close()
