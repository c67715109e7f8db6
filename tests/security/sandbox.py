"""Run one hostile try in a child process with an address-space and a wall-clock limit,
and say what happened to it: returned, refused with a typed error, raised something
untyped, crashed (a signal such as SIGSEGV), ran out of memory (a bomb) or hung.

A try is ``"package.module:function"`` called with keyword arguments that are plain
JSON. It runs in a grandchild forked from a *zygote*: one long-lived child of the test
process that imported torch, numpy, boto3 and every module of cloudckpt once (with
Lightning and transformers), built the S3 client, and started no threads of its own, so
each try costs a fork (milliseconds) instead of a Python start-up with torch (seconds),
and a try never shares state with the test process or with another try. The tries of
one sandbox share a cache folder (``$HOSTILE_TRIES_CACHE``, removed by ``close``)
for what is worth building once, such as the honest step of ``tries.honest_step``.

    with Sandbox() as sb:
        r = sb.run("tests.security.hostile_x:load_step", step="/tmp/x/step1", work="/tmp/w")
        assert r.outcome == REFUSED, r

Outcomes: ``ok`` (returned), ``refused`` (raised a :class:`cloudckpt.errors.CloudCkptError`
or, where an entry point documents it, a CLI exit code that means "refused"),
``untyped`` (any other exception), ``crash`` (killed by a signal), ``bomb``
(``MemoryError`` under the address-space limit, a peak RSS above ``rss_limit``, or a
write past ``fsize_limit``, the largest file a try may write), ``hang`` (still running
at ``timeout``; killed).

The zygote is ``python -m tests.security.sandbox`` reading one JSON request per line on
stdin and answering one JSON line on stdout per try, with the request's ``id``, as soon
as that try has ended: tries submitted together (``Sandbox.submit``, then
``Sandbox.result``) run side by side, each still in a fork of its own with its own
limits and its own wall clock; ``Sandbox.run`` submits one and waits for it.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

OK, REFUSED, UNTYPED, CRASH, BOMB, HANG = "ok", "refused", "untyped", "crash", "bomb", "hang"
OUTCOMES = (OK, REFUSED, UNTYPED, CRASH, BOMB, HANG)

AS_LIMIT = 4 << 30  # the address space a try may map (the reproduction used 4 GiB)
RSS_LIMIT = 1536 << 20  # peak resident memory above which a try that returned still counts as a bomb
TIMEOUT = 60.0  # seconds of wall clock per try
FSIZE_LIMIT = 2 << 30  # the largest file a try may write (a disk bomb is stopped here and reported)
WARM_UP_ENV = "HOSTILE_TRIES_WARM_UP"
CACHE_ENV = "HOSTILE_TRIES_CACHE"  # the sandbox's shared cache folder (not CLOUDCKPT_*: those are config overrides)

_REPO = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    outcome: str
    error: str = ""  # the exception's type name (qualified) for refused/untyped, the signal for crash
    message: str = ""  # str(exception), or the tail of the try's output
    value: object = None  # what the function returned, if JSON-able (else its repr)
    seconds: float = 0.0
    max_rss_mb: float = 0.0
    cpu_seconds: float = 0.0  # user + system CPU time of the try (its own process and what it waited for)
    output: str = field(default="", repr=False)  # stdout+stderr of the try (last 4 KiB)

    def __str__(self) -> str:
        return (f"{self.outcome} {self.error} {self.message[:500]!r} ({self.seconds:.1f}s, "
                f"{self.max_rss_mb:.0f} MB)\n{self.output[-1500:]}")


class Sandbox:
    """A zygote process and the tries run through it (one at a time)."""

    def __init__(self, *, env: dict[str, str] | None = None, warm_up: str | None = None):
        """``warm_up``: a ``"module:function"`` the zygote calls once before it forks any try
        (e.g. a save and a load in a scratch folder, so that lazy initialisations happen
        once); it must leave no thread running (the zygote refuses to start otherwise)."""
        e = dict(os.environ)
        e.update(env or {})
        e["PYTHONPATH"] = os.pathsep.join([str(_REPO), str(_REPO / "tests"), e.get("PYTHONPATH", "")])
        # a folder the tries of this sandbox share for things worth building once (tries.honest_step)
        self.cache = tempfile.mkdtemp(prefix="cloudckpt-sandbox-cache-")
        e[CACHE_ENV] = self.cache
        if warm_up:
            e[WARM_UP_ENV] = warm_up
        self._next = 0  # the number of the last try submitted
        self._answers: dict[int, dict] = {}  # results read while waiting for another
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.security.sandbox"], cwd=_REPO, env=e,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"the sandbox zygote did not start: {ready!r}")

    def run(self, target: str, *, timeout: float = TIMEOUT, as_limit: int = AS_LIMIT, rss_limit: int = RSS_LIMIT,
            fsize_limit: int = FSIZE_LIMIT, env: dict[str, str] | None = None, **kwargs) -> Result:
        """Run ``target`` (``"module:function"``) with ``kwargs`` in a fresh fork; never raises
        for what the try does."""
        return self.result(self.submit(target, timeout=timeout, as_limit=as_limit, rss_limit=rss_limit,
                                       fsize_limit=fsize_limit, env=env, **kwargs))

    def submit(self, target: str, *, timeout: float = TIMEOUT, as_limit: int = AS_LIMIT, rss_limit: int = RSS_LIMIT,
               fsize_limit: int = FSIZE_LIMIT, env: dict[str, str] | None = None, **kwargs) -> int:
        """Start ``run``'s try without waiting for it; returns the number ``result`` takes.
        Tries submitted before the result of the first is read run side by side, each in a
        fork of its own with its own limits and wall clock."""
        self._next += 1
        req = {"id": self._next, "target": target, "kwargs": kwargs, "timeout": timeout, "as_limit": as_limit,
               "rss_limit": rss_limit, "fsize_limit": fsize_limit, "env": env or {}}
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        return self._next

    def result(self, number: int) -> Result:
        """The result of the try ``submit`` numbered ``number`` (waiting for it)."""
        while number not in self._answers:
            line = self._proc.stdout.readline()
            if not line:
                raise RuntimeError("the sandbox zygote died")
            answer = json.loads(line)
            self._answers[answer.pop("id")] = answer
        return Result(**self._answers.pop(number))

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self.cache, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------- the zygote side
def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)[:2000]


def _child(req: dict, result_path: str, log_fd: int) -> None:
    """The grandchild: limits, run, write the result file, exit without cleanup."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    resource.setrlimit(resource.RLIMIT_AS, (req["as_limit"], req["as_limit"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize_limit"], req["fsize_limit"]))
    too_large: list[int] = []  # a write past RLIMIT_FSIZE fails with EFBIG and raises SIGXFSZ
    signal.signal(signal.SIGXFSZ, lambda *_: too_large.append(1))
    os.environ.update(req["env"])
    import importlib

    from cloudckpt.errors import CloudCkptError

    out: dict
    try:
        mod, fn = req["target"].split(":")
        value = getattr(importlib.import_module(mod), fn)(**req["kwargs"])
        out = {"outcome": OK, "value": _jsonable(value)}
    except MemoryError as e:
        out = {"outcome": BOMB, "error": "MemoryError", "message": str(e)[:2000]}
    except CloudCkptError as e:
        out = {"outcome": REFUSED, "error": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e)[:4000]}
    except SystemExit as e:  # a CLI entry point: exit codes are mapped by the caller through the value
        out = {"outcome": OK, "value": {"exit": e.code if isinstance(e.code, int) else 1}}
    except BaseException as e:  # noqa: BLE001 - the point is to see everything that escapes
        try:
            msg = str(e)[:4000]
        except BaseException as e2:  # noqa: BLE001 - str() of a hostile exception may itself fail
            msg = f"<str() raised {type(e2).__name__}>"
        out = {"outcome": UNTYPED, "error": f"{type(e).__module__}.{type(e).__qualname__}", "message": msg}
    if too_large:  # whatever it answered, it tried to write a file past the limit
        out = {"outcome": BOMB, "error": "fsize", "message": f"wrote a file past {req['fsize_limit']} bytes "
               f"(then: {out['outcome']} {out.get('error', '')})"}
    try:
        data = json.dumps(out)
    except BaseException:  # noqa: BLE001
        data = json.dumps({"outcome": out["outcome"], "error": out.get("error", ""), "message": "<unprintable>"})
    with open(result_path, "w") as f:
        f.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class _Running:
    """A try forked by the zygote and not reaped yet."""

    req: dict
    pid: int
    tmp: str
    t0: float
    pidfd: int | None

    @property
    def deadline(self) -> float:
        return self.t0 + self.req["timeout"]


