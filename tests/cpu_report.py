"""CPU time per test file, with every process a test started: ``TEST_CPU_REPORT=DIR``
makes each pytest process (each xdist worker) write ``DIR/cpu-<worker>.tsv`` with one
line per test file: the CPU-seconds (user + system) of the test process and of every
process below it (ranks, sandbox tries, servers, CLI subprocesses) while the file's
tests ran, and their wall seconds. What the suite's time is spent on, to see which files
to make cheaper (issue: the suite's time)::

    TEST_CPU_REPORT=/tmp/cpu make test
    sort -t$'\\t' -k2 -rn /tmp/cpu/cpu-*.tsv | head -30

A process's own CPU and that of the children it reaped are read from
``/proc/<pid>/stat``; a child still running at a boundary is counted by what it used so
far, so a long-lived server's CPU goes to the files that ran while it served them.
"""

from __future__ import annotations

import os
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
ENV = "TEST_CPU_REPORT"  # not CLOUDCKPT_*: those are checkpoint config overrides
NAME = "cloudckpt-cpu-report"


def register(config) -> None:
    """Install the report in this pytest process when ``$TEST_CPU_REPORT`` names a folder
    (tests/conftest.py calls it; ``pytest -p cpu_report`` does it through the hook below)."""
    if os.environ.get(ENV) and not config.pluginmanager.has_plugin(NAME):
        config.pluginmanager.register(CpuReport(os.environ[ENV]), NAME)


def pytest_configure(config) -> None:
    register(config)


def _tree_cpu(root: int) -> float:
    """CPU-seconds of ``root`` and every process below it (alive, or reaped by one alive)."""
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rindex(b")") + 2:].split()
        ppid = int(rest[1])
        cpu = sum(int(x) for x in rest[11:15]) / _TICK  # utime stime cutime cstime
        stats[int(name)] = (ppid, cpu)
    below: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        below.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(below.get(pid, ()))
    return total


class CpuReport:
    """The pytest plugin: CPU and wall per test file (module docstring)."""

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.path = os.path.join(folder, f"cpu-{worker}.tsv")
        self.per_file: dict[str, list[float]] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        c0, t0 = _tree_cpu(os.getpid()), time.monotonic()
        yield
        acc = self.per_file.setdefault(item.nodeid.split("::", 1)[0], [0.0, 0.0])
        acc[0] += _tree_cpu(os.getpid()) - c0
        acc[1] += time.monotonic() - t0

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            for name, (cpu, wall) in sorted(self.per_file.items(), key=lambda kv: -kv[1][0]):
                f.write(f"{name}\t{cpu:.1f}\t{wall:.1f}\n")
