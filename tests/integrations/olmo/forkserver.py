"""Start OLMo-core's processes for the OLMo-core tests in milliseconds instead of seconds.

Each OLMo-core command of these tests (``olmo_tool.py``, ``trainer_tool.py``, a
``python -c``) used to be a fresh Python of .venv-olmo importing torch and olmo_core
(5 CPU-s, 10-20 s of wall clock on the suite's 2-core machine), and a 2-rank run a
``torch.distributed.run`` with two more. Here one long-lived server per test module
(``python forkserver.py`` in .venv-olmo) imports them once, starts no thread, and
*forks* each command: the child is made what a fresh process would be before it runs
anything (the command's environment, working directory, ``sys.argv``, ``sys.path``
with the command's ``PYTHONPATH``, stdin from /dev/null, stdout and stderr into the
command's log file) and then runs the script as ``__main__``. Every command is still a
process of its own, with nothing of another's state; a 2-rank command is two children
with the environment ``torch.distributed.run`` gives its ranks (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), joined by gloo as before.

The one setting read at import time that differs between commands, cached_path's cache
folder (``CACHED_PATH_CACHE_ROOT``), is set again in each child from its environment.

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout
("ready" first). ``{"op": "start", "argv": [...], "env": {...}, "cwd": ..., "log": ...,
"ranks": N, "master_port": P}`` answers ``{"pids": [...]}``; ``{"op": "wait", "pids": [...],
"timeout": S}`` answers ``{"codes": [...]}``; ``{"op": "poll", "pids": [...]}`` answers
their codes, null for those still running (Popen's convention: ``-signal`` when killed;
all killed at the timeout, ``"timed_out": true``; the others killed 30 s after one failed,
as torch.distributed.run does).

The client side (``OlmoServer``) runs in cloudckpt's venv and imports only the stdlib.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = [
    "numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.run", "cached_path",
    "olmo_core.data", "olmo_core.distributed.parallel", "olmo_core.distributed.checkpoint", "olmo_core.io",
    "olmo_core.nn.transformer", "olmo_core.optim", "olmo_core.train", "olmo_core.train.callbacks",
    "olmo_core.train.checkpoint", "olmo_core.train.train_module",
]
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------- the client (cloudckpt's venv)
class OlmoServer:
    """The server process, started with ``python`` (.venv-olmo's) and ``env`` (the
    environment its imports see; each command gets its own); its own output goes to
    ``log`` (named in the error when it does not start or dies). ``preload``: more modules
    to import once (e.g. cloudckpt's adapter, found through ``env["PYTHONPATH"]``)."""

    def __init__(self, python: str, env: dict[str, str], log: str, preload: list[str] = ()):
        self.log = Path(log)
        with open(self.log, "ab") as err:
            self._proc = subprocess.Popen([python, str(Path(__file__)), *preload], env=env, cwd=str(HERE),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                          bufsize=1)
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            self._proc.kill()
            self._proc.wait()
            raise RuntimeError(f"the OLMo-core fork server did not start: {ready!r}\n{self._tail()}")

    def _tail(self) -> str:
        return f"--- {self.log} ---\n" + self.log.read_text(errors="replace")[-4000:]

    def _ask(self, req: dict) -> dict:
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the OLMo-core fork server died (exit {self._proc.wait()})\n{self._tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the OLMo-core fork server could not {req['op']}: {answer['error']}")
        return answer

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str, log: str, ranks: int = 1,
              master_port: int = 0) -> list[int]:
        """Fork ``argv`` (a script and its arguments, or ``-c CODE ARGS``) on ``ranks``
        processes, output appended to ``log``; returns their pids."""
        return self._ask({"op": "start", "argv": [str(a) for a in argv], "env": env, "cwd": str(cwd), "log": str(log),
                          "ranks": ranks, "master_port": master_port})["pids"]

    def wait(self, pids: list[int], timeout: float) -> tuple[list[int], bool]:
        """(exit codes, timed out) of the processes ``start`` returned."""
        r = self._ask({"op": "wait", "pids": pids, "timeout": timeout})
        return r["codes"], r["timed_out"]

    def poll(self, pids: list[int]) -> list[int | None]:
        """Exit codes of the processes ``start`` returned, None for those still running."""
        return self._ask({"op": "poll", "pids": pids})["codes"]

    def run(self, argv: list[str], *, env: dict[str, str], cwd: str, log: str, timeout: float, ranks: int = 1,
            master_port: int = 0) -> tuple[int, str]:
        """``start`` then ``wait``: (the first non-zero exit code or 0, the log's text);
        a run past ``timeout`` is killed and reported as exit 124."""
        codes, timed_out = self.wait(self.start(argv, env=env, cwd=cwd, log=log, ranks=ranks,
                                                master_port=master_port), timeout)
        out = Path(log).read_text(errors="replace") if Path(log).exists() else ""
        if timed_out:
            return 124, out + f"\n[forkserver: killed after {timeout:.0f} s]"
        return next((c for c in codes if c != 0), 0), out

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


# ----------------------------------------------------------------- the server (.venv-olmo)
def _rank_env(env: dict, rank: int, ranks: int, port: int) -> dict:
    """What torch.distributed.run (one node, ``--nproc_per_node ranks``) puts in a rank's environment."""
    if ranks == 1:
        return env
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), ROLE_WORLD_SIZE=str(ranks), GROUP_WORLD_SIZE="1",
                MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID=env.get("TORCHELASTIC_RUN_ID", "none"), TORCH_NCCL_ASYNC_ERROR_HANDLING="1")


