"""Layout, marker, commit protocol, discovery (and, on top, retention and the manager).

``Checkpointer`` (which needs torch) is imported on first use, so the torch-free
modules here (layout, marker, discovery, retention) load fast for the CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .discovery import contains_checkpoint, dir_is_checkpoint, find_checkpoints, latest_checkpoint, read_marker
from .marker import Marker, ObjectEntry

if TYPE_CHECKING:  # pragma: no cover
    from .checkpointer import Checkpointer


def __getattr__(name: str):
    if name == "Checkpointer":
        from .checkpointer import Checkpointer

        globals()[name] = Checkpointer
        return Checkpointer
    raise AttributeError(f"module 'cloudckpt.checkpoint' has no attribute {name!r}")


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
