"""The node-local tier's recovery through the read-once exchange (issue 33): 4 gloo
ranks as 2 "nodes" x 2 ranks (LOCAL_WORLD_SIZE=2), each node with its own folder, a
DDP-style state (every rank holds the same tensors; DCP's dedup stores each once) saved
as local step 10 and copied to the peer node. Node 1 is replaced (its folder wiped) and
the job resumes from the local step: node 1's ranks get the parts they lack from node
0 (the tier's fetch), and the replicated items each rank loads are read from the
ranks' local copies once in the whole job, the other ranks receiving them from peers
(the exchange). Without the exchange every rank reads every replicated byte itself.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from cloudckpt.dcp.exchange import TINY
from cloudckpt.testing.multiprocess import run_ranks

from .test_checkpointer import _env

WORLD = 4
ITEMS, NUMEL = 8, 64 * 256  # 8 replicated tensors of 64 KiB


def _state(zero: bool = False) -> dict:
    g = torch.Generator().manual_seed(7)
    model = {f"w{i}": (torch.zeros(NUMEL) if zero else torch.randn(NUMEL, generator=g)) for i in range(ITEMS)}
    return {"model": model, "step": torch.tensor(0 if zero else 10)}


def run(rank, world, save_folder, local, work, phase, exchange_on):
    """``save``: save the state as local step 10 (copied to the peer node). ``recover``:
    resume; report where from, bit-exact?, the tier's fetched bytes, and the bytes this
    rank read from its local step and received from peers in the exchange."""
    from cloudckpt.dcp import exchange

    from .local_workers import config

    mgr = config(save_folder, local, work, load_exchange=exchange_on).build()
    if phase == "save":
        mgr.maybe_save(10, _state(), {"step": 10})
        mgr.wait()
        mgr.close()
        return {}
    peers = {"bytes": 0, "loads": 0}
    read = exchange.Exchange.read

    def counted(self, reader, *a, **kw):
        try:
            return read(self, reader, *a, **kw)
        finally:
            peers["bytes"] += reader.bytes_from_peers
            peers["loads"] += 1

    exchange.Exchange.read = counted
    sd = _state(zero=True)
    ts = mgr.resume(sd)
    want = _state()
    exact = all(torch.equal(sd["model"][k], want["model"][k]) for k in want["model"]) and int(sd["step"]) == 10
    out = {"resumed": (mgr.resumed_from, mgr.resumed_step), "train_state": ts, "bitexact": exact,
           "fetched": mgr.local.last_recovery["fetched_bytes"], "read": mgr.checkpointer.last_load_info.bytes_read,
           "from_peers": peers["bytes"], "exchanges": peers["loads"]}
    mgr.close()
    return out


@pytest.fixture(scope="module")
def recovered(seaweed, tmp_path_factory):
    bucket = seaweed.create_bucket("local-exchange")
    tmp = tmp_path_factory.mktemp("local-exchange")
    env = dict(_env(), **seaweed.env(), LOCAL_WORLD_SIZE="2")
    args = (bucket + "/run", str(tmp / "local"), str(tmp / "work"))
    run_ranks(WORLD, run, *args, "save", True, env=env, timeout=180)
    out = {}
    for on in (True, False):
        shutil.rmtree(tmp / "local" / "node1", ignore_errors=True)  # node 1 replaced: its disk is empty
        out[on] = run_ranks(WORLD, run, *args, "recover", on, env=env, timeout=180)
    return out


def test_a_replaced_nodes_replicated_items_are_read_once_and_come_from_peers(recovered):
    outs, plain = recovered[True], recovered[False]
    for r, o in enumerate(outs):
        assert o["resumed"] == ("local", 10) and o["train_state"] == {"step": 10}, (r, o)
        assert o["bitexact"], r
        assert o["exchanges"] == 1, (r, o)
    need = plain[0]["read"]  # what one rank loads (every rank the same: the replicated items)
    assert need >= ITEMS * NUMEL * 4 and all(p["read"] == need for p in plain), plain
    # each stored byte read from the ranks' local copies once in the whole job (the step,
    # under TINY bytes, by each rank); the rest of what each rank loads came from peers
    assert need <= sum(o["read"] for o in outs) <= need + (WORLD - 1) * TINY, outs
    assert all(o["read"] + o["from_peers"] == need and o["from_peers"] > 0 for o in outs), outs
    # node 1's ranks had nothing on their disk: they fetched from node 0 only their share
    # of the reading (and their train state and index part), not what peers send them
    assert outs[0]["fetched"] == 0 and outs[1]["fetched"] == 0, outs
    for r in (2, 3):
        assert 0 < outs[r]["fetched"] < plain[r]["fetched"], (outs[r], plain[r])
        assert outs[r]["fetched"] - outs[r]["read"] == plain[r]["fetched"] - need, (outs[r], plain[r])


def test_without_the_exchange_each_rank_reads_every_replicated_byte(recovered):
    outs = recovered[False]
    assert all(o["bitexact"] and o["resumed"] == ("local", 10) for o in outs), outs
    assert all(o["from_peers"] == 0 and o["exchanges"] == 0 for o in outs), outs
    # node 1's ranks fetched from node 0 everything they read
    assert all(outs[r]["fetched"] > outs[r]["read"] for r in (2, 3)), outs
