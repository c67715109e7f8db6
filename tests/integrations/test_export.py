"""Weights export: safetensors (streaming) and torch files, local and in the bucket, with and
without a bf16 cast, sharded tensors assembled from their chunks, bounded memory."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.errors import AlreadyExists, CorruptCheckpoint, MissingKeys, NotACheckpoint
from cloudckpt.ops import export as export_mod
from cloudckpt.ops.export import export_weights
from cloudckpt.storage import open_store
from cloudckpt.testing.multiprocess import run_ranks

try:
    import safetensors.torch as safetensors_torch
    from safetensors import safe_open
except ImportError as e:  # a declared test dependency: missing means a broken install, not a reason to skip
    raise ImportError("safetensors is not installed; it is in the test extra: pip install -e '.[test]'") from e

_MiB = 1024 * 1024


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layers.0.w": torch.randn(16, 16, generator=g, dtype=torch.float64),
        "layers.0.b": torch.randn(16, generator=g).to(torch.float16),
        "norm.scale": torch.tensor(1.25),
        "steps": torch.arange(7),  # integer: never cast
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def _expected(model: dict, dtype: torch.dtype | None) -> dict:
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in model.items()}


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


@pytest.fixture
def step_in_bucket(s3_bucket, tmp_path):
    step = s3_bucket + "/run/step10"
    with Checkpointer(work_dir=str(tmp_path / "w")) as ckpt:
        ckpt.save(step, {"model": _model(), "optim": {"exp_avg": torch.randn(50, 16)}}, {"step": 10})
    return step


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored-dtype", "bf16"])
@pytest.mark.parametrize("dest", ["bucket", "local"])
def test_safetensors_export_reads_back_equal_to_the_model(step_in_bucket, s3_bucket, tmp_path, dest, dtype):
    url = s3_bucket + "/export/model.safetensors" if dest == "bucket" else str(tmp_path / "out" / "model.safetensors")
    info = export_weights(step_in_bucket, url, dtype=dtype, work_dir=str(tmp_path / "w"))
    local = url
    if dest == "bucket":
        local = str(tmp_path / "downloaded.safetensors")
        open_store(url).download_file(url, local)
        assert not os.listdir(tmp_path / "w"), "the temporary output file is removed after the upload"
    else:
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors"], "no temp file left"
    _assert_same(safetensors_torch.load_file(local), _expected(_model(), dtype))
    assert (info["step"], info["tensors"], info["format"]) == (10, 7, "safetensors")
    assert info["bytes"] == os.path.getsize(local)
    with safe_open(local, "pt") as st:
        assert st.metadata() == {"format": "pt", "cloudckpt_step": "10"}


def test_torch_format_export_loads_with_weights_only(step_in_bucket, s3_bucket, tmp_path):
    url = s3_bucket + "/export/"
    info = export_weights(step_in_bucket, url, dtype="float16", fmt="torch", work_dir=str(tmp_path / "w"))
    assert info["dest"] == s3_bucket + "/export/model.pt"
    local = str(tmp_path / "model.pt")
    open_store(info["dest"]).download_file(info["dest"], local)
    _assert_same(torch.load(local, weights_only=True), _expected(_model(), torch.float16))


def test_sharded_tensors_are_assembled_from_their_chunks(s3_bucket, tmp_path):
    from tests.checkpoint import workers
    from tests.checkpoint.test_checkpointer import _env

    step = s3_bucket + "/sharded/step7"
    run_ranks(2, workers.save_sharded, step, str(tmp_path / "w"), env=_env())
    full = workers.full_tensors(0)
    out = str(tmp_path / "model.safetensors")
    info = export_weights(step, out, dtype="bf16")
    got = safetensors_torch.load_file(out)
    assert torch.equal(got["w"], full["model.w"].to(torch.bfloat16)) \
        and torch.equal(got["b"], full["model.b"].to(torch.bfloat16))
    out = str(tmp_path / "optim.safetensors")
    export_weights(step, out, key_prefix="optim")
    assert torch.equal(safetensors_torch.load_file(out)["state.w.exp_avg"], full["optim.w_exp_avg"])
    assert info["skipped"] == []


def test_export_holds_one_tensor_at_a_time(step_in_bucket, tmp_path, monkeypatch):
    """Structural bound: when the next tensor is read, no earlier tensor (read or cast) is alive."""
    alive: set[int] = set()
    seen_alive: list[int] = []
    real_read, real_cast = export_mod._TensorReader.read, export_mod._cast

    def track(t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        alive.add(key)
        weakref.finalize(t, alive.discard, key)
        return t

    def read(self, e):
        seen_alive.append(len(alive))
        return track(real_read(self, e))

    monkeypatch.setattr(export_mod._TensorReader, "read", read)
    monkeypatch.setattr(export_mod, "_cast", lambda t, dtype: track(real_cast(t, dtype)))
    export_weights(step_in_bucket, str(tmp_path / "m.safetensors"), dtype="bf16")
    assert len(seen_alive) == 7 and max(seen_alive) == 0, seen_alive


_MEASURE = """
import json, sys
from pathlib import Path

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

