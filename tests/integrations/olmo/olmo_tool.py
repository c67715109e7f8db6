"""Drives the real OLMo-core (ai2-olmo-core 3.0.0) for tests/integrations/test_olmo_core.py.

Runs with the python of .venv-olmo (scripts/setup_olmo_venv.sh), never cloudckpt's:
this file imports olmo_core and torch only. The tests run each command in a process
forked from forkserver.py (torch and olmo_core imported once); it runs alike as a script.
Each command writes one JSON document to ``--out`` (and prints OLMo-core's own logs as it
runs).

    train FOLDER --work W --steps 4 --interval 2 [--fsdp]   OLMo-core's Trainer: a 1M-parameter
        OLMo2 model on random tokens, CPU, gloo; for 2 ranks run it as torch.distributed.run would
        (the tests fork its ranks with that environment: forkserver.py)
    truth STEP REF.pt        what OLMo-core itself reads back from STEP: unsharded model and
        optimizer (olmo_core.distributed.checkpoint.unshard_checkpoint) and every rank's train state
    save STEP REF.pt --seed S [--ephemeral]   OLMo-core's trainer Checkpointer.save of a small
        state dict (the same shape as the one the tests save with cloudckpt); REF.pt gets what was saved
    check FOLDER [--steps D ...] [--load STEP REF.pt ...]   OLMo-core's find_checkpoints (also
        filtered by ephemeral), latest_checkpoint, dir_is_checkpoint; and its Checkpointer.load of
        each STEP into zeros shaped like REF.pt, compared bit for bit (model, optim, extra, train state)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path


def load_reference(path) -> object:
    """A reference file these tests wrote themselves, or an OLMo-core train state:
    ``torch.load(weights_only=True)`` with numpy's RNG state (which OLMo-core's train
    state holds) admitted by exact name, as torch documents it. Runs in both venvs."""
    import numpy as np
    import torch

    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    extra = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), type(np.dtype(np.float64)),
             (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
             (core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct")]
    with torch.serialization.safe_globals(extra):
        return torch.load(path, weights_only=True)


def _synthetic(seed: int) -> tuple[dict, dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = {
        "model": {"layer.weight": torch.randn(8, 4, generator=g), "layer.bias": torch.randn(4, generator=g),
                  "emb.weight": torch.randn(16, 3, generator=g).to(torch.bfloat16)},
        "optim": {"state": {"layer.weight": {"step": torch.tensor(float(seed)),
                                             "exp_avg": torch.randn(8, 4, generator=g),
                                             "exp_avg_sq": torch.rand(8, 4, generator=g)}}},
        "extra": {"note": f"seed {seed}", "lr": 0.01 * seed},
    }
    return sd, {"step": seed, "tokens": [seed, seed * 2], "rng": torch.get_rng_state()}


class _Module:
    """The part of OLMo-core's TrainModule interface its Checkpointer calls."""

    def __init__(self, sd):
        self.sd = sd

    def state_dict_to_save(self):
        return self.sd

    def state_dict_to_load(self, metadata, optim=None):
        return self.sd

    def load_state_dict(self, sd):
        self.sd = sd


