"""Object stores behind one interface: local folders, S3 (and S3-compatible), GCS."""

from . import url
from .base import ListEntry, ObjectInfo, ObjectStore, PendingUpload, RangeReader, StorageOptions
from .location import Location, Where
from .registry import clear_cache, known_schemes, open_store, register_backend
from .url import resolve_local, resolve_step_dir

__all__ = [
    "ListEntry",
    "Location",
    "ObjectInfo",
    "ObjectStore",
    "PendingUpload",
    "RangeReader",
    "StorageOptions",
    "clear_cache",
    "known_schemes",
    "open_store",
    "register_backend",
    "resolve_local",
    "resolve_step_dir",
    "url",
    "Where",
]