import torch.distributed.checkpoint.metadata  # noqa: F401 - one-time imports and the S3 client are not the export's
from cloudckpt.ops.export import export_weights, read_dcp_metadata
read_dcp_metadata(sys.argv[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := current RSS
base = status("VmRSS")
info = export_weights(sys.argv[1], sys.argv[2], dtype="bf16")
print(json.dumps({"grown": status("VmHWM") - base, "bytes_read": info["bytes_read"]}))
"""


def test_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(s3_bucket, tmp_path):
    """12 tensors of 16 MiB (192 MiB): the peak RSS growth of an export from the bucket stays
    within 4 tensors' worth; holding the model would take over 192 MiB. Measured in a fresh
    process with glibc's mmap threshold fixed at 1 MiB, so every large buffer is its own
    mapping, returned when freed: RSS then follows what the export holds, not what the
    allocator keeps around from earlier tests."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs a writable /proc/self/clear_refs (Linux) to reset the peak RSS before the export")
    n, shape = 12, (2048, 2048)  # float32: 16 MiB each
    step = s3_bucket + "/big/step1"
    with Checkpointer(work_dir=str(tmp_path / "w")) as ckpt:
        ckpt.save(step, {"model": {f"t{i}": torch.full(shape, float(i)) for i in range(n)}})
    out = str(tmp_path / "big.safetensors")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 * _MiB))
    r = subprocess.run([sys.executable, "-c", _MEASURE, step, out], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"peak RSS growth {m['grown'] / _MiB:.1f} MiB for a {n * 16} MiB model (largest tensor 16 MiB)")
    assert m["bytes_read"] >= n * 16 * _MiB
    assert m["grown"] < 4 * 16 * _MiB, f"peak grew {m['grown'] / _MiB:.1f} MiB"
    with safe_open(out, "pt") as st:
        assert torch.equal(st.get_tensor("t11"), torch.full(shape, 11.0, dtype=torch.bfloat16))


# ---------------------------------------------------------------- errors
def test_export_refuses_an_uncommitted_step_and_an_existing_destination(step_in_bucket, s3_bucket, tmp_path):
    with pytest.raises(NotACheckpoint):
        export_weights(s3_bucket + "/run/step11", str(tmp_path / "x.safetensors"))
    out = str(tmp_path / "x.safetensors")
    export_weights(step_in_bucket, out)
    with pytest.raises(AlreadyExists, match="overwrite"):
        export_weights(step_in_bucket, out)
    export_weights(step_in_bucket, out, dtype="bf16", overwrite=True)
    assert safetensors_torch.load_file(out)["embed.weight"].dtype == torch.bfloat16


def test_export_names_the_top_level_keys_when_the_prefix_is_wrong(step_in_bucket, tmp_path):
    with pytest.raises(MissingKeys, match=r"\['model', 'optim'\]"):
        export_weights(step_in_bucket, str(tmp_path / "x.safetensors"), key_prefix="module")


@pytest.mark.parametrize("bad", [dict(fmt="gguf"), dict(dtype="int8"), dict(dtype="fp12")])
def test_export_rejects_unknown_formats_and_dtypes(step_in_bucket, tmp_path, bad):
    with pytest.raises(ValueError):
        export_weights(step_in_bucket, str(tmp_path / "x.safetensors"), **bad)


