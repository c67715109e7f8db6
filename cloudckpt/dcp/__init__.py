"""DCP StorageWriter / StorageReader on top of storage + transfer."""

from .reader import StreamingReader, coalesce
from .writer import UploadingWriter

__all__ = ["StreamingReader", "UploadingWriter", "coalesce"]
