"""Exact resume with loader workers: torchdata's StatefulDataLoader re-seeds a resumed
worker from the saved base seed, so without more a random augmentation in
``__getitem__`` draws other numbers after a resume. The manager keeps each worker's
RNG states in the loader's state; a resumed run (a fresh process) must then equal the
uninterrupted one bit for bit, for 0, 1 and 2 workers, persistent or not, snapshots
every step or every 3, workers forked or spawned, resumed mid-epoch and at an epoch's end. Cases that cannot
resume exactly are named when the loader is registered."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from cloudckpt import CheckpointConfig, exact_resume
from cloudckpt.checkpoint import loaders
from cloudckpt.errors import CorruptCheckpoint
from cloudckpt.testing.multiprocess import run_ranks

from . import worker_rng_workers as w

# (num_workers, persistent_workers, snapshot_every_n_steps, worker start method); prefetch_factor 2 with workers
CONFIGS = [(0, False, 1, None), (1, False, 1, "fork"), (1, True, 1, "fork"), (2, False, 1, "fork"),
           (2, True, 1, "fork"), (2, True, 3, "spawn")]
LOAD_STEPS = [8, 12]  # mid epoch 2; the end of epoch 2


def test_resumed_with_loader_workers_random_augmentation_repeats_bit_for_bit(tmp_path):
    root = str(tmp_path)
    straight = run_ranks(1, w.straight, root, CONFIGS)[0]
    resumed = run_ranks(1, w.resumed, root, CONFIGS, LOAD_STEPS, [(2, True, 1, "fork")])[0]
    for cfg in CONFIGS:
        want = straight[w._key(cfg)]
        for s in LOAD_STEPS:
            got = resumed[w._key(cfg), s]
            assert sorted(got["losses"]) == list(range(s + 1, w.STEPS + 1)), (cfg, s)
            assert {t: got["losses"][t] for t in got["losses"]} == {t: want["losses"][t] for t in got["losses"]}, \
                (cfg, s)  # int32 bits of each float32 loss
            for k, v in want["weights"].items():
                assert torch.equal(got["weights"][k], v), (cfg, s, k)
    # the same resume with the workers' RNG left as torchdata leaves it (re-seeded): the
    # augmentation draws other numbers from the first step on, so this test can fail
    unkept = resumed[w._key((2, True, 1, "fork")), "unkept"]["losses"]
    assert unkept[9] != straight[w._key((2, True, 1, "fork"))]["losses"][9]


class _Items(Dataset):
    def __init__(self, n=8):
        self.n, self.loaded = n, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class _StatefulItems(_Items):
    def state_dict(self):
        return {"pos": 3}

    def load_state_dict(self, state):
        self.loaded = state

    def __getitems__(self, idx):
        return [torch.tensor([float(i) + 100]) for i in idx]


class _Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        return iter(range(info.id if info else 0, 8, info.num_workers if info else 1))


def _manager(tmp_path):
    return CheckpointConfig(save_folder=str(tmp_path / "run"), work_dir=str(tmp_path / "w"), save_interval=1000).build()


def test_registration_names_what_cannot_resume_exactly(tmp_path, caplog):
    mgr = _manager(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="cloudckpt.checkpoint.loaders"):
            mgr.register_data_loader(StatefulDataLoader(_Stream(), batch_size=2, num_workers=2), name="stream")
            mgr.register_data_loader(StatefulDataLoader(_Items(), batch_size=2, num_workers=2, in_order=False),
                                     name="unordered")
            quiet = [StatefulDataLoader(_Stream(), batch_size=2), StatefulDataLoader(_Items(), batch_size=2),
                     StatefulDataLoader(_Items(), batch_size=2, num_workers=2, persistent_workers=True,
                                        snapshot_every_n_steps=3)]
            for i, dl in enumerate(quiet):
                mgr.register_data_loader(dl, name=f"quiet{i}")
        text = [r.getMessage() for r in caplog.records if r.name == "cloudckpt.checkpoint.loaders"]
        assert text == [
            "exact resume: loader 'stream' has num_workers > 0 and an IterableDataset (_Stream): its workers' RNG "
            "states are not saved, so random ops in the dataset (augmentation with torch.rand*, random, numpy.random) "
            "draw other numbers after a resume than the uninterrupted run. Resumes repeat them for map-style "
            "datasets, or with num_workers=0, or when the dataset draws from a generator it saves in its own "
            "state_dict()",
            "exact resume: loader 'unordered' has in_order=False and num_workers > 0: torchdata gives no guarantee "
            "for the state of such a loader, so a resume may repeat or skip batches and random ops; use "
            "in_order=True (the default) to resume exactly"]
        # a map-style loader's iterators hand their workers the wrapped dataset; loader.dataset stays the user's
        dl = quiet[2]
        copied = copy.deepcopy(dl)  # before it runs: torch cannot copy a loader's live worker iterator
        assert type(dl.dataset) is _Items
        assert [b.tolist() for b in dl] == [[[0.0], [1.0]], [[2.0], [3.0]], [[4.0], [5.0]], [[6.0], [7.0]]]
        assert type(dl.dataset) is _Items
        assert type(dl._iterator._dataset) is loaders.WorkerRNGDataset
        worker_state = dl.state_dict()["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
        assert set(worker_state) == {exact_resume.WORKER_KEY}
        assert set(worker_state[exact_resume.WORKER_KEY]) == {"python", "torch", "numpy"}  # no CUDA in a worker
        first = dl._iterator  # a copy's iterators are the copy's, wrapped too
        assert [b.tolist() for b in copied] == [[[0.0], [1.0]], [[2.0], [3.0]], [[4.0], [5.0]], [[6.0], [7.0]]]
        assert dl._iterator is first and type(copied._iterator._dataset) is loaders.WorkerRNGDataset
    finally:
        mgr.close()


def test_the_worker_dataset_wraps_the_users_and_keeps_its_state():
    inner = _StatefulItems()
    ds = loaders.WorkerRNGDataset(inner)
    assert len(ds) == 8 and ds[2].tolist() == [2.0] and ds.__getitems__([1])[0].tolist() == [101.0]
    ds.start = 5  # a worker_init_fn setting get_worker_info().dataset.start sets it on the user's dataset
    assert inner.start == 5 and ds.n == 8
    assert not hasattr(loaders.WorkerRNGDataset(_Items()), "__getitems__")
    assert ds.state_dict() == {"dataset": {"pos": 3}}  # outside a worker: no RNG of its own to keep
    ds.load_state_dict({"dataset": {"pos": 4}})
    assert inner.loaded == {"pos": 4}
    ds.load_state_dict({"pos": 5})  # a state saved before cloudckpt kept worker RNGs: the dataset's own
    assert inner.loaded == {"pos": 5}
    again = pickle.loads(pickle.dumps(ds))  # spawn and forkserver workers get it pickled
    assert type(again) is loaders.WorkerRNGDataset and again.start == 5 and again[3].tolist() == [3.0]


class _Loader:
    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.loaded = state


@pytest.mark.parametrize("bad", [b"\x00" * 10, {"torch": torch.zeros(3, dtype=torch.uint8)}, "rng"],
                         ids=["bytes", "short-torch-state", "str"])
def test_a_crafted_worker_rng_state_is_refused_before_anything_is_restored(bad):
    good = exact_resume.capture_rng_state(cuda=False)
    loader_state = {"_snapshot": {"_worker_snapshots": {
        "worker_0": {"dataset_state": {exact_resume.WORKER_KEY: good}},
        "worker_1": {"dataset_state": {exact_resume.WORKER_KEY: bad}}}}}
    dl, saved = _Loader(), torch.get_rng_state()
    torch.manual_seed(1)
    before = torch.get_rng_state()
    with pytest.raises(CorruptCheckpoint, match=r"step7: the exact-resume state \(cloudckpt_resume\) is not"):
        exact_resume.restore({"rng": {"torch": saved}, "loaders": {"train": loader_state}}, {"train": dl},
                             same_world_size=True, where="step7")
    assert dl.loaded is None and torch.equal(torch.get_rng_state(), before)
