"""Refusal notes: a committed step that ``resume()`` found failing its checks, recorded
beside the run for the operator, without touching the step.

When ``CheckpointManager.resume`` meets a committed step that fails its checks (a
damaged shard, train state or marker), rank 0 writes one small JSON object::

    {save_folder}/.cloudckpt/refused/step{N}.json
    {"format": "cloudckpt-refusal", "version": 1, "step": N, "refused_unix": 1712000000.0,
     "reason": "rank 0: ...", "marker_size": 2048, "marker_crc32c": "1a2b3c4d"}

It is no object of any step (no manifest lists it; the step's committed objects are
never rewritten), and it is bound to the step's marker as it was when refused
(``marker_size`` and the CRC32C of its first ``FINGERPRINT_BYTES``): once the step is
replaced, restored with a new marker, or removed, the note no longer describes it and
is ignored (``cloudckpt gc`` removes such notes; ``rm``, ``prune`` and the running
job's retention remove a step's note with the step).

Who reads it:

- ``cloudckpt list`` marks the step ``REFUSED`` with the reason, ``cloudckpt verify``
  reports it;
- ``resume`` with ``load_step`` below such a step treats it as replaceable (a
  warning): the run saves over it when it reaches that step number. A load never skips
  a step because of a note: ``resume`` still tries the newest step, and removes the note
  (with a log line) when that step now passes its checks.

Anyone who can write the folder can plant a note. A note is read with a ceiling
(``MAX_NOTE_BYTES``), parsed with ``untrusted.loads_json`` (depth, finite numbers,
short integers) and refused (``CorruptCheckpoint``, ignored with a warning) unless it is
an object of exactly these fields and types, named ``step{N}.json`` in the canonical
spelling, for step ``N``, with a reason of printable text. At most ``MAX_NOTES`` notes
are read from one folder.

Not collective: the manager calls it on rank 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import CloudCkptError, CorruptCheckpoint, NotFound
from ..storage import Location, Where
from ..storage import url as urls
from ..untrusted import loads_json
from . import layout

log = logging.getLogger(__name__)

NOTES_DIR = ".cloudckpt/refused"  # under the save folder: not a step{N} folder, so never a step
FORMAT = "cloudckpt-refusal"
VERSION = 1
MAX_NOTE_BYTES = 8 * 1024  # ours are under 1.5 KiB
MAX_REASON_CHARS = 1000
MAX_NOTES = 1000  # notes read from one folder (each costs a GET)
FINGERPRINT_BYTES = 64 * 1024  # of the marker, CRC32C'd to bind a note to it
_FIELDS = {"format", "version", "step", "refused_unix", "reason", "marker_size", "marker_crc32c"}
_MAX_STEP = (1 << 63) - 1
_IGNORED = "the note is ignored"


@dataclass(frozen=True)
class Refusal:
    """One refusal note: step ``step`` failed its checks at ``refused_unix`` (``reason``);
    ``marker_size``/``marker_crc32c`` fingerprint the marker it was refused with."""

    step: int
    reason: str
    refused_unix: float
    marker_size: int
    marker_crc32c: str
    url: str = ""

    @property
    def when(self) -> str:
        """``refused_unix`` in UTC, for messages."""
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.refused_unix))

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "step": self.step, "refused_unix": self.refused_unix,
                "reason": self.reason, "marker_size": self.marker_size, "marker_crc32c": self.marker_crc32c}

    def to_bytes(self) -> bytes:
        import json

        return json.dumps(self.to_json(), sort_keys=True).encode()

    def describes(self, fingerprint: tuple[int, str] | None) -> bool:
        """Whether the note was written for the marker whose fingerprint is given (None:
        the step has no marker now)."""
        return fingerprint is not None and fingerprint == (self.marker_size, self.marker_crc32c)


def note_url(folder: str, step: int) -> str:
    return urls.join(folder, NOTES_DIR, f"step{int(step)}.json")


def clean_reason(text: str) -> str:
    """``text`` as a note's reason: whitespace collapsed, other control characters as
    ``?``, at most MAX_REASON_CHARS characters."""
    text = " ".join(str(text).split())
    text = "".join("?" if (ord(c) < 32 or 0x7F <= ord(c) < 0xA0) else c for c in text)
    return text[:MAX_REASON_CHARS]


def parse(data: bytes, *, url: str, step: int) -> Refusal:
    """The note at ``url`` (named for step ``step``). Raises CorruptCheckpoint: over
    MAX_NOTE_BYTES, not JSON within ``loads_json``'s bounds, other fields or types, another
    step, a reason that is not printable text of at most MAX_REASON_CHARS."""
    d: Any = loads_json(data, url=url, what="refusal note", limit=MAX_NOTE_BYTES, max_depth=2)
    if type(d) is not dict or set(d) != _FIELDS:
        raise CorruptCheckpoint(f"{url}: not a cloudckpt refusal note (an object with exactly the fields "
                                f"{', '.join(sorted(_FIELDS))}); {_IGNORED}")
    if d["format"] != FORMAT or d["version"] != VERSION or type(d["version"]) is not int:
        raise CorruptCheckpoint(f"{url}: not a version-{VERSION} cloudckpt refusal note; {_IGNORED}")
    if type(d["step"]) is not int or d["step"] != step:
        raise CorruptCheckpoint(f"{url}: the note's step is not {step}, the step its name gives; {_IGNORED}")
    t = d["refused_unix"]
    if type(t) not in (int, float) or not 0 <= t < 1e11:
        raise CorruptCheckpoint(f"{url}: the note's refused_unix is not a time; {_IGNORED}")
    size, crc = d["marker_size"], d["marker_crc32c"]
    if type(size) is not int or not 0 <= size <= _MAX_STEP:
        raise CorruptCheckpoint(f"{url}: the note's marker_size is not a size; {_IGNORED}")
    if type(crc) is not str or len(crc) != 8 or any(c not in "0123456789abcdef" for c in crc):
        raise CorruptCheckpoint(f"{url}: the note's marker_crc32c is not 8 lowercase hex digits; {_IGNORED}")
    reason = d["reason"]
    if type(reason) is not str or len(reason) > MAX_REASON_CHARS or clean_reason(reason) != reason:
        raise CorruptCheckpoint(f"{url}: the note's reason is not printable text of at most {MAX_REASON_CHARS} "
                                f"characters; {_IGNORED}")
    return Refusal(step, reason, float(t), size, crc, url)


def fingerprint(step_dir: Where) -> tuple[int, str] | None:
    """``(size, CRC32C of the first FINGERPRINT_BYTES)`` of the step's marker, or None
    when it has none (one ranged GET; a HEAD more for a larger marker). Storage errors
    other than NotFound propagate."""
    from ..transfer import crc32c_bytes

    loc = Location.of(step_dir)
    store, url = loc.store, layout.marker_url(loc.url)
    try:
        head = store.get_bytes(url, start=0, end=FINGERPRINT_BYTES)
        size = len(head) if len(head) < FINGERPRINT_BYTES else store.stat(url).size
    except NotFound as e:
        if type(e) is not NotFound:
            raise  # the bucket is gone
        return None
    return size, crc32c_bytes(head)


def record(folder: Where, step: int, reason: str, *, now: float | None = None) -> Refusal | None:
    """Write (or rewrite) the note for ``step`` of ``folder``, bound to its marker as it is
    now. Best effort: returns None, with a warning, when the step has no marker or the
    note cannot be written (the refusal is logged and on the manager either way)."""
    loc = Location.of(folder)
    url = note_url(loc.url, step)
    try:
        fp = fingerprint(loc.join(f"step{int(step)}"))
        if fp is None:
            return None
        note = Refusal(step, clean_reason(reason), round(time.time() if now is None else now, 3), fp[0], fp[1], url)
        loc.store.put_bytes(url, note.to_bytes())
    except CloudCkptError as e:
        log.warning("could not record the refusal of step%d at %s (%s); `cloudckpt list` will not mark it", step,
                    url, e)
        return None
    return note


def read(folder: Where, step: int) -> Refusal | None:
    """The note for ``step`` (None: none, or unreadable: a warning says why). Not checked
    against the marker (``live``)."""
    loc = Location.of(folder)
    url = note_url(loc.url, step)
    try:
        return parse(loc.store.get_bytes(url, start=0, end=MAX_NOTE_BYTES + 1), url=url, step=step)
    except NotFound as e:
        if type(e) is not NotFound:
            raise
        return None
    except CorruptCheckpoint as e:
        log.warning("%s", e)
        return None
    except CloudCkptError as e:  # a link, a folder of that name, no access: a note only informs
        log.warning("ignoring the refusal note %s: %s", url, e)
        return None


def read_all(folder: Where) -> dict[int, Refusal]:
    """Every readable note of ``folder`` by step: one LIST of its notes folder, one ranged
    GET per note (at most MAX_NOTES; objects not named ``step{N}.json`` are ignored).
    Unreadable notes are left out with a warning. Not checked against the markers (``live``)."""
    loc = Location.of(folder)
    steps = listed_steps(loc)
    if len(steps) > MAX_NOTES:
        log.warning("%s holds %d refusal notes: reading the newest %d", urls.join(loc.url, NOTES_DIR), len(steps),
                    MAX_NOTES)
        steps = steps[-MAX_NOTES:]
    out = {}
    for s in steps:
        note = read(loc, s)
        if note is not None:
            out[s] = note
    return out


def listed_steps(folder: Where) -> list[int]:
    """The steps that have a note object in ``folder`` (one LIST), ascending."""
    loc = Location.of(folder)
    prefix = urls.as_prefix(urls.join(loc.url, NOTES_DIR))
    steps = set()
    for e in loc.store.list(prefix, delimiter="/"):
        name = urls.basename(e.url)
        if not e.is_prefix and name.endswith(".json"):
            s = layout.step_of_name(name[:-len(".json")])
            if s is not None:
                steps.add(s)
    return sorted(steps)


def live(folder: Where, notes: dict[int, Refusal], steps: Iterable[int] | None = None) -> dict[int, Refusal]:
    """The notes among ``notes`` (those of ``steps``, default all) that still describe
    their step's marker (one fingerprint each)."""
    loc = Location.of(folder)
    wanted = notes if steps is None else {s: notes[s] for s in steps if s in notes}
    return {s: n for s, n in wanted.items() if n.describes(fingerprint(loc.join(f"step{s}")))}


def remove(folder: Where, step: int) -> None:
    """Delete the note for ``step`` (nothing if there is none)."""
    loc = Location.of(folder)
    loc.store.delete(note_url(loc.url, step))


def stale(folder: Where) -> list[int]:
    """Steps whose note no longer describes the step (the step was replaced, restored or
    removed) or cannot be read: what ``cloudckpt gc`` removes."""
    loc = Location.of(folder)
    notes = read_all(loc)
    listed = listed_steps(loc)[-MAX_NOTES:]
    return sorted(s for s in listed if s not in notes or not notes[s].describes(fingerprint(loc.join(f"step{s}"))))