def _start_one(req: dict) -> _Running:
    tmp = tempfile.mkdtemp(prefix="cloudckpt-sandbox-")
    result_path, log_path = os.path.join(tmp, "result.json"), os.path.join(tmp, "log.txt")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child(req, result_path, log_fd)
        finally:
            os._exit(99)
    os.close(log_fd)
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel): polled
        pidfd = None
    return _Running(req, pid, tmp, t0, pidfd)


def _finish_one(run: _Running, status: int, rusage, hung: bool) -> dict:
    """The result of the reaped try ``run`` (its files read and removed)."""
    req, tmp, t0 = run.req, run.tmp, run.t0
    result_path, log_path = os.path.join(tmp, "result.json"), os.path.join(tmp, "log.txt")
    seconds = time.monotonic() - t0
    with open(log_path, "rb") as f:
        f.seek(max(0, os.path.getsize(log_path) - 4096))
        output = f.read().decode("utf-8", "replace")
    max_rss_mb = rusage.ru_maxrss / 1024 if rusage else 0.0
    cpu = rusage.ru_utime + rusage.ru_stime if rusage else 0.0
    res: dict = {"seconds": seconds, "max_rss_mb": max_rss_mb, "cpu_seconds": cpu, "output": output}
    if hung:
        res.update(outcome=HANG, message=f"still running after {req['timeout']} s")
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        res.update(outcome=CRASH, error=signal.Signals(sig).name, message=f"killed by {signal.Signals(sig).name}")
    elif not os.path.exists(result_path):
        res.update(outcome=CRASH, error=f"exit {os.WEXITSTATUS(status)}", message="exited without a result")
    else:
        with open(result_path) as f:
            res.update(json.load(f))
        if res["outcome"] == OK and max_rss_mb * (1 << 20) > req["rss_limit"]:
            res.update(outcome=BOMB, error="rss", message=f"peak RSS {max_rss_mb:.0f} MB over the limit")
    for p in (result_path, log_path):
        if os.path.exists(p):
            os.unlink(p)
    os.rmdir(tmp)
    return res


