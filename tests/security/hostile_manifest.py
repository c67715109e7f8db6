"""Crafted manifest parts (``manifest/rank{R}.json``, listed by the marker with its size
and CRC32C: format 2 as a list of references, format 3 as columns) and crafted declared
sizes through every entry point.

Each case starts from an honest committed step (``tries.honest_step``: one rank, so one
part) and crafts its part or the marker's reference to it: names outside the step, a
part that lists another rank's files or belongs to another step, sizes and CRC32Cs that
disagree with the marker, a part declared enormous, bounded-JSON bombs. A reader that
reads the part (the DCP readers, ``inspect``, ``verify``, ``export``, ``download``)
must refuse the step with a typed error naming it; the folder commands (``list``,
``latest``, ``gc``, ``prune``, ``rm``) read markers only and handle the step, unless
the crafted thing is in the marker itself. Class 9 (typed refusals) of the issue's
table; a crash, bomb, hang or untyped error is a finding.

The cases that edit the marker through ``corpus.Step.marker`` write it back as format 2
(``marker.as_part_list``); the ``columns-*`` cases craft format 3's columns themselves
(lengths that disagree, CRC32C strings that are not 8 hex digits each, rank runs that
overlap, run past the world or claim a million parts the columns do not hold), and the
``metadata-*`` cases declare a huge DCP ``.metadata``: over its ceiling for the step
(refused before any read), and under it because the part declares 2**62 bytes (read
only as far as the store holds it: never a bomb).
"""

from __future__ import annotations

import json

from .corpus import Step, crc
from .tries import ENTRY_POINTS, OK, REFUSED, Try, honest_step, outside_untouched, run_entry

PART = "manifest/rank0.json"
PART_READERS = {"load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify", "cli_export",
                "cli_download"}
OBJECT_CHECKERS = {"cli_verify", "cli_download"}  # every object against its entry (size, CRC32C)
# a marker the reader refuses: every entry point but the ones that leave such a step alone (gc, prune) or
# remove it as asked (rm removes a step whatever its marker holds)
MARKER_READERS = set(ENTRY_POINTS) - {"cli_gc", "cli_prune", "cli_rm"}


def _part(s: Step) -> dict:
    return json.loads(s.get(PART))


def _put_part(s: Step, body: bytes, *, relist: bool = True, part: dict | None = None) -> None:
    """Write the part; ``relist``: the marker's reference matches it (size, CRC32C; and,
    given the ``part`` it encodes, the object count and bytes it declares)."""
    s.store.put_bytes(s.join(s.url, PART), body)
    if not relist:
        return
    d = s.marker()
    ref = d["parts"][0]
    ref.update(size=len(body), crc32c=crc(body))
    if part is not None:
        ref.update(objects=len(part["objects"]), bytes=sum(o["size"] for o in part["objects"]))
    s.put_marker(d)


def _edit_part(edit):
    def apply(s: Step) -> None:
        part = edit(_part(s))
        _put_part(s, json.dumps(part).encode(), part=part)
    return apply


def _add_object(path: str, size: int = 8):
    def edit(p: dict) -> dict:
        p["objects"].append({"path": path, "size": size, "crc32c": "00000000"})
        return p
    return _edit_part(edit)


def _rename_first(path: str):
    def edit(p: dict) -> dict:
        p["objects"][0]["path"] = path
        return p
    return _edit_part(edit)


def _set_part(key: str, value):
    def edit(p: dict) -> dict:
        p[key] = value
        return p
    return _edit_part(edit)


def _shard_size(delta: int):
    def edit(p: dict) -> dict:
        next(o for o in p["objects"] if o["path"].endswith(".distcp"))["size"] += delta
        return p
    return _edit_part(edit)


def _raw_part(body: bytes):
    def apply(s: Step) -> None:
        _put_part(s, body)
    return apply


def _append_unlisted(s: Step) -> None:
    _put_part(s, s.get(PART) + b" ", relist=False)


def _marker_ref(**changes):
    def apply(s: Step) -> None:
        d = s.marker()
        d["parts"][0].update(changes)
        s.put_marker(d)
    return apply


def _missing(s: Step) -> None:
    s.store.delete(s.join(s.url, PART))


