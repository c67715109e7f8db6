"""The read-once exchange at load (issue 33): 4 real gloo ranks, SeaweedFS, and a
store that counts the bytes and requests each rank's GETs carry (bench/exchange.py's
CountingS3: the S3 backend subclassed and registered in the ranks).

- DDP-style (every rank holds the same replicated state) and 2x2 HSDP-style (ranks
  {0, 2} hold shard 0, {1, 3} shard 1, plus a replicated step): bit-exact load; the
  bucket serves the step's data bytes once (with the exchange) where it served them
  once per replica without; each rank's share of the reading within 2x of the others'.
- A rank killed during the exchange: every other rank's load fails with
  ExchangeFailed naming it, within the collective timeout; a restart loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch

from bench.exchange import counting, flat, snapshot, state
from cloudckpt.dcp.exchange import TINY
from cloudckpt.storage import open_store
from cloudckpt.testing.multiprocess import RankFailed, run_ranks

WORLD = 4
ITEMS = 48  # tensors of 128 KiB: enough items that the reading spreads evenly
NUMEL = 128 * 256
TIMEOUT = 20.0  # the collective timeout of the ranks


def _state(layout: str, rank: int, zero: bool = False) -> dict:
    return state(layout, rank, ITEMS, NUMEL, zero)


def save_and_load(rank, world, root, work, layouts):
    """Save each layout, then load it without and with the exchange, and with it and
    pre_download=True (counting the bucket's bytes); report per layout and way."""
    from cloudckpt import Checkpointer

    counting()
    ck = Checkpointer(work_dir=work, collective_timeout=TIMEOUT)
    report: dict = {}
    for layout in layouts:
        step = f"{root}/{layout}/step1"
        ck.save(step, _state(layout, rank), {"rank": rank})
        for way in ("off", "on", "pre_download"):
            ck.options = dataclasses.replace(ck.options, load_exchange=way != "off")
            target = _state(layout, rank, zero=True)
            ck.coord.all_gather(None)  # every rank is here: count the load alone
            before = snapshot()
            ck.load(step, target, pre_download=way == "pre_download")
            after = snapshot()
            want, got = flat(_state(layout, rank)), flat(target)
            report.setdefault(layout, {})[way] = {
                "bitexact": want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want),
                "bucket": {k: after[k] - before[k] for k in after},
            }
    return report


def kill_in_exchange(rank, world, root, work, victim, out_dir):
    """Load the saved DDP step; ``victim`` dies once the census is done (inside the exchange)."""
    from cloudckpt import Checkpointer
    from cloudckpt.dcp import exchange

    if rank == victim:
        census = exchange.Exchange.census

        def census_then_die(self, needed):
            census(self, needed)
            os._exit(9)

        exchange.Exchange.census = census_then_die
    ck = Checkpointer(work_dir=work, collective_timeout=TIMEOUT)
    t0 = time.monotonic()
    try:
        ck.load(f"{root}/ddp/step1", _state("ddp", rank, zero=True))
        outcome = {"raised": None}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        outcome = {"raised": type(e).__name__, "message": str(e)[:2000]}
    ex = exchange.for_coordinator(ck.coord)
    err = ex.last_error
    outcome.update(seconds=time.monotonic() - t0,
                   exchange_error=None if err is None else {"type": type(err).__name__,
                                                            "failures": {str(k): v for k, v in err.failures.items()}})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)  # the world lost a rank: skip tearing it down


def _env() -> dict:
    from tests.checkpoint.test_checkpointer import _env as env

    return env()


def bucket_and_tmp(seaweed, tmp_path_factory, name: str):
    """A fresh bucket's ``.../run`` (SeaweedFS's env set for the ranks) and a temporary folder."""
    for k, v in seaweed.env().items():
        os.environ[k] = v
    return seaweed.create_bucket(f"{name}-{os.getpid()}") + "/run", tmp_path_factory.mktemp(name)


@pytest.fixture(scope="module")
def saved(seaweed, tmp_path_factory):
    """One run: DDP and HSDP saved, each loaded without then with the exchange."""
    root, tmp = bucket_and_tmp(seaweed, tmp_path_factory, "exchange")
    reports = run_ranks(WORLD, save_and_load, root, str(tmp / "w1"), ["ddp", "hsdp"], env=_env(), timeout=120)
    return root, reports, tmp


def _data_bytes(step: str) -> int:
    store = open_store(step)
    return sum(e.size for e in store.list(step + "/", delimiter=None) if e.url.endswith(".distcp"))


@pytest.mark.parametrize("layout", ["ddp", "hsdp"])
def test_each_stored_byte_leaves_the_bucket_once(saved, layout):
    root, reports, _ = saved
    data = _data_bytes(f"{root}/{layout}/step1")
    assert data > 0
    for r in range(WORLD):
        assert all(reports[r][layout][way]["bitexact"] for way in ("off", "on", "pre_download")), r
    read = [reports[r][layout]["on"]["bucket"]["data_bytes"] for r in range(WORLD)]
    # with pre_download=True too (the shared share is streamed, the rest downloaded)
    # (the step, a 0-dim tensor DCP stores in 1,577 bytes, is read by each rank: under TINY bytes and
    # needed by at most OWN_READS ranks)
    once = (data, data + (WORLD - 1) * TINY)
    pre = sum(reports[r][layout]["pre_download"]["bucket"]["data_bytes"] for r in range(WORLD))
    assert once[0] <= pre <= once[1], (pre, data)
    plain = sum(reports[r][layout]["off"]["bucket"]["data_bytes"] for r in range(WORLD))
    # without the exchange each replica reads its copy: 4x (DDP) or 2x (HSDP; the step, 4x) the data
    copies = 4 if layout == "ddp" else 2
    assert copies * data <= plain <= copies * data * 1.001, (plain, data)
    assert once[0] <= sum(read) <= once[1], (read, data)  # each stored byte once
    assert max(read) <= 2 * min(read), read  # the reading is spread over the ranks


