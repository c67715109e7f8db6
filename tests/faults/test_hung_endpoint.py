"""Against an endpoint that accepts connections and never answers, every operation
fails fast with a typed :class:`~cloudckpt.errors.Timeout` naming the endpoint, and a
slow transfer that keeps moving is not cut by the same deadline.

The hung endpoint is :class:`cloudckpt.testing.hung.SilentServer` on 127.0.0.1, used as
``AWS_ENDPOINT_URL`` (S3) and ``STORAGE_EMULATOR_HOST`` (GCS). Each operation's time is
printed (run with ``-s``); docs/configuration.md quotes them. Timings are not asserted
tightly: the default bound (120 s) with margin, and an explicit small timeout ends well
under 30 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from cloudckpt import CheckpointConfig, Checkpointer
from cloudckpt.errors import Timeout
from cloudckpt.storage import StorageOptions, clear_cache
from cloudckpt.testing.hung import SilentServer, ThrottledForwarder
from cloudckpt.transfer import TransferConfig

from .conftest import FAKE_SECRETS

KEY, SECRET, _ = FAKE_SECRETS
DEFAULT_BOUND = 120.0  # what the defaults promise (docs/configuration.md)
SMALL = 5.0  # an explicit operation_timeout / --timeout
SMALL_BOUND = 30.0


@pytest.fixture
def silent(monkeypatch):
    """A silent endpoint for both backends at once (S3 reads AWS_ENDPOINT_URL, GCS reads
    STORAGE_EMULATOR_HOST), with credentials that are never checked."""
    with SilentServer() as srv:
        env = {"AWS_ENDPOINT_URL": srv.endpoint_url, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
               "AWS_REGION": "us-east-1", "STORAGE_EMULATOR_HOST": srv.endpoint_url}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        clear_cache()
        srv.env = env
        yield srv
        clear_cache()


@dataclass
class CliResult:
    code: int
    err: str

    def one_line_error(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("cloudckpt: error:"), self.err
        return lines[0]


def cli(*args: str) -> CliResult:
    """``python -m cloudckpt ARGS`` with this process's environment."""
    p = subprocess.run([sys.executable, "-m", "cloudckpt", *args], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    return CliResult(p.returncode, p.stderr)


def _state() -> dict:
    return {"model": {"w": torch.arange(8, dtype=torch.float32)}}


def _operations(folder: str, work: str, timeout: float | None) -> dict:
    """name -> a call that fails against the silent endpoint: returns the error (the CLI:
    its result). ``timeout`` None: the defaults everywhere."""
    so = StorageOptions() if timeout is None else StorageOptions(operation_timeout=timeout)
    cli_opts = () if timeout is None else ("--timeout", str(timeout))
    step = folder + "/step1"

    def expect_error(fn):
        def run():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the test looks at what it is
                return e
            raise AssertionError("the operation succeeded against an endpoint that never answers")
        return run

    def save():
        with Checkpointer(work_dir=work + "/save", storage_options=so) as ck:
            ck.save(step, _state(), {"step": 1})

    def load():
        with Checkpointer(work_dir=work + "/load", storage_options=so) as ck:
            ck.load(step, _state())

    def resume():
        kw = {} if timeout is None else {"operation_timeout": timeout}
        mgr = CheckpointConfig(save_folder=folder, work_dir=work + "/mgr", **kw).build()
        try:
            mgr.resume(_state())
        finally:
            mgr.close()

    return {
        "cloudckpt list": lambda: cli("list", folder, *cli_opts),
        "cloudckpt latest": lambda: cli("latest", folder, *cli_opts),
        "Checkpointer.find_checkpoints": expect_error(
            lambda: list(Checkpointer.find_checkpoints(folder, storage_options=so))),
        "Checkpointer.latest_checkpoint": expect_error(
            lambda: Checkpointer.latest_checkpoint(folder, storage_options=so)),
        "CheckpointManager.resume": expect_error(resume),
        "Checkpointer.save": expect_error(save),
        "Checkpointer.load": expect_error(load),
    }


def _run_all(ops: dict) -> dict:
    """Run every operation at once (they only wait); name -> (seconds, outcome)."""

    def timed(fn):
        t0 = time.monotonic()
        out = fn()
        return time.monotonic() - t0, out

    with ThreadPoolExecutor(max_workers=len(ops)) as pool:
        futures = {name: pool.submit(timed, fn) for name, fn in ops.items()}
        return {name: f.result() for name, f in futures.items()}


def _check(results: dict, backend: str, endpoint: str, bound: float, label: str) -> None:
    port = endpoint.rsplit(":", 1)[1]
    for name, (seconds, out) in results.items():
        print(f"hung endpoint, {label}, {backend}: {name} failed after {seconds:.1f}s")
        if name.startswith("cloudckpt "):
            line = out.one_line_error()
            assert out.code == 5, (name, out.code, out.err)
            text = line
            assert "--timeout" in text and "operation_timeout" not in text, text  # the CLI names its flag
        else:
            assert isinstance(out, Timeout), f"{name}: {type(out).__name__}: {out}"
            text = str(out)
        assert re.search(rf"127\.0\.0\.1:{port}\b", text), f"{name}: the endpoint is not named: {text}"
        assert "operation_timeout" in text or name.startswith("cloudckpt "), text
        assert KEY not in text and SECRET not in text, text
        assert seconds < bound, f"{name} took {seconds:.1f}s (bound {bound:.0f}s)"


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_every_operation_fails_with_timeout_within_a_small_explicit_timeout(silent, backend, tmp_path):
    folder = f"{'s3' if backend == 's3' else 'gs'}://hung-bucket/run"
    results = _run_all(_operations(folder, str(tmp_path), SMALL))
    _check(results, backend, silent.endpoint_url, SMALL_BOUND, f"--timeout {SMALL:g}")


@pytest.mark.slow  # waits out the default timeouts on both backends: about a minute
def test_default_bounds_end_every_operation_on_both_backends_within_120s(silent, tmp_path):
    """The defaults (connect 10 s, read 30 s, operation 60 s): about 60 s each."""
    ops = {}
    for backend, scheme in (("s3", "s3"), ("gcs", "gs")):
        for name, fn in _operations(f"{scheme}://hung-bucket/run", str(tmp_path / backend), None).items():
            ops[(backend, name)] = fn
    results = _run_all(ops)
    for backend in ("s3", "gcs"):
        mine = {name: r for (b, name), r in results.items() if b == backend}
        _check(mine, backend, silent.endpoint_url, DEFAULT_BOUND - 10, "defaults")


def test_a_slow_but_progressing_save_and_load_are_not_cut_by_the_deadline(seaweed, s3_bucket, monkeypatch, tmp_path):
    """Through a link of 4 MiB/s each way, a 24 MiB shard takes ~6 s to upload and again
    to load, twice operation_timeout=3 (and so twice every socket timeout): both succeed
    without a single retry. (The OS may still hold up to a few MiB of an upload when the
    client has written its last byte; the answer has to come within read_timeout after
    that, docs/configuration.md.)"""
    rate, n = 4 * 1024 * 1024, 6 * 1024 * 1024  # 24 MiB of float32
    with ThrottledForwarder(seaweed.endpoint_url, rate=rate) as slow:
        monkeypatch.setenv("AWS_ENDPOINT_URL", slow.endpoint_url)
        clear_cache()
        so = StorageOptions(operation_timeout=3.0)
        state = {"model": {"w": torch.randn(n)}}
        step = s3_bucket + "/run/step1"
        with Checkpointer(work_dir=str(tmp_path / "w"), storage_options=so,
                          transfer=TransferConfig(stall_timeout=10)) as ck:
            t0 = time.monotonic()
            ck.save(step, state, {"step": 1})
            saved = time.monotonic() - t0
            target = {"model": {"w": torch.zeros(n)}}
            t0 = time.monotonic()
            assert ck.load(step, target) == {"step": 1}
            loaded = time.monotonic() - t0
            stats = ck.engine.stats()
        print(f"slow link ({rate / 2**20:g} MiB/s), operation_timeout=3s: save {saved:.1f}s, load {loaded:.1f}s, "
              f"retries {stats.retries}, SDK retries {stats.sdk_retries}")
        assert torch.equal(target["model"]["w"], state["model"]["w"])
        assert saved > 2 * so.operation_timeout and loaded > 2 * so.operation_timeout, "the link was not slow"
        assert stats.retries == 0 and stats.sdk_retries == 0, stats
    clear_cache()