def _from_another_step(s: Step) -> None:
    """Step 1's part, copied as it is into the marker of another step (step 2: the honest
    step with its marker's step changed), relisted so its bytes match."""
    d = s.marker()
    d["step"] = 2
    s.put_marker(d)


def _two_parts_of_one_rank(s: Step) -> None:
    d = s.marker()
    d["parts"].append(dict(d["parts"][0]))
    s.put_marker(d)


def _part_in_objects(s: Step) -> None:
    d = s.marker()
    d["objects"].append({"path": "train/rank0.pt", "size": 1, "crc32c": "00000000"})
    s.put_marker(d)


# name: (what, apply, the entry points that refuse it)
CASES: dict[str, tuple[str, object, set[str]]] = {
    "part-lists-another-ranks-file": ("rank 0's part also lists rank 1's shard file (__1_0.distcp)",
                                      _add_object("model_and_optim/__1_0.distcp"), PART_READERS),
    "part-lists-another-ranks-train-state": ("rank 0's part lists train/rank1.pt", _add_object("train/rank1.pt"),
                                             PART_READERS),
    "part-lists-the-metadata": ("rank 0's part lists the step's own .metadata a second time",
                                _add_object("model_and_optim/.metadata"), PART_READERS),
    "part-name-dotdot": ("a part entry named ../step2/train/rank0.pt", _rename_first("../step2/train/rank0.pt"),
                         PART_READERS),
    "part-name-control": ("a part entry with an escape character in its name", _rename_first("train/\x1b[2Jrank0.pt"),
                          PART_READERS),
    "part-of-another-step": ("the part names step 7 (relisted so its bytes match)", _set_part("step", 7), PART_READERS),
    "part-of-another-save": ("the part names another save id", _set_part("save_id", "f" * 32), PART_READERS),
    "part-of-another-rank": ("the part says it is rank 1's", _set_part("rank", 1), PART_READERS),
    "marker-of-another-step": ("the marker names step 2; its part (step 1's) is unchanged", _from_another_step,
                               PART_READERS),
    "part-size-lies": ("a shard's size one byte more than the object (the marker's counts match the part): its "
                       "items still lie inside it and check, so loads load; the object checkers refuse",
                       _shard_size(1), OBJECT_CHECKERS),
    "part-bytes-undeclared": ("the part's bytes differ from what the marker's reference declares",
                              _marker_ref(bytes=1), PART_READERS),
    "part-crc-mismatch": ("the part has one byte more than the marker says", _append_unlisted, PART_READERS),
    "part-declared-larger": ("the marker declares the part 1 MiB larger than it is", None, PART_READERS),
    "part-declared-1tib": ("the marker declares the part at 1 TiB", _marker_ref(size=1 << 40), MARKER_READERS),
    "part-missing": ("the part deleted, the marker still lists it", _missing, PART_READERS),
    "part-deep-json": ("the part is JSON nested 100,000 deep", _raw_part(b"[" * 100_000 + b"]" * 100_000),
                       PART_READERS),
    "part-infinity": ("the part's first size is Infinity",
                      _raw_part(b'{"format": "cloudckpt-part", "format_version": 2, '
                                b'"step": 1, "rank": 0, "objects": [{"size": Infinity}]}'),
                      PART_READERS),
    "part-huge-count": ("the part lists its entries 20,000 times over", _edit_part(
        lambda p: {**p, "objects": p["objects"] * 20_000}), PART_READERS),
    "marker-two-parts-one-rank": ("the marker lists rank 0's part twice", _two_parts_of_one_rank, MARKER_READERS),
    "marker-part-elsewhere": ("the marker's part path is ../step2/manifest/rank0.json",
                              _marker_ref(path="../step2/manifest/rank0.json"), MARKER_READERS),
    "marker-part-rank-past-world": ("the marker lists a part of rank 5 in a world of 1", _marker_ref(rank=5),
                                    MARKER_READERS),
    "marker-rank-file-beside-parts": ("the marker also lists train/rank0.pt itself", _part_in_objects, MARKER_READERS),
}


def _raw_marker(s: Step) -> dict:
    """The marker as written (format 3: the parts as columns)."""
    return json.loads(s.get(".metadata.json"))


def _columns(**changes):
    def apply(s: Step) -> None:
        d = _raw_marker(s)
        assert d["format_version"] == 3, "the honest step is written in format 3"
        for k, v in changes.items():
            if k == "world_size":
                d[k] = v
            else:
                d["parts"][k] = v
        s.put_marker(d)
    return apply


