"""cloudckpt: checkpoints for PyTorch training on S3, GCS and local folders.

Public API::

    from cloudckpt import Checkpointer, CheckpointConfig, CheckpointManager
"""

from ._version import __version__
from .checkpoint import Checkpointer, Marker
from .checkpoint.manager import CheckpointManager
from .config import CheckpointConfig
from .storage import StorageOptions
from .transfer import TransferConfig
from . import errors

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "Checkpointer",
    "Marker",
    "StorageOptions",
    "TransferConfig",
    "errors",
    "__version__",
]
