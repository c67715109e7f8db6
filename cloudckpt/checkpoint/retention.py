"""Retention (prune) and garbage collection.

Pruning deletes committed steps by policy; gc deletes what crashed saves left:
step folders without a marker (older than a grace period) and orphaned
multipart uploads. Both delete a step's marker FIRST, then its objects: a crash
part-way leaves at worst an uncommitted folder (invisible, gc removes it), never
a committed step with objects missing.

Foreign steps (another tool's marker, e.g. OLMo-core's; adopted or not) are
committed: gc never removes a folder that has a marker, whoever wrote it, and
prune neither counts nor deletes them unless ``Policy.include_foreign``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import CloudCkptError
from ..storage import Location, Where
from ..storage import url as urls
from . import discovery, layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    keep_last_ephemeral: int = 1
    max_checkpoints: int | None = None  # persistent ones kept; None keeps all
    keep_every: int | None = None  # persistent steps divisible by this are never pruned
    include_foreign: bool = False  # count (and delete) steps other tools wrote like ours


def steps_to_prune(committed: list[tuple[int, bool]], policy: Policy, *, protect: frozenset[int] = frozenset()) -> list[int]:
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
    """Delete one step: marker first, then every object under it."""
    loc = Location.of(dir).resolved_step()
    dir, store = loc.url, loc.store
    store.delete(layout.marker_url(dir))
    return store.delete_prefix(dir)


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
    step_dirs: list[str]
    uploads: list[str]


def gc(folder: Where, *, older_than: float = 3600.0, only_steps_above: int | None = None, protect: frozenset[int] = frozenset(),
       keep_above: int | None = None, dry_run: bool = False, now: float | None = None) -> GcReport:
    """Delete uncommitted step folders (no marker, ours or another tool's) whose newest
    object is older than ``older_than`` seconds (or, with ``only_steps_above``, every uncommitted folder above that step,
    whatever its age: leftovers of a crashed attempt of the run being resumed), and
    multipart uploads under ``folder`` initiated more than ``older_than`` seconds ago.
    ``keep_above``: uncommitted folders above this step are never removed (a running
    job's saves in progress: they are above its newest committed step)."""
    now = time.time() if now is None else now
    loc = Location.of(folder).resolved()
    folder, store = loc.url, loc.store
    doomed = []
    steps = [(s, d) for s, d in discovery.list_step_dirs(loc)
             if s not in protect and (keep_above is None or s <= keep_above)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        committed = list(pool.map(lambda sd: store.exists(layout.marker_url(sd[1])), steps))
    for (step, dir), is_committed in zip(steps, committed):
        if is_committed:
            continue
        if only_steps_above is not None:
            if step <= only_steps_above:
                continue
        else:
            # a folder with no objects yet may be a save that is just starting: leave it
            newest = max((o.mtime or now for o in store.walk(urls.as_prefix(dir))), default=None)
            if newest is None or now - newest < older_than:
                continue
        doomed.append(dir)
    def in_progress(url: str) -> bool:
        step = layout.step_of_name(urls.relative(url, folder).split("/", 1)[0])
        return step is not None and (step in protect or (keep_above is not None and step > keep_above))

    uploads = [u for u in store.list_multipart_uploads(urls.as_prefix(folder))
               if (u.initiated is None or now - u.initiated >= older_than) and not in_progress(u.url)]
    if not dry_run:
        for d in doomed:
            try:
                store.delete_prefix(d)
                log.info("gc: removed uncommitted %s", d)
            except CloudCkptError as e:
                log.warning("gc: could not remove %s: %s", d, e)
        for u in uploads:
            store.abort_multipart_upload(u)
            log.info("gc: aborted multipart upload %s", u.url)
    return GcReport(doomed, [u.url for u in uploads])
