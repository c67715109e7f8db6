"""Crafted DCP index (``index/header.json``, listed in the marker, and
``index/rank{R}.json``, listed in its rank's manifest part; dcp/index/) through the
entry points that plan a load with it.

Each case starts from an honest committed step (one rank) and rewrites the header or
adds a part, with every manifest entry and the marker's part reference made to match
(the attacker controls the whole step): layouts that overlap, leave holes or lie
outside their tensor, items outside the shard files or past a file's end, owners far
past the job, a part that places a chunk in another rank's file or lacks a chunk the
header gives it, JSON bombs, a header declared enormous. Every one is a typed refusal
naming the step (class 9); a crash, bomb, hang or untyped error is a finding.
"""

from __future__ import annotations

import json

from .corpus import Step
from .tries import OK, REFUSED, Try, honest_step, outside_untouched, run_entry

HEADER = "index/header.json"
# Lightning builds its targets from the header (Checkpointer.load_with): it allocates what the header says
ENTRIES = ("load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify", "cli_export")


def _header(s: Step) -> dict:
    return json.loads(s.get(HEADER))


def _put_header(s: Step, doc: dict | bytes) -> None:
    s.put(HEADER, doc if isinstance(doc, bytes) else json.dumps(doc).encode())


def _w(doc: dict) -> list:
    return next(t for t in doc["tensors"] if t[0] == "model.w")


def _split_w(s: Step, *, boxes=(0, 32, 32, 32), owners=(0, 0)) -> tuple[dict, list]:
    """The header made to say ``model.w`` [64] is stored in chunks ``boxes`` (offset,
    size pairs) written by ``owners``; returns the header and ``model.w``'s whole item."""
    doc = _header(s)
    w = _w(doc)
    item = w[4]
    doc["layouts"].append({"ndim": 1, "boxes": list(boxes), "owners": list(owners)})
    w[3], w[4] = len(doc["layouts"]) - 1, None
    return doc, item


def _put_part(s: Step, rank: int, items: list) -> None:
    body = json.dumps({"format": "cloudckpt-dcp-index", "version": 1, "rank": rank, "items": items}).encode()
    s.put(f"index/rank{rank}.json", body)


def _overlap(s: Step) -> None:
    doc, _ = _split_w(s, boxes=(0, 40, 30, 34))
    _put_header(s, doc)


def _hole(s: Step) -> None:
    doc, _ = _split_w(s, boxes=(0, 30, 32, 32))
    _put_header(s, doc)


def _outside_tensor(s: Step) -> None:
    doc, _ = _split_w(s, boxes=(0, 32, 32, 40))
    _put_header(s, doc)


def _item_outside(s: Step) -> None:
    doc = _header(s)
    _w(doc)[4][0] = "../../outside/victim"
    _put_header(s, doc)


def _item_past_file(s: Step) -> None:
    doc = _header(s)
    _w(doc)[4][1] = 1 << 40
    _put_header(s, doc)


def _dtype(s: Step) -> None:
    doc = _header(s)
    _w(doc)[1] = "qint8"
    _put_header(s, doc)


def _owner_far(s: Step) -> None:
    doc, _ = _split_w(s, owners=(0, (1 << 24) - 1))
    _put_header(s, doc)


def _part_other_rank(s: Step) -> None:
    doc, (rel, off, n) = _split_w(s)
    _put_header(s, doc)
    _put_part(s, 0, [["model.w", [0], [32], rel, off, n], ["model.w", [32], [32], "__1_0.distcp", off, n]])


def _part_lacks_chunk(s: Step) -> None:
    doc, (rel, off, n) = _split_w(s)
    _put_header(s, doc)
    _put_part(s, 0, [["model.w", [0], [32], rel, off, n]])


def _part_missing(s: Step) -> None:
    doc, _ = _split_w(s)
    _put_header(s, doc)


def _deep(s: Step) -> None:
    _put_header(s, b"[" * 100_000 + b"]" * 100_000)


def _many_keys(s: Step) -> None:
    doc = _header(s)
    doc["tensors"] += [[f"k{i}", "float32", [1], -1, ["__0_0.distcp", 0, 1]] for i in range(200_000)]
    _put_header(s, doc)


