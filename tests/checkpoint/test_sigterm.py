"""SIGTERM during an async save: 'finish' commits it before exiting, 'abandon' leaves it
invisible; with the node-local tier, the same for the upload of a local step to the bucket."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from cloudckpt.checkpoint import discovery

SCRIPT = textwrap.dedent("""
    import logging, sys, threading, time, torch
    from cloudckpt import CheckpointConfig
    from cloudckpt.storage.local import LocalStore

    # Every upload of the save is held in the store until the SIGTERM handler says it is
    # finishing the in-flight save (its log line): the save is in flight when the signal
    # comes, whatever the machine's load, and "abandon" never lets it go on.
    reached, finishing = threading.Event(), threading.Event()
    real_upload = LocalStore.upload_fileobj

    def held_upload(self, *args, **kwargs):
        reached.set()
        finishing.wait(120)
        return real_upload(self, *args, **kwargs)

    LocalStore.upload_fileobj = held_upload

    class OnFinishing(logging.Handler):
        def emit(self, record):
            if "finishing" in record.getMessage():
                finishing.set()

    logging.basicConfig(level=logging.WARNING)  # the handler's warnings still reach stderr
    logging.getLogger("cloudckpt").addHandler(OnFinishing())
    local = dict(local_dir=sys.argv[2] + "/local", local_save_interval=1) if sys.argv[4] == "local" else {}
    mgr = CheckpointConfig(save_folder=sys.argv[1], work_dir=sys.argv[2], save_interval=1, async_save=True,
                           sigterm=sys.argv[3], exact_resume=False, **local).build()
    mgr.maybe_save(1, {"w": torch.randn(1024)}, {"step": 1})
    assert reached.wait(60), "the async save never started uploading"
    print("SAVING", flush=True)
    # short sleeps: the kernel may deliver SIGTERM to another thread, and then a long sleep of
    # the main thread is not interrupted (Python runs the handler when the main thread wakes)
    for _ in range(2400):
        time.sleep(0.05)
""")


@pytest.mark.parametrize("tier", ["bucket", "local"])
@pytest.mark.parametrize("mode", ["finish", "abandon"])
def test_sigterm_finishes_or_abandons_the_in_flight_save(mode, tier, tmp_path):
    folder = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, folder, str(tmp_path / "w"), mode, tier],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "SAVING"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:  # it hung: fail without leaving it behind
            p.kill()
            p.communicate()
    assert p.returncode == -signal.SIGTERM, err  # the process still exits with the signal
    committed = discovery.dir_is_checkpoint(os.path.join(folder, "step1"))
    assert committed == (mode == "finish"), err
    assert (re.search(r"finishing \d in-flight save", err) is not None) == (mode == "finish")
    if tier == "local":  # the local step was written whatever the mode
        assert os.path.isfile(tmp_path / "w" / "local" / "step1" / "rank0" / "part.json"), err
