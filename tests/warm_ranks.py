"""Start the ranks of ``cloudckpt.testing.multiprocess.run_ranks`` in milliseconds instead
of seconds: installed by ``conftest.py`` for the whole suite.

``run_ranks`` spawns each rank (a fresh Python that imports torch: ~3 CPU-s, 5-15 s of
wall clock on the suite's 2-core machine). Here each rank is forked from a forkserver
that imported torch, numpy and boto3 once (nothing of cloudckpt, no client, no thread
of its own), and then, before anything else runs, made what a spawned rank is: the
environment, the working directory, stdout and stderr of the test at the moment it
started the rank, and only then the rank's function and arguments unpickled (so the
test's modules and cloudckpt are imported under that environment, as in a spawn).
The ranks still run ``run_ranks``' own code (gloo world, results, failures, timeouts).

Only ``run_ranks`` is affected: its ``spawn`` context is replaced while the suite runs.
"""

from __future__ import annotations

import os
import pickle
from multiprocessing import reduction

# torch._dynamo: DTensor.from_local imports it on first use (about 1.5 s of wall clock per rank here)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint", "torch._dynamo",
           "numpy", "boto3", "botocore.session"]


class _Fd:
    """An fd of the starting process, handed to the rank (as a spawned rank inherits it)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _adopt, (reduction.DupFd(self.fd), self.fd)  # DupFd: only while the process starts


def _adopt(dup, fd: int) -> int:
    got = dup.detach()
    os.dup2(got, fd)
    os.close(got)
    return fd


def _as_spawned(environ: dict, cwd: str, fds: list, payload: bytes) -> None:
    del fds  # already placed on 1 and 2 by unpickling
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    target, args = pickle.loads(payload)  # imports the rank's modules now, under the test's environment
    target(*args)


class _Context:
    def __init__(self, ctx):
        self._ctx = ctx

    def Process(self, target, args=(), **kw):  # the multiprocessing name
        payload = bytes(reduction.ForkingPickler.dumps((target, args)))
        return self._ctx.Process(target=_as_spawned, args=(dict(os.environ), os.getcwd(), [_Fd(1), _Fd(2)],
                                                            payload), **kw)


class WarmSpawn:
    """Stands in for ``torch.multiprocessing`` inside ``cloudckpt.testing.multiprocess``."""

    def __init__(self):
        import torch.multiprocessing as mp

        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)

    def get_context(self, method: str):
        if method != "spawn":
            raise ValueError(f"run_ranks asked for the start method {method!r}; warm_ranks stands in for 'spawn' only")
        return _Context(self._ctx)
