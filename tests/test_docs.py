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
    # the site works opened from disk: nav links name pages (not folders a browser lists)
    # and the search index is bundled as a script (fetch of search_index.json fails on file://)
    site = tmp_path / "site"
    index = (site / "index.html").read_text()
    links = set(re.findall(r'href="((?:\./)?[a-z-]+(?:/|\.html))"', index))
    assert "configuration.html" in {x.lstrip("./") for x in links}, links
    assert not [x for x in links if x.endswith("/") and x not in ("./", "/")], f"folder links: {links}"
    assert (site / "search" / "search_index.js").is_file()
    # ... and without a network: no page loads a script, a stylesheet or a font from another host
    # (the search worker's file:// shim is vendored, the theme's web fonts are off)
    external = re.compile(r'<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*["\']?(?:https?:)?//', re.I)
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 10 and not [p.name for p in pages if external.search(p.read_text())], \
        [(p.name, external.search(p.read_text()).group()) for p in pages if external.search(p.read_text())][:5]
    assert "iframe-worker-shim.js" in index and (site / "javascripts" / "iframe-worker-shim.js").is_file()
    css = (site / "stylesheets" / "extra.css").read_text()
    assert "nowrap" in css and "stylesheets/extra.css" in (site / "configuration.html").read_text()
    # the API reference is rendered from the docstrings (mkdocstrings), not an empty page
    api = (site / "api.html").read_text()
    for name in ("cloudckpt.Checkpointer", "allow_partial", "before_read", "cloudckpt.CheckpointManager",
                 "register_data_loader", "cloudckpt.CheckpointConfig", "cloudckpt.storage.ObjectStore", "open_range",
                 "CorruptCheckpoint", "cloudckpt.options.CheckpointerOptions", "load_exchange", "LoadInfo",
                 "not_loaded", "SaveStats", "cloudckpt.options.RetentionConfig", "cloudckpt.options.ManagerOptions"):
        assert name in api, f"api.html lacks {name}"
    assert ":class:`" not in api and ":func:`" not in api, "a reStructuredText role printed literally"


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
                "tests/integrations/examples/lightning_fit.py", "tests/integrations/examples/export_and_seed.py",
                "tests/storage/test_conformance_local.py",
                "examples/hf_trainer.py", "examples/hf_accelerate.py",  # run by tests/integrations/test_hf.py
                "tests/integrations/titan/titan_tool.py", "tests/integrations/olmo/trainer_tool.py",
                "tests/integrations/megatron/mcore_tool.py",  # run by tests/integrations/test_megatron.py
                "tests/integrations/megatron/train_gpt.py"}
INLINE_SAMPLES_RUN = {"storage.md"}


def test_configuration_reference_lists_every_field_with_its_env_var():
    from cloudckpt import CheckpointConfig
    from cloudckpt.config import GROUPS

    text = (ROOT / "docs" / "configuration.md").read_text()
    for name in CheckpointConfig.field_names():
        if name in GROUPS:  # groups: set by their flat names or a mapping, not one variable
            assert f"`{name}`" in text, name
            continue
        assert f"`{name}`" in text and f"CLOUDCKPT_{name.upper()}" in text, name


def test_configuration_yaml_samples_build_the_config_they_describe(tmp_path):
    from cloudckpt import CheckpointConfig

    blocks = [b for page in ("configuration.md", "local-tier.md")
              for b in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)]
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(block)
        cfg = CheckpointConfig.from_yaml(str(path), section="checkpoint", env={})
        if "storage:" in block:  # the nested-and-flat sample
            assert cfg.endpoint_url == cfg.storage.endpoint_url == "http://127.0.0.1:8333"
            assert cfg.storage.max_attempts == 4 and cfg.storage.max_pool_connections == 32
            assert cfg.transfer.max_bytes_in_flight == 1024**3
            assert (cfg.retention.max_checkpoints, cfg.keep_every) == (3, 1000)
        if "local_dir:" in block:  # the local tier sample
            assert (cfg.local_dir, cfg.local_save_interval, cfg.keep_last_local, cfg.replication_factor) == (
                "/dev/shm/ckpt", 100, 2, 2)


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
    assert "restored: weights, AdamW moments and step, LR scheduler" in r.stdout  # asserted bit-exactly inside


def test_manager_example_resumes_on_second_run(s3_bucket, tmp_path):
    folder = s3_bucket + "/runs/run-7"
    cmd = [sys.executable, str(ROOT / "examples" / "manager.py"), str(ROOT / "examples" / "manager_config.yaml"),
           folder]
    env = dict(_env(), CLOUDCKPT_WORK_DIR=str(tmp_path / "w"))
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "resumed from None last saved 200" in first.stdout
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resumed from 200 last saved 400" in second.stdout
    # checked as a user would: step 400 of the resumed run equals step 400 of a run that was never stopped
    straight = s3_bucket + "/runs/straight"
    third = subprocess.run(cmd[:-1] + [straight, "450"], env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and "resumed from None last saved 400" in third.stdout, third.stderr
    _assert_same_step(folder + "/step400", straight + "/step400")


def _assert_same_step(a: str, b: str) -> None:
    """Weights, AdamW state and LR scheduler of two steps saved by examples/manager.py are equal."""
    import torch

    from cloudckpt import AppState, Checkpointer

    def load(step):
        model = torch.nn.Linear(8, 4)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=1000)
        ts = Checkpointer().load(step, AppState(model, optim, sched))
        return model, optim, sched, ts

    (m1, o1, s1, t1), (m2, o2, s2, t2) = load(a), load(b)
    assert t1["step"] == t2["step"] == 400
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o1.state[p1][k], o2.state[p2][k]), k
    assert s1.state_dict() == s2.state_dict()


def test_storage_page_sample_starts_seaweedfs():
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "storage.md").read_text(), re.S).group(1)
    ns: dict = {}
    exec(compile(block, "storage.md", "exec"), ns)
    assert ns["env"]["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")


def test_readme_sample_saves_and_a_second_run_resumes_everything(tmp_path):
    """The README's snippet, run as written (its bucket URL pointed at a local folder),
    twice: the second run restores the first run's weights, AdamW state and scheduler."""
    import torch

    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert "s3://my-bucket/runs/run-7" in block
    code = compile(block.replace("s3://my-bucket/runs/run-7", str(tmp_path / "run-7")), "README.md", "exec")

    def run(seed: int) -> dict:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        ns = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "num_steps": 100}
        exec(code, ns)
        return ns

    first = run(0)
    second = run(1)  # other initial weights: the resume must overwrite them
    assert first["train_state"] is None and second["train_state"] == {"step": 100}
    assert torch.equal(first["model"].weight, second["model"].weight)
    o1, o2 = first["optimizer"], second["optimizer"]
    for p1, p2 in zip(first["model"].parameters(), second["model"].parameters(), strict=True):
        assert torch.equal(o1.state[p1]["exp_avg"], o2.state[p2]["exp_avg"])
    assert first["scheduler"].state_dict() == second["scheduler"].state_dict()
