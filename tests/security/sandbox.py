"""Run hostile tries in child processes with an address-space and a wall-clock limit,
and say what happened to each: returned, refused with a typed error, raised something
untyped, crashed (a signal such as SIGSEGV), ran out of memory (a bomb) or hung.

A try is ``"package.module:function"`` called with keyword arguments that are plain
JSON. It runs in a process forked from a *zygote*: one long-lived child of the test
process that imported torch, numpy, boto3 and every module of cloudckpt once (with
Lightning and transformers), built the S3 client, and started no threads of its own, so
a try costs a fork instead of a Python start-up with torch (seconds). A try never
shares state with the test process.

**Runners.** Forking a zygote of 380 MB and tearing the fork down again costs more CPU
than most tries (each page a try writes is copied first), so tries run in *runners*:
forks of the zygote that take tries one after another, each try with its own wall
clock, peak RSS (reset before it) and CPU count. A runner is replaced by a fresh fork
after any try that ended other than ok or refused (a crash, bomb, hang or untyped
error ends with the process), or that left the process changed: its environment,
working directory, threads, signal handlers, or any module-level name of cloudckpt or
of these tests rebound (what a monkeypatch does); and after ``RUNNER_TRIES`` tries or
``RUNNER_GROWTH`` of memory. A try with an environment of its own, a lower RSS limit,
``fresh=True``, or every try under ``HOSTILE_FRESH_FORKS=1``, runs in a fork of its
own, as every try did before runners; ``test_hostile.py`` checks that both give the
same answers. The tries of one sandbox share a cache folder (``$HOSTILE_TRIES_CACHE``,
removed by ``close``) for what is worth building once, such as the honest step of
``tries.honest_step``.

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
``Sandbox.result``) run side by side (up to three runners at once), each with its own
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
FRESH_ENV = "HOSTILE_FRESH_FORKS"  # "1": every try in a fork of its own, none in a shared runner
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
    """A zygote process and the tries run through it."""

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
            fsize_limit: int = FSIZE_LIMIT, env: dict[str, str] | None = None, fresh: bool = False,
            **kwargs) -> Result:
        """Run ``target`` (``"module:function"``) with ``kwargs`` in a runner, or in a fork of
        its own (``fresh``, or ``env`` given); never raises for what the try does."""
        return self.result(self.submit(target, timeout=timeout, as_limit=as_limit, rss_limit=rss_limit,
                                       fsize_limit=fsize_limit, env=env, fresh=fresh, **kwargs))

    def submit(self, target: str, *, timeout: float = TIMEOUT, as_limit: int = AS_LIMIT, rss_limit: int = RSS_LIMIT,
               fsize_limit: int = FSIZE_LIMIT, env: dict[str, str] | None = None, fresh: bool = False,
               **kwargs) -> int:
        """Start ``run``'s try without waiting for it; returns the number ``result`` takes.
        Tries submitted before the result of the first is read run side by side (each in a
        runner or a fork of its own, with its own limits and wall clock)."""
        self._next += 1
        req = {"id": self._next, "target": target, "kwargs": kwargs, "timeout": timeout, "as_limit": as_limit,
               "rss_limit": rss_limit, "fsize_limit": fsize_limit, "env": env or {}, "fresh": fresh}
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


def _limit(as_limit: int, fsize_limit: int) -> list[int]:
    """A try's process limits; returns the list a write past ``fsize_limit`` appends to
    (it fails with EFBIG and raises SIGXFSZ, which is caught, not fatal)."""
    resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    too_large: list[int] = []
    signal.signal(signal.SIGXFSZ, lambda *_: too_large.append(1))
    null = os.open(os.devnull, os.O_RDONLY)  # a try never reads the zygote's requests
    os.dup2(null, 0)
    os.close(null)
    return too_large


def _call(req: dict, too_large: list[int]) -> dict:
    """Run the try of ``req`` in this process: its outcome, as the result says it."""
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
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        json.dumps(out)
    except BaseException:  # noqa: BLE001
        out = {"outcome": out["outcome"], "error": out.get("error", ""), "message": "<unprintable>"}
    return out


def _child(req: dict, result_path: str, log_fd: int) -> None:
    """A try in a fork of its own: limits, run, write the result file, exit without cleanup."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    too_large = _limit(req["as_limit"], req["fsize_limit"])
    os.environ.update(req["env"])
    out = _call(req, too_large)
    with open(result_path, "w") as f:
        f.write(json.dumps(out))
    os._exit(0)


