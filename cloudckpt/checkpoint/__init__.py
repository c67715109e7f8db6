"""Layout, marker, commit protocol, discovery (and, on top, retention and the manager).

``Checkpointer`` (which needs torch) is imported on first use, so the torch-free
modules here (layout, marker, discovery, retention) load fast for the CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .discovery import contains_checkpoint, dir_is_checkpoint, find_checkpoints, latest_checkpoint, read_marker
from .entries import ObjectEntry
from .marker import Marker

if TYPE_CHECKING:  # pragma: no cover
    from .checkpointer import Checkpointer


__getattr__, __dir__ = lazy_exports(__name__, {"Checkpointer": ".checkpointer"})


__all__ = [
    "Checkpointer",
    "Marker",
    "ObjectEntry",
    "contains_checkpoint",
    "dir_is_checkpoint",
    "find_checkpoints",
    "latest_checkpoint",
    "read_marker",
]
