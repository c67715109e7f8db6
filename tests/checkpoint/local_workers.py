"""Ranks of the node-local tier tests (module level: spawned processes import them).

A run trains a sharded state (DTensors: each rank holds its own rows) with a
deterministic update per step, and checkpoints with the local tier: local steps
every 10, bucket steps every 20. Ranks are grouped 2 per "node" (LOCAL_WORLD_SIZE=2),
each node with its own folder ``{local}/node{n}``.
"""

from __future__ import annotations

import os
import signal

from cloudckpt import CheckpointConfig

from .workers import gathered, sharded_state


def _train_step(sd: dict, step: int) -> None:
    for t in (sd["model"]["w"], sd["model"]["b"], sd["optim"]["state"]["w"]["exp_avg"],
              sd["optim"]["state"]["w"]["exp_avg_sq"]):
        t.to_local().mul_(0.99).add_(0.001 * step)
    sd["optim"]["step"] = step


def config(save_folder: str, local: str, work: str, **kw) -> CheckpointConfig:
    opts = dict(save_folder=save_folder, local_dir=os.path.join(local, "node{node}"), local_save_interval=10,
                save_interval=20, keep_last_local=3, work_dir=work, exact_resume=False, collective_timeout=30)
    opts.update(kw)
    return CheckpointConfig(**opts)


def run(rank, world_size, save_folder, local, work, upto, cfg_kw=None, kill=None):
    """Resume (if anything is there), train up to step ``upto``; return what was
    resumed, the gathered state right after resume, and snapshots at every 10 steps.
    ``kill``: ``(step, rank, where)`` SIGKILLs that rank in the local save (``"save"``),
    in the copying (``"copy"``) or in the upload to the bucket (``"persist"``) of that step."""
    cfg = config(save_folder, local, work, **(cfg_kw or {}))
    if kill is not None:
        _arm(rank, *kill)
    mgr = cfg.build()
    sd = sharded_state(world_size, seed=0)
    ts = mgr.resume(sd)
    start = ts["step"] if ts else 0
    out = {"resumed_step": mgr.resumed_step, "resumed_from": mgr.resumed_from, "train_state": ts,
           "at_resume": _snapshot(sd), "recovery": dict(mgr.local.last_recovery), "snapshots": {}}
    for step in range(start + 1, upto + 1):
        _train_step(sd, step)
        mgr.maybe_save(step, sd, {"step": step, "rank": rank})
        if kill is not None and step == kill[0] - 1:
            mgr.wait()  # the previous local step is copied and persisted before the victim dies
        if step % 10 == 0 and kill is None:  # (a collective: not with a rank about to die)
            out["snapshots"][step] = _snapshot(sd)
    mgr.close()
    return out


def _snapshot(sd: dict) -> dict:
    """The gathered state as it is now: copies (the full tensor of a replicated DTensor is
    its local tensor itself, which the next training steps change in place)."""
    return {k: v.clone() for k, v in gathered(sd).items()}


def _arm(rank: int, step: int, victim: int, where: str) -> None:
    if rank != victim:
        return
    from cloudckpt.checkpoint import checkpointer, rank_writer
    from cloudckpt.checkpoint.local import exchange

    if where == "copy":
        real = exchange._recv_checked

        def dying_recv(coord, path, size, crc, src):
            if f"step{step}" in path:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(coord, path, size, crc, src)

        exchange._recv_checked = dying_recv
    elif where == "persist":
        real_upload = rank_writer.RankWriter.upload

        def dying_upload(self, ref, files):
            if f"step{step}" in ref.url:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_upload(self, ref, files)

        rank_writer.RankWriter.upload = dying_upload
    else:
        real_write = checkpointer.Checkpointer._write_local

        def dying_write(self, folder, state_dict, train_state=None):
            if f"step{step}" in folder:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(self, folder, state_dict, train_state)

        checkpointer.Checkpointer._write_local = dying_write


def file_pieces(rank: int, world_size: int, folder: str) -> dict:
    """Rank 0 sends a file in small pieces (CHUNK lowered to 1000 bytes, so the
    transfers are pipelined over several pieces of uneven last size) to rank 1: whole,
    a range from an offset into an existing file, and a size of one piece or less.
    Returns what rank 1 received and the CRC32C its ``on_chunk`` computed."""
    import google_crc32c

    from cloudckpt import dist

    coord = dist.Coordinator(timeout=30)
    coord.CHUNK = 1000
    src = os.path.join(folder, "src.bin")
    out: dict = {}
    for name, size, offset in [("whole", 10_500, 0), ("range", 4_321, 777), ("one", 1000, 0), ("small", 17, 3)]:
        if coord.rank == 0:
            coord.send_file(src, size, 1, offset=offset)
        else:
            dst = os.path.join(folder, f"dst-{name}.bin")
            crc = {"v": 0}

            def on_chunk(data, crc=crc) -> None:
                crc["v"] = google_crc32c.extend(crc["v"], bytes(data))
            if name == "range":
                with open(dst, "wb") as f:
                    f.write(b"\0" * (offset + size + 5))
                coord.recv_file(dst, size, 0, on_chunk=on_chunk, offset=offset)
            else:
                coord.recv_file(dst, size, 0, on_chunk=on_chunk)
            with open(dst, "rb") as f:
                out[name] = (f.read(), crc["v"])
    return out
