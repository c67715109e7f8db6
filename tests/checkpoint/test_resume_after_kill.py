"""Resume after ``kill -9`` restores everything a user would check: after the first
resumed step, the weights, AdamW's state, the LR scheduler, the data loader's position
and every RNG equal an uninterrupted run's, bit for bit. 1 and 2 ranks (FSDP2), through
``AppState`` with the Checkpointer directly and through the manager, on SeaweedFS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cloudckpt.testing.multiprocess import RankFailed, run_ranks

from . import resume_workers
from .test_checkpointer import _env

STEPS, KILL_AFTER = 6, 5  # saves every 2 steps: step 4 is the newest committed one when step 5 is killed
_straight: dict = {}


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _uninterrupted(world_size, mode, bucket, tmp_path):
    if world_size not in _straight:
        _straight[world_size] = run_ranks(world_size, resume_workers.train_resumable, bucket + f"/straight{world_size}",
                                          str(tmp_path / "ws"), STEPS, mode, env=_env())
    return _straight[world_size]


@pytest.mark.parametrize("mode", ["helper", "manager"])
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 ranks: 15-25 s each
def test_resume_after_kill_9_restores_weights_optimizer_scheduler_loader_and_rng(world_size, mode, s3_bucket, tmp_path):
    straight = _uninterrupted(world_size, mode, s3_bucket, tmp_path)
    folder = s3_bucket + f"/killed-{mode}{world_size}"
    with pytest.raises(RankFailed) as ei:
        run_ranks(world_size, resume_workers.train_resumable, folder, str(tmp_path / "w"), STEPS, mode, KILL_AFTER,
                  env=_env())
    assert all("exit code -9" in msg for msg in ei.value.failures.values()), ei.value.failures
    resumed = run_ranks(world_size, resume_workers.train_resumable, folder, str(tmp_path / "w"), STEPS, mode,
                        env=_env())
    for r in range(world_size):
        assert resumed[r]["resumed"] == 4
        assert sorted(resumed[r]["digests"]) == [5, 6]
        for step in (5, 6):  # the first resumed step, and the one after it
            _same(straight[r]["digests"][step], resumed[r]["digests"][step], f"rank{r} step{step}")
