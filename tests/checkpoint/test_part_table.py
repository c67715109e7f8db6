"""A marker's part references are held as columns (marker.PartTable): rank 0 hands the
marker to every rank of a load, so what travels and what a rank builds must not grow
by an object per rank of the job."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from cloudckpt.checkpoint.entries import ObjectEntry
from cloudckpt.checkpoint.layout import part_name
from cloudckpt.checkpoint.marker import FORMAT_VERSION, Marker
from cloudckpt.checkpoint.parts import PartRef, PartTable


def _refs(ranks) -> tuple[PartRef, ...]:
    return tuple(PartRef(r, part_name(r), 900_000 + r, f"{(r * 2654435761) & 0xffffffff:08x}", 99, 10**11 + r)
                 for r in ranks)


def _marker(parts) -> Marker:
    return Marker(step=7, ephemeral=False, world_size=max((p.rank for p in parts), default=0) + 1, parts=parts,
                  objects=(ObjectEntry("index/header.json", 4096, "0123abcd"),), format_version=FORMAT_VERSION,
                  save_id="f" * 32)


@pytest.mark.parametrize("ranks", [range(16_384), [0, 1, 5, 9, 200]], ids=["every rank", "some ranks"])
def test_a_marker_pickles_its_parts_as_columns_and_equals_itself(ranks):
    parts = _refs(ranks)
    m = _marker(parts)
    assert isinstance(m.parts, PartTable) and m.parts == parts and tuple(m.parts) == parts
    assert m.part_of("model_and_optim/__9_0.distcp") == (parts[3] if len(parts) == 5 else parts[9])
    m.part_of("model_and_optim/__0_0.distcp")  # builds the lookup cache, which does not travel
    data = pickle.dumps(m)
    back = pickle.loads(data)
    assert back == m and back.to_bytes() == m.to_bytes()
    assert back._parts_by_rank.get(3) is None if len(parts) == 5 else back._parts_by_rank[3] == parts[3]
    if len(parts) > 1000:
        # 8 + 8 + 8 bytes of sizes and counts and 4 of CRC32C a part; a PartRef per rank was ~70
        assert len(data) / len(parts) < 30, len(data) / len(parts)


def test_parts_that_a_table_cannot_hold_stay_a_tuple():
    odd = dataclasses.replace(_refs([3])[0], path="manifest/elsewhere.json")
    m = _marker((*_refs([0, 1]), odd))
    assert type(m.parts) is tuple and m.part_of("model_and_optim/__2_0.distcp") is None
    assert m._parts_by_rank[3] is odd
    unsorted = _marker(tuple(reversed(_refs([0, 1, 2]))))
    assert type(unsorted.parts) is tuple


def test_a_table_is_indexed_like_a_tuple():
    parts = _refs([2, 4, 6])
    t = PartTable.of(parts)
    assert t[0] == parts[0] and t[-1] == parts[-1] and t[1:] == parts[1:] and len(t) == 3
    assert t.get(4) == parts[1] and t.get(5) is None and t.get(-1) is None and t.get(7, "x") == "x"
    with pytest.raises(IndexError):
        t[3]
    assert hash(t) == hash(parts) and t == parts and t == list(parts) and t != parts[:2]


def test_a_marker_with_its_parts_withheld_still_knows_the_steps_bytes():
    # load_with bounds what it allocates from the index header by the step's bytes, on every rank
    m = _marker(_refs(range(64)))
    withheld = pickle.loads(pickle.dumps(m.withholding_parts()))
    assert withheld.total_bytes == m.total_bytes == 4096 + sum(900_000 + r + 10**11 + r for r in range(64))
    assert len(withheld.parts) == 64
