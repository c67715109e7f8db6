"""Layout, marker, commit protocol, discovery (and, on top, retention and the manager)."""

from .checkpointer import Checkpointer
from .discovery import contains_checkpoint, dir_is_checkpoint, find_checkpoints, latest_checkpoint, read_marker
from .marker import Marker, ObjectEntry

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
