"""DCP StorageWriter / StorageReader on top of storage + transfer."""

from .reader import StreamingReader, coalesce
from .safe_pickle import loads_metadata
from .writer import UploadingWriter

__all__ = ["StreamingReader", "UploadingWriter", "coalesce", "loads_metadata"]
