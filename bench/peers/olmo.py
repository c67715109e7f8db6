"""OLMo-core (``ai2-olmo-core``) as a benchmark peer: its trainer ``Checkpointer``
(``save`` -> ``save_state_dict`` with its ``RemoteFileSystemWriter``, train state
and ``.metadata.json``; ``load`` -> ``load_state_dict``), default settings, and its
``Checkpointer.latest_checkpoint`` for the discovery case.

OLMo-core reads ``s3://`` with a boto3 client whose endpoint comes from the
standard AWS env (``AWS_ENDPOINT_URL``), so it talks to the bench's SeaweedFS as is.

Discovery, run as a script in the OLMo venv::

    .venv-bench-olmo/bin/python bench/peers/olmo.py latest s3://bench/disc --reps 3 --out r.json
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

_ck = None


class _Module:
    """The part of OLMo-core's TrainModule interface its Checkpointer calls."""

    def __init__(self, sd):
        self.sd = sd

    def state_dict_to_save(self):
        return self.sd

    def state_dict_to_load(self, metadata, optim=None):
        return self.sd

    def load_state_dict(self, sd):
        pass  # DCP loaded in place


def setup(ctx) -> None:
    global _ck
    from olmo_core.train.checkpoint import Checkpointer

    work = os.path.join(tempfile.gettempdir(), "olmo-bench-work")
    _ck = Checkpointer(work_dir=Path(work))


def save(url, sd, ctx):
    _ck.save(f"{url}/step1", _Module(sd), {"rank": ctx["rank"], "step": 1})
    return {}


def load(url, sd, ctx):
    _ck.load(f"{url}/step1", _Module(sd), load_trainer_state=False)
    return {}


def _latest(url: str, reps: int) -> dict:
    import time

    from olmo_core.train.checkpoint import Checkpointer

    from bench.ranks import HttpCounter

    counter = HttpCounter.install()
    runs = []
    for _ in range(reps):
        n0 = counter.n
        t0 = time.perf_counter()
        found = Checkpointer.latest_checkpoint(url)
        runs.append({"seconds": time.perf_counter() - t0, "requests": counter.n - n0, "found": found})
    return {"ok": True, "runs": runs}


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["latest"])
    ap.add_argument("url")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        res = _latest(a.url, a.reps)
    except Exception as e:  # noqa: BLE001 - reported as the row's error
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    Path(a.out).write_text(json.dumps(res))
