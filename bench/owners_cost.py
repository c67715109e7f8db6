"""Per-rank and rank-0 cost of a save's global planning: stock DCP (every local plan
gathered on rank 0, create_global_plan, plans scattered back) against owners.plan_by_owners.
State: KEYS DTensor keys per rank, each rank's shard (8, 16) float32 (Shard(0) of (8R, 16)),
plus REPL replicated keys.

    .venv/bin/python -m bench.owners_cost R [KEYS] [REPL]   # docs/performance.md: R = 2, 4, 8"""
import os
import statistics
import sys
import time
import tracemalloc


def rank_fn(rank, world, keys, repl, reps):
    import torch
    import torch.distributed as tdist
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from cloudckpt.dcp.owners import plan_by_owners
    from cloudckpt.dist import Coordinator

    mesh = init_device_mesh("cpu", (world,))
    state = {f"model.layers.{k}.w": DTensor.from_local(torch.ones(8, 16), mesh, [Shard(0)], run_check=False)
             for k in range(keys)}
    state.update({f"model.norm.{k}": DTensor.from_local(torch.ones(16), mesh, [Replicate()], run_check=False)
                  for k in range(repl)})
    coord = Coordinator(timeout=600)
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    planner.set_up_planner(state, None, rank == 0)
    local = planner.create_local_plan()
    g = coord.group

    def stock():
        # DCP's reduce_scatter("plan"): gather to rank 0, create_global_plan there, scatter back
        out = [None] * world if rank == 0 else None
        tdist.gather_object(local, out, dst=tdist.get_global_rank(g, 0), group=g)
        plans = planner.create_global_plan(out)[0] if rank == 0 else None
        box = [None]
        tdist.scatter_object_list(box, plans, src=tdist.get_global_rank(g, 0), group=g)
        return box[0]

    def owners():
        return plan_by_owners(coord, local, writer="lowest").plan

    res = {}
    for name, fn in (("stock", stock), ("owners", owners)):
        cpu = []
        for _ in range(reps):
            coord.any_rank([False])  # line up
            t = time.process_time()
            fn()
            cpu.append(time.process_time() - t)
        coord.any_rank([False])
        tracemalloc.start()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        res[name] = (statistics.median(cpu), peak)
    # .metadata: stock pickles the whole Metadata on rank 0; ours: each rank its fragment, joined in a folder
    import pickle
    import tempfile

    from torch.distributed.checkpoint.storage import WriteResult

    from cloudckpt._torch_compat import StorageInfo
    from cloudckpt.dcp.assemble import TRAILER, header
    from cloudckpt.dcp.assemble_store import assemble_in_store
    from cloudckpt.dcp.owners import fragment_of
    from cloudckpt.storage import open_store
    owned = plan_by_owners(coord, local, writer="lowest")
    results = [WriteResult(i.index, 64, StorageInfo(f"__{rank}_0.distcp", 512 * k, 512))
               for k, i in enumerate(owned.plan.items)]
    folder = coord.on_coordinator("tmp", lambda: tempfile.mkdtemp(prefix="owners-cost-", dir="/tmp/h42"))
    def stock_md():
        if rank == 0:
            out = [None] * world
        else:
            out = None
        tdist.gather_object(results, out, dst=tdist.get_global_rank(g, 0), group=g)
        if rank == 0:
            md = planner.metadata
            md.storage_data = {wr.index: wr.storage_data for rs in out for wr in rs}
            return len(pickle.dumps(md))
    n = [0]
    def ours():
        n[0] += 1
        url = os.path.join(folder, f"md{n[0]}")
        return assemble_in_store(coord, open_store(url), url, fragment_of(owned, results), header=header(),
                                 trailer=TRAILER).size
    planner.create_global_plan(coord.all_gather(local)) if False else None
    stock()  # rank 0's planner.metadata
    for name, fn in (("stock .metadata", stock_md), ("assembled .metadata", ours)):
        cpu = []
        for _ in range(reps):
            coord.any_rank([False])
            t = time.process_time()
            size = fn()
            cpu.append(time.process_time() - t)
        res[name] = (statistics.median(cpu), 0)
        if rank == 0:
            res[name + " bytes"] = size
    a = sorted((i.index.fqn, tuple(i.index.offset)) for i in stock().items)
    b = sorted((i.index.fqn, tuple(i.index.offset)) for i in owners().items)
    assert a == b
    res["received"] = coord.exchanged
    return res


if __name__ == "__main__":
    from cloudckpt.testing.multiprocess import run_ranks
    R = int(sys.argv[1])
    keys = int(sys.argv[2]) if len(sys.argv) > 2 else 4000
    repl = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    out = run_ranks(R, rank_fn, keys, repl, 3, timeout=1800)
    print("bytes of .metadata: stock", out[0]["stock .metadata bytes"],
          "assembled", out[0]["assembled .metadata bytes"])
    for name in ("stock", "owners", "stock .metadata", "assembled .metadata"):
        cpus = [o[name][0] for o in out]
        peaks = [o[name][1] for o in out]
        others = cpus[1:] or cpus
        print(f"R={R} {name:6s} rank0 CPU {cpus[0]:.3f}s peak {peaks[0]/2**20:.1f} MiB | other ranks median CPU "
              f"{statistics.median(others):.3f}s peak {statistics.median(peaks[1:] or peaks)/2**20:.1f} MiB")
