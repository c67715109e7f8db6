"""SIGTERM during an async save: 'finish' commits it before exiting, 'abandon' leaves it invisible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from cloudckpt.checkpoint import discovery

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from cloudckpt import CheckpointConfig
    mgr = CheckpointConfig(save_folder=sys.argv[1], work_dir=sys.argv[2], save_interval=1, async_save=True,
                           bandwidth_limit="1MB/s", sigterm=sys.argv[3], exact_resume=False).build()
    # 12 MiB at 1 MB/s: ~12.6 s in flight, so a test process held up for seconds between reading
    # SAVING and sending SIGTERM (a busy 2-core machine did that with 4 s) still signals a save in flight
    mgr.maybe_save(1, {"w": torch.randn(3 * 1024 * 1024)}, {"step": 1})
    print("SAVING", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("mode", ["finish", "abandon"])
def test_sigterm_finishes_or_abandons_the_in_flight_save(mode, tmp_path):
    folder = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, folder, str(tmp_path / "w"), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "SAVING"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGTERM, err  # the process still exits with the signal
    committed = discovery.dir_is_checkpoint(os.path.join(folder, "step1"))
    assert committed == (mode == "finish"), err
    assert ("finishing 1 in-flight save" in err) == (mode == "finish")
