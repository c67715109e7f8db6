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
``WarmModules`` does the same for the ``python -m bench.<module>`` children a benchmark
starts with ``subprocess.run`` (tests/warm_bench.py installs it; the suite does not).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
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


def _as_module(module: str, args: list[str], environ: dict, cwd: str, out: str, err: str) -> None:
    """In the fork: become ``python -m module args`` started in ``cwd`` with ``environ``
    (stdin from /dev/null, stdout and stderr into the files ``out`` and ``err``), then run it."""
    import runpy

    for fd, path in ((1, out), (2, err)):
        got = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(got, fd)
        os.close(got)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = [cwd, *(p for p in sys.path if p not in ("", cwd))]  # as ``python -m``: the cwd first
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class WarmModules:
    """Stands in for ``subprocess.run`` for ``[sys.executable, "-m", "<prefix>...", ...]``
    with its output captured (what ``bench.scale`` does for each of its phases): the
    child is forked from ``spawn``'s forkserver (torch imported once) instead of a fresh
    Python, then made what that command is (``_as_module``): its environment, working
    directory, ``sys.argv``, its module run as ``__main__``. The result is the
    ``CompletedProcess`` (or ``TimeoutExpired``, ``CalledProcessError``) that
    ``subprocess.run`` gives; every other call goes to ``subprocess.run`` itself."""

    def __init__(self, spawn: WarmSpawn, prefixes: tuple[str, ...] = ("bench.",)):
        self._ctx = spawn._ctx
        self._prefixes = prefixes
        self._real = subprocess.run

    def install(self) -> None:
        subprocess.run = self.run

    def run(self, args, *rest, **kw):
        plain = set(kw) <= {"cwd", "capture_output", "text", "timeout", "env", "check"} and kw.get("capture_output")
        if rest or not plain or not isinstance(args, (list, tuple)) or len(args) < 3 or args[0] != sys.executable \
                or args[1] != "-m" or not str(args[2]).startswith(self._prefixes):
            return self._real(args, *rest, **kw)
        import tempfile

        with tempfile.TemporaryDirectory(prefix="warm-module-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            env = dict(kw["env"] if kw.get("env") is not None else os.environ)
            p = self._ctx.Process(target=_as_module, args=(str(args[2]), [str(a) for a in args[3:]], env,
                                                           str(kw.get("cwd") or os.getcwd()), out, err))
            p.start()
            p.join(kw.get("timeout"))
            timed_out = p.exitcode is None
            if timed_out:
                p.kill()
                p.join()
            got = []
            for path in (out, err):
                with open(path, "rb") as f:
                    data = f.read()
                got.append(data.decode(errors="replace") if kw.get("text") else data)
        if timed_out:
            raise subprocess.TimeoutExpired(list(args), kw["timeout"], output=got[0], stderr=got[1])
        done = subprocess.CompletedProcess(list(args), p.exitcode, got[0], got[1])
        if kw.get("check"):
            done.check_returncode()
        return done
