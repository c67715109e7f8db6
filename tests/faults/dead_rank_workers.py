"""Ranks of the dead-rank tests (test_dead_rank.py; module level: spawned processes
import them).

Every rank saves step 1, then one rank (the victim) is stopped at a chosen point of
the save of step 2 or of the load of step 1: SIGKILL (it dies) or SIGSTOP (it hangs).
It writes the wall-clock time of its end first. Every other rank (a survivor) writes
what it raised and when, waits until every survivor has written (so that no survivor's
exit closes a connection another one is still waiting on), and exits. A survivor then
tries the next save (step 3) on the same Checkpointer: refused at once.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

NUMEL = 32 * 1024  # 128 KiB per tensor


def state(step: int, rank: int, *, zero: bool = False) -> dict:
    """Rank ``rank``'s own tensors at ``step`` (nothing replicated: each rank reads back
    its own shard file only)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    w, m = torch.randn(NUMEL, generator=g), torch.rand(NUMEL // 2, generator=g)
    if zero:
        w, m = torch.zeros_like(w), torch.zeros_like(m)
    return {"model": {f"w{rank}": w}, "optim": {f"m{rank}": m}}


def _stop(out_dir: str, sig: str) -> None:
    with open(os.path.join(out_dir, "victim.json"), "w") as f:
        json.dump({"at": time.time(), "pid": os.getpid()}, f)
    os.kill(os.getpid(), getattr(signal, sig))


def _arm(phase: str, out_dir: str, sig: str) -> None:
    """Make this rank stop at ``phase``: ``write`` (inside DCP's write of step 2, before
    its data is written), ``agree`` (in AGREE, before it reports), ``read`` (in the load's
    read, after the read-once exchange's census)."""
    if phase == "write":
        from cloudckpt.dcp import writer

        def write_data(self, plan, planner):
            _stop(out_dir, sig)

        writer.UploadingWriter.write_data = write_data
    elif phase == "agree":
        from cloudckpt.checkpoint import saving

        def report(*a, **kw):
            _stop(out_dir, sig)

        saving._report = report
    elif phase == "read":
        from cloudckpt.dcp import reader

        def read_streamed(*a, **kw):
            _stop(out_dir, sig)

        reader.read_streamed = read_streamed
    else:
        raise ValueError(phase)


def run(rank, world_size, folder, work_dir, phase, victim, sig, timeout, out_dir):
    from cloudckpt import Checkpointer
    from cloudckpt.checkpoint import layout

    ck = Checkpointer(work_dir=work_dir, collective_timeout=timeout)
    ck.save(layout.step_dir(folder, 1), state(1, rank), {"step": 1, "rank": rank})
    if rank == victim:
        _arm(phase, out_dir, sig)
    t0 = time.monotonic()
    try:
        if phase == "read":
            ck.load(layout.step_dir(folder, 1), state(1, rank, zero=True))
        else:
            ck.save(layout.step_dir(folder, 2), state(2, rank), {"step": 2, "rank": rank})
        outcome = {"raised": None}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        outcome = {"raised": type(e).__name__, "message": str(e), "step": getattr(e, "step", None),
                   "where": getattr(e, "where", None), "gone": list(getattr(e, "gone", ())),
                   "timed_out": getattr(e, "timed_out", None),
                   "chain": [type(x).__name__ for x in _chain(e)]}
    outcome.update(at=time.time(), seconds=time.monotonic() - t0)
    if outcome["raised"]:  # the next save, on the spent group: refused at once
        t1 = time.monotonic()
        try:
            ck.save(layout.step_dir(folder, 3), state(3, rank), {"step": 3, "rank": rank})
            outcome["next"] = {"raised": None}
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcome["next"] = {"raised": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t1}
    tmp = os.path.join(out_dir, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(outcome, f)
    os.rename(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    survivors = [r for r in range(world_size) if r != victim]
    deadline = time.monotonic() + 2 * timeout + 30
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out_dir, f"rank{r}.json"))
                                                  for r in survivors):
        time.sleep(0.05)
    os._exit(0)  # the world lost a rank: skip tearing it down


def _chain(e: BaseException) -> list:
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out
