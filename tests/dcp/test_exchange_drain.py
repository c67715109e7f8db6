"""After a failed read-once exchange no thread of the exchange is left waiting in gloo
(issue 44, item 7c). A thread blocked in a gloo receive when the process exits dies
inside gloo: ``terminate called without an active exception`` (SIGABRT), seen on the
rank that was not at fault. Here 2 real gloo ranks load a DDP step (every item shared:
each rank reads half and sends it to the other); rank 1's own bucket read fails part-way.
Both loads must raise (rank 1 its own error, rank 0 ExchangeFailed naming rank 1), with
no exchange thread alive once they have, then load again on the same group (the failed
load's messages match nothing of the next: its tags carry the load's number), and both
processes must exit cleanly (exit code 0, no ``terminate called`` on stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ITEMS, NUMEL = 24, 4096  # 16 KiB items: several in flight each way


def drain(rank, world, root, work):
    import threading

    import torch

    from bench.exchange import flat, state
    from cloudckpt import Checkpointer
    from cloudckpt.dcp import reader as reader_mod
    from cloudckpt.errors import CorruptCheckpoint

    ck = Checkpointer(work_dir=work, collective_timeout=20)
    step = f"{root}/ddp/step1"
    ck.save(step, state("ddp", rank, ITEMS, NUMEL), {"rank": rank})
    check, seen = reader_mod.StreamingReader._check, []
    if rank == 1:
        def failing(self, rel, offset, length, data, url, **kw):
            seen.append(offset)
            if len(seen) == 3:
                raise CorruptCheckpoint(f"{url}: planted at offset {offset}")
            return check(self, rel, offset, length, data, url, **kw)

        reader_mod.StreamingReader._check = failing
    try:
        ck.load(step, state("ddp", rank, ITEMS, NUMEL, zero=True))
        raised = None
    except Exception as e:  # noqa: BLE001 - reported
        raised = f"{type(e).__name__}: {e}"
    left = [t.name for t in threading.enumerate() if t.name.startswith("cloudckpt-exchange")]
    reader_mod.StreamingReader._check = check
    target = state("ddp", rank, ITEMS, NUMEL, zero=True)
    ck.load(step, target)  # the same exchange group, the next load
    want, got = flat(state("ddp", rank, ITEMS, NUMEL)), flat(target)
    return {"raised": raised, "left": left, "again": all(torch.equal(want[k], got[k]) for k in want)}


def test_a_failed_exchange_leaves_no_thread_in_gloo_and_both_ranks_exit_cleanly(tmp_path):
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.getcwd()!r})
        from cloudckpt.testing.multiprocess import run_ranks
        from tests.dcp.test_exchange_drain import drain
        print("RESULT", json.dumps(run_ranks(2, drain, {str(tmp_path / 'run')!r}, {str(tmp_path / 'w')!r},
                                             timeout=120)))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                       cwd=os.getcwd())
    assert p.returncode == 0, p.stderr[-4000:]
    assert "terminate called" not in p.stderr, p.stderr[-4000:]
    import json

    out = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT "):])
    r0, r1 = out
    assert r1["raised"].startswith("CorruptCheckpoint") and "planted" in r1["raised"], r1
    assert r0["raised"].startswith("ExchangeFailed") and "rank 1" in r0["raised"], r0
    assert r0["left"] == [] and r1["left"] == [], out  # no exchange thread outlives the failed load
    assert r0["again"] and r1["again"], out
