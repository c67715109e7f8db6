"""A few of Megatron-core's own ``dist_checkpointing`` unit tests (``test_serialization.py``) run
through cloudckpt's save and load (``mcore_units_plugin``, MCORE_UNITS_STRATEGY=cloudckpt),
one gloo rank on CPU, in .venv-megatron: each must pass and each must have saved and
loaded through cloudckpt (not through Megatron's own functions). The full run, both
strategies side by side at 8 ranks, is ``run_units.py`` (docs/integrations.md).

Megatron's tests are not part of the megatron-core wheel: they are read from a
Megatron-LM source tree named by ``MEGATRON_LM_SRC`` (``git clone -b core_r0.19.0
https://github.com/NVIDIA/Megatron-LM``). Without it this test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ..test_megatron import megatron_python  # noqa: F401 - the fixture is used by name

HERE = Path(__file__).parent
SELECTED = "test_sharded_object_serialization or test_can_mix_sharded_tensors_and_factories " \
           "or test_content_metadata_load_from_checkpoint"


def _source() -> Path:
    src = os.environ.get("MEGATRON_LM_SRC")
    if not src or not (Path(src) / "tests" / "unit_tests" / "dist_checkpointing" / "test_serialization.py").is_file():
        pytest.skip("MEGATRON_LM_SRC does not name a Megatron-LM source tree (its tests/unit_tests/dist_checkpointing "
                    "is not in the megatron-core wheel): git clone -b core_r0.19.0 "
                    "https://github.com/NVIDIA/Megatron-LM and set MEGATRON_LM_SRC to it")
    return Path(src)


def test_megatron_own_serialization_tests_pass_through_cloudckpt(megatron_python, tmp_path):  # noqa: F811
    src = _source()
    out = tmp_path / "result.json"
    p = subprocess.run([megatron_python, str(HERE / "run_units.py"), "--megatron-lm", str(src), "--world", "1",
                        "-k", SELECTED, "--strategy", "cloudckpt", "--timeout", "240", "--json", str(out),
                        "--logs", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    tests = json.loads(out.read_text())["cloudckpt"]["tests"]
    assert len(tests) == 5, tests  # 1 + 1 + 3 parametrizations
    for name, t in tests.items():
        log = (tmp_path / "mcore-units-cloudckpt.log").read_text()[-4000:]
        assert t["outcome"] == "passed", f"{name}: {t}\n{log}"
        assert t["calls"].get("cloudckpt save", 0) >= 1 and t["calls"].get("cloudckpt load", 0) >= 1, (name, t)
        assert not any(k.startswith("megatron") for k in t["calls"]), (name, t)
