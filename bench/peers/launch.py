"""Run one benchmark case on N spawned gloo ranks and print its JSON result.

Used two ways, with the same rank code (``bench.ranks.run_case``):
- by a peer's own venv python, as a script (cloudckpt is not installed there)::

      .venv-bench-olmo/bin/python bench/peers/launch.py --tool olmo --op save \\
          --url s3://bench/olmo/rep0 --bytes 1073741824 --ranks 2 --out result.json

- by ``bench/run.py`` for cloudckpt itself, through
  ``cloudckpt.testing.multiprocess.run_ranks`` in the main venv.

The launcher mirrors ``run_ranks`` (spawn start method, file:// rendezvous,
per-rank pickled outcome) so every tool is started and timed the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _worker(rank, world_size, init_file, out_dir, args):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        import torch.distributed as dist

        from bench.ranks import run_case

        dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"file://{init_file}")
        try:
            value = run_case(rank, world_size, args)
        finally:
            dist.destroy_process_group()
        with open(path, "wb") as f:
            pickle.dump(("ok", value), f)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        with open(path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        os._exit(1)


def spawn(world_size: int, args: dict, timeout: float) -> list:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="cloudckpt-bench-mp-") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, tmp, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        out, failures = [], {}
        for r in range(world_size):
            try:
                with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                    status, value = pickle.load(f)
            except FileNotFoundError:
                status, value = "error", f"rank {r} died (exit code {procs[r].exitcode}) or hung past {timeout}s"
            if status == "ok":
                out.append(value)
            else:
                failures[r] = value
        if failures:
            raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--op", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--saved-ranks", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    args = {"tool": ns.tool, "op": ns.op, "url": ns.url, "bytes": ns.bytes, "saved_ranks": ns.saved_ranks or ns.ranks}
    try:
        result = {"ok": True, "ranks": spawn(ns.ranks, args, ns.timeout)}
    except Exception as e:  # noqa: BLE001 - reported to bench/run.py as this row's error
        result = {"ok": False, "error": str(e)}
    Path(ns.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
