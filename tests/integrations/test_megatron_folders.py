"""Megatron's own ``torch_dist`` folders read and imported (cloudckpt/integrations/megatron_folders.py).

The source folder is written by Megatron-core's own ``dist_checkpointing.save`` (0.19.2,
.venv-megatron, 2 gloo ranks on CPU, its default torch_dist strategy: its ``.metadata``
holds the ranks' pickled SavePlans) through tests/integrations/megatron/mcore_tool.py,
once per module, as ``run/iter_0000010``; the tracker beside it is written here (Megatron-LM's
training loop writes it, ``dist_checkpointing.save`` does not). What is proved:

- ``import_run`` commits it to SeaweedFS as ``iter_0000010`` (``cloudckpt verify`` OK), writes
  the destination's tracker after the commit, and every tensor and byte item of a download
  of the step equals the source's bit for bit;
- cloudckpt's Megatron loader (``integrations.megatron.load``, 2 ranks) loads the imported
  step into Megatron's sharded state dict exactly; Megatron's own loader reads the step's
  ``model_and_optim/`` folder (Megatron's ``metadata.json`` is kept);
- discovery: an iteration folder without Megatron's ``metadata.json`` (a save that did not
  finish) is never found, even when the tracker names it; the tracker is read as Megatron
  writes it (a number or ``release``) and anything else is refused;
- a legacy ``common.pt`` (older torch_dist checkpoints) becomes the ``common_state`` item,
  as Megatron's own loader reads it.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cloudckpt.errors import CorruptCheckpoint, NotACheckpoint, UnsafeCheckpoint
from cloudckpt.integrations import megatron_folders as mf

from .test_megatron import mcore, mcore_pool, megatron_python  # noqa: F401 - fixtures used by name

ITER = "iter_0000010"


@pytest.fixture(scope="module")
def stock_run(mcore_pool, tmp_path_factory) -> Path:  # noqa: F811 - the fixture imported above
    """A save folder holding Megatron's own save of mcore_tool's state dict (2 ranks) as iteration 10."""
    tmp = tmp_path_factory.mktemp("stock")
    run = tmp / "run"
    mcore(mcore_pool, tmp, "save", str(run / ITER), "--stock", "--world", "2")
    (run / mf.TRACKER).write_text("10")
    return run


def _expected_tensors() -> dict:
    a = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 7
    f = a.flip(0) * 3
    return {"a": a, "b": torch.linspace(-1, 1, 5, dtype=torch.float64), "f.h0": f[:, :2], "f.h1": f[:, 2:]}


def test_read_iteration_gives_megatrons_tensors_whole_and_its_objects_as_plain_data(stock_run):
    sd = mf.read_iteration(stock_run / ITER)
    for k, t in _expected_tensors().items():
        assert sd[k].dtype == t.dtype and torch.equal(sd[k], t), k
    assert sd["common_state/shard_0_1"] == [{"iteration": 7}]
    assert sd["obj/shard_0_2"] == [{"saved_by": 0, "words": []}]
    assert sd["obj/shard_1_2"] == [{"saved_by": 1, "words": ["x"]}]


def test_megatron_own_save_imported_to_s3_is_bit_exact_and_both_loaders_read_it(mcore_pool, stock_run,  # noqa: F811
                                                                                 s3_bucket, tmp_path):
    dest = f"{s3_bucket}/imported"
    done = mf.import_run(stock_run, dest, work_dir=str(tmp_path / "work"))
    assert [(i.url, i.iteration, i.skipped) for i in done] == [(f"{dest}/{ITER}", 10, ())]
    assert mf.read_tracker(dest) == 10
    assert [(i.iteration, i.kind) for i in mf.find_iterations(dest)] == [(10, "cloudckpt")]
    assert mf.import_run(stock_run, dest, work_dir=str(tmp_path / "work")) == []  # committed: kept, not redone
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "verify", f"{dest}/{ITER}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr

    r = subprocess.run([sys.executable, "-m", "cloudckpt", "download", f"{dest}/{ITER}", str(tmp_path / "dl")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    folder = tmp_path / "dl" / "step10" / "model_and_optim"
    src, back = (mf._read(mf._open(str(p), None), raw=True) for p in (stock_run / ITER, folder))
    assert src.keys() == back.keys() and len(src) == 7
    for k, v in src.items():
        if isinstance(v, io.BytesIO):
            assert v.getvalue() == back[k].getvalue(), k
        else:
            assert v.dtype == back[k].dtype and torch.equal(v, back[k]), k

    assert "LOADED OK" in mcore(mcore_pool, tmp_path, "load", f"{dest}/{ITER}", "--world", "2")
    assert "LOADED OK" in mcore(mcore_pool, tmp_path, "load", str(folder), "--stock", "--world", "1",
                                saved_world=2)


def _copy_iteration(run: Path, src: Path, n: int, *, committed: bool) -> Path:
    dst = run / mf.iteration_name(n)
    shutil.copytree(src, dst)
    if not committed:
        os.remove(dst / "metadata.json")
    return dst


def test_an_iteration_without_megatrons_metadata_json_is_never_found_even_when_the_tracker_names_it(stock_run,
                                                                                                    tmp_path, caplog):
    run = tmp_path / "run"
    _copy_iteration(run, stock_run / ITER, 10, committed=True)
    _copy_iteration(run, stock_run / ITER, 20, committed=False)  # a save killed before its commit
    (run / "iter_12").mkdir()  # not Megatron's spelling: ignored
    (run / mf.TRACKER).write_text("20")
    assert [(i.iteration, i.kind) for i in mf.find_iterations(run)] == [(10, "megatron")]
    assert mf.latest_iteration(run).iteration == 10
    assert "the tracker names 20" in caplog.text
    with pytest.raises(NotACheckpoint, match=r"no committed Megatron iteration \[20\]"):
        mf.import_run(run, str(tmp_path / "dest"), iterations=[20], work_dir=str(tmp_path / "work"))
    done = mf.import_run(run, str(tmp_path / "dest"), iterations="latest", work_dir=str(tmp_path / "work"))
    assert [i.iteration for i in done] == [10] and mf.read_tracker(tmp_path / "dest") == 10


@pytest.mark.parametrize("text,want", [("10", 10), ("release\n", "release"), (" 0000042 ", 42)])
def test_the_tracker_is_read_as_megatron_writes_it(tmp_path, text, want):
    (tmp_path / mf.TRACKER).write_text(text)
    assert mf.read_tracker(tmp_path) == want


@pytest.mark.parametrize("text,error", [("10; rm -rf /", CorruptCheckpoint), ("-3", CorruptCheckpoint),
                                        ("9" * 40, CorruptCheckpoint), ("1" * 100, UnsafeCheckpoint)])
def test_a_tracker_that_is_not_an_iteration_is_refused(tmp_path, text, error):
    (tmp_path / mf.TRACKER).write_text(text)
    with pytest.raises(error):
        mf.read_tracker(tmp_path)
    assert mf.read_tracker(tmp_path / "nothing") is None


def test_a_legacy_common_pt_becomes_the_common_state_item_as_megatron_reads_it(stock_run, tmp_path):
    src = _copy_iteration(tmp_path / "run", stock_run / ITER, 3, committed=True)
    torch.save({"iteration": 3, "args": {"lr": 0.5}}, src / "common.pt")
    (src / "run_config.yaml").write_text("a: 1\n")  # Megatron-Bridge's: not imported, and named
    assert mf.read_iteration(src)["common_state/shard_0_1"] == [{"iteration": 3, "args": {"lr": 0.5}}]
    done = mf.import_iteration(src, str(tmp_path / "dest" / "iter_0000003"), work_dir=str(tmp_path / "work"))
    assert done.skipped == ("run_config.yaml",) and done.iteration == 3
    back = mf.read_iteration(tmp_path / "dest" / "iter_0000003" / "model_and_optim")
    assert back["common_state/shard_0_1"] == [{"iteration": 3, "args": {"lr": 0.5}}]


def test_a_common_pt_that_is_not_plain_data_is_refused_and_nothing_is_committed(stock_run, tmp_path):
    src = _copy_iteration(tmp_path / "run", stock_run / ITER, 4, committed=True)
    torch.save({"fn": os.system}, src / "common.pt")
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system"):
        mf.import_iteration(src, str(tmp_path / "dest" / "iter_0000004"), work_dir=str(tmp_path / "work"))
    assert not (tmp_path / "dest" / "iter_0000004" / ".metadata.json").exists()


def test_a_megatron_run_in_a_bucket_is_found_and_imported_from_there(stock_run, s3_bucket, tmp_path):
    from cloudckpt.storage import Location

    src = f"{s3_bucket}/megatron-run"
    store = Location.of(src).store
    for f in sorted((stock_run / ITER).iterdir()):
        store.put_bytes(f"{src}/{ITER}/{f.name}", f.read_bytes())
    store.put_bytes(f"{src}/{mf.TRACKER}", b"10")
    assert mf.read_tracker(src) == 10 and [(i.iteration, i.kind) for i in mf.find_iterations(src)] == [(10, "megatron")]
    done = mf.import_run(src, f"{s3_bucket}/imported-from-bucket", work_dir=str(tmp_path / "work"))
    assert [i.iteration for i in done] == [10]
    back = mf.read_iteration(f"{s3_bucket}/imported-from-bucket/{ITER}/model_and_optim")
    for k, t in _expected_tensors().items():
        assert torch.equal(back[k], t), k
