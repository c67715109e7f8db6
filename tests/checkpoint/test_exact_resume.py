"""Exact resume: straight training vs. stop, restart, resume is bit-identical (CPU, gloo, 2 ranks, SeaweedFS)."""

from __future__ import annotations

import torch

from cloudckpt.testing.multiprocess import run_ranks

from . import resume_workers
from .test_checkpointer import _env


def test_stopped_cleanly_after_a_save_then_resumed_is_bit_identical_to_training_straight(s3_bucket, tmp_path):
    """A job that ends right after a step (clean exit, close() runs; kill -9 is
    test_resume_after_kill.py) and is restarted trains on exactly as if never stopped."""
    steps = 8
    straight = run_ranks(2, resume_workers.train, s3_bucket + "/straight", str(tmp_path / "w"), steps, env=_env())
    first = run_ranks(2, resume_workers.train, s3_bucket + "/resumed", str(tmp_path / "w"), steps, 5, env=_env())
    assert max(first[0]["losses"]) == 5  # preempted after step 5; the last committed step is 4
    second = run_ranks(2, resume_workers.train, s3_bucket + "/resumed", str(tmp_path / "w"), steps, env=_env())
    for r in range(2):
        assert second[r]["resumed"] == 4
        for step in range(5, steps + 1):
            assert second[r]["losses"][step] == straight[r]["losses"][step], (r, step)
        for k, v in straight[r]["weights"].items():
            assert torch.equal(second[r]["weights"][k], v), k


def test_resume_on_another_world_size_says_what_it_could_not_restore(s3_bucket, tmp_path):
    run_ranks(2, resume_workers.train, s3_bucket + "/ws", str(tmp_path / "w"), 2, env=_env())
    out = run_ranks(1, resume_workers.train_logged, s3_bucket + "/ws", str(tmp_path / "w"), 3, env=_env())
    assert out[0]["resumed"] == 2
    assert "not restored on rank 0: rng, loader:train (the world size changed)" in out[0]["log"]
