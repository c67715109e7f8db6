"""torchtitan-style load options (exclude_from_loading, model_only for seed checkpoints) and the
deferred commit hook (save(commit=False) -> PendingCommit) the Lightning async plugin uses."""

from __future__ import annotations

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout
from cloudckpt.checkpoint.checkpointer import PendingCommit
from cloudckpt.errors import SaveInProgress
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        "optim": {"exp_avg": torch.randn(4, 3, generator=g)},
        "extra": {"ema": torch.randn(2, generator=g)},
    }


def _fresh() -> dict:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "optim": {"exp_avg": torch.zeros(4, 3)},
            "extra": {"ema": torch.zeros(2)}}


@pytest.fixture
def saved(s3_bucket, tmp_path):
    step = s3_bucket + "/run/step5"
    with Checkpointer(work_dir=str(tmp_path / "w")) as ckpt:
        ckpt.save(step, _state(0), {"step": 5, "lr": 0.1})
    return step


def test_exclude_from_loading_keeps_excluded_keys_untouched_and_loads_the_rest(saved, tmp_path):
    target = _fresh()
    with Checkpointer(work_dir=str(tmp_path / "w")) as ckpt:
        ts = ckpt.load(saved, target, exclude_from_loading=["optim", "extra"])
    want = _state(0)
    assert torch.equal(target["model"]["w"], want["model"]["w"]) \
        and torch.equal(target["model"]["b"], want["model"]["b"])
    assert torch.count_nonzero(target["optim"]["exp_avg"]) == 0, "excluded key keeps its current value"
    assert torch.count_nonzero(target["extra"]["ema"]) == 0
    assert ts == {"step": 5, "lr": 0.1}, "exclude_from_loading is about the DCP state dict; train state still loads"


def test_exclude_from_loading_rejects_a_key_the_state_dict_does_not_have(saved, tmp_path):
    with Checkpointer(work_dir=str(tmp_path / "w")) as ckpt, pytest.raises(ValueError, match="optimizer"):
        ckpt.load(saved, _fresh(), exclude_from_loading=["optimizer"])


def test_model_only_seeds_a_fresh_run_from_the_model_alone(saved, tmp_path):
    target = _fresh()
    with Checkpointer(work_dir=str(tmp_path / "w")) as ckpt:
        ts = ckpt.load(saved, target, model_only=True)
    assert ts is None, "no train state: the fresh run starts at step 0"
    assert torch.equal(target["model"]["w"], _state(0)["model"]["w"])
    assert torch.count_nonzero(target["optim"]["exp_avg"]) == 0 and torch.count_nonzero(target["extra"]["ema"]) == 0


def test_model_only_loads_a_seed_checkpoint_that_has_only_a_model(s3_bucket, tmp_path):
    seed = s3_bucket + "/seed/step0"
    with Checkpointer(work_dir=str(tmp_path / "w")) as ckpt:
        ckpt.save(seed, {"model": _state(3)["model"]})
        target = _fresh()
        assert ckpt.load(seed, target, model_only=True) is None
    assert torch.equal(target["model"]["b"], _state(3)["model"]["b"])


def test_model_only_needs_a_model_key_and_no_train_state(saved, tmp_path):
    with Checkpointer(work_dir=str(tmp_path / "w")) as ckpt:
        with pytest.raises(ValueError, match="'model'"):
            ckpt.load(saved, {"net": {}}, model_only=True)
        with pytest.raises(ValueError, match="load_trainer_state"):
            ckpt.load(saved, _fresh(), model_only=True, load_trainer_state=True)


def test_save_without_commit_is_invisible_until_commit_and_holds_the_lock(s3_bucket, tmp_path):
    step = s3_bucket + "/run/epoch=0-step=3.ckpt"
    with Checkpointer(work_dir=str(tmp_path / "w"), distributed=False) as ckpt:
        pending = ckpt.save(step, _state(1), {"step": 3}, step=3, commit=False)
        assert isinstance(pending, PendingCommit)
        store = open_store(step)
        assert not store.exists(layout.marker_url(step)), "uploaded but not committed"
        assert store.exists(urls.join(step, layout.LOCK)), "the lock is held until commit"
        with pytest.raises(SaveInProgress):
            ckpt.save(step, _state(2), step=3)
        marker = pending.commit()
        assert discovery.read_marker(step).save_id == marker.save_id
        assert not store.exists(urls.join(step, layout.LOCK))
        target = _fresh()
        assert ckpt.load(step, target) == {"step": 3}
    assert torch.equal(target["optim"]["exp_avg"], _state(1)["optim"]["exp_avg"])


def test_aborted_pending_commit_leaves_nothing(s3_bucket, tmp_path):
    step = s3_bucket + "/run/step9"
    with Checkpointer(work_dir=str(tmp_path / "w"), distributed=False) as ckpt:
        ckpt.save(step, _state(1), {"step": 9}, commit=False).abort()
    assert list(open_store(step).walk(urls.as_prefix(step))) == []