@pytest.fixture(scope="module")
def killed(saved):
    """A DDP load in which rank 2 dies inside the exchange (each other rank's outcome),
    then a restart: a load, and a load in which rank 1 corrupts what it sends."""
    root, _, tmp = saved
    out = tmp / "kill"
    out.mkdir()
    with pytest.raises(RankFailed) as info:
        run_ranks(WORLD, kill_in_exchange, root, str(tmp / "w3"), VICTIM, str(out), env=_env(),
                  timeout=3 * TIMEOUT + 30)
    outcomes = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)
                if (out / f"rank{r}.json").exists()}
    restart = run_ranks(WORLD, restart_then_corrupt, root, str(tmp / "w4"), LIAR, env=_env(), timeout=120)
    return info.value, outcomes, restart


VICTIM, LIAR = 2, 1


def test_a_rank_killed_in_the_exchange_fails_every_rank_naming_it_and_a_restart_loads(killed):
    failed, outcomes, restart = killed
    assert VICTIM in failed.failures and VICTIM not in outcomes
    assert sorted(outcomes) == [r for r in range(WORLD) if r != VICTIM]
    for r, o in outcomes.items():
        # the load's error on every rank: the exchange's, naming the rank that died
        assert o["raised"] == "ExchangeFailed" and f"rank {VICTIM}:" in o["message"], (r, o)
        err = o["exchange_error"]
        assert err is not None and err["type"] == "ExchangeFailed" and set(err["failures"]) == {str(VICTIM)}, (r, o)
        assert o["seconds"] < 2 * TIMEOUT + 10, (r, o)
    assert all(bitexact for bitexact, _ in restart), restart  # a restart loads


def restart_then_corrupt(rank, world, root, work, liar):
    """Load the saved DDP step (bit-exact?); then load it again while ``liar`` flips a
    byte of every item it sends to peers (the error each rank raises)."""
    from cloudckpt import Checkpointer
    from cloudckpt.dcp import exchange

    ck = Checkpointer(work_dir=work, collective_timeout=TIMEOUT)
    target = _state("ddp", rank, zero=True)
    ck.load(f"{root}/ddp/step1", target)
    want, got = flat(_state("ddp", rank)), flat(target)
    bitexact = all(torch.equal(want[k], got[k]) for k in want)
    if rank == liar:
        keep = exchange._Sender.keep

        def flipped(self, rel, off, length, data, release):
            data = bytearray(data)
            if data:
                data[len(data) // 2] ^= 0xFF
            return keep(self, rel, off, length, data, release)

        exchange._Sender.keep = flipped
    try:
        ck.load(f"{root}/ddp/step1", _state("ddp", rank, zero=True))
        return bitexact, (None, None)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return bitexact, (type(e).__name__, str(e))


def test_bytes_a_peer_sends_are_checked_like_bucket_reads(killed):
    outs = [err for _, err in killed[2]]
    # a receiver's check fails naming the rank the bytes came from; the ranks it exchanges
    # with hear that it failed: no rank's load succeeds, every error is typed. The bytes
    # were checked by the sender when it read them: a cloudckpt bug (InternalError), never a
    # verdict on the checkpoint (CorruptCheckpoint would make resume() fall back)
    assert all(kind in ("InternalError", "ExchangeFailed") for kind, _ in outs), outs
    named = [m for kind, m in outs if kind == "InternalError"]
    assert named and all(f"received from rank {LIAR}" in m and "CRC32C" in m and "cloudckpt bug" in m
                         for m in named), outs


def test_owners_cut_shared_ranges_into_even_contiguous_runs():
    from cloudckpt.dcp.exchange import BLOCK, assign

    mib = 1024 * 1024
    fid = 7
    # one block, 16 items of 512 KiB needed by ranks 0-3; one item needed by rank 2 alone
    req = {(fid, i * mib // 2, mib // 2): [0, 1, 2, 3] for i in range(16)}
    req[(fid, BLOCK + 5, 100)] = [2]
    load: dict = {}
    got = assign(req, load)
    assert got[(fid, BLOCK + 5, 100)] == 2
    shared = sorted(k for k in req if len(req[k]) == 4)
    readers = [got[k] for k in shared]
    assert sorted(set(readers)) == [0, 1, 2, 3]
    assert [load[r] for r in range(4)] == [2 * mib] * 4  # the shared bytes, evenly (unshared: read by their rank)
    runs = [readers[i] for i in range(len(readers)) if i == 0 or readers[i] != readers[i - 1]]
    assert len(runs) == 4, readers  # contiguous: one run per rank, so one request each
