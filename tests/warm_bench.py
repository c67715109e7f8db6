"""Run a bench module as ``python -m`` would, with its gloo ranks forked warm.

    python tests/warm_bench.py bench.run --smoke ...   # as: python -m bench.run --smoke ...

For tests/test_bench_smoke.py: a bench run starts its ranks with
``cloudckpt.testing.multiprocess.run_ranks``, a fresh Python per rank (torch imported
each time: 5-10 s of wall clock per case on the suite's 2-core machine). Here
``run_ranks`` gets the stand-in the test suite itself uses (``warm_ranks.WarmSpawn``:
each rank forked from a forkserver that imported torch, numpy and boto3 once, then
given the environment, working directory and output of a spawned rank before its
function is unpickled), and the module then runs unchanged as ``__main__``: the
same cases, the same rank code, the same checks of what was loaded. Only the ranks'
start-up differs, so the figures of such a run (meaningless in a smoke run anyway) do
not include a rank's Python start-up.

A bench that runs parts of itself as ``python -m bench.<module>`` children through
``subprocess.run`` (``bench.scale``: each phase in its own process) gets those children
forked from the same forkserver (``warm_ranks.WarmModules``): each is still a process of
its own that imports cloudckpt and the bench module and runs it as ``__main__``, with
the command's arguments, environment and working directory; only torch is imported
already, so its figures (meaningless in a smoke run) start from a different baseline.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/warm_bench.py MODULE [ARGS...]")
    sys.path.insert(0, str(ROOT))  # as ``python -m`` from the repository root (tests/ stays: warm_ranks)
    from warm_ranks import WarmModules, WarmSpawn

    from cloudckpt.testing import multiprocess

    multiprocess.mp = spawn = WarmSpawn()
    WarmModules(spawn).install()  # ``python -m bench.*`` children (bench.scale's phases) forked warm too
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
