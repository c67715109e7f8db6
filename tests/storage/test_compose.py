"""Assembly from pieces (storage/assembly.py) where the conformance suite does not
reach: a read-only store refuses every call, naming the location; the piece checks
the complete runs before it sends anything."""

from __future__ import annotations

import pytest

from cloudckpt.errors import PreconditionFailed, ReadOnlyLocation
from cloudckpt.storage import open_store
from cloudckpt.storage.assembly import Assembly, Piece, check_pieces


def test_an_https_store_is_read_only_for_every_assembly_call():
    store = open_store("https://127.0.0.1:9/run/step1")  # nothing listens: no call may send a request
    a = Assembly("https://127.0.0.1:9/run/step1/obj", "t")
    assert store.assembles_objects is False
    for call in (lambda: store.begin_assembly(a.url), lambda: store.put_piece(a, 0, b"x", offset=0),
                 lambda: store.complete_assembly(a, [Piece(0, 0, 1)]), lambda: store.abort_assembly(a)):
        with pytest.raises(ReadOnlyLocation, match="cannot assemble https://127.0.0.1:9/run/step1/obj"):
            call()


@pytest.mark.parametrize("pieces, why", [
    ([Piece(1, 0, 5)], "piece 0 is missing"),
    ([Piece(0, 0, 5), Piece(0, 5, 5)], "piece 1 is missing or given twice"),
    ([Piece(0, 0, 5), Piece(1, 6, 5)], "the pieces before it end at 5"),
    ([Piece(0, 1, 5)], "the pieces before it end at 0"),
    ([Piece(0, 0, 3), Piece(1, 3, 5)], "at least 4"),
    ([Piece(k, 4 * k, 4) for k in range(4)], "more than the 3"),
])
def test_pieces_that_a_store_would_refuse_are_refused_before_the_complete(pieces, why):
    with pytest.raises(PreconditionFailed, match=why):
        check_pieces("s3://b/k", pieces, min_piece_size=4, max_pieces=3)


def test_pieces_in_any_order_come_back_in_index_order_and_the_last_may_be_small():
    got = check_pieces("s3://b/k", [Piece(2, 8, 1), Piece(0, 0, 4), Piece(1, 4, 4)], min_piece_size=4, max_pieces=3)
    assert [p.index for p in got] == [0, 1, 2]


def test_an_s3_part_number_past_ten_thousand_is_refused_without_a_request():
    store = open_store("s3://bucket/k")
    with pytest.raises(PreconditionFailed, match="1..10000"):
        store.put_piece(Assembly("s3://bucket/k", "upload"), 10_000, b"x", offset=0)
