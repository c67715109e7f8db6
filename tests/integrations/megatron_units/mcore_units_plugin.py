"""pytest plugin: Megatron-core's own ``tests/unit_tests/dist_checkpointing`` on CPU with gloo,
with Megatron's stock ``torch_dist`` save/load or with cloudckpt's in their place.

Loaded by ``run_units.py`` (``-p mcore_units_plugin --noconftest``) in each rank's pytest
process (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT`` set by the runner). Megatron's
own conftest files are not loaded (the top one downloads test data); the fixtures the
dist_checkpointing tests use are defined here. What it changes, and nothing else:

- CPU: ``torch.cuda.set_device`` and ``torch.cuda.synchronize`` do nothing,
  ``torch.cuda.current_device()`` is the CPU; ``Utils.initialize_distributed`` (Megatron's
  test helper) starts gloo on 127.0.0.1 instead of NCCL; ``parallel_state.initialize_model_parallel``
  defaults to ``create_gloo_process_groups=False``; after each test every process group
  but the default one is destroyed (each gloo group keeps threads: without this a rank
  leaks hundreds); Python 3.11 gets ``typing.override`` (Megatron's training package,
  which the tests' helpers import, uses the 3.12 name).
- ``MCORE_UNITS_STRATEGY=cloudckpt``: ``dist_checkpointing.save`` and ``load`` (the package's
  and ``serialization``'s) become cloudckpt's (``cloudckpt.integrations.megatron``) whenever a
  call asks for the default ``torch_dist`` strategy (none given, Megatron's own
  ``TorchDistSave/LoadShardedStrategy``, or ``("torch_dist", v)``) synchronously with the
  default strictness, and ``load_tensors_metadata`` and ``load_content_metadata`` read a
  cloudckpt step through cloudckpt;
  any other call (another strategy, async, ``common_strategy``, another strictness, a
  folder cloudckpt did not write) goes to Megatron's own function and is counted as such.
- Each rank writes ``$MCORE_UNITS_OUT/rank{R}.json``: per test, its outcome and how many
  saves and loads went through cloudckpt and through Megatron's own functions.
"""

from __future__ import annotations

import collections
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest

RANK = int(os.environ.get("RANK", "0"))
OURS = os.environ.get("MCORE_UNITS_STRATEGY", "stock") == "cloudckpt"
_CALLS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_OUTCOMES: dict[str, str] = {}
_current = [""]


def _cpu() -> None:
    import typing

    import torch
    import typing_extensions

    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: torch.device("cpu")


def _gloo() -> None:
    import megatron.core.parallel_state as ps
    import torch
    import torch.distributed as dist
    from tests.unit_tests.test_utilities import Utils

    def initialize_distributed():
        if not dist.is_initialized() and Utils.rank >= 0:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                    rank=Utils.rank, world_size=Utils.world_size,
                                    timeout=timedelta(seconds=float(os.environ.get("MCORE_UNITS_PG_TIMEOUT", "120"))))
        Utils.inited = True

    Utils.initialize_distributed = staticmethod(initialize_distributed)
    stock = ps.initialize_model_parallel

    def initialize_model_parallel(*args, **kwargs):
        kwargs.setdefault("create_gloo_process_groups", False)
        return stock(*args, **kwargs)

    ps.initialize_model_parallel = initialize_model_parallel
    del torch


def _count(kind: str) -> None:
    _CALLS[_current[0]][kind] += 1


