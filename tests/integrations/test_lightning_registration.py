"""Importing ``cloudckpt.integrations.lightning`` changes nothing global; building a
plugin registers the fsspec shim and wraps ``ModelCheckpoint._find_last_checkpoints``,
once per process however many plugins are built. Each case runs in a fresh interpreter
(a registration made by another test in this process could not be told apart)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import importlib.util, json
    import fsspec
    from fsspec.registry import registry
    from lightning.pytorch.callbacks import ModelCheckpoint

    original = ModelCheckpoint._find_last_checkpoints
    before = {k: v for k, v in registry.items()}
    import cloudckpt.integrations.lightning as cl
    from cloudckpt.integrations import _fsspec

    out = {"import_changed_registry": dict(registry) != before,
           "import_wrapped": ModelCheckpoint._find_last_checkpoints is not original}
    out["expected"] = sorted(p for cls, pkg in _fsspec._SHIMS if importlib.util.find_spec(pkg) is None
                             for p in cls.protocol if p not in before)
    PLUGIN
    after_one = {k: v for k, v in registry.items()}
    wrapped = ModelCheckpoint._find_last_checkpoints
    out["added"] = sorted(set(after_one) - set(before))
    out["shim_classes"] = sorted({registry[p].__module__ for p in out["added"]})
    out["wrapped_once"] = wrapped is not original and getattr(wrapped, "__wrapped__", None) is original
    PLUGIN
    out["second_changed_registry"] = dict(registry) != after_one
    out["second_rewrapped"] = ModelCheckpoint._find_last_checkpoints is not wrapped
    print(json.dumps(out))
""")


def _run(plugin: str) -> dict:
    code = CHECK.replace("PLUGIN", plugin)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(out: dict) -> None:
    assert out["import_changed_registry"] is False and out["import_wrapped"] is False, out
    assert out["expected"], "s3fs and gcsfs are both installed here: the shim registers nothing to observe"
    assert out["added"] == out["expected"] and out["shim_classes"] == ["cloudckpt.integrations._fsspec"], out
    assert out["wrapped_once"], out
    assert out["second_changed_registry"] is False and out["second_rewrapped"] is False, out


def test_importing_the_module_changes_nothing_and_building_the_sync_plugin_registers_once():
    _check(_run("cl.CloudCheckpointIO()"))


def test_building_the_async_plugin_registers_once_too():
    _check(_run("p = cl.AsyncCloudCheckpointIO(); p.teardown()"))
