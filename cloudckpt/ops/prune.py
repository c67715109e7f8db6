"""Pruning a save folder once, by the library's retention policy
(:func:`cloudckpt.checkpoint.retention.steps_to_prune`), with what the CLI adds:

- ``ephemeral_only``: persistent steps are not candidates; the newest ``keep_last``
  ephemeral ones are kept, ephemeral steps divisible by ``keep_every`` are kept and
  not counted (retention's ``Policy`` has no such mode: it is composed here from
  ``steps_to_prune`` over the ephemeral candidates, the newest committed step protected);
- a plan to show before anything is deleted (sizes, kinds, the foreign steps left out);
- steps a resume refused (a refusal note that still describes the step,
  :mod:`cloudckpt.checkpoint.refusals`) are neither counted nor pruned: they are listed,
  and ``cloudckpt rm`` removes one.

Steps are deleted with :func:`~cloudckpt.checkpoint.retention.delete_step` (marker
first, then the objects).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..checkpoint import discovery, layout, refusals, retention
from ..storage import Location, Where


@dataclass(frozen=True)
class PruneItem:
    step: int
    url: str
    ephemeral: bool
    size_bytes: int

    def to_json(self) -> dict:
        return {"step": self.step, "url": self.url, "ephemeral": self.ephemeral, "size_bytes": self.size_bytes}


@dataclass(frozen=True)
class PrunePlan:
    folder: Location
    keep_last: int
    keep_every: int | None
    ephemeral_only: bool
    keep_last_ephemeral: int | None  # None with ephemeral_only
    include_foreign: bool
    prune: list[PruneItem]
    kept: list[int]
    foreign: list[int]  # committed steps another tool wrote (counted only with include_foreign)
    refused: list[int] = field(default_factory=list)  # committed steps a resume refused (never counted or pruned)
    deleted: list[int] = field(default_factory=list)
    kept_items: list[PruneItem] = field(default_factory=list)  # the kept steps, like ``prune`` (for showing)

    @property
    def committed(self) -> int:
        return len(self.prune) + len(self.kept)

    def to_json(self, *, dry_run: bool) -> dict:
        return {"folder": self.folder.url, "dry_run": dry_run,
                "policy": {"keep_last": self.keep_last, "keep_every": self.keep_every,
                           "ephemeral_only": self.ephemeral_only, "keep_last_ephemeral": self.keep_last_ephemeral},
                "prune": [i.to_json() for i in self.prune], "kept": self.kept, "deleted": self.deleted,
                "foreign": {"steps": self.foreign, "counted": self.include_foreign}, "refused": self.refused}


def plan_prune(folder: Where, *, keep_last: int, keep_every: int | None = None, keep_last_ephemeral: int | None = None,
               ephemeral_only: bool = False, include_foreign: bool = False) -> PrunePlan:
    """Which committed steps of ``folder`` a prune deletes (nothing is deleted here).
    Default: keep the newest ``keep_last`` persistent steps (multiples of
    ``keep_every`` kept and not counted) and the newest ``keep_last_ephemeral``
    (default 1) ephemeral ones. ``ephemeral_only``: see the module docstring. The
    newest committed step is never pruned. Steps another tool wrote are neither
    counted nor pruned unless ``include_foreign``. Raises ValueError
    (``keep_last_ephemeral`` with ``ephemeral_only``), storage errors."""
    if ephemeral_only and keep_last_ephemeral is not None:
        raise ValueError("keep_last_ephemeral cannot be combined with ephemeral_only (there keep_last counts "
                         "ephemeral steps)")
    loc = Location.of(folder)
    found = list(discovery.find_checkpoints(loc, with_markers=True))
    refused = sorted(refusals.live(loc, refusals.read_all(loc), [s for s, _, _ in found]))
    found = [f for f in found if f[0] not in refused]
    foreign = [s for s, _, m in found if m.foreign]
    if not include_foreign:
        found = [f for f in found if not f[2].foreign]
    markers = {s: m for s, _, m in found}
    committed = [(s, m.ephemeral) for s, _, m in found]
    if ephemeral_only:
        newest = max((s for s, _ in committed), default=None)
        candidates = [(s, e) for s, e in committed if e and not (keep_every and s % keep_every == 0)]
        doomed = retention.steps_to_prune(candidates, retention.Policy(keep_last_ephemeral=keep_last),
                                          protect=frozenset(() if newest is None else {newest}))
    else:
        keep_last_ephemeral = keep_last_ephemeral or 1
        policy = retention.Policy(keep_last_ephemeral=keep_last_ephemeral, max_checkpoints=keep_last,
                                  keep_every=keep_every)
        doomed = retention.steps_to_prune(committed, policy)
    def item(s: int) -> PruneItem:
        return PruneItem(s, layout.step_dir(loc.url, s), markers[s].ephemeral, markers[s].total_bytes)

    gone = set(doomed)
    kept = [s for s, _ in committed if s not in gone]
    return PrunePlan(loc, keep_last, keep_every, ephemeral_only, keep_last_ephemeral, include_foreign,
                     [item(s) for s in doomed], kept, foreign, refused, kept_items=[item(s) for s in kept])


def apply_prune(plan: PrunePlan, *, on_deleted: Callable[[PruneItem], None] | None = None) -> list[int]:
    """Delete the plan's steps in order, each marker first; returns the steps deleted
    (also appended to ``plan.deleted`` as they go). Raises storage errors (steps
    deleted before the error stay deleted)."""
    for item in plan.prune:
        retention.delete_step(plan.folder.at(item.url))
        plan.deleted.append(item.step)
        if on_deleted:
            on_deleted(item)
    return list(plan.deleted)
