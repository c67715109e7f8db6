"""cloudckpt: checkpoints for PyTorch training on S3, GCS and local folders.

Public API::

    from cloudckpt import Checkpointer, StorageOptions, TransferConfig
"""

from ._version import __version__
from .checkpoint import Checkpointer, Marker
from .storage import StorageOptions
from .transfer import TransferConfig
from . import errors

__all__ = ["Checkpointer", "Marker", "StorageOptions", "TransferConfig", "errors", "__version__"]