def _child(argv: list[str], env: dict, cwd: str, log: str) -> None:
    """In the fork: become the fresh process the command would have been, run it, exit."""
    code = 1
    try:
        if _PROTO_FD is not None:
            os.close(_PROTO_FD)  # the server's answers are not the command's to write
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        if "cached_path.common" in sys.modules and env.get("CACHED_PATH_CACHE_ROOT"):
            sys.modules["cached_path.common"].set_cache_dir(env["CACHED_PATH_CACHE_ROOT"])
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        import runpy

        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *extra, *sys.path[1:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path[:] = [str(Path(argv[0]).resolve().parent), *extra, *sys.path[1:]]
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed like an uncaught exception, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _start(req: dict) -> dict:
    pids = []
    for rank in range(req["ranks"]):
        env = _rank_env(req["env"], rank, req["ranks"], req["master_port"])
        pid = os.fork()
        if pid == 0:
            _child(req["argv"], env, req["cwd"], req["log"])
        _DONE.pop(pid, None)  # a pid used again
        pids.append(pid)
    return {"pids": pids}


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _reap(pid: int, block: bool = False) -> int | None:
    """The exit code of the child ``pid``, None while it runs; kept once reaped."""
    if pid not in _DONE:
        wpid, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        if wpid == pid:
            _DONE[pid] = _code(status)
    return _DONE.get(pid)


def _wait(req: dict) -> dict:
    pids = req["pids"]
    deadline = time.monotonic() + req["timeout"]
    failed_at = None
    timed_out = False
    while True:
        codes = [_reap(pid) for pid in pids]
        if None not in codes:
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + 30):
            timed_out = now > deadline
            for pid, c in zip(pids, codes, strict=True):
                if c is None:
                    os.kill(pid, signal.SIGKILL)
            codes = [_reap(pid, block=True) for pid in pids]
            break
        time.sleep(0.05)
    return {"codes": codes, "timed_out": timed_out}


def _poll(req: dict) -> dict:
    return {"codes": [_reap(pid) for pid in req["pids"]]}


_DONE: dict[int, int] = {}  # the exit codes of the children reaped
OPS = {"start": _start, "wait": _wait, "poll": _poll}


def _serve() -> None:
    global _PROTO_FD
    import gc
    import importlib
    import threading

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in PRELOAD + sys.argv[1:]:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise RuntimeError(f"importing started threads, a fork would lose them: {threading.enumerate()}")
    _PROTO_FD = os.dup(1)
    proto = os.fdopen(_PROTO_FD, "w", buffering=1)
    os.dup2(2, 1)  # anything the server itself prints goes to stderr, not into the protocol
    gc.collect()
    gc.freeze()  # the children do not copy the pages of what the server imported when they collect
    proto.write("ready\n")
    for line in sys.stdin:
        if line.strip():
            req = json.loads(line)
            try:
                answer = OPS[req["op"]](req)
            except Exception as e:  # noqa: BLE001 - the client raises it, the server goes on
                answer = {"error": f"{type(e).__name__}: {e}"}
            proto.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    _serve()
