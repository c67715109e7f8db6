"""Removing one step folder on request (``cloudckpt rm``): what it holds is read first
(its marker if any, one recursive LIST), then :func:`cloudckpt.checkpoint.retention.delete_step`
deletes the marker first and then every object, so a crash part-way leaves an
uncommitted folder (``gc`` removes it), never a committed step with objects missing."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import layout, retention
from ..checkpoint.marker import Marker
from ..errors import ConfigError, NotFound
from ..storage import Location, Where
from .steps import probe_marker


@dataclass(frozen=True)
class RemovePlan:
    step: Location
    number: int
    marker: Marker | None  # None: not committed (no marker, or an unreadable one: ``problem``)
    problem: str | None
    object_count: int
    size_bytes: int

    @property
    def status(self) -> str:
        return "committed" if self.marker else ("unreadable" if self.problem else "incomplete")

    def to_json(self, *, dry_run: bool, deleted: int | None) -> dict:
        m = self.marker
        return {"url": self.step.url, "step": self.number, "status": self.status,
                "ephemeral": m.ephemeral if m else None, "object_count": self.object_count,
                "size_bytes": self.size_bytes, "created": m.created if m else None,
                "dry_run": dry_run, "deleted_objects": deleted}


def plan_remove(step: Where) -> RemovePlan:
    """Describe the step folder ``step`` before it is removed. Raises ConfigError (not
    named ``step{N}``: rm removes one step, never a save folder), NotFound (nothing
    there), storage errors."""
    loc = Location.of(step).resolved_step()
    number = layout.step_of_name(loc.name)
    if number is None:
        raise ConfigError(f"{loc.url} is not a step folder (named step{{N}}): `cloudckpt rm` removes one step; "
                          "use `cloudckpt prune` or `cloudckpt gc` on a save folder")
    marker, problem = probe_marker(loc)
    objects = list(loc.store.walk(loc.prefix))
    if not objects:
        raise NotFound(f"{loc.url} holds no objects: there is no step to remove (run `cloudckpt list` on its save "
                       "folder)", url=loc.url)
    return RemovePlan(loc, number, marker, problem, len(objects), sum(o.size for o in objects))


def apply_remove(plan: RemovePlan) -> int:
    """Delete the step: marker first, then its objects. Returns the objects deleted
    after the marker. Raises storage errors (AccessDenied, UnsafeDelete for a step at
    the bucket root below ``min_delete_depth``, ...)."""
    return retention.delete_step(plan.step)
