"""Retention (prune) and garbage collection.

Pruning deletes committed steps by policy; gc deletes what crashed saves left:
step folders without a marker (older than a grace period) and orphaned
multipart uploads. Both delete a step's marker FIRST, then its objects: a crash
part-way leaves at worst an uncommitted folder (invisible, gc removes it), never
a committed step with objects missing.

Foreign steps (another tool's marker, e.g. OLMo-core's; adopted or not) are
committed: gc never removes a folder that has a marker, whoever wrote it, and
prune neither counts nor deletes them unless ``Policy.include_foreign``.

``prune`` and ``gc`` are one-shot (the CLI): they read every marker and look at every
step folder. A running job uses ``Maintenance`` instead, whose cost per save does not
grow with the kept steps or the job's size: one LIST of the save folder, one LIST of
pending multipart uploads, and the deletes themselves. Committed steps never change,
so the header (step, ephemeral, writer) of each is read once (the first few KiB of its
marker, ``read_header``), or handed over by the save that committed it, and kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import CheckpointError, CloudCkptError, NotFound
from ..storage import Location, Where
from ..storage import url as urls
from . import discovery, layout, refusals
from .foreign import parse_marker
from .marker import FORMAT, NEWEST_FORMAT_VERSION, Marker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    keep_last_ephemeral: int = 1
    max_checkpoints: int | None = None  # persistent ones kept; None keeps all
    keep_every: int | None = None  # persistent steps divisible by this are never pruned
    include_foreign: bool = False  # count (and delete) steps other tools wrote like ours


def steps_to_prune(committed: list[tuple[int, bool]], policy: Policy, *,
                   protect: frozenset[int] = frozenset()) -> list[int]:
    """Which committed steps the policy deletes. ``committed`` is ``(step, ephemeral)``.
    Never the newest committed step, never a step in ``protect`` (being written)."""
    if not committed:
        return []
    newest = max(s for s, _ in committed)
    eph = sorted((s for s, e in committed if e), reverse=True)
    per = sorted((s for s, e in committed if not e), reverse=True)
    doomed = set(eph[max(1, policy.keep_last_ephemeral):])
    if policy.max_checkpoints is not None:
        countable = [s for s in per if not (policy.keep_every and s % policy.keep_every == 0)]
        doomed |= set(countable[max(1, policy.max_checkpoints):])
    doomed -= {newest}
    doomed -= set(protect)
    return sorted(doomed)


def delete_step(dir: Where) -> int:
    """Delete one step: marker first, then every object under it, then its refusal note
    (``refusals``) if it has one."""
    loc = Location.of(dir).resolved_step()
    dir, store = loc.url, loc.store
    store.delete(layout.marker_url(dir))
    n = store.delete_prefix(dir)
    step = layout.step_of_name(urls.basename(dir))
    if step is not None:
        try:
            refusals.remove(loc.at(urls.parent(dir)), step)
        except CloudCkptError as e:  # the step is gone; a note left behind no longer describes it (gc)
            log.warning("could not remove the refusal note of %s: %s", dir, e)
    return n


def prune(folder: Where, policy: Policy, *, protect: frozenset[int] = frozenset(), dry_run: bool = False) -> list[str]:
    """Apply the policy to ``folder``. Returns the step folders deleted (or that would be).
    Foreign steps are left out unless ``policy.include_foreign``."""
    loc = Location.of(folder).resolved()
    folder = loc.url
    found = [f for f in discovery.find_checkpoints(loc, with_markers=True)
             if policy.include_foreign or not f[2].foreign]
    doomed = steps_to_prune([(s, m.ephemeral) for s, _, m in found], policy, protect=protect)
    dirs = [layout.step_dir(folder, s) for s in doomed]
    if not dry_run:
        for d in dirs:
            delete_step(loc.at(d))
            log.info("pruned %s", d)
    return dirs


@dataclass(frozen=True)
class GcReport:
    step_dirs: list[str]  # removed (would be, in a dry run)
    uploads: list[str]
    failed: list[str] = field(default_factory=list)  # step folders whose delete failed (logged): not in step_dirs
    young: list[str] = field(default_factory=list)  # uncommitted folders left: newest object younger than older_than
    notes: list[str] = field(default_factory=list)  # refusal notes that no longer describe their step (removed)


def gc(folder: Where, *, older_than: float = 3600.0, only_steps_above: int | None = None,
       protect: frozenset[int] = frozenset(), keep_above: int | None = None, dry_run: bool = False,
       now: float | None = None) -> GcReport:
    """Delete uncommitted step folders (no marker, ours or another tool's) whose newest
    object is older than ``older_than`` seconds (or, with ``only_steps_above``, every
    uncommitted folder above that step, whatever its age: leftovers of a crashed attempt
    of the run being resumed), and
    multipart uploads under ``folder`` initiated more than ``older_than`` seconds ago;
    without ``only_steps_above``, also the refusal notes (``refusals``) that no longer
    describe their step (one LIST of the notes, a GET of each and of its step's marker).
    ``keep_above``: uncommitted folders above this step are never removed (a running
    job's saves in progress: they are above its newest committed step)."""
    now = time.time() if now is None else now
    loc = Location.of(folder).resolved()
    store = loc.store
    steps = [(s, d) for s, d in discovery.list_step_dirs(loc)
             if s not in protect and (keep_above is None or s <= keep_above)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        committed = list(pool.map(lambda sd: store.exists(layout.marker_url(sd[1])), steps))
    uncommitted = [sd for sd, is_committed in zip(steps, committed, strict=True) if not is_committed]
    rep = _collect(loc, uncommitted, older_than=older_than, only_steps_above=only_steps_above, protect=protect,
                   keep_above=keep_above, dry_run=dry_run, now=now)
    if only_steps_above is not None:
        return rep
    # refusal notes whose step was replaced, restored or removed since (or that cannot be read)
    stale = [s for s in refusals.stale(loc) if s not in protect and (keep_above is None or s <= keep_above)]
    if not dry_run:
        for s in stale:
            refusals.remove(loc, s)
            log.info("gc: removed the refusal note of step%d (it no longer describes the step)", s)
    return dataclasses.replace(rep, notes=[refusals.note_url(loc.url, s) for s in stale])


def _collect(loc: Location, uncommitted: list[tuple[int, str]], *, older_than: float, only_steps_above: int | None,
             protect: frozenset[int], keep_above: int | None, dry_run: bool, now: float,
             found_empty: list[int] | None = None) -> GcReport:
    """gc's decisions and deletes, given the step folders known to have no marker.
    ``found_empty`` gets the steps whose folder held no object."""
    folder, store = loc.url, loc.store
    doomed, young = [], []
    for step, dir in uncommitted:
        if only_steps_above is not None:
            if step <= only_steps_above:
                continue
        else:
            # a folder with no objects yet may be a save that is just starting: leave it
            newest = max((o.mtime or now for o in store.walk(urls.as_prefix(dir))), default=None)
            if newest is None and found_empty is not None:
                found_empty.append(step)
            if newest is None or now - newest < older_than:
                if newest is not None:
                    young.append(dir)
                continue
        doomed.append(dir)

    def in_progress(url: str) -> bool:
        step = layout.step_of_name(urls.relative(url, folder).split("/", 1)[0])
        return step is not None and (step in protect or (keep_above is not None and step > keep_above))

    uploads = [u for u in store.list_multipart_uploads(urls.as_prefix(folder))
               if (u.initiated is None or now - u.initiated >= older_than) and not in_progress(u.url)]
    failed = []
    if not dry_run:
        for d in doomed:
            try:
                store.delete_prefix(d)
                log.info("gc: removed uncommitted %s", d)
            except CloudCkptError as e:
                log.warning("gc: could not remove %s: %s", d, e)
                failed.append(d)
        for u in uploads:
            store.abort_multipart_upload(u)
            log.info("gc: aborted multipart upload %s", u.url)
    return GcReport([d for d in doomed if d not in failed], [u.url for u in uploads], failed, young)


# ---------------------------------------------------------------- maintenance of a running job
HEADER_BYTES = 64 * 1024  # what ``read_header`` reads of a marker: our header fields come first


@dataclass(frozen=True)
class StepHeader:
    """What retention needs of a committed step: its number, kind and writer."""

    step: int
    ephemeral: bool
    foreign: bool = False


def read_header(step_dir: Location) -> StepHeader | None:
    """The header of the committed step at ``step_dir`` from the first HEADER_BYTES of
    its marker (one ranged GET). A marker that fits is parsed whole (ours, or another
    tool's: then the step must hold DCP metadata, as discovery requires); of a larger
    one (ours: its manifest follows the header) only the leading fields are parsed, and
    where they are not there the whole marker is read (``discovery.read_marker``).
    None: no marker (not committed). Raises CheckpointError for a marker discovery
    would skip (unreadable, refused), storage errors."""
    store, url = step_dir.store, layout.marker_url(step_dir.url)
    step = layout.parse_step_dir(step_dir.url)
    try:
        data = store.get_bytes(url, start=0, end=HEADER_BYTES)
    except NotFound as e:
        if type(e) is not NotFound:
            raise  # the bucket is gone: not an uncommitted step
        return None
    if len(data) < HEADER_BYTES:
        parsed = parse_marker(data, url=url)
        if isinstance(parsed, Marker):
            return StepHeader(step, parsed.ephemeral, parsed.foreign)
        m = discovery.read_marker(step_dir)  # another tool's marker: checks the folder holds DCP metadata
        return StepHeader(step, m.ephemeral, m.foreign)
    head = _leading_fields(data)
    v = head.get("format_version")
    if (head.get("format") == FORMAT and type(v) is int and 1 <= v <= NEWEST_FORMAT_VERSION
            and head.get("step") == step and type(head.get("step")) is int and type(head.get("ephemeral")) is bool):
        return StepHeader(step, head["ephemeral"])
    m = discovery.read_marker(step_dir)
    return StepHeader(step, m.ephemeral, m.foreign)


def _leading_fields(data: bytes) -> dict:
    """The members of the JSON object that ``data`` starts with whose values are
    scalars (strings, numbers, true/false/null), up to the first member that is not
    one or the end of ``data`` (a prefix of a larger document). A key seen twice
    gives ``{}`` (the whole document decides then)."""
    text = data.decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    out: dict = {}
    i = _skip(text, 0)
    if not text.startswith("{", i):
        return {}
    i += 1
    while True:
        i = _skip(text, i)
        if not text.startswith('"', i):
            return out
        try:
            key, i = dec.raw_decode(text, i)
            i = _skip(text, i)
            if not text.startswith(":", i):
                return out
            i = _skip(text, i + 1)
            if text[i:i + 1] in ("{", "[", ""):
                return out
            value, i = dec.raw_decode(text, i)
        except ValueError:  # cut off by the prefix, or not JSON: what came before stands
            return out
        if key in out:
            return {}
        out[key] = value
        i = _skip(text, i)
        if not text.startswith(",", i):
            return out
        i += 1


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class Maintenance:
    """Prune and gc of a running job's save folder after each save, at a cost that
    does not grow with the kept steps, the job's ranks or its tensors:

    - one LIST of the save folder (a page per 1,000 step folders) and one LIST of its
      pending multipart uploads;
    - the header of a committed step is read once (``read_header``: a ranged GET of
      a few KiB) or handed over by the save that committed it (``committed``), and
      kept: a committed marker never changes. Folders no longer listed are forgotten;
    - no request per kept step: only folders not known to be committed (a crashed
      attempt's leftovers, at or below the newest committed step) are looked at, each
      with one ranged GET of its marker and one LIST of its objects for their age.
      Folders it deleted or found empty are not looked at again while they are listed
      (stores with real directories, SeaweedFS's filer among them, list a folder after
      its last object is gone);
    - the deletes (a pruned step: its marker, then one LIST and batch deletes).

    Same rules as ``prune`` and ``gc``: never the newest committed step, never a step
    in ``protect`` or above ``keep_above`` (being written), never another tool's step
    unless the policy includes them; a folder with a marker is never gc'd. One
    instance per save folder; ``run`` is not re-entrant (the manager runs it on one
    thread), ``committed`` may be called from any thread."""

    def __init__(self, folder: Where, policy: Policy, *, older_than: float = 3600.0):
        self.location = Location.of(folder)
        self.policy = policy
        self.older_than = older_than
        self._headers: dict[int, StepHeader] = {}
        self._empty: set[int] = set()  # folders deleted or found without objects
        self._refused: set[int] = set()  # committed steps that failed their checks: never counted or pruned
        self._lock = threading.Lock()

    def refused(self, steps) -> None:
        """Steps that failed their checks at resume (``refusals``): neither counted among the
        kept steps nor pruned nor read, until this process commits the step number again."""
        with self._lock:
            self._refused |= set(steps)

    def committed(self, step: int, *, ephemeral: bool, foreign: bool = False) -> None:
        """Record a step this process committed (no read needed to know its header)."""
        with self._lock:
            self._headers[step] = StepHeader(step, ephemeral, foreign)
            self._empty.discard(step)
            self._refused.discard(step)

    def run(self, *, protect: frozenset[int] = frozenset(), keep_above: int | None = None,
            now: float | None = None) -> tuple[list[str], GcReport]:
        """Prune by the policy, then gc. Returns the pruned step folders and gc's report."""
        now = time.time() if now is None else now
        loc = self.location.resolved()
        listed = discovery.list_step_dirs(loc)
        listed_steps = {s for s, _ in listed}
        with self._lock:
            for s in [s for s in self._headers if s not in listed_steps]:
                del self._headers[s]
            self._empty &= listed_steps
            known, empty, refused = dict(self._headers), set(self._empty), set(self._refused)
        uncommitted = []
        for step, dir in listed:
            if (step in known or step in empty or step in refused or step in protect
                    or (keep_above is not None and step > keep_above)):
                continue
            try:
                header = read_header(loc.at(dir))
            except CheckpointError as e:
                log.warning("retention: skipping %s: %s", dir, e)  # has a marker: never gc'd, never counted
                continue
            if header is None:
                uncommitted.append((step, dir))
            else:
                known[step] = header
                with self._lock:
                    self._headers[step] = header
        counted = [(h.step, h.ephemeral) for h in known.values()
                   if (self.policy.include_foreign or not h.foreign) and h.step not in refused]
        pruned = []
        for s in steps_to_prune(sorted(counted), self.policy, protect=protect):
            d = layout.step_dir(loc.url, s)
            delete_step(loc.at(d))
            with self._lock:
                self._headers.pop(s, None)
                self._empty.add(s)
            log.info("pruned %s", d)
            pruned.append(d)
        found_empty: list[int] = []
        rep = _collect(loc, uncommitted, older_than=self.older_than, only_steps_above=None, protect=protect,
                       keep_above=keep_above, dry_run=False, now=now, found_empty=found_empty)
        with self._lock:
            self._empty.update(found_empty)
            self._empty.update(s for s, d in uncommitted if d in rep.step_dirs)
        return pruned, rep
