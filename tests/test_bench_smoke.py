"""The peer benchmark (``bench/run.py``) in its smoke form, so it cannot rot.

Tiny state, one repetition, every case (save, streaming and 2 -> 1 loads, GCS,
discovery; ``--smoke`` leaves out the pre-download load to stay under 90 s)
against real SeaweedFS and fake-gcs-server on 127.0.0.1. The peers' venvs are
pointed at an empty folder, so this proves they are reported as "not installed"
rows (not errors, not silent skips) without needing them. No timing assertions:
the figures of a smoke run mean nothing; only that every case ran and produced
its outputs, and that what was loaded matches what was saved (the bench checks
that itself and reports a mismatch as an error row).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def warm(module: str, *args: str) -> list[str]:
    """``python -m module args`` with the bench's gloo ranks forked from a warm forkserver
    instead of spawned (tests/warm_bench.py: the same cases and rank code, torch imported
    once instead of once per rank and case)."""
    return [sys.executable, str(ROOT / "tests" / "warm_bench.py"), module, *args]


@pytest.mark.slow  # every bench case end to end: 20 s (ranks forked warm), a minute spawned
def test_smoke_bench_runs_every_case_and_reports_absent_peers_as_not_installed(tmp_path):
    out = tmp_path / "results"
    argv = warm("bench.run", "--smoke", "--peer-venvs", str(tmp_path / "no-peer-venvs"), "--out-dir", str(out),
                "--tmp", str(tmp_path))
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"

    data = json.loads((out / "smoke.json").read_text())
    rows = {(r["case"], r["tool"]): r for r in data["rows"]}
    for case in ("save", "load", "load_2to1", "gcs_save", "gcs_load", "latest", "list", "list_cli"):
        row = rows[(case, "cloudckpt")]
        assert row["status"] == "ok" and row["n"] == 1, (case, row["status"], row["reason"])
    # the 2 -> 1 load took the whole state on one rank (replicated step scalars are counted once per rank in
    # the save's total); every load was checked against the saved state by the bench (else an error row)
    one_rank = rows[("load_2to1", "cloudckpt")]["samples"][0]["per_rank"]
    assert len(one_rank) == 1 and abs(one_rank[0]["local_bytes"] - rows[("save", "cloudckpt")]["bytes"]) < 4096
    # discovery counted its HTTP requests: latest reads one marker, list one per step
    assert rows[("latest", "cloudckpt")]["requests"] >= 2
    assert rows[("list", "cloudckpt")]["requests"] >= data["settings"]["discovery_steps"]
    for peer in ("olmo", "s3tc", "fsspec"):
        for case in ("save", "load"):
            row = rows[(case, peer)]
            assert row["status"] == "not installed" and "setup_peers.sh" in row["reason"], (peer, case, row)
    assert rows[("latest", "olmo")]["status"] == "not installed"
    # s5cmd ships with the test extra; without it the row says so instead of failing
    assert rows[("save", "s5cmd")]["status"] in ("ok", "not installed")
    if rows[("save", "s5cmd")]["status"] == "ok":
        # each cloudckpt load has s5cmd's download of the same bytes right after it, and the
        # load targets are judged on those pairs
        for case in ("load", "load_2to1"):
            assert rows[(case, "cloudckpt")]["samples"][0]["s5cmd_paired_seconds"] > 0, case
        assert any("paired ratios" in t["target"] for t in data["targets"]), data["targets"]
    assert rows[("gcs_save", "gcs_tm")]["status"] == "ok"

    md = (out / "smoke.md").read_text()
    assert "| save | 4MiB | cloudckpt |" in md and "not installed" in md and "not judged" in md
    assert data["command"].startswith(".venv/bin/python -m bench.run --smoke")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "smoke.png").stat().st_size > 0


def test_smoke_range_reads_reads_every_byte_with_every_reader(tmp_path):
    """``bench/range_reads.py`` (range reads into memory without DCP, against s5cmd)
    at 1 MiB objects, one repetition: every reader ran and read both objects whole
    (the script checks the sizes and fails otherwise)."""
    out = tmp_path / "results"
    argv = [sys.executable, "-m", "bench.range_reads", "--object-mib", "1", "--reps", "1", "--out-dir", str(out)]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    data = json.loads((out / "range_reads.json").read_text())
    readers = set(data["samples"])
    assert {"boto3 8MiB", "boto3 8MiB+4KiB", "boto3 32MiB", "engine 8MiB"} <= readers
    assert "s5cmd" in readers or "s5cmd: not installed" in p.stdout
    assert all(len(v) == 1 and v[0]["seconds"] > 0 for v in data["samples"].values())
    assert "| engine 8MiB |" in (out / "range_reads.md").read_text()


@pytest.mark.slow  # exports a git revision and loads through both trees: 15 s (ranks forked warm)
def test_smoke_ab_load_runs_each_revision_from_its_own_tree(tmp_path):
    """``bench/ab_load.py`` (interleaved A/B of the load between git revisions): HEAD
    exported with ``git archive`` against the working tree, both load modes, a tiny
    state; every load was checked against the saved state by the script itself."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: bench/ab_load.py compares git revisions")
    out = tmp_path / "ab.json"
    argv = warm("bench.ab_load", "--revs", "HEAD,.", "--modes", "stream,pre", "--size", "4MiB", "--reps", "1",
                "--out", str(out))
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["mode"], r["rev"]) for r in rows) == [("pre", "."), ("pre", "HEAD"), ("stream", "."),
                                                            ("stream", "HEAD")]
    assert all(r["requests"] >= 2 and r["seconds"] > 0 for r in rows), rows
    assert "medians:" in p.stdout



