"""Fixtures of the fault suite: fault proxies in front of the real local stores, and
the credential-leak scan that every test of this folder runs under."""

from __future__ import annotations

import logging
import os

import pytest

from cloudckpt.storage import clear_cache
from cloudckpt.testing.faultproxy import FaultProxy

# Credentials that must never show up in a log line or an error message. Bad-input
# cases use these on purpose (wrong keys); the servers' own keys are added per test.
FAKE_SECRETS = ("AKWRONGKEY0123456789", "wrong-secret-Zm9vYmFyYmF6cXV4", "/tmp/cloudckpt-no-such-adc-file.json")


class SecretScan:
    """Collects every log record (any logger, any level from INFO; cloudckpt from
    DEBUG) and every text a test adds (error messages, rank logs); at teardown none
    may contain a credential."""

    def __init__(self) -> None:
        self.secrets: set[str] = set(FAKE_SECRETS)
        self.texts: list[str] = []
        self.records: list[logging.LogRecord] = []

    def add(self, *texts: str) -> None:
        self.texts.extend(str(t) for t in texts)

    def lines(self) -> list[str]:
        out = []
        for r in self.records:
            try:
                out.append(r.getMessage())
            except Exception:  # noqa: BLE001 - a malformed record: scan its raw parts
                out.append(f"{r.msg} {r.args}")
            if r.exc_info and r.exc_info[1] is not None:
                out.append(str(r.exc_info[1]))
        return out + self.texts

    def check(self) -> None:
        for line in self.lines():
            for s in self.secrets:
                assert s not in line, f"a credential leaked into a log line or error message: {line[:300]!r}"


class _Capture(logging.Handler):
    def __init__(self, scan: SecretScan):
        super().__init__(level=logging.DEBUG)
        self.scan = scan

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.INFO or record.name.startswith("cloudckpt"):
            self.scan.records.append(record)


@pytest.fixture(autouse=True)
def secret_scan(request):
    """Autouse: every test of tests/faults is scanned for leaked credentials."""
    scan = SecretScan()
    for name in ("seaweed", "moto_s3"):
        if name in request.fixturenames:
            srv = request.getfixturevalue(name)
            scan.secrets |= {v for k, v in vars(srv).items() if "key" in k and isinstance(v, str)}
            scan.secrets |= {getattr(type(srv), a) for a in ("access_key", "secret_key")
                             if isinstance(getattr(type(srv), a, None), str)}
    handler = _Capture(scan)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(min(old_level or logging.WARNING, logging.INFO))
    cl = logging.getLogger("cloudckpt")
    old_cl = cl.level
    cl.setLevel(logging.DEBUG)
    try:
        yield scan
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        cl.setLevel(old_cl)
    scan.check()


@pytest.fixture
def s3_proxy(seaweed, s3_bucket, monkeypatch, secret_scan):
    """A FaultProxy in front of SeaweedFS; the env (and so every rank) talks to the proxy."""
    secret_scan.secrets |= {seaweed.access_key, seaweed.secret_key, seaweed.ro_access_key, seaweed.ro_secret_key}
    with FaultProxy(seaweed.endpoint_url, seed=int(os.environ.get("CLOUDCKPT_FAULT_SEED", "0")), flavor="s3") as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint_url)
        clear_cache()
        p.bucket = s3_bucket
        yield p
        clear_cache()


@pytest.fixture
def gcs_proxy(fake_gcs, gcs_bucket, monkeypatch):
    """A FaultProxy in front of fake-gcs-server; STORAGE_EMULATOR_HOST points at the proxy."""
    with FaultProxy(fake_gcs.endpoint_url, seed=int(os.environ.get("CLOUDCKPT_FAULT_SEED", "0")), flavor="gcs") as p:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.endpoint_url)
        clear_cache()
        p.bucket = gcs_bucket
        yield p
        clear_cache()


@pytest.fixture(params=["s3", "gcs"])
def proxy(request):
    """A fault proxy in front of each emulator that allows it (S3: SeaweedFS, GCS: fake-gcs-server)."""
    return request.getfixturevalue(f"{request.param}_proxy")

