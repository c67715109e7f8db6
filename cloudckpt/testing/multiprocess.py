"""Run a function on N real processes with a gloo world (``spawn`` start method:
boto3 and fork do not mix). Used by tests and benchmarks.

    results = run_ranks(4, fn, arg1, env={"AWS_ENDPOINT_URL": ...})

``fn(rank, world_size, *args)`` must be importable (module-level). Returns the
list of per-rank return values; if any rank raises, :class:`RankFailed` carries
every rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))


def _worker(rank, world_size, init_file, out_dir, env, fn, args):
    os.environ.update(env or {})
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    from cloudckpt import dist

    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(rank, world_size, init_method=f"file://{init_file}")
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        with open(path, "wb") as f:
            pickle.dump(("ok", value), f)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        with open(path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        os._exit(1)


def run_ranks(world_size: int, fn, *args, env: dict | None = None, timeout: float = 300.0) -> list:
    """Run ``fn`` on ``world_size`` spawned processes joined in a gloo world."""
    with tempfile.TemporaryDirectory(prefix="cloudckpt-mp-") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, tmp, env, fn, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, failures = [], {}
        for r in range(world_size):
            try:
                with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                    status, value = pickle.load(f)
            except FileNotFoundError:
                status, value = "error", ("hung past the timeout" if r in hung
                                          else f"died with exit code {procs[r].exitcode}")
            if status == "ok":
                results.append(value)
            else:
                failures[r] = value
        if failures:
            raise RankFailed(failures)
        return results
