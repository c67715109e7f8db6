"""What an ordinary rank receives at the end of a save does not grow with the job.

DCP's save ends by broadcasting what its finish step returns, the job's global
``Metadata`` (every item of every rank), to every rank (``_torch_compat.CoordinatorMetadata``
says where); only the coordinator uses it. Here, on real gloo ranks, the objects a rank
other than 0 receives through ``broadcast_object_list`` during a first and a repeated save
stay a few hundred bytes whatever the number of tensors, while rank 0's ``.metadata`` holds
every item and loads bit for bit with stock DCP."""

from __future__ import annotations

import os
import pickle

import torch

from cloudckpt.testing.multiprocess import run_ranks


def save_and_measure(rank, world_size, folder, work_dir, tensors):
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from cloudckpt import Checkpointer

    received: list[int] = []
    real = tdist.broadcast_object_list

    def spy(object_list, src=0, group=None, device=None, **kw):
        out = real(object_list, src=src, group=group, device=device, **kw)
        if tdist.get_rank() != src:
            received.append(len(pickle.dumps(object_list)))
        return out

    tdist.broadcast_object_list = spy
    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"model": {f"t{i}": distribute_tensor(torch.arange(8.0 * world_size) + i, mesh, [Shard(0)])
                    for i in range(tensors)}}
    try:
        with Checkpointer(work_dir=work_dir) as ck:
            for step in (1, 2):  # a first save, then a repeated one (DCP's plan cache answers)
                ck.save(f"{folder}/step{step}", sd)
    finally:
        tdist.broadcast_object_list = real
    return {"largest_received": max(received, default=0), "broadcasts": len(received)}


def test_an_ordinary_rank_receives_no_metadata_at_the_end_of_a_save(tmp_path):
    import torch.distributed.checkpoint as dcp

    small = run_ranks(2, save_and_measure, str(tmp_path / "a"), str(tmp_path / "wa"), 10)
    large = run_ranks(2, save_and_measure, str(tmp_path / "b"), str(tmp_path / "wb"), 400)
    for got in (small[1], large[1]):
        assert got["broadcasts"] > 0, "rank 1 took part in the saves' broadcasts"
    assert large[1]["largest_received"] < 2048, large[1]
    assert large[1]["largest_received"] <= small[1]["largest_received"] + 64, (small[1], large[1])
    md = dcp.FileSystemReader(os.path.join(tmp_path, "b", "step2", "model_and_optim")).read_metadata()
    assert type(md).__module__ == "torch.distributed.checkpoint.metadata" and len(md.state_dict_metadata) == 400
    sd = {"model": {f"t{i}": torch.zeros(16) for i in range(400)}}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(tmp_path, "b", "step2", "model_and_optim")),
             no_dist=True)
    assert all(torch.equal(sd["model"][f"t{i}"], torch.arange(16.0) + i) for i in range(400)), "stock DCP reads it"
