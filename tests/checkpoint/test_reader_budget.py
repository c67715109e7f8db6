"""The streaming reader's memory budget and stream sizes, from the bytes a rank loads."""

from __future__ import annotations

import pytest

from cloudckpt.dcp.reader import ShardSource, StreamingReader, coalesce

MiB = 1024 * 1024


def _reader(**kw) -> StreamingReader:
    streamed = kw.pop("streamed", True)
    return StreamingReader(ShardSource("s3://b/ck/model_and_optim", lambda *a: None, streamed=streamed), **kw)


@pytest.mark.parametrize(
    "planned, inflight, stream",
    [
        (0, 32 * MiB, 16 * MiB),             # small loads: the 32 MiB floor, streams of at least 16 MiB
        (24 * MiB, 32 * MiB, 16 * MiB),
        (512 * MiB, 32 * MiB, 128 * MiB),    # 1 GiB over 2 ranks: four streams
        (1024 * MiB, 64 * MiB, 256 * MiB),   # 1 GiB on one rank (2 -> 1)
        (2048 * MiB, 128 * MiB, 512 * MiB),  # 4 GiB over 2 ranks
        (4096 * MiB, 256 * MiB, 512 * MiB),  # max_stream_size: more streams, each at most 512 MiB
        (64 * 1024 * MiB, 512 * MiB, 512 * MiB),  # the 512 MiB in-flight cap
    ],
)
def test_budget_is_a_sixteenth_of_the_rank_in_flight_in_streams_of_a_quarter(planned, inflight, stream):
    assert _reader().budget(planned) == (inflight, stream)


@pytest.mark.parametrize("planned, inflight, stream",
                         [(512 * MiB, 32 * MiB, 8 * MiB), (2048 * MiB, 128 * MiB, 32 * MiB)])
def test_stores_without_a_streamed_get_read_streams_of_a_quarter_of_the_budget(planned, inflight, stream):
    """GCS fetches a range in part_size pieces: a long stream would be held whole (or
    copied across pieces), so its streams stay short, one request each."""
    assert _reader(streamed=False).budget(planned) == (inflight, stream)


def test_budget_respects_the_configured_caps():
    r = _reader(max_inflight_bytes=64 * MiB, max_stream_size=4 * MiB)
    assert r.budget(16 * 1024 * MiB) == (64 * MiB, 4 * MiB)


def test_coalesce_never_splits_an_item_and_keeps_ranges_under_the_size():
    items = [(i * 3 * MiB, 3 * MiB, i) for i in range(10)] + [(40 * MiB, 20 * MiB, "big")]
    ranges = coalesce(items, max_gap=MiB, max_range=8 * MiB)
    assert [p for _, _, ps in ranges for (_, _, p) in ps] == list(range(10)) + ["big"]
    for start, end, parts in ranges:
        assert end - start <= 8 * MiB or len(parts) == 1
        assert all(start <= off and off + n <= end for off, n, _ in parts)


def test_a_rank_loading_512_mib_from_two_files_reads_them_through_four_streams():
    """The bench's 1 GiB load per rank: two 256 MiB shard files of ~4 MiB items (zip
    headers between them): each file is two or three streams (a quarter of the
    rank's bytes rarely falls on an item boundary), never one request per few MiB."""
    item = 4 * MiB + 1024
    per_file = [(i * item, item, i) for i in range(int(256 * MiB // item))]
    _, size = _reader().budget(2 * sum(n for _, n, _ in per_file))
    ranges = coalesce(per_file, max_gap=MiB, max_range=size)
    assert 2 <= len(ranges) <= 3 and sum(len(p) for _, _, p in ranges) == len(per_file)
    assert all(e - s <= size for s, e, _ in ranges)