# ----------------------------------------------------------------- shared runners
RUNNER_TRIES = 400  # tries one runner takes before it is replaced by a fresh fork
RUNNER_GROWTH = 256 << 20  # resident or mapped memory a runner may gain over the zygote's before it is replaced


def _status() -> dict[str, int]:
    """VmRSS, VmHWM and VmSize of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "VmSize:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) << 10
    return out


def _settle(limit: float = 0.2) -> None:
    """Give threads a try's code ended a moment to exit (a transfer engine closes its
    pool without joining it: its idle threads exit by themselves)."""
    import threading

    deadline = time.monotonic() + limit
    for t in threading.enumerate():
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


def _state() -> tuple:
    """What a try could leave behind for the next one in a shared process, in a form
    that compares: the environment, the working directory, threads, signal handlers,
    and every module-level name of cloudckpt and of these tests (a try that rebinds one,
    as a monkeypatch does, ends its runner)."""
    import threading

    names = {}
    for name, mod in list(sys.modules.items()):
        if mod is not None and name.startswith(("cloudckpt", "tests.")):
            d = getattr(mod, "__dict__", {})
            names[name] = {k: id(v) for k, v in list(d.items())}
    handlers = tuple(signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                                                   signal.SIGUSR2, signal.SIGCHLD, signal.SIGALRM))
    return dict(os.environ), os.getcwd(), threading.active_count(), handlers, names


def _same_state(before: tuple, after: tuple) -> bool:
    """``after`` leaves nothing of ``before`` changed; names a try added (a module
    imported lazily, which its package then names) are not changes."""
    if before[:4] != after[:4]:
        return False
    old, new = before[4], after[4]
    return all(new.get(m, {}).get(k, i) == i for m, d in old.items() for k, i in d.items())


def _runner(requests: int, results: int, as_limit: int, fsize_limit: int, base: dict[str, int]) -> None:
    """A runner: tries one after another in this one process, each answered on
    ``results`` as a JSON line with its own CPU time and peak RSS (the peak is reset
    before each try: ``/proc/self/clear_refs``). It exits after the first try that ended
    other than ok or refused, or left the process changed (``_state``), or after
    RUNNER_TRIES tries or RUNNER_GROWTH of memory: the zygote forks a fresh one."""
    too_large = _limit(as_limit, fsize_limit)
    reader = os.fdopen(requests, "r")
    before = _state()
    for n in range(1, RUNNER_TRIES + 1):
        line = reader.readline()
        if not line:
            os._exit(0)
        req = json.loads(line)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS starts from now
        too_large.clear()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        out = _call(req, too_large)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        st = _status()
        out["cpu_seconds"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        out["max_rss_mb"] = st["VmHWM"] / (1 << 20)
        _settle()
        after = _state()
        out["reused"] = n < RUNNER_TRIES and out["outcome"] in (OK, REFUSED) and _same_state(before, after) and \
            st["VmRSS"] - base["VmRSS"] < RUNNER_GROWTH and st["VmSize"] - base["VmSize"] < RUNNER_GROWTH
        before = after
        os.write(results, (json.dumps(out) + "\n").encode())
        if not out["reused"]:
            break
    os._exit(0)


@dataclass
class _Try:
    """A try started and not answered yet: in a fork of its own (``runner`` None) or in
    a shared runner."""

    req: dict
    tmp: str
    t0: float
    pid: int = 0
    pidfd: int | None = None
    runner: "_Runner | None" = None

    @property
    def deadline(self) -> float:
        return self.t0 + self.req["timeout"]

    @property
    def result_path(self) -> str:
        return os.path.join(self.tmp, "result.json")

    @property
    def log_path(self) -> str:
        return os.path.join(self.tmp, "log.txt")


@dataclass
class _Runner:
    pid: int
    pidfd: int
    requests: int  # fd: requests to the runner
    results: int  # fd: its answers
    key: tuple[int, int]  # (as_limit, fsize_limit)
    busy: _Try | None = None
    buffer: bytes = b""
    gone: bool = False  # said it exits after its current answer
    used: float = 0.0  # when it was last given a try


def _new_tmp() -> str:
    return tempfile.mkdtemp(prefix="cloudckpt-sandbox-")


def _fork_one(req: dict) -> _Try:
    run = _Try(req, _new_tmp(), 0.0)
    log_fd = os.open(run.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    run.t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child(req, run.result_path, log_fd)
        finally:
            os._exit(99)
    os.close(log_fd)
    run.pid, run.pidfd = pid, os.pidfd_open(pid)
    return run


def _fork_runner(key: tuple[int, int], base: dict[str, int]) -> _Runner:
    req_r, req_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(req_w)
            os.close(res_r)
            _runner(req_r, res_w, *key, base)
        finally:
            os._exit(99)
    os.close(req_r)
    os.close(res_w)
    os.set_blocking(res_r, False)
    return _Runner(pid, os.pidfd_open(pid), req_w, res_r, key)


def _answer(run: _Try, status: int | None, rusage, hung: bool, said: dict | None) -> dict:
    """The result of the try ``run``: what it said (``said``, from a runner), else what
    its exit ``status`` and its files tell; its folder removed."""
    req = run.req
    seconds = time.monotonic() - run.t0
    output = ""
    if os.path.exists(run.log_path):
        with open(run.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(run.log_path) - 4096))
            output = f.read().decode("utf-8", "replace")
    res: dict = {"seconds": seconds, "output": output, "max_rss_mb": rusage.ru_maxrss / 1024 if rusage else 0.0,
                 "cpu_seconds": rusage.ru_utime + rusage.ru_stime if rusage else 0.0}
    if said is not None:
        said.pop("reused", None)
        res.update(said)
    elif hung:
        res.update(outcome=HANG, message=f"still running after {req['timeout']} s")
    elif status is not None and os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        res.update(outcome=CRASH, error=sig, message=f"killed by {sig}")
    elif not os.path.exists(run.result_path):
        code = os.WEXITSTATUS(status) if status is not None else "?"
        res.update(outcome=CRASH, error=f"exit {code}", message="exited without a result")
    else:
        with open(run.result_path) as f:
            res.update(json.load(f))
    if res["outcome"] == OK and res["max_rss_mb"] * (1 << 20) > req["rss_limit"]:
        res.update(outcome=BOMB, error="rss", message=f"peak RSS {res['max_rss_mb']:.0f} MB over the limit")
    shutil.rmtree(run.tmp, ignore_errors=True)
    return res


class _Zygote:
    """Starts tries and answers them in the order they end. A try whose request sets no
    environment runs in a shared runner of its limits (``_runner``; up to RUNNERS at
    once, forked on demand, replaced when one ends), any other, or every try when
    FRESH_ENV is set, in a fork of its own."""

    RUNNERS = 3

    def __init__(self, proto):
        self.proto = proto
        self.base = _status()
        self.fresh = os.environ.get(FRESH_ENV) == "1"
        self.forks: dict[int, _Try] = {}  # pid -> a try in a fork of its own
        self.runners: dict[int, _Runner] = {}  # pid -> runner
        self.queue: list[dict] = []  # requests waiting for a free runner
        self.open = True

    def start(self, req: dict) -> None:
        if self.fresh or req["fresh"] or req["env"] or req["rss_limit"] < RSS_LIMIT:
            run = _fork_one(req)
            self.forks[run.pid] = run
            return
        self.queue.append(req)
        self.dispatch()

    def dispatch(self) -> None:
        for req in list(self.queue):
            key = (req["as_limit"], req["fsize_limit"])
            idle = [r for r in self.runners.values() if r.busy is None and not r.gone and r.key == key]
            if not idle and len(self.runners) >= self.RUNNERS:
                spare = [r for r in self.runners.values() if r.busy is None and not r.gone]
                if not spare:
                    return  # every runner busy: it waits
                self.retire(spare[0])
            runner = max(idle, key=lambda r: r.used) if idle else self.spawn(key)  # the last used: its pages are copied
            runner.used = time.monotonic()
            self.queue.remove(req)
            run = _Try(req, _new_tmp(), time.monotonic(), runner=runner)
            runner.busy = run
            msg = {"target": req["target"], "kwargs": req["kwargs"], "fsize_limit": req["fsize_limit"],
                   "log": run.log_path}
            os.write(runner.requests, (json.dumps(msg) + "\n").encode())

    def spawn(self, key) -> _Runner:
        r = _fork_runner(key, self.base)
        self.runners[r.pid] = r
        return r

    def retire(self, r: _Runner) -> None:
        """End runner ``r`` (idle or hung) and reap it."""
        try:
            os.kill(r.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.reap(r)

    def reap(self, r: _Runner) -> tuple[int, object]:
        _, status, ru = os.wait4(r.pid, 0)
        for fd in (r.pidfd, r.requests, r.results):
            os.close(fd)
        del self.runners[r.pid]
        return status, ru

    def read(self, r: _Runner) -> None:
        """Answer what runner ``r`` has answered."""
        while True:
            try:
                data = os.read(r.results, 1 << 20)
            except BlockingIOError:
                break
            if not data:
                break
            r.buffer += data
        while b"\n" in r.buffer and r.busy is not None:
            line, r.buffer = r.buffer.split(b"\n", 1)
            said, run = json.loads(line), r.busy
            r.busy, r.gone = None, not said["reused"]
            self.say(run, _answer(run, None, None, False, said))

    def say(self, run: _Try, res: dict) -> None:
        if self.open:
            self.proto.write(json.dumps({"id": run.req.get("id"), **res}) + "\n")

    def fds(self) -> list[int]:
        return ([0] if self.open else []) + [t.pidfd for t in self.forks.values()] + \
            [fd for r in self.runners.values() for fd in (r.results, r.pidfd)]

    def next_deadline(self) -> float | None:
        tries = list(self.forks.values()) + [r.busy for r in self.runners.values() if r.busy]
        return min((t.deadline for t in tries), default=None)

    def poll(self, ready: set[int]) -> None:
        now = time.monotonic()
        for pid, run in list(self.forks.items()):
            if run.pidfd in ready or now >= run.deadline or not self.open:
                hung = run.pidfd not in ready and (now >= run.deadline or not self.open)
                if hung:
                    os.kill(pid, signal.SIGKILL)
                _, status, ru = os.wait4(pid, 0)
                os.close(run.pidfd)
                del self.forks[pid]
                self.say(run, _answer(run, status, ru, hung and self.open, None))
        for r in list(self.runners.values()):
            if r.results in ready or r.pidfd in ready:  # a runner that ended wrote its last answer before
                self.read(r)
            if r.pidfd in ready or (r.busy is not None and (now >= r.busy.deadline or not self.open)):
                run = r.busy
                hung = run is not None and r.pidfd not in ready
                if hung:
                    os.kill(r.pid, signal.SIGKILL)
                status, ru = self.reap(r)
                if run is not None:  # it died, or hung, in the middle of a try
                    self.say(run, _answer(run, status, ru if not hung else None, hung and self.open, None))
        self.dispatch()


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
    import tqdm

    tqdm.tqdm.monitor_interval = 0  # no monitor thread: a runner's tries would leave it behind (tqdm's own switch)
    target = os.environ.pop(WARM_UP_ENV, "")
    if target:
        mod, fn = target.split(":")
        getattr(importlib.import_module(mod), fn)()
    _settle(10.0)  # a transfer engine's idle threads exit by themselves: on a loaded machine, not at once
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
    from hugepages import collapse

    collapse()  # a fork then copies a few hundred page-table entries, not 100,000 (tests/hugepages.py)
    proto.write("ready\n")
    _serve(proto)


def _serve(proto) -> None:
    """Read requests from stdin and start each try at once; answer each (with its ``id``)
    as soon as it has ended, in the order they end. At the end of stdin the tries still
    running are killed (nobody will read their results)."""
    z = _Zygote(proto)
    pending = b""
    while z.open or z.forks or z.runners:
        if not z.open:  # stdin is gone: end what runs
            for pid in z.forks:
                os.kill(pid, signal.SIGKILL)
            for r in list(z.runners.values()):
                z.retire(r)
        wait = z.next_deadline()
        if wait is not None:
            wait = max(0.0, wait - time.monotonic())
        fds = z.fds()
        ready = set(select.select(fds, [], [], wait)[0]) if fds else set()
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:
                z.open = False
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.strip():
                    z.start(json.loads(line))
        z.poll(ready)


if __name__ == "__main__":
    _zygote()
