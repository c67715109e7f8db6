"""One pool of Megatron ranks for the Megatron tests: ``mcore_tool.py serve`` (its docstring
says what a command is) started once per test session, so that Megatron is imported
twice in all instead of twice per command (~8 s of CPU each on a 2-core machine).

Each command still runs in a gloo process group of its own, with the world size it
names, and each test checks its own answers: what the pool shares is the processes and
their imports, not state (Megatron's parallel state and every process group are
destroyed after each command). A command that fails, times out or kills a rank fails
its test with the ranks' output and the pool's log; the pool is then started again for
the next test.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from pathlib import Path

TOOL = Path(__file__).parent / "megatron" / "mcore_tool.py"


class PoolError(Exception):
    """The pool did not answer a command (it died or passed the time limit)."""


class McorePool:
    """The client of ``mcore_tool.py serve --world W`` run by ``python`` with ``env``;
    the pool's stderr goes to ``log``."""

    def __init__(self, python: str, env: dict, log: Path, *, world: int = 2, start_timeout: float = 300):
        self.python, self.env, self.log, self.world, self.start_timeout = python, env, log, world, start_timeout
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        with open(self.log, "a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([self.python, str(TOOL), "serve", "--world", str(self.world)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env=self.env, start_new_session=True)  # its ranks: one group to kill
        self._answer("the pool's start (Megatron's imports)", self.start_timeout)

    def _answer(self, what: str, timeout: float) -> dict:
        """The pool's next answer line, or PoolError (the pool is killed) after ``timeout``."""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=1):
                line = self.proc.stdout.readline()
                if line:
                    return json.loads(line)
                break  # the pool exited
        exited = self.proc.poll()
        self.kill()
        raise PoolError(f"mcore_tool serve gave no answer to {what} "
                        f"({'it exited ' + str(exited) if exited is not None else f'within {timeout:.0f}s'}); "
                        f"its log ({self.log}):\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def run(self, argv: list[str], *, env: dict | None = None, timeout: float = 240) -> dict:
        """Run one command on the pool (started again if it is not running). Returns its
        answer, ``{"ok": bool, "ranks": {"0": {"status", "out"}, …}}``. Raises PoolError."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env or {}}) + "\n")
        self.proc.stdin.flush()
        return self._answer(" ".join(argv), timeout)

    def kill(self) -> None:
        """SIGKILL the pool and its ranks (one process group)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        """End the pool: its ranks leave when stdin closes; what is still running after 2 s
        (a helper process Megatron started in a rank) is killed."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

