"""What every rank of a benchmark case does, for every tool (ours and the peers).

``run_case(rank, world_size, args)`` builds the state, runs one operation of one
tool between two barriers, and returns this rank's figures. It imports only
torch at module level (the peers' venvs have no cloudckpt); the tool module is
imported by name from ``bench/peers/``.

A tool module defines ``save(url, sd, ctx)`` and ``load(url, sd, ctx)``; ``ctx``
carries rank, world size and options (e.g. ``pre_download``). Timing: from a
barrier before the call to a barrier after it, so the figure is the slowest rank's.

Memory (load): ``peak_rss_above_baseline`` is the kernel's peak RSS during state
allocation + load minus the RSS before the load target was allocated; the target
is "the bytes this rank loads", so the ratio to ``local_bytes`` includes the
target itself (1.0 = no overhead at all).

CPU: user + system seconds of the rank's process (all its threads) during the
operation, from ``getrusage``.

HTTP requests: counted at the HTTP layer of botocore (``URLLib3Session.send``)
and of requests (google-cloud-storage), every attempt included. Tools using
other HTTP stacks (s3torchconnector's CRT client, s3fs's aiohttp) report None.
"""

from __future__ import annotations

import importlib
import os
import resource
import threading
import time

from bench import state as S


def self_cpu() -> float:
    """CPU seconds (user + system) of this process, every thread: a rank, or the bench
    itself for the tools it runs in-process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

TOOLS = {
    "cloudckpt": "bench.peers.cloudckpt_tool",
    "olmo": "bench.peers.olmo",
    "s3tc": "bench.peers.s3tc",
    "fsspec": "bench.peers.fsspec_s3",
    "dcp_local": "bench.peers.dcp_local",
}


class HttpCounter:
    """Counts HTTP requests sent by botocore and requests in this process."""

    _installed = False
    n = 0
    _lock = threading.Lock()

    @classmethod
    def install(cls) -> "type[HttpCounter]":
        if cls._installed:
            return cls
        cls._installed = True

        def wrap(owner, name):
            real = getattr(owner, name)

            def send(self, *a, **kw):
                with cls._lock:
                    cls.n += 1
                return real(self, *a, **kw)

            setattr(owner, name, send)

        try:
            from botocore.httpsession import URLLib3Session

            wrap(URLLib3Session, "send")
        except ImportError:
            pass
        try:
            import requests

            wrap(requests.Session, "send")
        except ImportError:
            pass
        return cls


def _counts_http(tool: str, url: str) -> bool:
    return tool in ("cloudckpt", "olmo")


def run_case(rank: int, world_size: int, args: dict) -> dict:
    tool = importlib.import_module(TOOLS[args["tool"]])
    op, url, nbytes = args["op"], args["url"], int(args["bytes"])
    counter = HttpCounter.install()
    ctx = {"rank": rank, "world_size": world_size, **args}
    if hasattr(tool, "setup"):
        tool.setup(ctx)  # clients, groups: not timed
    S.trim_malloc()
    baseline = S.rss()
    S.reset_peak()
    out: dict = {"rank": rank, "tool": args["tool"], "op": op}
    if op in ("save", "write_local"):
        sd = S.build_state(world_size, nbytes)
        out["fingerprint"] = S.full_fingerprint(sd)
        out["local_bytes"] = S.local_bytes(sd)
        staged = S.rss()
        S.barrier()
        S.reset_peak()
        n0, c0 = counter.n, self_cpu()
        t0 = time.perf_counter()
        info = tool.save(url, sd, ctx) or {}
        S.barrier()
        out["seconds"] = time.perf_counter() - t0
        out["cpu_s"] = self_cpu() - c0
        out["peak_rss_above_state"] = S.peak_rss() - staged
    elif op == "load":
        sd = S.build_state(world_size, nbytes, zero=True)
        out["local_bytes"] = S.local_bytes(sd)
        S.barrier()
        n0, c0 = counter.n, self_cpu()
        t0 = time.perf_counter()
        info = tool.load(url, sd, ctx) or {}
        S.barrier()
        out["seconds"] = time.perf_counter() - t0
        out["cpu_s"] = self_cpu() - c0
        out["peak_rss_above_baseline"] = S.peak_rss() - baseline
        out["fingerprint"] = S.full_fingerprint(sd)
    else:
        raise ValueError(f"unknown op {op!r}")
    out["requests"] = counter.n - n0 if _counts_http(args["tool"], url) else None
    out["baseline_rss"] = baseline
    out.update(info)
    if hasattr(tool, "teardown"):
        tool.teardown(ctx)
    return out


def cloudckpt_case(rank: int, world_size: int, args: dict) -> dict:
    """Entry point for ``cloudckpt.testing.multiprocess.run_ranks`` (dist already initialised)."""
    os.environ.setdefault("CLOUDCKPT_BENCH", "1")
    return run_case(rank, world_size, args)
