"""Class 9, scanned generically: malformed objects of a step through every entry point.

Each case starts from an honest committed step (``tries.honest_step``) and breaks one
object the way a crash, a bad disk or a careless tool would, not the way an attacker
would aim: truncated (the marker rewritten to match, so only the parser can notice, or
left as it was), emptied, overwritten with random bytes, deleted, or, for the marker and
the ``latest`` pointer, replaced by JSON of the wrong type. Every entry point must
either handle the step (ok) or refuse it with a typed error naming it (R); an untyped
exception, a crash, a bomb or a hang is a finding.

Which entry point refuses which case follows from what it reads: the DCP readers parse
``.metadata`` and the shards, the train-state readers ``train/rank0.pt``, ``verify`` and
``download`` compare every object with the marker, and the folder commands (``list``,
``latest``, ``gc``, ``prune``, ``rm``) read markers only.
"""

from __future__ import annotations

import json
import random

from .corpus import META, MODEL, TRAIN, Step
from .tries import ENTRY_POINTS, OK, REFUSED, Try, honest_step, outside_untouched, run_entry

MARKER = ".metadata.json"
SHARD0 = f"{MODEL}/__0_0.distcp"  # the model's tensors and the DCP byte item (a non-tensor value)
SHARD1 = f"{MODEL}/__0_1.distcp"  # the optimizer's tensor
ALL = set(ENTRY_POINTS)
DCP_READERS = {"load", "load_pre_download", "resume", "lightning"}
TRAIN_READERS = DCP_READERS | {"cli_inspect", "cli_verify"}
METADATA_READERS = DCP_READERS | {"cli_inspect", "cli_verify", "cli_export"}  # and the manifest's file sizes
OBJECT_CHECKERS = {"cli_verify", "cli_download"}  # every object against the marker (size, CRC32C, presence)
# gc and prune leave a step whose marker they cannot read alone; rm deletes a step folder committed or not
MARKER_READERS = ALL - {"cli_gc", "cli_prune", "cli_rm"}


def _random(n: int, seed: str) -> bytes:
    return random.Random(seed).randbytes(n)


