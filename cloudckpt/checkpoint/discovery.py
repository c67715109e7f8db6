"""Finding committed checkpoints.

Cost: one paginated LIST of the save folder (delimiter ``/``), then markers read
only as needed: ``latest_checkpoint`` walks from the highest step down and stops
at the first committed one; ``find_checkpoints`` reads markers concurrently.
A folder counts only if it is named exactly ``step{N}`` (the canonical spelling:
ASCII digits, no leading zero; ``step04`` is not step 4) and its marker parses:

- our marker: a committed step with its manifest (sizes, CRC32Cs);
- another tool's marker (OLMo-core's ``{"ephemeral": ..., "version": ...}``) and a
  ``model_and_optim/.metadata``: a *foreign* step, described from one LIST of the
  step folder (sizes, no checksums: ``Marker.verified`` is False), or from the
  manifest ``cloudckpt adopt`` wrote beside that marker (``.cloudckpt.json``);
- anything else (corrupt, a newer format, foreign without DCP metadata) is skipped
  with one warning per folder by ``find_checkpoints``; ``latest_checkpoint`` raises
  instead when such a marker is cloudckpt's and its step is the newest: a committed
  step a reader refuses is a loud error naming it, never a silent resume of an older
  step.
- format 2 and 3 markers list the ranks' manifest parts; discovery reads none of them
  (``read_header``); ``StepManifest`` reads the parts a caller needs, ``read_marker``
  all of them.

These functions are not collective: in a multi-rank job let one rank discover and
broadcast (the manager does).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

from ..errors import BucketNotFound, CheckpointError, CorruptCheckpoint, NotACheckpoint, NotFound
from ..storage import Location, Where
from ..storage import url as urls
from ..untrusted import MAX_MARKER_BYTES, read_capped
from . import layout
from .entries import ObjectEntry
from .foreign import ForeignMarker, foreign_step, parse_marker
from .marker import Marker
from .parts import MAX_PART_BYTES, ManifestPart, PartRef
from .step import StepRef

log = logging.getLogger(__name__)


def read_marker(dir: Where) -> Marker:
    """The parsed marker of a step folder with every object of the step inline: ours
    (its manifest parts read, each checked against the marker), or for a foreign step
    (another tool's marker) a ``Marker`` with ``foreign`` set, from its adopted manifest
    or from a listing of the folder (``verified=False``). What the CLI's verify,
    download and inspect read; a load reads only the parts it needs (``StepManifest``).
    Raises NotACheckpoint (no marker), CorruptCheckpoint / IncompatibleCheckpoint /
    UnsafeCheckpoint (unreadable or refused marker or part, a foreign step without DCP
    metadata), storage errors."""
    return read_marker_bytes(dir)[0]


def read_marker_bytes(dir: Where) -> tuple[Marker, bytes]:
    """``read_marker`` and the marker's bytes as read."""
    loc = Location.of(dir).resolved_step()
    marker, data = read_header_bytes(loc)
    if marker.parts:
        marker = StepManifest(loc, marker).full()
    return marker, data


def read_header(dir: Where) -> Marker:
    """The marker as written: the step header, and for format 2 and 3 the references to the
    ranks' manifest parts, unread. Enough to find, list and order steps. Raises as
    ``read_marker``."""
    return read_header_bytes(dir)[0]


def read_header_bytes(dir: Where) -> tuple[Marker, bytes]:
    """``read_header`` and the marker's bytes as read (at most MAX_MARKER_BYTES)."""
    loc = Location.of(dir).resolved_step()
    dir = loc.url
    url = layout.marker_url(dir)
    store = loc.store
    try:
        data = read_capped(store, url, limit=MAX_MARKER_BYTES, what="commit marker")
    except BucketNotFound:
        raise
    except NotFound:
        raise NotACheckpoint(
            f"{dir} is not a committed checkpoint: it has no {layout.MARKER} "
            "(the save never finished, or the path is wrong); "
            "use `cloudckpt list` on the save folder to see committed steps"
        ) from None
    step = layout.step_of_name(urls.basename(dir))
    parsed = parse_marker(data, url=url) if step is not None else Marker.from_bytes(data, url=url)
    if isinstance(parsed, ForeignMarker):
        return _foreign(dir, step, parsed, data, store), data
    return parsed, data


def _foreign(dir: str, step: int, fm: ForeignMarker, data: bytes, store) -> Marker:
    """A foreign step's Marker: one LIST of the step folder, and the adopted manifest
    when the listing holds one that vouches for exactly this marker."""
    from ..transfer import crc32c_bytes

    prefix = urls.as_prefix(dir)
    listing = [(o.url[len(prefix):], o.size, o.mtime) for o in store.walk(prefix)]
    url = urls.join(dir, layout.ADOPTED_MANIFEST)
    if any(rel == layout.ADOPTED_MANIFEST for rel, _, _ in listing):
        try:
            adopted = Marker.from_bytes(read_capped(store, url, limit=MAX_MARKER_BYTES, what="adopted manifest"),
                                        url=url)
        except NotFound:
            adopted = None  # removed since the listing: the step is as the listing says
        if adopted is not None:
            if adopted.foreign and adopted.step == step and adopted.adopted_crc32c == crc32c_bytes(data):
                return adopted
            log.warning("ignoring %s: it does not vouch for this step's marker (the step was rewritten after "
                        "`cloudckpt adopt`); the step is unverified until adopted again", url)
    return foreign_step(fm, step=step, listing=listing, url=urls.as_prefix(dir))


class StepManifest:
    """The objects of one committed step, read as they are needed: the marker's own,
    and a rank's part only when one of its files is asked for. Each part is read once,
    with no more bytes than the marker declares, and trusted only once it matches the
    marker (size, CRC32C, step, save id, rank, only its rank's files)."""

    def __init__(self, step: Location, marker: Marker, *, pace: Callable[[str], Any] | None = None):
        """``pace(url)``: called before each part is read (the transfer engine's request
        pacing: every rank of a load reads its parts at once)."""
        self.step = step
        self.marker = marker
        self.pace = pace
        self._parts: dict[int, ManifestPart] = {}
        self._lock = threading.Lock()
        self.parts_read = 0  # requests for parts (tests and benchmarks count them)

    def entry(self, rel: str) -> ObjectEntry | None:
        """The manifest entry of ``rel`` (relative to the step), or None if the step has none."""
        return self.entries([rel]).get(rel)

    def entries(self, rels: Iterable[str]) -> dict[str, ObjectEntry]:
        """``{rel: entry}`` of those of ``rels`` the step lists, reading the parts that
        cover them (concurrently)."""
        rels = list(rels)
        m = self.marker
        ranks = {p.rank for p in (m.part_of(r) for r in rels) if p is not None}
        parts = self.parts(ranks)
        out = {}
        for rel in rels:
            ref = m.part_of(rel)
            e = m.object(rel) if ref is None else parts[ref.rank].entry(rel)
            if e is not None:
                out[rel] = e
        return out

    def parts(self, ranks: Iterable[int]) -> dict[int, ManifestPart]:
        """The checked parts of ``ranks`` (each read once per StepManifest)."""
        refs = {r: self.marker._parts_by_rank[r] for r in ranks}
        with self._lock:
            todo = [ref for r, ref in refs.items() if r not in self._parts]
        if todo:
            with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
                got = list(pool.map(self._read_part, todo))
            with self._lock:
                for ref, part in zip(todo, got, strict=True):
                    self._parts[ref.rank] = part
        with self._lock:
            return {r: self._parts[r] for r in refs}

    def _read_part(self, ref: PartRef) -> ManifestPart:
        from ..untrusted import read_checked

        url = StepRef(self.step, root=self.marker.root).url_of(ref.path)  # a replaced step's: under its root
        with self._lock:
            self.parts_read += 1
        if self.pace is not None:
            self.pace(url)
        data = read_checked(self.step.store, url, ref, limit=MAX_PART_BYTES, what="manifest part")
        return ManifestPart.from_bytes(data, url=url, ref=ref, step=self.marker.step, save_id=self.marker.save_id)

    def full(self) -> Marker:
        """The marker with every object of the step inline (every part read)."""
        return self.marker.with_parts(self.parts(p.rank for p in self.marker.parts).values())


def list_step_dirs(folder: Where) -> list[tuple[int, str]]:
    """Every ``step{N}`` folder under ``folder`` (committed or not), ascending, from one LIST pass."""
    return scan_step_dirs(folder)[0]


def scan_step_dirs(folder: Where) -> tuple[list[tuple[int, str]], list[str]]:
    """One LIST pass of ``folder``: its ``step{N}`` folders ``(step, url)`` ascending,
    and the URLs of folders that look like steps but are not spelled canonically
    (``step04``, ``step4.old``: ``layout.is_step_junk``). Only the first are steps: a
    step number comes from exactly one folder name, so junk planted beside a step can
    never make it count twice."""
    loc = Location.of(folder).resolved()
    folder, prefix = loc.url, loc.prefix
    out, junk = [], []
    for e in loc.store.list(prefix, delimiter="/"):
        if not e.is_prefix:
            continue
        name = urls.basename(e.url)
        step = layout.step_of_name(name)
        if step is not None:
            out.append((step, urls.join(folder, f"step{step}")))
        elif layout.is_step_junk(name):
            junk.append(e.url.rstrip("/"))
    out.sort()
    junk.sort()
    return out, junk


def _try_marker(dir: Location) -> Marker | None:
    try:
        return read_header(dir)
    except NotACheckpoint:
        return None
    except CheckpointError as e:
        log.warning("skipping %s: %s", dir, e)
        return None


def find_checkpoints(
    folder: Where, ephemeral: bool | None = None, *, with_markers: bool = False
) -> Iterator[tuple[int, str]]:
    """Committed checkpoints under ``folder`` as ``(step, dir)``, ascending by step
    (``(step, dir, marker)`` with ``with_markers``). ``ephemeral`` filters on the
    marker's flag (None: both)."""
    loc = Location.of(folder)
    steps = list_step_dirs(loc)
    with ThreadPoolExecutor(max_workers=32) as pool:
        markers = list(pool.map(lambda sd: _try_marker(loc.at(sd[1])), steps))
    for (step, dir), m in zip(steps, markers, strict=True):
        if m is None or (ephemeral is not None and m.ephemeral != ephemeral):
            continue
        yield (step, dir, m) if with_markers else (step, dir)


def latest_checkpoint(folder: Where, *, use_pointer: bool = False) -> str:
    """The newest committed step folder, ours or foreign. Raises NotACheckpoint (a
    FileNotFoundError) if none; CorruptCheckpoint / UnsafeCheckpoint /
    IncompatibleCheckpoint naming the step when a step above every readable one has a
    marker of ours this reader refuses (it is never passed over for an older step).

    One LIST of the folder's step prefixes (a page per 1000), then markers from the
    highest step down: 2 requests when the newest step folder is committed by
    cloudckpt (LIST, GET marker), one more LIST when it is a foreign step. No
    ``latest`` pointer decides: saves no longer write one (``pointer.py``). With
    ``use_pointer`` (``cloudckpt latest --pointer``), a pointer an older version left
    is read (one more GET) and a warning says when it names another step.
    Local folders are resolved to their real path first (the local backend follows
    no links inside them); the step folder returned is under the resolved path."""
    loc = Location.of(folder).resolved()
    folder = loc.url
    for step, dir in reversed(list_step_dirs(loc)):
        m = _newest_candidate(loc.at(dir), folder)
        if m is None:
            continue
        if use_pointer:
            _say_pointer(loc, step, m)
        return dir
    raise NotACheckpoint(f"no committed checkpoint in {folder}")


def _say_pointer(loc: Location, step: int, m: Marker) -> None:
    """Log what the ``latest`` pointer an older version left says, when it names
    another step than ``step`` (the newest committed one, found by listing)."""
    from . import pointer

    p = pointer.read(loc)  # a planted or oversized pointer: None, with a warning
    if p is None or p[0] == step:
        return
    if p[0] > step:
        why = "that step is not committed (pruned, removed, or a planted pointer)"
    elif m.foreign:
        why = f"{m.writer} wrote it{'' if m.verified else ' (no manifest: unverified)'}"
    else:
        why = "an older cloudckpt wrote the pointer; saves no longer move it"
    log.warning("%s: using step%d, %s than step%d named by the latest pointer: %s", loc.url, step,
                "newer" if p[0] < step else "older", p[0], why)


def newest_usable(folder: Where, *, skip_refused: bool) -> tuple[str | None, list[tuple[int, str, str]]]:
    """For ``resume``: the newest committed step folder (None if there is none), and the
    newer steps passed over, as ``(step, dir, reason)``: steps whose marker of ours this
    reader refuses (damaged, unsafe). Without ``skip_refused`` such a step raises as in
    :func:`latest_checkpoint`; a marker from a newer cloudckpt (IncompatibleCheckpoint)
    always raises. The caller logs and records what was passed over."""
    loc = Location.of(folder).resolved()
    skipped: list[tuple[int, str, str]] = []
    for step, dir in reversed(list_step_dirs(loc)):
        try:
            m = _newest_candidate(loc.at(dir), loc.url)
        except CorruptCheckpoint as e:
            if not skip_refused:
                raise
            skipped.append((step, dir, " ".join(str(e).split())[:500]))
            continue
        if m is not None:
            return dir, skipped
    return None, skipped


def _newest_candidate(dir: Location, folder: str) -> Marker | None:
    """The marker of ``dir`` for ``latest_checkpoint``: None when the step is not
    committed (no marker) or its marker is not cloudckpt's (another tool's without DCP
    metadata, junk: skipped with a warning). A marker of ours that cannot be read (over
    the size cap, damaged, a newer format) is a committed step this reader refuses:
    raised, never passed over for an older step."""
    try:
        return read_header(dir)
    except NotACheckpoint:
        return None
    except CheckpointError as e:
        if not _claims_ours(dir):
            log.warning("skipping %s: %s", dir, e)
            return None
        raise type(e)(f"{dir.url} is the newest step and its commit marker is cloudckpt's, but it cannot be read: {e}. "
                      "Not falling back to an older step silently: restore or remove the step, upgrade cloudckpt if it "
                      f"was written by a newer one, or resume an older step explicitly with load_step=N (`cloudckpt "
                      f"list {folder}` shows them)") from None


def _claims_ours(dir: Location) -> bool:
    """Whether the marker of ``dir`` starts the way cloudckpt writes one (``{"format":
    "cloudckpt"``), read with one small ranged request."""
    try:
        head = dir.store.get_bytes(layout.marker_url(dir.url), start=0, end=64)
    except CheckpointError:
        return False
    except Exception:  # noqa: BLE001 - a storage error here: judge by the error already raised
        return True
    return head.replace(b" ", b"").startswith(b'{"format":"cloudckpt"')


def dir_is_checkpoint(dir: Where) -> bool:
    """True if ``dir`` is named ``step{N}`` and is committed: our marker parses, or it
    is a foreign step (another tool's marker and DCP metadata)."""
    loc = Location.of(dir)
    if layout.step_of_name(loc.name) is None:
        return False
    return _try_marker(loc) is not None


def contains_checkpoint(folder: Where) -> bool:
    try:
        latest_checkpoint(folder)
        return True
    except NotACheckpoint:
        return False
