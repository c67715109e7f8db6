"""``TEST_CPU_REPORT`` (tests/cpu_report.py, docs/development.md): a pytest run writes the
CPU-seconds of each test file with every process its tests started, and its wall time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BURN = """
import subprocess, sys, time

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.6: pass"], check=True)
"""
IDLE = """
import time

def test_waits():
    time.sleep(0.6)
"""


def test_the_report_counts_a_childs_cpu_for_its_file_and_not_a_wait(tmp_path):
    (tmp_path / "test_burn.py").write_text(BURN)
    (tmp_path / "test_idle.py").write_text(IDLE)
    out = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # not a worker: cpu-main
    env = {**env, "TEST_CPU_REPORT": str(out),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cpu_report", "-p", "no:cacheprovider",
                        "test_burn.py", "test_idle.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {name: (float(cpu), float(wall)) for name, cpu, wall in
            (line.split("\t") for line in (out / "cpu-main.tsv").read_text().splitlines())}
    assert set(rows) == {"test_burn.py", "test_idle.py"}, rows
    assert rows["test_burn.py"][0] >= 0.5, rows  # the child's 0.6 s, counted once it was reaped
    assert rows["test_idle.py"][0] < 0.3 <= 0.5 <= rows["test_idle.py"][1], rows  # a wait: wall, no CPU
