"""A tiny Megatron-core GPT trained with Megatron's DDP and optimizer, saved to a bucket.

Megatron's ``examples/run_simple_mcore_train_loop.py`` with Megatron's optimizer and
RNG state in the checkpoint, on CPU with gloo. The cloudckpt changes are the two lines
marked ``# cloudckpt``: ``cm.save``/``cm.load`` in place of ``dist_checkpointing.save``/
``load``, and the folder, a bucket URL. Resume finds the newest committed step with
``Checkpointer.latest_checkpoint`` (Megatron's training loop reads its tracker file).

Run one process per rank, as ``torchrun`` does (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT)::

    torchrun --nproc-per-node 2 train_gpt.py --save s3://bucket/run-7 --steps 6 --save-interval 2

Each rank prints ``step N loss L`` and, after each committed save, rank 0 prints
``COMMITTED N``. ``--step-seconds S``: each step lasts at least S seconds, as a real
model's would (a kill then lands inside a step, not after the last one). With ``--out
DIR`` each rank writes its losses, weights, optimizer state and RNG states at the end
to ``DIR/rank{R}.pt`` (the tests compare them).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

from cloudckpt import Checkpointer
from cloudckpt.errors import NotACheckpoint
from cloudckpt.integrations import megatron as cm

SEQ, BATCH, VOCAB, SEED = 16, 4, 64, 1234


def cpu_stand_ins() -> None:
    """Only because this runs on CPU (delete on GPUs): Megatron puts buffers and scalars on
    ``cuda``, and its tensor-parallel RNG tracker keeps CUDA generator states. Here the
    CPU generator plays the CUDA one: the tracker's ``fork()`` swaps its states in and out
    of it, so dropout in tensor-parallel regions draws from the tracker's stream."""
    from megatron.core.tensor_parallel import random as mrandom

    def on_cpu(fn):
        def call(*args, device=None, **kwargs):
            return fn(*args, device="cpu" if device is not None and "cuda" in str(device) else device, **kwargs)
        return call

    torch.tensor, torch.zeros = on_cpu(torch.tensor), on_cpu(torch.zeros)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda device=None: None  # the grad sync waits on no CUDA-graph event
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)  # "CPU RNG state changed within GPU RNG context"


def build(tp: int):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=tp, hidden_dropout=0.1, attention_dropout=0.1)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    # clip_grad=0: Megatron's clipping asserts CUDA grads; without gloo groups: each leaks threads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.0),
                                       [model], use_gloo_process_groups=False)
    return model, optimizer


def rng_state() -> ShardedObject:
    """Megatron's ``get_rng_state`` (megatron/training/checkpointing.py): python, numpy,
    torch and the tracker's states, one object per tensor-parallel rank."""
    state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
              "torch_rng_state": torch.get_rng_state(),
              "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]
    return ShardedObject("rng_state", state, (1, parallel_state.get_tensor_model_parallel_world_size()),
                         (0, parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank())


def set_rng_state(state: list) -> None:
    s = state[0]
    random.setstate(s["random_rng_state"])
    np.random.set_state(s["np_rng_state"])
    torch.set_rng_state(s["torch_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(s["rng_tracker_states"])


def sharded_state_dict(model, optimizer, iteration: int, *, is_loading: bool) -> dict:
    """Megatron's ``generate_state_dict``: model, optimizer, RNG, iteration."""
    model_sd = model.module.sharded_state_dict()  # the GPTModel inside DDP: keys without "module."
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
            "rng_state": rng_state(), "iteration": iteration, "checkpoint_version": 3.0}


def batch():
    """The step's micro-batch: tokens from numpy's RNG, the sequence length cut by python's."""
    tokens = torch.from_numpy(np.random.randint(0, VOCAB, (BATCH, SEQ + 1)))
    keep = random.randint(SEQ // 2, SEQ)
    tokens = tokens[:, :keep + 1]
    pos = torch.arange(keep).unsqueeze(0).expand(BATCH, keep)
    mask = torch.tril(torch.ones(1, 1, keep, keep)) < 0.5
    return tokens[:, :-1], pos, mask, tokens[:, 1:]


def train_step(model, optimizer) -> float:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, pos, mask, labels = batch()
    loss = model(tokens, pos, mask, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([model])  # the data-parallel all-reduce of the grads
    optimizer.step()
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-interval", type=int, required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out")
    ap.add_argument("--step-seconds", type=float, default=0.0)  # a real model's step time, at least
    a = ap.parse_args()
    cpu_stand_ins()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build(a.tp)
    dp_rank = parallel_state.get_data_parallel_rank()  # the data differs across data-parallel ranks only
    random.seed(SEED + dp_rank)
    np.random.seed(SEED + dp_rank)
    settings = {"work_dir": a.work} if a.work else {}

    iteration = 0
    try:
        latest = Checkpointer.latest_checkpoint(a.save)
    except NotACheckpoint:
        latest = None
    if latest is not None:
        state = cm.load(sharded_state_dict(model, optimizer, 0, is_loading=True), latest, **settings)  # cloudckpt
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng_state"])
        iteration = state["iteration"]
        print(f"RESUMED {iteration}", flush=True)

    losses = {}
    while iteration < a.steps:
        iteration += 1
        start = time.monotonic()
        losses[iteration] = train_step(model, optimizer)
        time.sleep(max(0.0, a.step_seconds - (time.monotonic() - start)))
        print(f"rank {rank} step {iteration} loss {losses[iteration]:.6f}", flush=True)
        if iteration % a.save_interval == 0:
            cm.save(sharded_state_dict(model, optimizer, iteration, is_loading=False),
                    f"{a.save}/step{iteration}", **settings)  # cloudckpt
            if rank == 0:
                print(f"COMMITTED {iteration}", flush=True)
    if a.out:  # what the tests compare, loadable with weights_only
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        os.makedirs(a.out, exist_ok=True)
        torch.save({"losses": losses, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": {"python": random.getstate(), "numpy": [name, torch.from_numpy(keys), pos, has_gauss, gauss],
                            "torch": torch.get_rng_state(),
                            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}},
                   os.path.join(a.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
