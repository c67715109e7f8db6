"""Module-level functions run on spawned ranks (they must be importable), and a small
launcher for jobs the tests kill -9."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback

import torch

from cloudckpt import Checkpointer
from cloudckpt.errors import CloudCkptError
from cloudckpt.storage import StorageOptions
from cloudckpt.transfer import TransferConfig

from . import checks


def save_and_load(rank, world_size, folder, work_dir, steps, storage, transfer):
    """Save ``steps`` then load each back; returns per-step save stats, whether every
    load was bit-exact, and this rank's log text."""
    logs = checks.LogCapture()
    ck = Checkpointer(work_dir=work_dir, storage_options=StorageOptions(**storage), transfer=TransferConfig(**transfer))
    stats = []
    for s in steps:
        ck.save(checks.step_dir(folder, s), checks.step_state(s, rank), {"step": s, "rank": rank})
        stats.append(dataclasses.asdict(ck.last_save_stats))
    exact = []
    for s in steps:
        sd = checks.zero_state(world_size, ranks=[rank])
        ts = ck.load(checks.step_dir(folder, s), sd)
        exact.append(checks.bitexact(sd, s, world_size, ranks=[rank]) and ts == {"step": s, "rank": rank})
    load_stats = ck.engine.stats()
    ck.close()
    return {"stats": stats, "exact": exact, "load_retries": load_stats.retries,
            "load_sdk_retries": load_stats.sdk_retries,
            "logs": logs.text()}


def stalled_save_then_recover(rank, world_size, folder, work_dir, storage, transfer):
    """Step 1's save meets a stalled upload (the proxy's rule); the training loop goes
    on (collectives on the training group); step 2's save must commit."""
    import torch.distributed as tdist

    logs = checks.LogCapture()
    ck = Checkpointer(work_dir=work_dir, storage_options=StorageOptions(**storage), transfer=TransferConfig(**transfer),
                      collective_timeout=60)
    t0 = time.monotonic()
    error = None
    try:
        ck.save(checks.step_dir(folder, 1), checks.step_state(1, rank), {"step": 1, "rank": rank})
    except CloudCkptError as e:
        error = f"{type(e).__name__}: {e}"
    failed_at = time.monotonic()  # CLOCK_MONOTONIC: comparable with the proxy's event times (same machine)
    for _ in range(5):  # the training loop goes on
        t = torch.ones(4)
        tdist.all_reduce(t)
        assert t[0].item() == world_size
    ck.save(checks.step_dir(folder, 2), checks.step_state(2, rank), {"step": 2, "rank": rank})
    sd = checks.zero_state(world_size, ranks=[rank])
    ck.load(checks.step_dir(folder, 2), sd)
    ck.close()
    return {"error": error, "failed_after": failed_at - t0, "failed_at": failed_at,
            "exact": checks.bitexact(sd, 2, world_size, ranks=[rank]),
            "logs": logs.text()}


def save_plain(rank, world_size, dir, work_dir, who):
    """One save of a state that says who wrote it; returns the error text or None."""
    ck = Checkpointer(work_dir=work_dir)
    try:
        ck.save(dir, {"model": {"x": torch.full((256, 256), float(who))}}, {"who": who})
        return None
    except CloudCkptError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ck.close()


# ------------------------------------------------------------------ kill -9 jobs
def save_loop(rank, world_size, folder, work_dir, mode, steps, numel, progress_dir, ready_after_first=True):
    """Save ``steps`` one after another (``mode``: "sync" or "async"), recording in
    ``progress_dir`` when each save returned (sync) or its future resolved (async).
    ``ready{rank}`` appears when the first save committed (``ready_after_first``) or at once."""
    ck = Checkpointer(work_dir=work_dir, collective_timeout=15)
    if ready_after_first:
        s = steps[0]
        ck.save(checks.step_dir(folder, s), checks.step_state(s, rank, numel=numel), {"step": s, "rank": rank})
        _mark(progress_dir, rank, s)
        steps = steps[1:]
    open(os.path.join(progress_dir, f"ready{rank}"), "w").close()
    futures = []
    for s in steps:
        state = checks.step_state(s, rank, numel=numel)
        d = checks.step_dir(folder, s)
        if mode == "sync":
            ck.save(d, state, {"step": s, "rank": rank})
            _mark(progress_dir, rank, s)
        else:
            f = ck.save_async(d, state, {"step": s, "rank": rank})
            f.add_done_callback(lambda f, s=s: f.exception() is None and _mark(progress_dir, rank, s))
            futures.append(f)
            with torch.no_grad():  # training goes on: the live state changes under the staged copy
                for v in state["model"].values():
                    v.add_(1.0)
    ck.close()


def _mark(progress_dir: str, rank: int, step: int) -> None:
    with open(os.path.join(progress_dir, f"done{rank}"), "a") as f:
        f.write(f"{step}\n")


def _job_rank(rank, world_size, init_file, env, fn, args):
    os.environ.update(env)
    # a killed job's survivors print gloo errors: keep them in a file, not in the test output
    log = os.open(os.path.join(os.path.dirname(init_file), f"rank{rank}.stderr"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 2)
    from cloudckpt import dist

    try:
        dist.init_process_group(rank, world_size, init_method=f"file://{init_file}", timeout=60)
        fn(rank, world_size, *args)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - a rank of a killed job: its error is expected
        traceback.print_exc()
        os._exit(1)


class Job:
    """``world_size`` spawned ranks running ``fn``; the test kills them like a scheduler.
    Started as ``run_ranks`` starts its ranks: in the suite, forked from the warm
    forkserver and made what a spawned rank is (tests/warm_ranks.py); each is still a
    process of its own, killed and reaped like one."""

    def __init__(self, world_size: int, fn, *args, env: dict, tmp: str):
        from cloudckpt.testing import multiprocess

        ctx = multiprocess.mp.get_context("spawn")
        init = os.path.join(tmp, "init")
        self.procs = [ctx.Process(target=_job_rank, args=(r, world_size, init, env, fn, args), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def kill(self, rank: int) -> None:
        p = self.procs[rank]
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert not p.is_alive(), f"rank {rank} (pid {p.pid}) is still alive 10 s after SIGKILL"

    def kill_all(self) -> None:
        for r in range(len(self.procs)):
            self.kill(r)

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return not any(p.is_alive() for p in self.procs)


def prune_all(rank, world_size, folder, progress_dir):
    """Prune to the newest persistent and newest ephemeral step (to be killed part-way)."""
    from cloudckpt.checkpoint import retention

    open(os.path.join(progress_dir, f"ready{rank}"), "w").close()
    retention.prune(folder, retention.Policy(keep_last_ephemeral=1, max_checkpoints=1))


def gc_all(rank, world_size, folder, progress_dir):
    """Garbage-collect every uncommitted step folder (to be killed part-way)."""
    from cloudckpt.checkpoint import retention

    open(os.path.join(progress_dir, f"ready{rank}"), "w").close()
    retention.gc(folder, older_than=0)