def _warm() -> None:
    """Import every module of cloudckpt (and what its integrations import: Lightning,
    transformers) and build the S3 client once, so that a try pays only for its fork
    and its own work. Nothing here starts a thread or opens a connection: a forked
    child must not inherit either."""
    import importlib
    import pkgutil
    import threading

    import cloudckpt

    for m in pkgutil.walk_packages(cloudckpt.__path__, "cloudckpt."):
        if m.name.startswith("cloudckpt.testing") or m.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(m.name)
        except Exception:  # noqa: BLE001 - an optional package not installed, or a module that does not
            pass  # import now: warming up is only for speed, the tries that use it will say what is wrong
    if os.environ.get("AWS_ENDPOINT_URL"):
        from cloudckpt.storage import open_store

        open_store("s3://sandbox-warm-up").client  # noqa: B018 - the client is built lazily
    target = os.environ.pop(WARM_UP_ENV, "")
    if target:
        mod, fn = target.split(":")
        getattr(importlib.import_module(mod), fn)()
    if threading.active_count() != 1:
        raise RuntimeError(f"the sandbox zygote started threads while warming up: {threading.enumerate()}")


def _log_handler():
    """Log records of a try carry their exception's type and message, not the traceback:
    Python 3.11 parses the source of every frame to underline it, which cost a tenth of
    a try that logs two warnings with exc_info. What escapes a try is in its result."""
    import logging
    import traceback

    class Formatter(logging.Formatter):
        def formatException(self, ei) -> str:
            return "".join(traceback.format_exception_only(ei[0], ei[1])).rstrip()

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Formatter("%(levelname)s %(name)s: %(message)s"))
    return handler


def _zygote() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, handlers=[_log_handler()])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import boto3  # noqa: F401 - imported once here so each try only forks
    import numpy  # noqa: F401
    import torch
    import torch.distributed.checkpoint  # noqa: F401

    _warm()

    # the zygote's own stdout is the protocol; a try writes to its log file instead
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    # what the zygote holds is never collected by a try's garbage collector: a collection
    # walks (writes) every tracked object, which makes the child copy the pages it shares
    import gc

    gc.collect()
    gc.freeze()
    proto.write("ready\n")
    _serve(proto)


def _serve(proto) -> None:
    """Read requests from stdin and start each try at once; answer each (with its ``id``)
    as soon as it has ended, in the order they end. At the end of stdin the tries still
    running are killed (nobody will read their results)."""
    running: dict[int, _Running] = {}
    pending, open_ = b"", True
    while open_ or running:
        fds = ([0] if open_ else []) + [r.pidfd for r in running.values() if r.pidfd is not None]
        wait = min((r.deadline for r in running.values()), default=None)
        if wait is not None:
            wait = max(0.0, wait - time.monotonic())
            if any(r.pidfd is None for r in running.values()):
                wait = min(wait, 0.01)
        if not open_:  # stdin is gone: end what runs
            for r in running.values():
                os.kill(r.pid, signal.SIGKILL)
            wait = 0.0 if fds else None
        ready = select.select(fds, [], [], wait)[0] if fds else []
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:
                open_ = False
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.strip():
                    req = json.loads(line)
                    run = _start_one(req)
                    running[run.pid] = run
        for pid in list(running):
            run = running[pid]
            wpid, st, ru = os.wait4(pid, os.WNOHANG)
            hung = False
            if wpid != pid:
                if time.monotonic() < run.deadline and open_:
                    continue
                os.kill(pid, signal.SIGKILL)
                _, st, ru = os.wait4(pid, 0)
                hung = open_
            del running[pid]
            if run.pidfd is not None:
                os.close(run.pidfd)
            res = _finish_one(run, st, ru, hung)
            if open_:
                proto.write(json.dumps({"id": run.req.get("id"), **res}) + "\n")


if __name__ == "__main__":
    _zygote()
