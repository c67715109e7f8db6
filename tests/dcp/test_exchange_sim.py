"""The read-once exchange's planning at scale, without ranks (bench/exchange.py's
``_Sim``: bench/scale.py's layout of an HSDP job, exchange.py's own ``owner_of`` and
``assign`` for every owner, ``Exchange.census`` run on one rank with its peers'
messages computed from them)."""

from __future__ import annotations

import pytest

from bench.exchange import _Sim
from bench.scale import small
from cloudckpt.dcp.exchange import BLOCK, TINY, owner_of


@pytest.mark.parametrize("R,G", [(64, 8), (64, 32)])
def test_every_stored_byte_is_read_once_and_the_census_agrees_with_the_owners(R, G):
    sim = _Sim(small(96), R, R // G)
    pr = sim.per_rank()
    stored = sum(k[2] for k in sim.reader)
    assert sum(pr["bucket_bytes"]) == stored  # each distinct range read by exactly one rank
    assert sum(pr["need_bytes"]) > (G - 0.5) * stored  # without the exchange: once per replica group
    for r in range(R):
        assert pr["bucket_bytes"][r] + pr["peer_bytes"][r] == pr["need_bytes"][r]
    hot = max(range(R), key=pr["requests_owned"].__getitem__)
    for me in (1, hot):
        got = sim.run_census(me)  # raises if the plan differs from the owners' choice
        assert got["received_bytes"] > 0 and got["reads"] + got["receives"] == len(sim.needs(me))


def test_tiny_ranges_meet_at_owners_of_their_own_and_larger_ones_at_their_blocks_owner():
    R, fid = 1024, 12345
    tiny = {owner_of(fid, 8 * i, 8, R) for i in range(200)}  # 200 replicated scalars side by side
    assert len(tiny) > 100
    big = {owner_of(fid, i * (1 << 20), 1 << 20, R) for i in range(BLOCK // (1 << 20))}
    assert len(big) == 1
    assert owner_of(fid, 0, TINY, R) == owner_of(fid, BLOCK - TINY, TINY, R)


def test_a_tiny_range_few_ranks_need_is_read_by_each_and_one_all_ranks_need_by_one():
    from cloudckpt.dcp.exchange import EACH, OWN_READS, assign

    fid = 5
    step = (fid, 0, 1577)  # a 0-dim tensor as DCP stores it
    few = assign({step: list(range(OWN_READS))}, {})
    assert few == {step: EACH}  # each of the ranks reads it: no exchange for a few bytes
    many = assign({step: list(range(64))}, {})
    assert 0 <= many[step] < 64  # one reads it and sends it to the others
    weight = (fid, 4096, TINY)  # not tiny: exchanged even between two ranks
    assert assign({weight: [0, 1]}, {})[weight] in (0, 1)
