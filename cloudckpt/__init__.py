"""cloudckpt: checkpoints for PyTorch training on S3, GCS and local folders.

Public API::

    from cloudckpt import Checkpointer, CheckpointConfig, CheckpointManager

Names that need torch are imported on first use (PEP 562), so ``cloudckpt list``
and other torch-free tools start without paying for ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import errors
from ._version import __version__
from .checkpoint.marker import Marker
from .config import CheckpointConfig
from .storage import StorageOptions
from .transfer import TransferConfig

_LAZY = {
    "AppState": "cloudckpt.checkpoint.app_state",
    "Checkpointer": "cloudckpt.checkpoint.checkpointer",
    "CheckpointManager": "cloudckpt.checkpoint.manager",
}

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint.app_state import AppState
    from .checkpoint.checkpointer import Checkpointer
    from .checkpoint.manager import CheckpointManager


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cloudckpt' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AppState",
    "CheckpointConfig",
    "CheckpointManager",
    "Checkpointer",
    "Marker",
    "StorageOptions",
    "TransferConfig",
    "errors",
    "__version__",
]