def test_go_symbols_names_functions_of_the_stripped_weed_binary():
    """``bench/server_profile.py`` names samples in SeaweedFS's stripped Go binary from
    its ``.gopclntab``: the ELF entry point (read from the ELF header, not the table)
    must resolve to Go's amd64 Linux entry stub, and a function's own address to it."""
    import struct

    from bench.server_profile import GoSymbols
    from cloudckpt.testing.servers import weed_binary

    path = weed_binary()
    syms = GoSymbols(path)
    with open(path, "rb") as f:
        entry, = struct.unpack_from("<Q", f.read(0x20), 0x18)
    assert syms.name(entry) == "_rt0_amd64_linux"
    md5 = syms.address("crypto/md5.block")
    assert md5 is not None and syms.name(md5) == syms.name(md5 + 64) == "crypto/md5.block"
    assert syms.name(md5 - 1) != "crypto/md5.block"


@pytest.mark.slow  # profiles a save and an s5cmd upload under perf
def test_smoke_server_profile_attributes_seaweedfs_samples_to_named_functions(tmp_path):
    """``bench/server_profile.py`` at 4 MiB: a cloudckpt save and s5cmd's upload, each
    profiled in SeaweedFS with perf; every row has samples, and the samples in the weed
    binary are named (Go functions, not raw addresses)."""
    import shutil

    if shutil.which("perf") is None:
        pytest.skip("perf (Debian's linux-perf) is not installed: bench/server_profile.py samples with it")
    out = tmp_path / "profile.json"
    argv = warm("bench.server_profile", "--size", "4MiB", "--tools", "cloudckpt,s5cmd", "--out", str(out))
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    rows = json.loads(out.read_text())["rows"]
    assert [r["tool"] for r in rows] == ["cloudckpt", "s5cmd"]
    for r in rows:
        assert r["samples"] > 0 and r["server_cpu_s"] > 0, r
        assert abs(sum(r["share"].values()) - 1) < 1e-6, r
        user = [t["function"] for t in r["top"] if not t["function"].startswith("[k] ")]
        assert user and "?" not in user and any("." in f for f in user), r["top"]


def test_metadata_unpickle_bench_reports_both_times_and_their_ratio():
    out = subprocess.run([sys.executable, "-m", "bench.metadata_unpickle", "--reps", "1", "--layers", "3"],
                         cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300, check=True).stdout
    assert re.search(r"pickle\.loads [\d.]+ s, cloudckpt loads_metadata [\d.]+ s .*ratio [\d.]+", out), out


