"""The venvs of the integrations whose pins conflict with .venv (OLMo-core, torchtitan) and
of checkov, built in the background from the moment a session has collected a test that
needs one, instead of when that test starts.

Each is built by its idempotent script (``scripts/setup_olmo_venv.sh``,
``scripts/setup_torchtitan_venv.sh``, ``scripts/checkov_venv.sh``: one to two minutes of
pip on a fresh machine, nothing once built). The tests still run the script themselves
(``run_script``) and fail with its log when it fails: the background build only starts
it earlier, so that its downloads and unpacking overlap the tests that run first instead
of holding up the worker that reaches the test. Both the background build and the test
run the script under one lock per script (``flock``), so the two workers of
``make test``, which both collect every test, never run pip into the same venv at once:
whoever comes second waits for the lock and finds the venv built.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# the script that builds a venv -> the fixture of the tests that need it
SCRIPTS = {
    "setup_olmo_venv.sh": "olmo_python",
    "setup_torchtitan_venv.sh": "titan_python",
    "setup_megatron_venv.sh": "megatron_python",
    "checkov_venv.sh": "checkov_report",
}


def _lock_path(script: str) -> str:
    tag = hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"cloudckpt-venv-{tag}-{script}.lock")


def run_script(script: str, timeout: float) -> subprocess.CompletedProcess:
    """``bash scripts/{script}`` under the script's lock (waiting for a build in progress,
    within ``timeout`` seconds in all); its output captured."""
    deadline = time.monotonic() + timeout
    with open(_lock_path(script), "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(["bash", f"scripts/{script}"], timeout) from None
                time.sleep(1)
        return subprocess.run(["bash", str(REPO / "scripts" / script)], cwd=REPO, capture_output=True, text=True,
                              timeout=max(1.0, deadline - time.monotonic()))


def start_needed(items) -> list[str]:
    """Start, in the background, the build of each venv that one of the collected ``items``
    needs (its fixture); returns the scripts started. ``CLOUDCKPT_TEST_NO_PREBUILD=1``
    leaves every build to the test that needs it."""
    if os.environ.get("CLOUDCKPT_TEST_NO_PREBUILD") == "1":
        return []
    needed = {fx for item in items for fx in getattr(item, "fixturenames", ())}
    started = []
    for script, fixture in SCRIPTS.items():
        if fixture in needed:
            subprocess.Popen([sys.executable, __file__, script], cwd=REPO, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            started.append(script)
    return started


if __name__ == "__main__":  # the background build: its result is read again by the test that needs it
    try:
        run_script(sys.argv[1], timeout=1800)
    except subprocess.TimeoutExpired:
        sys.exit(1)
