"""``dcp.resumable.coalesce``: the ranges a load streams read. What it groups is
checked against a plain reference on random inputs, and its cost stays linear in
the items (it used to copy a range's list on every merge: 100 k items in one range
took 12.5 s)."""

from __future__ import annotations

import random
import time

import pytest

from cloudckpt.dcp.resumable import coalesce


def _reference(items, *, max_gap, max_range):
    """The definition, written the slow obvious way."""
    groups = []
    for off, length, p in sorted(items, key=lambda t: t[0]):
        if groups:
            s = groups[-1][0][0]
            e = max(o + n for o, n, _ in groups[-1])
            if off - e <= max_gap and (off + length) - s <= max_range:
                groups[-1].append((off, length, p))
                continue
        groups.append([(off, length, p)])
    return [(g[0][0], max(o + n for o, n, _ in g), g) for g in groups]


@pytest.mark.parametrize("seed", range(20))
def test_coalesce_groups_items_exactly_as_the_definition_says(seed):
    rng = random.Random(seed)
    items, off = [], 0
    for i in range(rng.randint(0, 300)):
        off += rng.choice([0, 1, 5, 50, 4000])
        n = rng.randint(1, 3000)
        items.append((off, n, f"item{i}"))
        off += n
    rng.shuffle(items)
    gap, rng_max = rng.choice([0, 16, 100, 10_000]), rng.choice([1, 4096, 65536, 1 << 62])
    got = coalesce(items, max_gap=gap, max_range=rng_max)
    assert got == _reference(items, max_gap=gap, max_range=rng_max)
    assert sorted(p for _, _, ps in got for *_, p in ps) == sorted(p for *_, p in items)


def test_coalesce_is_linear_in_items_merged_into_one_range():
    """200 k adjacent items that all merge (pre-download's unbounded range): the old
    copy-per-merge form needed about 50 s here, the linear one well under a second;
    the bound leaves a wide margin for a busy machine."""
    n = 200_000
    items = [(i * 10, 10, i) for i in range(n)]
    t = time.process_time()
    out = coalesce(items, max_gap=0, max_range=1 << 62)
    took = time.process_time() - t
    assert len(out) == 1 and out[0][:2] == (0, n * 10) and len(out[0][2]) == n
    assert took < 5.0, f"coalesce of {n} items took {took:.1f} CPU-s: quadratic again?"