def _rewrite(rel: str, how: str):
    """Replace the object ``rel`` (its manifest entry matching the new bytes)."""
    def apply(s: Step, folder: str) -> None:
        data = s.get(rel)
        new = {"truncated": data[: len(data) // 2], "empty": b"", "random": _random(len(data), rel)}[how]
        s.put(rel, new)
    return apply


def _short(rel: str):
    """Truncate ``rel`` and leave the marker as it was (its size and CRC32C now lie)."""
    def apply(s: Step, folder: str) -> None:
        s.store.put_bytes(s.join(s.url, rel), s.get(rel)[:-7])
    return apply


def _missing(rel: str):
    def apply(s: Step, folder: str) -> None:
        s.store.delete(s.join(s.url, rel))
    return apply


def _marker(edit):
    """The marker as JSON, edited (``edit(d)`` returns the new document)."""
    def apply(s: Step, folder: str) -> None:
        s.put_marker(json.dumps(edit(s.marker())).encode())
    return apply


def _marker_bytes(make):
    def apply(s: Step, folder: str) -> None:
        s.put_marker(make(s.get(MARKER)))
    return apply


def _pointer(data: bytes):
    def apply(s: Step, folder: str) -> None:
        s.store.put_bytes(s.join(folder, "latest"), data)
    return apply


def _set(key: str, value):
    def edit(d: dict):
        d[key] = value
        return d
    return edit


def _first_object(key: str, value):
    def edit(d: dict):
        d["objects"][0][key] = value
        return d
    return edit


# plan a load of our steps from the DCP index (Lightning too: its targets come from the index header)
INDEX_PLANNERS = {"load", "load_pre_download", "resume", "lightning"}
# read a step's tensors from the DCP index (inspect: the header alone; export: the parts it reads too)
INDEX_READERS = INDEX_PLANNERS | {"cli_inspect", "cli_export"}

# name: (what, apply, the entry points that refuse it, also on S3)
CASES: dict[str, tuple[str, object, set[str], bool]] = {}


def _case(name: str, what: str, apply, refusing: set[str], *, s3: bool = False) -> None:
    assert name not in CASES, name
    CASES[name] = (what, apply, refusing, s3)


# (object, label, who refuses it cut or emptied (the manifest's sizes against .metadata's items),
#  who reads its bytes (refuses random bytes of its size, or a missing or short object), variants)
_OBJECTS = (
    (META, "metadata", METADATA_READERS, METADATA_READERS, ("truncated", "empty", "random", "missing")),
    (SHARD0, "model-shard", METADATA_READERS, DCP_READERS | {"cli_export"},
     ("truncated", "random", "missing", "short")),
    (SHARD1, "optim-shard", METADATA_READERS, DCP_READERS, ("random",)),
    (TRAIN, "train-state", TRAIN_READERS, TRAIN_READERS, ("truncated", "empty", "random", "missing", "short")),
)
# on S3 too where the store answers differently from a local folder: a missing object, a body shorter
# than the marker says; the parsers are the same for both backends
_ON_S3 = {"model-shard-missing", "train-state-short"}
for _rel, _label, _cut_by, _random_by, _variants in _OBJECTS:  # _random_by: the object's readers
    for _v in _variants:
        _name = f"{_label}-{_v}"
        if _v in ("truncated", "empty"):  # DCP items now run past their file: the manifest's sizes tell
            # inspect reads the index header, no shard, but checks the header as every reader does: its own items
            # (the tensors it stores whole) must lie inside the shard files the marker lists, so a shard cut short
            # is refused there too
            _case(_name, f"{_rel} {'cut in half' if _v == 'truncated' else 'empty'}, the marker rewritten to match",
                  _rewrite(_rel, _v), _cut_by, s3=_name in _ON_S3)
        elif _v == "random":
            _case(_name, f"{_rel} replaced by random bytes of its size, the marker rewritten to match",
                  _rewrite(_rel, _v), _random_by)
        elif _v == "missing":
            # loads of our steps plan from the DCP index and never read .metadata (its deletion harms stock DCP
            # readers only; `verify` and `download` report it)
            spared = INDEX_READERS if _rel == META else set()
            _case(_name, f"{_rel} deleted, the marker still lists it", _missing(_rel),
                  (_random_by | OBJECT_CHECKERS) - spared, s3=_name in _ON_S3)
        else:
            _case(_name, f"{_rel} 7 bytes short of what the marker says", _short(_rel),
                  _random_by | OBJECT_CHECKERS, s3=_name in _ON_S3)

_case("marker-truncated", "the marker cut in half (not JSON)", _marker_bytes(lambda b: b[: len(b) // 2]),
      MARKER_READERS)
_case("marker-empty", "the marker empty", _marker_bytes(lambda b: b""), MARKER_READERS)
_case("marker-random", "the marker replaced by random bytes", _marker_bytes(lambda b: _random(len(b), "marker")),
      MARKER_READERS)
_case("marker-missing", "the marker deleted (an uncommitted step)", _missing(MARKER), MARKER_READERS, s3=True)
for _name, _doc in (("array", []), ("string", "step1"), ("null", None)):
    _case(f"marker-{_name}", f"the marker is a JSON {_name}", _marker(lambda d, v=_doc: v), MARKER_READERS)
_case("marker-objects-dict", "the marker's objects is an object, not a list", _marker(_set("objects", {"a": 1})),
      MARKER_READERS)
_case("marker-object-number", "an entry of the marker's objects is a number", _marker(
    lambda d: {**d, "objects": [1] + d["objects"]}), MARKER_READERS)
_case("marker-step-string", "the marker's step is a string", _marker(_set("step", "1")), MARKER_READERS)
_case("marker-size-string", "an object's size is a string", _marker(_first_object("size", "12")), MARKER_READERS)

# a tuple: the same order in every xdist worker (a set's order follows salted string hashes)
_POINTER_ENTRIES = ("resume", "cli_list", "cli_latest", "cli_gc", "cli_prune")
_case("pointer-random", "the latest pointer replaced by random bytes", _pointer(_random(81, "pointer")), set(),
      s3=True)
_case("pointer-array", "the latest pointer is a JSON array", _pointer(b"[1]"), set())
_case("pointer-step-string", "the latest pointer names step \"1\" (a string)", _pointer(b'{"step": "1"}'), set())


def attack(tmp: str, root: str, case: str, entry: str) -> None:
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    step = honest_step(root)
    CASES[case][1](Step(open_store(step), step, urls.join), root)
    with outside_untouched(tmp):
        run_entry(entry, step=step, folder=root, tmp=tmp)


TRIES: list[Try] = [
    Try(klass=9, case=name, what=what, entry=entry, target="tests.security.hostile_generic:attack",
        kwargs={"case": name, "entry": entry}, expect=REFUSED if entry in refusing else OK, backend=backend,
        timeout=30.0)
    for name, (what, _, refusing, s3) in CASES.items()
    for backend in (("local", "s3") if s3 else ("local",))
    for entry in (_POINTER_ENTRIES if name.startswith("pointer-") else ENTRY_POINTS)
]
