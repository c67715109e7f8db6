"""``load_exchange`` (CheckpointConfig / CheckpointerOptions) reaches the load: 2 real
gloo ranks holding the same replicated (DDP) state, SeaweedFS, and an S3 backend that
counts the bytes each rank's GETs return (bench/exchange.py's CountingS3). With the
setting off each rank reads the whole step from the bucket (2x its data bytes over the
ranks); on (the default) the bucket serves each byte once."""

from __future__ import annotations

import pytest
import torch

from bench.exchange import counting, flat, snapshot, state
from cloudckpt.storage import open_store
from cloudckpt.testing.multiprocess import run_ranks

WORLD = 2
ITEMS, NUMEL = 16, 64 * 256  # 16 tensors of 64 KiB


def save_then_load_both_ways(rank, world, root, work):
    """Save the DDP state once, then load it with ``load_exchange`` off, then on, each
    through a Checkpointer built from a CheckpointConfig; per way: bit-exact?, and the
    data bytes this rank's GETs returned."""
    from cloudckpt import CheckpointConfig, Checkpointer

    counting()
    step = f"{root}/step1"
    report = {}
    for way in (None, False, True):  # None: save only (the default config)
        cfg = CheckpointConfig(save_folder=root, work_dir=work, collective_timeout=30, _env={},
                               **({} if way is None else {"load_exchange": way}))
        with Checkpointer(cfg.checkpointer_options()) as ck:
            if way is None:
                ck.save(step, state("ddp", rank, ITEMS, NUMEL), {"rank": rank})
                continue
            target = state("ddp", rank, ITEMS, NUMEL, zero=True)
            ck.coord.all_gather(None)  # every rank is here: count the load alone
            before = snapshot()["data_bytes"]
            ck.load(step, target)
            read = snapshot()["data_bytes"] - before
            want, got = flat(state("ddp", rank, ITEMS, NUMEL)), flat(target)
            report[str(way)] = {"bitexact": want.keys() == got.keys() and all(torch.equal(want[k], got[k])
                                                                              for k in want),
                                "data_bytes": read}
    return report


@pytest.fixture
def loads(s3_bucket, tmp_path):
    from tests.checkpoint.test_checkpointer import _env

    root = s3_bucket + "/run"
    reports = run_ranks(WORLD, save_then_load_both_ways, root, str(tmp_path / "w"), env=_env(), timeout=180)
    store = open_store(root)
    data = sum(e.size for e in store.list(root + "/step1/", delimiter=None) if e.url.endswith(".distcp"))
    return reports, data


def test_load_exchange_off_reads_the_replicated_bytes_per_rank_and_on_reads_them_once(loads):
    reports, data = loads
    assert data >= ITEMS * NUMEL * 4  # the state's float32 bytes, saved once (DCP's dedup)
    assert all(r[way]["bitexact"] for r in reports for way in ("False", "True")), reports
    off = [r["False"]["data_bytes"] for r in reports]
    on = [r["True"]["data_bytes"] for r in reports]
    assert off == [data] * WORLD, (off, data)  # each rank reads every byte it needs itself
    # each stored byte leaves the bucket once, split (the step, under exchange.TINY bytes, read by each rank)
    from cloudckpt.dcp.exchange import TINY

    assert data <= sum(on) <= data + (WORLD - 1) * TINY and min(on) > 0, (on, data)
