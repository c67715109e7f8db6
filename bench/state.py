"""The benchmark's training state and per-rank measurements, with torch only
(no cloudckpt import), so the peer scripts in their own venvs use the same code.

State: a transformer-like model of ``layers`` blocks (two d x d matrices, a bias
and a norm each) with Adam state (``exp_avg``, ``exp_avg_sq`` and a ``step``
tensor per parameter), every tensor a ``Shard(0)`` DTensor over the ranks (as
FSDP2 gives), in the shape of ``torch.distributed.checkpoint.state_dict``:
``{"model": {fqn: DTensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}}``.
``total_bytes`` = 3 x the parameter bytes (params + two moments), fp32.

Memory is measured from ``/proc/self/status``: ``reset_peak()`` clears the
kernel's high-water mark (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) so
``peak_rss()`` afterwards is the peak since the reset, not since process start.
"""

from __future__ import annotations

import math
import time

import torch

from bench.common import MiB


def plan_layers(total_bytes: int, d: int | None = None) -> tuple[int, int]:
    """(layers, d) so that 3 x fp32 params of ``layers`` blocks of 2*d*d + 2*d is about ``total_bytes``."""
    if d is None:
        d = 2048 if total_bytes >= 256 * MiB else 256
    per_layer = 3 * 4 * (2 * d * d + 2 * d)
    return max(1, round(total_bytes / per_layer)), d


def _fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t.normal_(generator=g)
    return t


def build_state(world_size: int, total_bytes: int, *, zero: bool = False, mesh=None) -> dict:
    """This rank's view of the sharded state (DTensors over a 1-D CPU mesh of all ranks).
    ``zero=True`` builds the same structure filled with zeros (a load target)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = mesh or init_device_mesh("cpu", (world_size,))
    rank = mesh.get_local_rank()
    layers, d = plan_layers(total_bytes)
    shapes = {}
    for i in range(layers):
        shapes[f"layers.{i}.w1"] = (d, d)
        shapes[f"layers.{i}.w2"] = (d, d)
        shapes[f"layers.{i}.bias"] = (d,)
        shapes[f"layers.{i}.norm"] = (d,)

    def dt(shape, seed):
        # the local shard of a Shard(0) DTensor, made locally (no full tensor, no scatter)
        rows = shape[0]
        per = math.ceil(rows / world_size)
        lo, hi = min(rows, rank * per), min(rows, (rank + 1) * per)
        local_shape = (hi - lo,) + tuple(shape[1:])
        local = torch.zeros(local_shape) if zero else _fill(torch.empty(local_shape), seed * 1000 + rank)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    model, ostate = {}, {}
    for k, (name, shape) in enumerate(shapes.items()):
        model[name] = dt(shape, 3 * k + 1)
        ostate[name] = {"step": torch.tensor(0.0 if zero else 100.0),
                        "exp_avg": dt(shape, 3 * k + 2), "exp_avg_sq": dt(shape, 3 * k + 3)}
        if not zero:
            ostate[name]["exp_avg_sq"].to_local().abs_()
    groups = [{"lr": 0.0 if zero else 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
               "params": list(shapes)}]
    return {"model": model, "optim": {"state": ostate, "param_groups": groups}}


def local_tensors(sd) -> list[torch.Tensor]:
    out = []

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, torch.Tensor):
            out.append(x.to_local() if hasattr(x, "to_local") else x)

    walk(sd)
    return out


def local_bytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(sd))


def fingerprint(sd) -> float:
    """A cheap content check: the float64 sum of every local element (no copies)."""
    return float(sum(t.sum(dtype=torch.float64).item() for t in local_tensors(sd)))


def full_fingerprint(sd) -> float:
    """The fingerprint of the whole (global) state, for comparing across world sizes."""
    import torch.distributed as dist

    s = torch.tensor([fingerprint(sd)], dtype=torch.float64)
    # the step tensors are replicated on every rank: count them once
    steps = sum(float(v["step"]) for v in sd["optim"]["state"].values())
    if dist.is_initialized():
        dist.all_reduce(s)
        s -= steps * (dist.get_world_size() - 1)
    return float(s.item())


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return _status("VmRSS")


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process. False if not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    return _status("VmHWM")


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def max_over_ranks(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sum_over_ranks(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return float(t.item())


def trim_malloc() -> None:
    """Give freed heap memory back to the OS (glibc), so a baseline RSS is honest."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
