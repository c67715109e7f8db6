"""Whole-object copies of http(s):// objects in cached-path's cache.

Used by :mod:`.http` when a server ignores ``Range``: the object is fetched once and
later ranges are read from the local copy. The cache is cached-path's
(``~/.cache/cached_path``; ``CACHED_PATH_CACHE_ROOT`` or ``cached_path.set_cache_dir``
move it), keyed by the URL and the object's validator (its ``ETag``, else
``Last-Modified`` and size), so a replaced object gets a new copy. cached-path's file
lock lets one process or thread download while the others wait, and its temporary
file and rename mean a broken download never becomes a cached copy.

cached-path's own http client has no timeouts, so the requests go through the
:class:`~cloudckpt.storage.http.HTTPStore` that asked (its timeouts, deadline and
typed errors): a client for the private scheme ``cloudckpt+http(s)`` is registered
with ``cached_path.add_scheme_client`` (cached-path's plain ``http(s)`` handling, which
other libraries in the process may use, is left alone), and the store is handed to it
through a context variable for the duration of the call.

The server is untrusted: a copy is made only of an object whose size the server
announces (``Content-Length``), only when that size fits in the cache folder's free
space with :data:`RESERVE` bytes to spare, and the body is held to that size
(ObjectTooLarge past it, Transient when it ends short); a server that announces
no size or 1 TiB gets a typed error, never a full disk.
"""

from __future__ import annotations

import contextvars
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import cached_path
import cached_path.common
from cached_path import SchemeClient

from ..errors import ObjectTooLarge, Transient

if TYPE_CHECKING:
    from .http import HTTPStore

RESERVE = 1024 * 1024 * 1024  # bytes of the cache folder's disk a copy always leaves free
_PREFIX = "cloudckpt+"
_STORE: contextvars.ContextVar["HTTPStore"] = contextvars.ContextVar("cloudckpt_http_store")
_registered = False
_lock = threading.Lock()


class _StoreClient(SchemeClient):
    """cached-path's view of one object, fetched through the store in ``_STORE``."""

    scheme = ("cloudckpt+http", "cloudckpt+https")
    recoverable_errors = ()  # never fall back to an older copy: errors are the store's typed ones

    def __init__(self, resource: str, headers=None) -> None:
        super().__init__(resource)
        self.url = resource[len(_PREFIX):]
        self.store = _STORE.get()
        self._headers: Optional[dict] = None

    @property
    def headers(self) -> dict:
        if self._headers is None:
            self._headers = self.store.head(self.url, "get")
        return self._headers

    def get_etag(self) -> Optional[str]:
        h = self.headers
        if h.get("ETag"):
            return h["ETag"]
        if h.get("Last-Modified"):
            return f"{h['Last-Modified']}|{h.get('Content-Length', '')}"
        return None  # nothing tells versions apart: the copy is reused until the cache is cleared

    def get_size(self) -> Optional[int]:
        try:
            return int(self.headers["Content-Length"])
        except (KeyError, ValueError):
            return None

    def get_resource(self, temp_file) -> None:
        from .http import _shown

        size = self.get_size()
        shown = _shown(self.url)
        if size is None:
            raise ObjectTooLarge(f"get {shown}: the server ignores Range requests and does not announce the object's "
                                 "size (no Content-Length), so no bounded copy of it can be made; serve the "
                                 "checkpoint from a server that answers Range requests", url=shown)
        folder = os.path.abspath(cached_path.common.get_cache_dir())
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        free = shutil.disk_usage(folder).free
        if size > free - RESERVE:
            raise ObjectTooLarge(f"get {shown}: the server ignores Range requests and announces {size} bytes; a copy "
                                 f"would not fit in the cache folder {folder} ({free} bytes free, {RESERVE} kept "
                                 "free); serve the checkpoint from a server that answers Range requests, or move "
                                 "the cache (CACHED_PATH_CACHE_ROOT)", url=shown)
        n = self.store.download_fileobj(self.url, temp_file, size=size)
        if n != size:
            raise Transient(f"get {shown}: got {n} bytes, the server said {size} (the object changed while it was "
                            "read?)", url=shown)

    def get_bytes_range(self, index: int, length: int) -> bytes:
        raise NotImplementedError  # the store reads ranges itself; this is its whole-object path


def cached_file(store: "HTTPStore", url: str) -> Path:
    """A local copy of the object at ``url``, downloaded through ``store`` unless the
    cache holds the current one. Raises the store's errors."""
    global _registered
    with _lock:
        if not _registered:
            cached_path.add_scheme_client(_StoreClient)
            _registered = True
    token = _STORE.set(store)
    try:
        return Path(cached_path.cached_path(_PREFIX + url, quiet=True))
    finally:
        _STORE.reset(token)
