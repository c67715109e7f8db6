"""Workers of test_load_scale.py: the same per-rank state at any world size (each rank
holds 16 rows of every tensor: FSDP-style Shard(0) DTensors, plus replicated scalars),
saved, then loaded while counting what this rank reads, by kind of object."""

from __future__ import annotations

import pickle
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import loading

TENSORS, ROWS, COLS = 60, 16, 8


def state(world_size: int, zero: bool = False) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    sd: dict = {"model": {}, "optim": {}}
    for t in range(TENSORS):
        full = torch.zeros(world_size * ROWS, COLS) if zero else \
            torch.arange(world_size * ROWS * COLS, dtype=torch.float32).reshape(-1, COLS) + t
        sd["model"][f"layer{t}"] = distribute_tensor(full, mesh, [Shard(0)])
        sd["optim"][f"step{t}"] = torch.tensor(0 if zero else t)
    return sd


def save(rank, world_size, dir, work_dir):
    with Checkpointer(work_dir=work_dir) as ck:
        ck.save(dir, state(world_size))
    return {}


def _kind(url: str) -> str:
    name = url.rsplit("/step", 1)[1].split("/", 1)[1] if "/step" in url else url
    if name.startswith("index/rank"):
        return "index part"
    if name.startswith("manifest/rank"):
        return "manifest part"
    return {"index/header.json": "index header", ".metadata.json": "marker",
            "model_and_optim/.metadata": "dcp metadata"}.get(name, "shard" if name.endswith(".distcp") else name)


def load_counting(rank, world_size, dir, work_dir, with_build=False):
    """Load this rank's shard; report the small objects it read (GETs by kind), the
    shard ranges it read, and its CPU seconds for the load. ``with_build``: through
    ``Checkpointer.load_with``, the targets built once the metadata it hands over is
    checked (every saved key, its size and dtype; no chunks, no storage)."""
    from cloudckpt.storage import open_store

    cls = type(open_store(dir))
    real_get, real_range = cls.get_bytes, cls.open_range
    gets: dict[str, int] = {}
    got_bytes: dict[str, int] = {}

    def get_bytes(self, url, **kw):
        data = real_get(self, url, **kw)
        k = _kind(url)
        gets[k] = gets.get(k, 0) + 1
        got_bytes[k] = got_bytes.get(k, 0) + len(data)
        return data

    def open_range(self, url, *a, **kw):
        k = _kind(url)
        gets[k] = gets.get(k, 0) + 1
        return real_range(self, url, *a, **kw)

    cls.get_bytes, cls.open_range = get_bytes, open_range
    sd = state(world_size, zero=True)
    loaded = []  # the CommittedStep each load ran on: the marker as this rank holds it after planning
    real_load = loading.load

    def load(coord, engine, options, committed, *a, **kw):
        loaded.append(committed)
        return real_load(coord, engine, options, committed, *a, **kw)

    loading.load = load
    try:
        with Checkpointer(work_dir=work_dir) as ck:
            t = time.process_time()
            if with_build:
                seen = []

                def build(md):
                    seen.append({k: (tuple(v.size), v.properties.dtype, len(v.chunks)) if hasattr(v, "size")
                                 else None for k, v in md.state_dict_metadata.items()})
                    seen.append(len(md.storage_data))
                    return sd

                ck.load_with(dir, build)
            else:
                ck.load(dir, sd)
            cpu = time.process_time() - t
    finally:
        cls.get_bytes, cls.open_range = real_get, real_range
        loading.load = real_load
    (committed,) = loaded
    marker = committed.marker
    parts = marker.parts
    held = sorted(parts.held) if type(parts).__name__ == "WithheldParts" else None
    ok = all(torch.equal(sd["model"][f"layer{t}"].to_local(), state(world_size)["model"][f"layer{t}"].to_local())
             for t in range(TENSORS)) and all(int(sd["optim"][f"step{t}"]) == t for t in range(TENSORS))
    # what rank 0 handed this rank: the marker (part references withheld but those fetched) and the index header
    received = len(pickle.dumps(marker.withholding_parts())) if held is not None else len(pickle.dumps(marker))
    return {"gets": gets, "bytes": got_bytes, "cpu_s": cpu, "bitexact": ok, "parts_held": held,
            "received_marker_bytes": received, "built_from": seen if with_build else None}
