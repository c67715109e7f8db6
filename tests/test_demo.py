"""The README's main job (``make demo``) runs as a user runs it and does what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_make_demo_trains_is_preempted_resumes_exactly_and_lists_the_checkpoints():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "== preempting the job at step 23" in out, out[-4000:]
    # resumed from the newest committed step before the kill, and the steps run 1 took
    # after it were taken again with the same losses (the demo fails otherwise)
    m = re.search(r"RESUMED from step (\d+)", out)
    assert m and int(m.group(1)) in (20, 25), out[-4000:]
    assert re.search(r"== resumed at step \d+: steps \d+-23 repeat run 1's losses exactly", out) \
        or int(m.group(1)) == 25, out[-4000:]
    assert "DONE at step 40" in out
    # the listing: max_checkpoints 3 persistent (20, 30, 40) and keep_last_ephemeral 1 (35)
    listed = [int(s) for s in re.findall(r"^\s+(\d+)\s+(?:persistent|ephemeral)\s", out, re.M)]
    assert listed == [20, 30, 35, 40], out[-2000:]
    assert "4 committed (3 persistent, 1 ephemeral)" in out
    assert "SeaweedFS stopped" in out
