"""Helpers for the CLI tests: run ``python -m cloudckpt`` as a subprocess against
SeaweedFS, fake-gcs-server and local folders, and build small runs to look at."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

BACKENDS = ["local", "s3", "gcs"]


@dataclass
class Result:
    code: int
    out: str
    err: str
    seconds: float

    def json(self):
        """The one JSON object a command printed with --json: exactly one line."""
        assert self.out.count("\n") == 1 and self.out.endswith("\n"), self.out
        return json.loads(self.out)

    def lines(self) -> list:
        """The objects of JSON Lines output (``list --json``): one per line."""
        return [json.loads(ln) for ln in self.out.splitlines()]

    def assert_one_line_error(self) -> str:
        """stderr is exactly one line starting ``cloudckpt:``, with no traceback; returns it."""
        lines = [ln for ln in self.err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("cloudckpt:"), self.err
        assert "Traceback" not in self.err
        return lines[0]


def _runner():
    """``subprocess.run``, or in the suite its stand-in that forks ``python -m cloudckpt``
    from the ranks' warm forkserver (tests/warm_ranks.py ``WarmModules``: a process of its
    own, with the command's environment, working directory, argv, stdin from /dev/null
    and its own stdout and stderr, without a Python start-up and the SDKs' imports
    each time). ``CLI_SPAWN=1`` runs the real interpreter, as the import-time tests do."""
    from cloudckpt.testing import multiprocess

    spawn = multiprocess.mp
    if os.environ.get("CLI_SPAWN") == "1" or type(spawn).__name__ != "WarmSpawn":
        return subprocess.run
    from warm_ranks import WarmModules

    return WarmModules(spawn, prefixes=("cloudckpt",)).run


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> Result:
    """Run ``python -m cloudckpt ARGS`` with the current environment (plus ``env``)."""
    import time

    full_env = dict(os.environ)
    full_env.update(env or {})
    t0 = time.perf_counter()
    p = _runner()([sys.executable, "-m", "cloudckpt", *map(str, args)], env=full_env, capture_output=True, text=True,
                  timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr, time.perf_counter() - t0)


def new_root(backend: str, stores: dict, tmp_path_factory) -> str:
    """A fresh, empty folder on ``backend``: a local temp dir or a new bucket."""
    name = "cli-" + uuid.uuid4().hex[:16]
    if backend == "local":
        return str(tmp_path_factory.mktemp("cli") / "root")
    if backend == "s3":
        return stores["seaweed"].create_bucket(name) + "/root"
    return stores["fake_gcs"].create_bucket(name) + "/root"


def save_steps(folder: str, steps: list[tuple[int, bool]], work_dir: str) -> None:
    """Real checkpoints made with the Checkpointer: ``(step, ephemeral)``."""
    import torch

    from cloudckpt import Checkpointer

    with Checkpointer(work_dir=work_dir) as ck:
        for step, eph in steps:
            sd = {"model": {"w": torch.full((4,), float(step)), "b": torch.zeros(2, 3, dtype=torch.bfloat16)},
                  "optim": {"lr": 0.1}}
            ck.save(urls.join(folder, f"step{step}"), sd, {"step": step, "tokens": step * 1000, "rng": [1, 2, 3]},
                    ephemeral=eph)


def write_fake_steps(folder: str, steps: dict[int, bool], *, threads: int = 32, object_size: int = 0) -> None:
    """Commit markers written directly (fast), for listing/pruning tests: each step gets
    one object ``train/rank0.pt`` of ``object_size`` bytes (none when 0) and a valid marker."""
    import json
    import time

    import google_crc32c

    store = open_store(folder)
    body = b"x" * object_size

    def one(item):
        step, eph = item
        dir = urls.join(folder, f"step{step}")
        objects = []
        if object_size:
            store.put_bytes(urls.join(dir, "train/rank0.pt"), body)
            objects = [{"path": "train/rank0.pt", "size": len(body), "crc32c": f"{google_crc32c.value(body):08x}"}]
        # the marker as raw JSON, from the schema in docs/protocol.md (not the library's Marker class)
        now = time.time()
        marker = {"format": "cloudckpt", "format_version": 1, "step": step, "ephemeral": eph, "world_size": 1,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now)), "created_unix": now,
                  "library_version": "test", "torch_version": "", "save_id": "",
                  "total_bytes": len(body) if objects else 0,
                  "object_count": len(objects), "objects": objects}
        store.put_bytes(urls.join(dir, ".metadata.json"), json.dumps(marker).encode())

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(one, steps.items()))


def write_incomplete_step(folder: str, step: int) -> str:
    """A step folder with an object but no marker (a crashed save)."""
    dir = urls.join(folder, f"step{step}")
    open_store(dir).put_bytes(urls.join(dir, "train/rank0.pt"), b"partial")
    return dir
