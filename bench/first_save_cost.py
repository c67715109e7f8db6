"""Per-rank and rank-0 CPU of a whole first save to a local folder: stock dcp.save
(DefaultSavePlanner, FileSystemWriter) against dcp.save with owners.OwnersSavePlanner,
a writer keeping its results, and .metadata assembled in the folder.
State: KEYS DTensor keys of (8, 16) float32 per rank (Shard(0)) + REPL replicated (16,).
Usage: .venv/bin/python -m bench.first_save_cost R [KEYS] [REPL]"""
import os
import shutil
import statistics
import sys
import tempfile
import time


def rank_fn(rank, world, keys, repl, reps, root):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.futures import Future

    from cloudckpt.dcp.assemble import TRAILER, header
    from cloudckpt.dcp.assemble_store import assemble_in_store
    from cloudckpt.dcp.owners import OwnersSavePlanner, fragment_of
    from cloudckpt.dist import Coordinator
    from cloudckpt.storage import open_store

    class Keeping(FileSystemWriter):
        def write_data(self, plan, planner):
            done = super().write_data(plan, planner)
            done.wait()
            self.results = done.value()
            out = Future()
            out.set_result([])
            return out
        def finish(self, metadata, results):
            pass

    mesh = init_device_mesh("cpu", (world,))
    state = {f"model.layers.{k}.w": DTensor.from_local(torch.ones(8, 16), mesh, [Shard(0)], run_check=False)
             for k in range(keys)}
    state.update({f"model.norm.{k}": DTensor.from_local(torch.ones(16), mesh, [Replicate()], run_check=False)
                  for k in range(repl)})
    coord = Coordinator(timeout=900)
    n = [0]

    def stock():
        n[0] += 1
        dcp.save(state, checkpoint_id=os.path.join(root, f"s{n[0]}"), process_group=coord.group)

    def owners():
        n[0] += 1
        folder = os.path.join(root, f"o{n[0]}")
        planner, writer = OwnersSavePlanner(coord), Keeping(folder)
        dcp.save(state, storage_writer=writer, planner=planner, process_group=coord.group)
        url = os.path.join(folder, ".metadata")
        assemble_in_store(coord, open_store(url), url, fragment_of(planner.owned, writer.results),
                          header=header(), trailer=TRAILER)

    res = {}
    for name, fn in (("stock dcp.save", stock), ("owners dcp.save", owners)):
        cpu, wall = [], []
        for _ in range(reps):
            coord.any_rank([False])
            t, w = time.process_time(), time.perf_counter()
            fn()
            cpu.append(time.process_time() - t)
            wall.append(time.perf_counter() - w)
        res[name] = (statistics.median(cpu), statistics.median(wall))
    return res


if __name__ == "__main__":
    from cloudckpt.testing.multiprocess import run_ranks
    R = int(sys.argv[1])
    keys = int(sys.argv[2]) if len(sys.argv) > 2 else 4000
    repl = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    root = tempfile.mkdtemp(prefix="save-cost-", dir="/tmp/h42")
    try:
        out = run_ranks(R, rank_fn, keys, repl, 2, root, timeout=3000)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name in ("stock dcp.save", "owners dcp.save"):
        cpus = [o[name][0] for o in out]
        print(f"R={R} {name}: rank0 CPU {cpus[0]:.2f}s | other ranks median CPU {statistics.median(cpus[1:]):.2f}s"
              f" | wall {out[0][name][1]:.2f}s")