def _zeros_like(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    return None if not isinstance(tree, (list, tuple)) else type(tree)(_zeros_like(v) for v in tree)


def _bits(t):
    """A tensor's bytes (bit-exact comparison: -0.0 and NaN payloads included)."""
    return t.detach().reshape(-1).contiguous().view(__import__("torch").uint8) if t.numel() else t


def _diff(a, b, path="") -> list[str]:
    """Where two trees differ (tensors and numpy arrays bit for bit, dtype and shape included)."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(_bits(a), _bits(b))
        return [] if ok else [path or "<root>"]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        ok = isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
        return [] if ok else [path or "<root>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}" if path else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if (type(a) is type(b) and a == b) else [f"{path}: {a!r} != {b!r}"]


def cmd_train(a) -> dict:
    import numpy as np
    import torch
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
    from olmo_core.train.callbacks import CheckpointerCallback
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

    prepare_training_environment(seed=0, backend="gloo")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tok = TokenizerConfig(vocab_size=128, eos_token_id=0, pad_token_id=1)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    tokens = work / "tokens.npy"
    if rank == 0 and not tokens.exists():
        np.random.default_rng(0).integers(2, 128, size=64 * 200, dtype=np.uint16).tofile(tokens)
    torch.distributed.barrier()
    ds = NumpyFSLDatasetConfig(paths=[str(tokens)], sequence_length=32, tokenizer=tok,
                               work_dir=str(work / "ds")).build()
    model = TransformerConfig.olmo2_1M(vocab_size=128).build(init_device="cpu")
    dp = TransformerDataParallelConfig(name=DataParallelType.fsdp) if a.fsdp else None
    tm = TransformerTrainModuleConfig(rank_microbatch_size=4 * 32, max_sequence_length=32, optim=AdamWConfig(lr=1e-3),
                                      dp_config=dp).build(model, device=torch.device("cpu"))
    dl = NumpyDataLoaderConfig(global_batch_size=4 * 32 * world, seed=0, num_workers=0).build(ds)
    trainer = TrainerConfig(save_folder=a.folder, work_dir=str(work / "trainer"), max_duration=Duration.steps(a.steps),
                            device="cpu", metrics_collect_interval=1, cancel_check_interval=1).with_callback(
        "checkpointer", CheckpointerCallback(save_interval=a.interval, ephemeral_save_interval=None, save_async=False)
    ).build(tm, dl)
    trainer.fit()
    teardown_training_environment()
    return {"ok": True, "world_size": world, "global_step": trainer.global_step}


def cmd_truth(a) -> dict:
    import torch
    from cached_path import cached_path
    from olmo_core.distributed.checkpoint import unshard_checkpoint
    from olmo_core.io import list_directory

    with tempfile.TemporaryDirectory() as tmp:
        model_path, optim_path = unshard_checkpoint(f"{a.step}/model_and_optim", tmp, optim=True, quiet=True)
        ref = {"model": load_reference(model_path), "optim": load_reference(optim_path)}
    train = {}
    for path in list_directory(f"{a.step}/train"):
        name = os.path.basename(str(path))
        train[int(name[len("rank"):-len(".pt")])] = load_reference(cached_path(str(path), quiet=True))
    ref["train"] = train
    torch.save(ref, a.ref)
    return {"ok": True, "ranks": sorted(train)}


def cmd_save(a) -> dict:
    import torch
    from olmo_core.train.checkpoint import Checkpointer

    sd, ts = _synthetic(a.seed)
    Checkpointer(work_dir=Path(tempfile.mkdtemp())).save(a.step, _Module(sd), ts, ephemeral=a.ephemeral)
    sd, ts = _synthetic(a.seed)
    torch.save({"sd": sd, "train": ts}, a.ref)
    return {"ok": True}


def cmd_check(a) -> dict:
    from olmo_core.train.checkpoint import Checkpointer

    out: dict = {"ok": True, "found": [[s, str(p)] for s, p in Checkpointer.find_checkpoints(a.folder)]}
    try:
        out["latest"] = str(Checkpointer.latest_checkpoint(a.folder))
    except FileNotFoundError as e:
        out["latest"], out["latest_error"] = None, str(e)
    out["is_checkpoint"] = {d: Checkpointer.dir_is_checkpoint(d) for d in a.steps}
    try:  # OLMo-core parses its marker strictly (CheckpointMetadata) when it filters by ephemeral
        out["persistent"] = sorted(s for s, _ in Checkpointer.find_checkpoints(a.folder, ephemeral=False))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["persistent"], out["persistent_error"] = None, f"{type(e).__name__}: {e}"
    out["loads"] = {}
    for step, ref_path in a.load:
        ref = load_reference(ref_path)
        mod = _Module(_zeros_like(ref["sd"]))
        ts = Checkpointer(work_dir=Path(tempfile.mkdtemp())).load(step, mod, load_trainer_state=True)
        out["loads"][step] = _diff(mod.sd, ref["sd"]) + _diff(ts, ref["train"], "train")
    out["ok"] = not any(out["loads"].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("folder")
    t.add_argument("--work", required=True)
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--interval", type=int, default=2)
    t.add_argument("--fsdp", action="store_true")
    t = sub.add_parser("truth")
    t.add_argument("step")
    t.add_argument("ref")
    t = sub.add_parser("save")
    t.add_argument("step")
    t.add_argument("ref")
    t.add_argument("--seed", type=int, required=True)
    t.add_argument("--ephemeral", action="store_true")
    t = sub.add_parser("check")
    t.add_argument("folder")
    t.add_argument("--steps", nargs="*", default=[])
    t.add_argument("--load", nargs=2, action="append", default=[], metavar=("STEP", "REF"))
    a = ap.parse_args()
    try:
        res = globals()[f"cmd_{a.cmd}"](a)
    except Exception as e:  # noqa: BLE001 - the test reports it with the traceback
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(a.out).write_text(json.dumps(res, default=str))
    sys.exit(0 if res.get("ok") else 1)


if __name__ == "__main__":
    main()
