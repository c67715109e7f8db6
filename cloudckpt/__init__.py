"""cloudckpt: checkpoints for PyTorch training on S3, GCS and local folders.

Public API::

    from cloudckpt import Checkpointer, CheckpointConfig, CheckpointManager

Names that need torch are imported on first use (PEP 562), so ``cloudckpt list``
and other torch-free tools start without paying for ``import torch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import errors
from ._lazy import lazy_exports
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


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


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