def test_export_detects_a_corrupt_shard(step_in_bucket, tmp_path):
    store = open_store(step_in_bucket)
    shard = next(o.url for o in store.walk(step_in_bucket + "/model_and_optim/") if o.url.endswith(".distcp"))
    data = bytearray(store.get_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(shard, bytes(data))
    with pytest.raises(CorruptCheckpoint, match="CRC32C"):
        export_weights(step_in_bucket, str(tmp_path / "x.safetensors"))
    assert not (tmp_path / "x.safetensors").exists()


def test_export_example_runs_and_seeds_a_run(s3_bucket):
    spec = importlib.util.spec_from_file_location("export_and_seed",
                                                  Path(__file__).parent / "examples" / "export_and_seed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    info = mod.main(s3_bucket + "/example-run")
    assert info["dest"] == s3_bucket + "/example-run/export/model.safetensors" and info["dtype"] == "bfloat16"


def test_read_progress_is_told_the_total_and_every_byte_read(step_in_bucket, tmp_path):
    class Progress:
        total = None
        moved = 0

        def start(self, total):
            self.total = total

        def update(self, n):
            self.moved += n

    p = Progress()
    info = export_weights(step_in_bucket, str(tmp_path / "m.safetensors"), read_progress=p)
    assert p.total == p.moved == info["bytes_read"] > 0


def test_export_holds_one_ranks_parts_at_a_time_never_every_chunk(s3_bucket, tmp_path, monkeypatch):
    """Streaming per tensor (4 ranks, 60 sharded tensors): the export reads each rank's
    index part and manifest part once, drops them before the next rank's, and holds
    none of them (nor any shard file's entry with its items' CRC32Cs) while it reads
    the tensors: what it keeps is one tensor's chunk list, not the job's R x T chunks."""
    from cloudckpt.checkpoint import parts as parts_mod
    from cloudckpt.dcp import index
    from tests.checkpoint import scale_workers as w
    from tests.checkpoint.test_load_scale import _env

    R = 4
    step = s3_bucket + "/four/step5"
    run_ranks(R, w.save, step, str(tmp_path / "w"), env=_env(), timeout=600)

    class Part(dict):
        pass

    alive = {"index parts": 0, "shard entries": 0}
    at_parse, at_read = [], []

    def gone(kind):
        alive[kind] -= 1

    real_parse, real_from_bytes = index.parse_part, parts_mod.ManifestPart.from_bytes

    def parse_part(data, **kw):
        at_parse.append(alive["index parts"])
        part = Part(real_parse(data, **kw))
        alive["index parts"] += 1
        weakref.finalize(part, gone, "index parts")
        return part

    def from_bytes(data, **kw):
        part = real_from_bytes(data, **kw)
        for o in part.objects:
            if o.path.endswith(".distcp"):
                alive["shard entries"] += 1
                weakref.finalize(o, gone, "shard entries")
        return part

    real_read = export_mod._TensorReader.read

    def read(self, e):
        at_read.append(dict(alive))
        return real_read(self, e)

    monkeypatch.setattr(index, "parse_part", parse_part)
    monkeypatch.setattr(parts_mod.ManifestPart, "from_bytes",
                        classmethod(lambda cls, data, **kw: from_bytes(data, **kw)))
    monkeypatch.setattr(export_mod._TensorReader, "read", read)
    out = str(tmp_path / "m.safetensors")
    info = export_weights(step, out)
    assert info["tensors"] == w.TENSORS
    assert at_parse == [0] * R, at_parse  # every rank's part read once, the one before it dropped
    assert at_read == [{"index parts": 0, "shard entries": 0}] * w.TENSORS, at_read[:3]
    got = safetensors_torch.load_file(out)
    for t in range(w.TENSORS):
        want = torch.arange(R * w.ROWS * w.COLS, dtype=torch.float32).reshape(-1, w.COLS) + t
        assert torch.equal(got[f"layer{t}"], want), t
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".export-")], "the chunk index is removed"
    # a rank's index part replaced by other bytes: refused by its CRC32C, and nothing is left behind
    open_store(step).put_bytes(f"{step}/index/rank2.json", b'{"format": "cloudckpt-dcp-index"}')
    out_dir = tmp_path / "damaged"
    out_dir.mkdir()
    with pytest.raises(CorruptCheckpoint):
        export_weights(step, str(out_dir / "m.safetensors"))
    assert os.listdir(out_dir) == [], os.listdir(out_dir)
