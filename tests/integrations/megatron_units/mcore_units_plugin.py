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
- ``MCORE_UNITS_STRATEGY=cloudckpt``: ``dist_checkpointing.save``, ``load``,
  ``load_tensors_metadata``, ``load_sharded_metadata`` and ``load_content_metadata`` (the
  package's and ``serialization``'s) become cloudckpt's (``cloudckpt.integrations.megatron``)
  whenever a call asks for the default ``torch_dist`` strategy (none given, Megatron's own
  ``TorchDistSave/LoadShardedStrategy`` with its default options, or ``("torch_dist", v)``),
  synchronously, with any ``strict``, and (for a load) on a folder cloudckpt committed;
  any other call (another strategy or ``separation_hint``, async, ``verify_integrity``, a
  ``process_group``, a folder cloudckpt did not write) goes to Megatron's own function
  and is counted as such. Arguments are bound by name against Megatron's own signature.
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
    import inspect

    from megatron.core.dist_checkpointing import serialization as ser
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    from cloudckpt.integrations import megatron as cm

    work = os.environ["MCORE_UNITS_WORK"]
    stock = {name: getattr(ser, name) for name in ("save", "load", "load_tensors_metadata", "load_sharded_metadata",
                                                   "load_content_metadata")}

    def args_of(name, args, kwargs) -> dict:  # every argument by name, as Megatron's own function takes them
        bound = inspect.signature(stock[name]).bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def default(strategy, cls) -> bool:
        if type(strategy) is cls:  # Megatron's own class with its default options
            return getattr(strategy, "separation_hint", None) is None
        return strategy is None or (type(strategy) is tuple and strategy[0] == "torch_dist")

    def ours(checkpoint_dir) -> bool:
        return checkpoint_dir is not None and os.path.exists(os.path.join(str(checkpoint_dir), ".metadata.json"))

    def save(*args, **kwargs):
        a = args_of("save", args, kwargs)
        if not default(a["sharded_strategy"], TorchDistSaveShardedStrategy) or a.get("common_strategy") is not None \
                or a["async_sharded_save"] or a.get("verify_integrity"):
            _count("megatron save")
            return stock["save"](*args, **kwargs)
        _count("cloudckpt save")
        cm.save(a["sharded_state_dict"], str(a["checkpoint_dir"]), step=0,
                validate_access_integrity=a["validate_access_integrity"], content_metadata=a["content_metadata"],
                preprocess_common_before_consistancy_check=a["preprocess_common_before_consistancy_check"],
                work_dir=work)
        return None

    def load(*args, **kwargs):
        a = args_of("load", args, kwargs)
        if not (ours(a["checkpoint_dir"]) and default(a["sharded_strategy"], TorchDistLoadShardedStrategy)
                and a.get("common_strategy") is None and not a.get("verify_integrity")
                and a.get("process_group") is None):
            _count("megatron load")
            return stock["load"](*args, **kwargs)
        _count("cloudckpt load")
        return cm.load(a["sharded_state_dict"], str(a["checkpoint_dir"]),
                       validate_access_integrity=a["validate_access_integrity"], strict=a["strict"], work_dir=work)

    def metadata(name):
        def read(*args, **kwargs):
            a = args_of(name, args, kwargs)
            if not (ours(a["checkpoint_dir"]) and default(a["sharded_strategy"], TorchDistLoadShardedStrategy)):
                _count("megatron load")
                return stock[name](*args, **kwargs)
            _count("cloudckpt load")
            return getattr(cm, name)(str(a["checkpoint_dir"]), work_dir=work)
        return read

    def load_content_metadata(checkpoint_dir=None, *, preloaded_state_dict=None):
        if preloaded_state_dict is not None or not ours(checkpoint_dir):
            return stock["load_content_metadata"](checkpoint_dir, preloaded_state_dict=preloaded_state_dict)
        _count("cloudckpt load")  # the common state alone: a load of no sharded values
        return cm.load({}, str(checkpoint_dir), work_dir=work).get("content_metadata")

    replaced = {"save": save, "load": load, "load_tensors_metadata": metadata("load_tensors_metadata"),
                "load_sharded_metadata": metadata("load_sharded_metadata"),
                "load_content_metadata": load_content_metadata}
    from megatron.core import dist_checkpointing as dc

    for mod in (dc, ser):  # the package and serialization export the entry points
        for name, fn in replaced.items():
            if hasattr(mod, name):
                setattr(mod, name, fn)


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
