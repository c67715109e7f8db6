"""cloudckpt itself, as a benchmark tool: ``Checkpointer.save`` / ``Checkpointer.load``
(streaming by default, ``pre_download`` when the case asks for it), default settings."""

from __future__ import annotations

import os
import tempfile

_ck = None


def setup(ctx) -> None:
    global _ck
    from cloudckpt import Checkpointer

    work = os.path.join(tempfile.gettempdir(), "cloudckpt-bench-work")
    # constructing it creates the checkpointer's gloo group (a collective): not timed
    _ck = Checkpointer(work_dir=work, pre_download=bool(ctx.get("pre_download")))


def save(url, sd, ctx):
    _ck.save(f"{url}/step1", sd, {"rank": ctx["rank"], "step": 1})
    s = _ck.last_save_stats
    return {"objects": s.objects, "retries": s.retries, "throttled": s.throttled}


def load(url, sd, ctx):
    _ck.load(f"{url}/step1", sd, load_trainer_state=False)
    return {}


def teardown(ctx) -> None:
    global _ck
    _ck.close()
    _ck = None