def _columns_part_crc_wrong(s: Step) -> None:
    d = _raw_marker(s)
    d["parts"]["crc32c"] = "%08x" % (int(d["parts"]["crc32c"], 16) ^ 1)
    s.put_marker(d)


def _metadata_declared(size: int, part_bytes: int | None = None):
    def apply(s: Step) -> None:
        d = _raw_marker(s)
        next(o for o in d["objects"] if o["path"] == "model_and_optim/.metadata")["size"] = size
        if part_bytes is not None:
            d["parts"]["bytes"] = [part_bytes]
        s.put_marker(d)
    return apply


# the entry points that read DCP's .metadata of one of our steps (load, resume, Lightning, inspect and export read
# the DCP index instead)
METADATA_READERS = {"cli_verify", "cli_download"}

CASES.update({
    "columns-length-disagree": ("format 3: one part size more than the other columns hold",
                                _columns(size=[1, 2]), MARKER_READERS),
    "columns-crc-short": ("format 3: the CRC32C string one hex digit short", _columns(crc32c="0" * 7), MARKER_READERS),
    "columns-crc-not-hex": ("format 3: the CRC32C string is not lowercase hex", _columns(crc32c="XYZW0000"),
                            MARKER_READERS),
    "columns-ranks-a-million": ("format 3: the rank runs claim 1,048,576 parts for one of each column",
                                _columns(ranks=[[0, 1 << 20]], world_size=1 << 20), MARKER_READERS),
    "columns-ranks-past-world": ("format 3: the part of rank 1 in a world of 1", _columns(ranks=[[1, 1]]),
                                 MARKER_READERS),
    "columns-ranks-overlap": ("format 3: rank runs that overlap", _columns(ranks=[[0, 1], [0, 1]]), MARKER_READERS),
    "columns-200k-sizes": ("format 3: 200,000 part sizes (and counts, CRC32Cs) in a world of 1", _columns(
        size=[1] * 200_000, objects=[1] * 200_000, bytes=[1] * 200_000, crc32c="0" * 1_600_000), MARKER_READERS),
    "columns-bytes-20-digits": ("format 3: a part declares 10**19 bytes (more than an int64)",
                                _columns(bytes=[10**19]), MARKER_READERS),
    "columns-part-crc-wrong": ("format 3: the marker's CRC32C of the part is off by one bit", _columns_part_crc_wrong,
                               PART_READERS),
    "metadata-declared-1tib": ("the marker declares DCP's .metadata at 1 TiB in a step of a few KB: over the ceiling "
                               "(1 GiB or the step's other bytes), refused before any read",
                               _metadata_declared(1 << 40), METADATA_READERS),
    "metadata-declared-64gib-backed": ("the part declares 2**62 bytes, so a .metadata declared at 64 GiB is under the "
                                       "ceiling: read only as far as the store holds it, refused for its size",
                                       _metadata_declared(64 << 30, part_bytes=1 << 62),
                                       PART_READERS | METADATA_READERS),
})


def _declared_larger(s: Step) -> None:
    d = s.marker()
    d["parts"][0]["size"] += 1 << 20
    s.put_marker(d)


CASES["part-declared-larger"] = (CASES["part-declared-larger"][0], _declared_larger, PART_READERS)


def attack(tmp: str, root: str, case: str, entry: str) -> None:
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    step = honest_step(root)
    CASES[case][1](Step(open_store(step), step, urls.join))
    with outside_untouched(tmp):
        run_entry(entry, step=step, folder=root, tmp=tmp)


S3_CASES = {"part-lists-another-ranks-file", "part-crc-mismatch", "part-declared-1tib", "part-missing",
            "columns-ranks-a-million", "metadata-declared-1tib", "metadata-declared-64gib-backed"}

TRIES: list[Try] = [
    Try(klass=9, case=name, what=what, entry=entry, target="tests.security.hostile_manifest:attack",
        kwargs={"case": name, "entry": entry}, expect=REFUSED if entry in refusing else OK, backend=backend,
        timeout=30.0)
    for name, (what, _, refusing) in CASES.items()
    for backend in (("local", "s3") if name in S3_CASES else ("local",))
    for entry in ENTRY_POINTS
]
