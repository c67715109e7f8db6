"""The docs build, their code samples run, and the configuration reference is complete."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mkdocs_build_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_python_sample_in_the_docs_is_included_from_a_tested_file():
    """Python blocks in docs/ must be snippet includes of example files (which the tests run)."""
    for md in (ROOT / "docs").glob("*.md"):
        for block in re.findall(r"```python\n(.*?)```", md.read_text(), re.S):
            lines = [ln for ln in block.strip().splitlines() if ln.strip()]
            if all(ln.startswith("--8<--") for ln in lines):
                for ln in lines:
                    path = ln.split('"')[1]
                    assert (ROOT / path).is_file(), f"{md.name}: {path} missing"
                    assert path in TESTED_FILES, f"{md.name}: {path} is not run by the test suite"
            else:
                # inline samples must at least compile and be exercised below
                compile(block, str(md), "exec")
                assert md.name in INLINE_SAMPLES_RUN, f"{md.name} has an inline python sample that no test runs"


TESTED_FILES = {"examples/quickstart.py", "examples/manager.py", "examples/manager_config.yaml",
                "tests/integrations/examples/lightning_fit.py", "tests/integrations/examples/export_and_seed.py"}
INLINE_SAMPLES_RUN = {"storage.md"}


def test_configuration_reference_lists_every_field_with_its_env_var():
    from cloudckpt import CheckpointConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    for name in CheckpointConfig.field_names():
        assert f"`{name}`" in text and f"CLOUDCKPT_{name.upper()}" in text, name


def _env() -> dict:
    return dict(os.environ)


@pytest.mark.parametrize("backend", ["local", "s3", "gcs"])
def test_quickstart_example_runs_on_every_backend(backend, request, tmp_path):
    folder = {"local": lambda: str(tmp_path / "run-1"), "s3": lambda: request.getfixturevalue("s3_bucket") + "/run-1",
              "gcs": lambda: request.getfixturevalue("gcs_bucket") + "/run-1"}[backend]()
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), folder], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"latest: {folder}/step100" in r.stdout and "'step': 100" in r.stdout


def test_manager_example_resumes_on_second_run(s3_bucket, tmp_path):
    folder = s3_bucket + "/runs/run-7"
    cmd = [sys.executable, str(ROOT / "examples" / "manager.py"), str(ROOT / "examples" / "manager_config.yaml"), folder]
    env = dict(_env(), CLOUDCKPT_WORK_DIR=str(tmp_path / "w"))
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "resumed from None last saved 200" in first.stdout
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resumed from 200 last saved 400" in second.stdout


def test_storage_page_sample_starts_seaweedfs():
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "storage.md").read_text(), re.S).group(1)
    ns: dict = {}
    exec(compile(block, "storage.md", "exec"), ns)
    assert ns["env"]["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
