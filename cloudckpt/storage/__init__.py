"""Object stores behind one interface: local folders, S3 (and S3-compatible), GCS."""

from .base import ListEntry, ObjectInfo, ObjectStore, PendingUpload, RangeReader, StorageOptions
from .registry import clear_cache, known_schemes, open_store, register_backend
from .location import Location, Where
from . import url
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