def _declared_huge(s: Step) -> None:
    data = s.get(HEADER)
    from .corpus import crc

    s.relist(HEADER, 1 << 40, crc(data))


def _grid(s: Step, layout: dict) -> None:
    doc = _header(s)
    w = _w(doc)
    doc["layouts"].append({"ndim": 1, **layout})
    w[3], w[4] = len(doc["layouts"]) - 1, None
    _put_header(s, doc)


def _grid_huge(s: Step) -> None:
    """2^40 chunks owned by ranks 0, 1, 2, ... (a rule): more than the step's writers."""
    _grid(s, {"cuts": [{"every": 1, "end": 1 << 40}], "owners": {"start": 0, "step": 1}})


def _grid_past(s: Step) -> None:
    _grid(s, {"cuts": [[0, 32, 80]], "owners": [0, 0]})


def _tensor_huge(s: Step) -> None:
    """model.w declared [2^40] float32 (4 TiB), its item the honest one: a target built
    from the header would allocate 4 TiB."""
    doc = _header(s)
    _w(doc)[2] = [1 << 40]
    _put_header(s, doc)


def _renamed_key(s: Step) -> None:
    doc = _header(s)
    _w(doc)[0] = "model.x"
    _put_header(s, doc)


CASES = {
    "index-layout-overlap": ("a layout's chunks overlap", _overlap),
    "index-layout-hole": ("a layout's chunks leave a hole", _hole),
    "index-layout-outside": ("a chunk lies past its tensor", _outside_tensor),
    "index-item-outside": ("an item names ../../outside/victim", _item_outside),
    "index-item-past-file": ("an item starts 1 TiB into its file", _item_past_file),
    "index-dtype": ("a dtype DCP does not write (qint8)", _dtype),
    "index-owner-far": ("a chunk owned by rank 2^24 - 1", _owner_far),
    "index-part-other-rank": ("a part places a chunk in another rank's file", _part_other_rank),
    "index-part-lacks-chunk": ("a part lacks a chunk the header gives it", _part_lacks_chunk),
    "index-part-missing": ("the header's owner has no part", _part_missing),
    "index-deep": ("100,000 nested lists", _deep),
    "index-many-keys": ("200,000 keys the target lacks", _many_keys),
    "index-declared-1tib": ("the header declared 1 TiB", _declared_huge),
    "index-renamed-key": ("the header renames a key", _renamed_key),
    "index-tensor-huge": ("a tensor declared 2^40 elements (4 TiB), its item the honest one (64 floats)", _tensor_huge),
    "index-grid-huge": ("a grid of 2^40 chunks owned by rule", _grid_huge),
    "index-grid-past": ("a grid's cuts end past its tensor", _grid_past),
}
# the header lists keys the target does not have: they are left behind, loudly (KeysNotLoaded
# for keys under model/optim; here they are top-level keys of their own: loaded as nothing). Lightning
# builds its targets from the header: a renamed key is loaded under the header's name (the header is
# what the checkpoint says, CRC-checked against its manifest), as it would be from a renamed .metadata
# `cloudckpt inspect` reads the header alone, checked as every reader checks it (layouts, dtypes, owners
# within the job, the bytes its tensors hold against the step's, its own items inside the shard files): what
# the parts say is for a load and `verify` to refuse. Export
# writes the model's tensors under the names the header gives (many keys outside `model.` are not exported)
OK_CASES = {"index-many-keys": {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_export"},
            "index-renamed-key": {"lightning", "cli_inspect", "cli_export"},
            **{case: {"cli_inspect"} for case in ("index-part-other-rank", "index-part-lacks-chunk",
                                                  "index-part-missing")}}


def attack(tmp: str, root: str, case: str, entry: str) -> None:
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    step = honest_step(root)
    CASES[case][1](Step(open_store(step), step, urls.join))
    with outside_untouched(tmp):
        run_entry(entry, step=step, folder=root, tmp=tmp)


TRIES: list[Try] = [
    Try(klass=9, case=name, what=what, entry=entry, target="tests.security.hostile_index:attack",
        kwargs={"case": name, "entry": entry}, expect=OK if entry in OK_CASES.get(name, ()) else REFUSED,
        timeout=60.0)
    for name, (what, _) in CASES.items()
    for entry in ENTRIES
]