@pytest.mark.slow
def test_smoke_local_tier_bench_recovers_bit_exactly_from_peers(tmp_path):
    """``bench.local_tier --smoke``: every row is measured and the recovery it times is
    a real one (from the peer node, bit-exact); the figures of a smoke run mean nothing."""
    p = subprocess.run(warm("bench.local_tier", "--smoke", "--out-dir", str(tmp_path)),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    row = json.loads((tmp_path / "local_tier_smoke.json").read_text())["row"]
    assert row["recovered_from"] == ["local", 1] and row["bit_exact"] and row["fetched_bytes_node1"] > 0
    assert all(row[k] > 0 for k in ("copy_s", "local_blocked_s", "bucket_s", "replicated_s", "recover_local_s"))


@pytest.mark.slow  # seven phases in their own processes and two real gloo ranks (forked warm): 25 s, 2 min spawned
def test_smoke_scale_runs_every_phase_and_agrees_with_real_ranks(tmp_path):
    """``bench/scale.py --quick --confirm``: the small shape at R = 4, every phase run by
    the library's code (save protocol, resume, load prologue, stock pickle, maintenance)
    without an error, and the simulation's AGREE bytes and marker size matching a real
    2-rank gloo save of the same shape (within a few bytes of timestamps and ids)."""
    p = subprocess.run(warm("bench.scale", "--quick", "--confirm", "--out-dir", str(tmp_path)),
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "scale_quick.json").read_text())
    (row,) = res["rows"]
    for phase in ("inputs", "save", "resume", "load", "load_with", "export", "stock", "maintain_N3"):
        assert "error" not in row[phase], (phase, row[phase])
    assert row["load_with"]["keys_handed"] == res["sharded_tensors"] + res["scalars"], row["load_with"]
    assert row["load_with"]["items_to_read"] == row["load"]["items_to_read"] > 0
    # export: every chunk of the model's tensors located, one tensor's list at a time (R chunks at most)
    assert row["export"]["chunks"] == res["sharded_tensors"] // 3 * 4 and row["export"]["largest_chunk_list"] == 4
    assert row["save"]["marker_bytes"] > 0 and row["load"]["items_to_read"] > 0
    assert row["stock"]["items"] == row["inputs"]["items"] == row["items"]
    m = row["maintain_N3"]
    assert m["fresh"]["pruned"] == m["steady"]["pruned"] == 1 and m["steady"]["store_calls"] <= 10, m
    # a job's first save planned by owners (rank 0, the busiest owner), then its repeated save planned from the
    # step it made: every result where the first save put it; a restart's saves planned from the loaded step
    for who in ("rank0", "owner"):
        f = row["first"][who]
        assert "error" not in f and f["repeated"]["same_places"], (who, f)
        assert f["first"]["collectives"]["send the save plan's records to their owners"][1] > 0, f
    for who in ("rank0", "rank1"):
        r = row["resumed"][who]
        assert "error" not in r and r["first"]["same_places"] and r["next"]["same_places"], (who, r)
        assert r["last_rank_verdict"] == "planned from the loaded step", r
    (c,) = res["confirm"]
    real = [r["agree_received_bytes"] for r in c["real"]]
    sim = c["sim"]["agree_received_bytes"]
    assert abs(real[0] - sim) <= 0.05 * max(real[0], 1) + 16, (real, sim)
    assert abs(c["real"][0]["marker_bytes"] - c["sim"]["marker_bytes"]) <= 0.05 * c["sim"]["marker_bytes"], c
    assert c["sim"]["error"] is None and c["sim"]["metadata_parse_cpu_s"] is not None, c["sim"]
    # the simulated collectives carry what the real ones carry: an ordinary rank's load, step by step
    assert c["load_payloads_agree"], (c["real"][1]["load_collectives"], c["sim"]["load_collectives"])
    # a job's first save is planned by owners and the next from its structure: DCP's own gathers
    # carry no plan either time (300 tensors' plans are tens of KB)
    assert all(max(r["dcp_gather_sent_bytes"]) <= 400 for r in c["real"]), c["real"]
    assert "| 4 |" in (tmp_path / "scale_quick.md").read_text()


def test_smoke_metadata_copy_bench_copies_without_sending_a_byte_and_checks_each_copy(tmp_path):
    # its own process: the bench starts its own stores and points the environment at them
    p = subprocess.run([sys.executable, "-m", "bench.metadata_copy", "--smoke", "--out-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads((tmp_path / "metadata_copy_smoke.json").read_text())
    assert [r["store"] for r in got["rows"]] == ["SeaweedFS (S3)", "fake-gcs-server (GCS)"]
    for r in got["rows"]:
        assert (r["upload_sent"], r["copy_sent"], r["copied"]) == (got["size"], 0, got["size"]), r
    assert "| copy / upload |" in (tmp_path / "metadata_copy_smoke.md").read_text()
