"""What one rank reads to load does not grow with the world size: the same per-rank
state saved and loaded on 2 and on 8 real gloo ranks (SeaweedFS). A rank reads the DCP
index's part of its own rank and, for the small replicated items the save gives rank 0,
at most rank 0's manifest part besides its own; only rank 0 reads the marker and the
index header (and hands them on, the marker's part references withheld: a rank fetches
the few its load reads from rank 0); nobody reads DCP's .metadata. Counts are asserted,
CPU seconds only reported."""

from __future__ import annotations

import os

import torch

from cloudckpt.testing.multiprocess import run_ranks

from . import scale_workers as w


def _env() -> dict:
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION",
            "AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
    return {k: os.environ[k] for k in keys if k in os.environ}


def test_a_rank_reads_a_fixed_set_of_small_objects_whatever_the_world_size(s3_bucket, tmp_path, capsys):
    loads = {}
    for R in (2, 8):
        step = f"{s3_bucket}/scale{R}/step5"
        work = str(tmp_path / f"w{R}")
        run_ranks(R, w.save, step, work, env=_env(), timeout=600)
        loads[R] = run_ranks(R, w.load_counting, step, work, env=_env(), timeout=600)
    small = ("index part", "manifest part", "index header", "marker")
    for R in (2, 8):
        for rank, o in enumerate(loads[R]):
            print(f"R={R} rank {rank}: load CPU {o['cpu_s']:.2f} s; " + ", ".join(
                f"{k} {o['gets'].get(k, 0)} GET / {o['bytes'].get(k, 0):,} B" for k in small))
            g = o["gets"]
            assert o["bitexact"], (R, rank)
            assert g.get("dcp metadata", 0) == 0, (R, rank, g)
            assert g.get("index part") == 1, (R, rank, g)  # its own
            assert g.get("manifest part") == (1 if rank == 0 else 2), (R, rank, g)  # its own (+ rank 0's: scalars)
            assert g.get("marker", 0) == g.get("index header", 0) == (1 if rank == 0 else 0), (R, rank, g)
            # rank 0 keeps the marker's part references; a rank gets those of the parts it reads (its own, rank 0's)
            assert o["parts_held"] == (None if rank == 0 else sorted({0, rank})), (R, rank, o["parts_held"])
    # an ordinary rank's small reads: the same objects, of about the same size (its part lists the same items)
    two, eight = loads[2][1], loads[8][1]
    for k in ("index part", "manifest part"):
        assert eight["bytes"][k] <= 1.2 * two["bytes"][k], (k, two["bytes"], eight["bytes"])
    # and the marker rank 0 hands it does not grow with the ranks (its part references stay on rank 0)
    assert eight["received_marker_bytes"] <= two["received_marker_bytes"] + 16, (two, eight)  # digits of R


def test_load_with_builds_its_targets_from_the_index_header_and_reads_what_load_reads(s3_bucket, tmp_path):
    # the Lightning and OLMo-core integrations load through load_with: it hands the caller every saved
    # key with its size and dtype, from the index header every rank already gets; no rank reads .metadata
    R = 4
    step = f"{s3_bucket}/with/step5"
    work = str(tmp_path / "w")
    run_ranks(R, w.save, step, work, env=_env(), timeout=600)
    loads = run_ranks(R, w.load_counting, step, work, True, env=_env(), timeout=600)
    for rank, o in enumerate(loads):
        g = o["gets"]
        assert o["bitexact"], rank
        assert g.get("dcp metadata", 0) == 0, (rank, g)
        assert g.get("index part") == 1, (rank, g)
        assert g.get("marker", 0) == g.get("index header", 0) == (1 if rank == 0 else 0), (rank, g)
        assert o["parts_held"] == (None if rank == 0 else sorted({0, rank})), (rank, o["parts_held"])
        keys, storage = o["built_from"]
        assert storage == 0, rank
        assert len(keys) == 2 * w.TENSORS, rank
        for t in range(w.TENSORS):
            assert keys[f"model.layer{t}"] == ((R * w.ROWS, w.COLS), torch.float32, 0), (rank, t)
            assert keys[f"optim.step{t}"] == ((), torch.int64, 0), (rank, t)
