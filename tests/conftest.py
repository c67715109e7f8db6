"""Shared fixtures: real stores on 127.0.0.1 (SeaweedFS, fake-gcs-server, moto), started once per session."""

from __future__ import annotations

import os
import uuid
from typing import NamedTuple

import pytest
from memprobe import write_random

from cloudckpt.storage import StorageOptions, clear_cache
from cloudckpt.testing.servers import FakeGCS, SeaweedFS, free_port
from cloudckpt.transfer import crc32c_file

# Never let a test reach a real cloud: no instance metadata, no default endpoints.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
for _v in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
           "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
    os.environ.pop(_v, None)
os.environ["AWS_CONFIG_FILE"] = os.devnull
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull


# The files that take longest (seconds measured alone, -n 0, on the 2-core machine), run
# first: `make test` hands whole files to its 2 workers (--dist loadfile) in the order of
# the collection, so the longest start first and the short ones fill in at the end, and
# no worker is left with a long file while the other has finished. Without this xdist
# orders files by their number of tests. Re-measure with
# `pytest -n 0 --durations=40 tests/<dir>` when these drift; a stale list costs time only.
LONGEST_FIRST = {
    "tests/test_bench_smoke.py": 190,
    "tests/integrations/test_olmo_core.py": 100,
    "tests/security/test_hostile.py": 300,
    "tests/security/test_hostile_share1.py": 300,
    "tests/security/test_hostile_share2.py": 300,
    "tests/security/test_corpus.py": 300,
    "tests/faults/test_kill.py": 75,
    "tests/integrations/test_hf.py": 260,
    "tests/integrations/test_olmo_core_trainer.py": 40,
    "tests/storage/test_conformance.py": 245,
    "tests/cli/test_cli.py": 220,
    "tests/integrations/test_torchtitan.py": 210,
    "tests/integrations/test_megatron.py": 120,
    "tests/integrations/test_megatron_bridge.py": 40,
    "tests/integrations/test_megatron_folders.py": 40,
    "tests/dcp/test_assemble_store.py": 50,
    "tests/checkpoint/test_first_save_owners.py": 25,
    "tests/checkpoint/test_local_tier.py": 185,
    "tests/cli/test_cli_words.py": 170,
    "tests/integrations/test_lightning_resume.py": 125,
    "tests/checkpoint/test_resume_after_kill.py": 110,
    "tests/faults/test_hung_endpoint.py": 110,
    "tests/dcp/test_balanced_save.py": 105,
    "tests/checkpoint/test_checkpointer.py": 100,
    "tests/cli/test_runs_and_rm.py": 95,
    "tests/faults/test_bad_input.py": 80,
    "tests/faults/test_storms.py": 75,
    "tests/faults/test_crash_boundaries.py": 70,
    "tests/checkpoint/test_load_scale.py": 60,
    "tests/transfer/test_pacing_ranks.py": 60,
    "tests/faults/test_races.py": 55,
    "tests/faults/test_commit_order.py": 55,
    "tests/checkpoint/test_usual_loop_resume.py": 55,
    "tests/cli/test_foreign_cli.py": 55,
    "tests/integrations/test_export.py": 50,
    "tests/cli/test_output.py": 50,
}


def pytest_configure(config):
    from cpu_report import register

    register(config)  # with $TEST_CPU_REPORT: CPU-seconds per test file (cpu_report.py)
    if hasattr(config.option, "loadscopereorder"):  # xdist: keep the order below (not "most tests first")
        config.option.loadscopereorder = False


def pytest_collection_finish(session):
    """Start building the venvs (OLMo-core, torchtitan, checkov) that a collected test
    needs, in the background (venv_builds.py), so that pip overlaps the tests run first."""
    if not session.config.option.collectonly:
        from venv_builds import start_needed

        start_needed(session.items)


def pytest_collection_modifyitems(config, items):
    def weight(item) -> float:
        return LONGEST_FIRST.get(item.nodeid.split("::", 1)[0], 0.0)

    items.sort(key=lambda item: -weight(item))  # stable: each file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def warm_ranks():
    """``run_ranks`` forks its ranks from a forkserver that imported torch once, each rank
    made what a spawned one is before it runs (warm_ranks.py): a rank starts in
    milliseconds instead of a Python start-up with torch (seconds). ``RANKS_SPAWN=1`` keeps
    run_ranks' own spawn (to tell a rank's problem from this start-up's)."""
    if os.environ.get("RANKS_SPAWN") == "1":
        yield
        return
    from warm_ranks import WarmSpawn

    from cloudckpt.testing import multiprocess

    real = multiprocess.mp
    multiprocess.mp = WarmSpawn()
    try:
        yield
    finally:
        multiprocess.mp = real


@pytest.fixture(scope="session")
def seaweed():
    with SeaweedFS() as s:  # started again on fresh ports if it lost a port race (servers.py)
        yield s


@pytest.fixture(scope="session")
def fake_gcs():
    with FakeGCS() as g:
        yield g


class MotoS3:
    """moto's ThreadedMotoServer on 127.0.0.1 (fast, for fault-injection tests)."""

    access_key = "motokey"
    secret_key = "motosecret"
    region = "us-east-1"

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region}


@pytest.fixture(scope="session")
def moto_s3():
    m = MotoS3()
    m.server.start()
    yield m
    m.server.stop()


def _bucket_name() -> str:
    return "t-" + uuid.uuid4().hex[:20]


@pytest.fixture
def s3_bucket(seaweed, monkeypatch):
    """A fresh bucket on SeaweedFS; the environment points boto3 at it. Yields ``s3://bucket``."""
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    clear_cache()
    url = seaweed.create_bucket(_bucket_name())
    yield url
    clear_cache()


@pytest.fixture
def gcs_bucket(fake_gcs, monkeypatch):
    """A fresh bucket on fake-gcs-server; STORAGE_EMULATOR_HOST points at it. Yields ``gs://bucket``."""
    for k, v in fake_gcs.env().items():
        monkeypatch.setenv(k, v)
    clear_cache()
    url = fake_gcs.create_bucket(_bucket_name())
    yield url
    clear_cache()


@pytest.fixture
def moto_bucket(moto_s3, monkeypatch):
    for k, v in moto_s3.env().items():
        monkeypatch.setenv(k, v)
    clear_cache()
    url = moto_s3.create_bucket(_bucket_name())
    yield url
    clear_cache()


@pytest.fixture(params=["local", "s3", "gcs"])
def any_root(request, tmp_path):
    """A fresh writable root on each real backend: local folder, SeaweedFS, fake-gcs-server."""
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "s3":
        yield request.getfixturevalue("s3_bucket") + "/root"
    else:
        yield request.getfixturevalue("gcs_bucket") + "/root"


@pytest.fixture
def storage_options() -> StorageOptions:
    return StorageOptions()


class ShardFile(NamedTuple):
    path: str
    size: int
    crc32c: str


@pytest.fixture
def shard_file(tmp_path) -> ShardFile:
    """A 256 MiB file of random bytes (the size of a DCP shard file) and its CRC32C."""
    path, size = tmp_path / "shard.distcp", 256 * 1024 * 1024
    write_random(path, size)
    return ShardFile(str(path), size, crc32c_file(path))
