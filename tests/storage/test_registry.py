"""The registry: URL schemes to backends, malformed URLs, and the install hint of a
missing extra (boto3 and google-cloud-storage are the ``s3`` / ``gcs`` extras)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cloudckpt.errors import InvalidURL
from cloudckpt.storage import open_store
from cloudckpt.storage.url import parse_url


@pytest.mark.parametrize(
    "bad",
    [
        "s3:/bucket/key",  # one slash
        "s3://",  # no bucket
        "gs:///key",  # empty bucket
        "s3://Upper_Case/key",  # invalid bucket name
        "gs://ab/key",  # bucket name too short
        "s3://bucket//key",  # empty path segment
        "",  # nothing
    ],
)
def test_malformed_urls_raise_invalid_url_from_parse_url_and_open_store(bad):
    with pytest.raises(InvalidURL):
        parse_url(bad)
    with pytest.raises(InvalidURL):
        open_store(bad).get_bytes(bad)


@pytest.mark.parametrize("url", ["ftp://bucket/key", "azure://container/blob", "hdfs://nn/path"])
def test_unknown_schemes_raise_invalid_url_naming_the_known_ones(url):
    with pytest.raises(InvalidURL) as ei:
        open_store(url)
    assert "s3://" in str(ei.value) and "gs://" in str(ei.value)


# Run in a fresh interpreter in which the cloud SDKs cannot be imported, as after
# `pip install cloudckpt` without extras.
WITHOUT_SDKS = textwrap.dedent('''
    import importlib.abc, os, sys

    BLOCKED = ("boto3", "botocore", "s3transfer", "google.cloud", "google.api_core", "google.auth")

    class NoCloudSDKs(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoCloudSDKs())

    import cloudckpt, cloudckpt.cli
    import torch
    from cloudckpt import Checkpointer
    from cloudckpt.errors import BackendUnavailable
    from cloudckpt.storage import open_store

    folder = sys.argv[1]
    state = {"w": torch.arange(6.0)}
    Checkpointer(save_overwrite=True).save(folder + "/step1", state, {"step": 1})
    target = {"w": torch.zeros(6)}
    assert Checkpointer(save_overwrite=True).load(Checkpointer.latest_checkpoint(folder), target) == {"step": 1}
    assert torch.equal(target["w"], state["w"])

    for url in ("s3://bucket/run", "gs://bucket/run"):
        try:
            open_store(url)
        except BackendUnavailable as e:
            print(f"{url} -> {e}")
        else:
            raise AssertionError(f"{url}: opened without its SDK")
    loaded = sorted({m.split(".")[0] for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)})
    print("sdk modules:", loaded)
    sys.exit(cloudckpt.cli.main(["list", "s3://bucket/run"]))
''')


def test_without_the_cloud_sdks_local_checkpoints_work_and_cloud_urls_name_the_extra(tmp_path):
    r = subprocess.run([sys.executable, "-c", WITHOUT_SDKS, str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert "s3://bucket/run -> s3://bucket/run: " in out and "pip install 'cloudckpt[s3]'" in out, out
    assert "gs://bucket/run -> gs://bucket/run: " in out and "pip install 'cloudckpt[gcs]'" in out, out
    assert "sdk modules: []" in out, out
    # the CLI: one line naming the extra, a non-zero exit
    assert r.returncode != 0, out
    assert out.count("pip install 'cloudckpt[s3]'") == 2, out