def _install_cloudckpt() -> None:
    """Megatron's entry points replaced as the module docstring says."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import serialization as ser
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from cloudckpt.integrations import megatron as cm

    work = os.environ["MCORE_UNITS_WORK"]
    stock_save, stock_load, stock_metadata = ser.save, ser.load, ser.load_tensors_metadata

    def default(strategy, cls) -> bool:
        return strategy is None or type(strategy) is cls or (type(strategy) is tuple and strategy[0] == "torch_dist")

    def ours(checkpoint_dir) -> bool:
        return os.path.exists(os.path.join(str(checkpoint_dir), ".metadata.json"))

    def save(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
             validate_access_integrity=True, async_sharded_save=False,
             preprocess_common_before_consistancy_check=None, content_metadata=None):
        if not default(sharded_strategy, TorchDistSaveShardedStrategy) or common_strategy is not None \
                or async_sharded_save:
            _count("megatron save")
            return stock_save(sharded_state_dict, checkpoint_dir, sharded_strategy, common_strategy,
                              validate_access_integrity, async_sharded_save,
                              preprocess_common_before_consistancy_check, content_metadata)
        _count("cloudckpt save")
        cm.save(sharded_state_dict, str(checkpoint_dir), step=0, validate_access_integrity=validate_access_integrity,
                content_metadata=content_metadata,
                preprocess_common_before_consistancy_check=preprocess_common_before_consistancy_check, work_dir=work)
        return None

    def load(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
             validate_access_integrity=True, strict=StrictHandling.ASSUME_OK_UNEXPECTED):
        if not (ours(checkpoint_dir) and default(sharded_strategy, TorchDistLoadShardedStrategy)
                and common_strategy is None and strict == StrictHandling.ASSUME_OK_UNEXPECTED):
            _count("megatron load")
            return stock_load(sharded_state_dict, checkpoint_dir, sharded_strategy, common_strategy,
                              validate_access_integrity, strict)
        _count("cloudckpt load")
        return cm.load(sharded_state_dict, str(checkpoint_dir), validate_access_integrity=validate_access_integrity,
                       work_dir=work)

    def load_tensors_metadata(checkpoint_dir, sharded_strategy=None):
        if not ours(checkpoint_dir):
            _count("megatron load")
            return stock_metadata(checkpoint_dir, sharded_strategy)
        _count("cloudckpt load")
        strategy = cm.CloudLoadStrategy(work_dir=work)
        try:
            return strategy.load_tensors_metadata(str(checkpoint_dir))
        finally:
            strategy.close()

    stock_content = ser.load_content_metadata

    def load_content_metadata(checkpoint_dir=None, *, preloaded_state_dict=None):
        if preloaded_state_dict is not None or not ours(checkpoint_dir):
            return stock_content(checkpoint_dir, preloaded_state_dict=preloaded_state_dict)
        _count("cloudckpt load")  # the common state alone: a load of no sharded values
        return cm.load({}, str(checkpoint_dir), work_dir=work).get("content_metadata")

    for mod in (dc, ser):
        mod.save, mod.load, mod.load_tensors_metadata = save, load, load_tensors_metadata
        mod.load_content_metadata = load_content_metadata


def pytest_configure(config) -> None:
    _cpu()
    _gloo()
    if OURS:
        _install_cloudckpt()


# ---------------------------------------------------------------- the fixtures of Megatron's conftest files
@pytest.fixture(scope="session", autouse=True)
def disable_msc():
    from megatron.core.msc_utils import MultiStorageClientFeature

    MultiStorageClientFeature.disable()
    yield


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt() -> Path:
    """One folder shared by the ranks (the runner's)."""
    return Path(os.environ["MCORE_UNITS_SHARED"])


@pytest.fixture(scope="class")
def tmp_dir_per_class(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(autouse=True)
def destroy_subgroups(request):
    _current[0] = request.node.nodeid
    yield
    import megatron.core.parallel_state as ps
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    ps.destroy_model_parallel()
    if dist.is_initialized():
        world = c10d._get_default_group()
        for pg in list(c10d._world.pg_map):
            if pg is not world:
                dist.destroy_process_group(pg)


# ---------------------------------------------------------------- the report
def pytest_runtest_logreport(report) -> None:
    was = _OUTCOMES.get(report.nodeid)
    if report.failed:
        _OUTCOMES[report.nodeid] = "failed"
    elif report.skipped and was != "failed":
        _OUTCOMES[report.nodeid] = "skipped"
    elif report.when == "call" and was is None:
        _OUTCOMES[report.nodeid] = "passed"


def pytest_sessionfinish(session, exitstatus) -> None:
    out = os.environ.get("MCORE_UNITS_OUT")
    if out:
        tests = {k: {"outcome": v, "calls": dict(_CALLS.get(k, {}))} for k, v in _OUTCOMES.items()}
        Path(out, f"rank{RANK}.json").write_text(json.dumps({"strategy": "cloudckpt" if OURS else "stock",
                                                             "tests": tests}, indent=1))
