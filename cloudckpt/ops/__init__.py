"""Library operations behind the ``cloudckpt`` command: each takes a
:class:`~cloudckpt.storage.Location` (or a URL) and returns plain data (dataclasses
with a ``to_json``), so the CLI only parses arguments and formats results, and a
script can call the same functions.

- :func:`list_steps` — the step folders of a save folder, committed or not
- :func:`inspect_step` — tensors, train state keys and marker of one step
- :func:`verify_step` — every object of a step against its manifest
- :func:`prepare_download` / :func:`run_download` (:func:`download`) — a step to a
  local folder, resumable, marker last
- :func:`find_runs` — the runs (folders of step folders) under a bucket or prefix
- :func:`plan_prune` / :func:`apply_prune` — retention's policy applied once
- :func:`plan_remove` / :func:`apply_remove` — one step folder, marker first
- :func:`cloudckpt.ops.adopt.adopt` — our manifest for a step another tool committed
- :func:`cloudckpt.ops.export.export_weights` — a step's model weights to one
  safetensors or torch file

Latest and gc are the library's own functions:
:func:`cloudckpt.checkpoint.discovery.latest_checkpoint`,
:func:`cloudckpt.checkpoint.retention.gc`.

Progress goes to an optional object with ``start(total_bytes)`` and ``update(n)``
(:class:`Progress`); nothing here prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .progress import Progress

_LAZY = {
    "list_steps": "steps", "StepRow": "steps", "StepListing": "steps",
    "inspect_step": "inspect", "StepReport": "inspect",
    "verify_step": "verify", "VerifyReport": "verify",
    "prepare_download": "downloads", "run_download": "downloads", "download": "downloads",
    "DownloadPlan": "downloads", "DownloadReport": "downloads",
    "find_runs": "runs", "RunsListing": "runs", "RunRow": "runs",
    "plan_remove": "remove", "apply_remove": "remove", "RemovePlan": "remove",
    "plan_prune": "prune", "apply_prune": "prune", "PrunePlan": "prune", "PruneItem": "prune",
}

__all__ = [
    "apply_prune",
    "apply_remove",
    "download",
    "DownloadPlan",
    "DownloadReport",
    "find_runs",
    "inspect_step",
    "list_steps",
    "plan_prune",
    "plan_remove",
    "prepare_download",
    "Progress",
    "PruneItem",
    "PrunePlan",
    "RemovePlan",
    "run_download",
    "RunRow",
    "RunsListing",
    "StepListing",
    "StepReport",
    "StepRow",
    "verify_step",
    "VerifyReport",
]


# lazy: `cloudckpt list` must not import what `inspect` needs (torch)
__getattr__, __dir__ = lazy_exports(__name__, {k: "." + v for k, v in _LAZY.items()})


if TYPE_CHECKING:  # pragma: no cover
    from .downloads import DownloadPlan, DownloadReport, download, prepare_download, run_download
    from .inspect import StepReport, inspect_step
    from .prune import PruneItem, PrunePlan, apply_prune, plan_prune
    from .remove import RemovePlan, apply_remove, plan_remove
    from .runs import RunRow, RunsListing, find_runs
    from .steps import StepListing, StepRow, list_steps
    from .verify import VerifyReport, verify_step
