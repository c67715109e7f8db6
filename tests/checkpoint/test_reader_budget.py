"""The streaming reader's memory budget and range sizes, from the bytes a rank loads."""

from __future__ import annotations

import pytest

from cloudckpt.dcp.reader import StreamingReader, coalesce

MiB = 1024 * 1024


def _reader(**kw) -> StreamingReader:
    return StreamingReader("s3://b/ck/model_and_optim", lambda *a: None, get_bytes=lambda u: b"", **kw)


@pytest.mark.parametrize(
    "planned, inflight, size",
    [
        (0, 32 * MiB, 8 * MiB),            # small loads: the 32 MiB floor, 4 ranges of 8 MiB
        (512 * MiB, 32 * MiB, 8 * MiB),    # 1 GiB over 2 ranks
        (1024 * MiB, 64 * MiB, 16 * MiB),  # 1 GiB on one rank (2 -> 1)
        (1100 * MiB, 68.75 * MiB, 17.1875 * MiB),  # still a quarter below a 128 MiB budget: two items of
        # 8 MiB + their zip headers fit one range (an eighth, or a 16 MiB floor, would split them)
        (2048 * MiB, 128 * MiB, 16 * MiB), # 4 GiB over 2 ranks: 8 ranges of 16 MiB in flight
        (4096 * MiB, 256 * MiB, 32 * MiB),
        (64 * 1024 * MiB, 512 * MiB, 64 * MiB),  # the 512 MiB cap, ranges at max_range_size
    ],
)
def test_budget_is_a_sixteenth_of_the_rank_in_ranges_of_a_quarter_or_an_eighth(planned, inflight, size):
    got_inflight, got_size = _reader().budget(planned)
    assert (got_inflight, got_size) == (int(inflight), int(size))
    assert 4 <= got_inflight // got_size <= 8


def test_budget_respects_the_configured_caps():
    r = _reader(max_inflight_bytes=64 * MiB, max_range_size=4 * MiB)
    assert r.budget(16 * 1024 * MiB) == (64 * MiB, 4 * MiB)


def test_coalesce_never_splits_an_item_and_keeps_ranges_under_the_size():
    items = [(i * 3 * MiB, 3 * MiB, i) for i in range(10)] + [(40 * MiB, 20 * MiB, "big")]
    ranges = coalesce(items, max_gap=MiB, max_range=8 * MiB)
    assert [p for _, _, ps in ranges for (_, _, p) in ps] == list(range(10)) + ["big"]
    for start, end, parts in ranges:
        assert end - start <= 8 * MiB or len(parts) == 1
        assert all(start <= off and off + n <= end for off, n, _ in parts)


def test_ranges_of_a_one_rank_gigabyte_hold_two_power_of_two_items_with_their_headers():
    """A shard of a 2048 x 2048 fp32 matrix is 8 MiB plus its zip headers: a 16 MiB
    range would hold one of them, doubling the requests of a 2 -> 1 load at 1 GiB."""
    item = 8 * MiB + 1024
    items = [(i * item, item, i) for i in range(132)]  # ~1057 MiB, as in the bench's 2 -> 1 load
    _, size = _reader().budget(sum(n for _, n, _ in items))
    ranges = coalesce(items, max_gap=MiB, max_range=size)
    assert len(ranges) == 66 and all(len(parts) == 2 for _, _, parts in ranges)
