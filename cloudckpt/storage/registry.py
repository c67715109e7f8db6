"""Maps a URL scheme to a lazily imported backend class.

The only place that chooses a backend by a URL's scheme: everything else gets its
store here (``open_store``, ``Location.store``) and calls the ObjectStore interface.
Each cloud backend's SDK is an extra (``cloudckpt[s3]``, ``cloudckpt[gcs]``): a missing
one gives BackendUnavailable naming the URL and the install command, instead of an
ImportError deep in a call.

Other code that reads a scheme, and why:

- in ``storage/``: ``url.py`` parses it (``scheme_of``, ``parse_url`` and the bucket
  naming rule of each scheme, ``local_path``, the hint for an ``http(s)://`` save
  location); each backend refuses a URL of another scheme; ``http.py`` keeps a
  redirect within its origin.
- above ``storage/``, code that must have a local folder (a download's destination,
  an export for ``from_pretrained``, a torchtitan folder to import) asks
  ``url.local_path`` and never spells the test itself: ``ops/downloads.py``,
  ``ops/export.py``, ``cli/hints.py``, ``integrations/hf_export.py``,
  ``integrations/torchtitan.py``.
- ``config.py`` checks ``save_folder``'s scheme against :func:`known_schemes` and
  refuses a bucket root of an object-store URL.
"""

from __future__ import annotations

import importlib
import threading
from typing import Dict, Tuple

from ..errors import BackendUnavailable, InvalidURL
from .base import ObjectStore, StorageOptions
from .url import http_url_message, scheme_of

# scheme -> ("module:Class", pip extra that provides its dependencies; "" for none)
_BACKENDS: Dict[str, Tuple[str, str]] = {
    "file": ("cloudckpt.storage.local:LocalStore", ""),
    "s3": ("cloudckpt.storage.s3:S3Store", "s3"),
    "gs": ("cloudckpt.storage.gcs:GCSStore", "gcs"),
    "https": ("cloudckpt.storage.http:HTTPStore", "https"),  # read-only: loads of published steps
}
_ALIASES = {"gcs": "gs", "s3a": "s3", "http": "https"}

_lock = threading.Lock()
_instances: Dict[Tuple[str, StorageOptions], ObjectStore] = {}


def register_backend(scheme: str, target: str, extra: str = "") -> None:
    """Register ``module:Class`` for ``scheme`` (for third-party backends)."""
    _BACKENDS[scheme] = (target, extra)


def known_schemes() -> list[str]:
    return sorted(set(_BACKENDS) | set(_ALIASES))


def backend_class(scheme: str, url: str | None = None) -> type[ObjectStore]:
    """The class serving ``scheme``, imported now. ``url`` is named in errors."""
    scheme = _ALIASES.get(scheme, scheme)
    if scheme not in _BACKENDS:
        raise InvalidURL(
            f"unknown storage scheme {scheme + '://'!r}: cloudckpt supports local paths, file://, "
            f"s3:// and gs:// (known: {', '.join(s + '://' for s in known_schemes())})"
        )
    target, extra = _BACKENDS[scheme]
    mod_name, _, cls_name = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        hint = f"pip install 'cloudckpt[{extra}]'" if extra else "reinstall cloudckpt"
        where = f"{url}: " if url else ""
        raise BackendUnavailable(
            f"{where}the {scheme}:// backend needs packages that are not installed (no module {e.name!r}): {hint}",
            url=url,
        ) from e
    return getattr(mod, cls_name)


def open_store(url: str, options: StorageOptions | None = None) -> ObjectStore:
    """The (shared, thread-safe) store that serves ``url``. Raises InvalidURL for
    malformed URLs or unknown schemes, BackendUnavailable when an extra is missing."""
    scheme = _ALIASES.get(scheme_of(url), scheme_of(url))
    if scheme in ("http", "https") and scheme not in _BACKENDS:
        raise InvalidURL(http_url_message(url), url=url)
    cls = backend_class(scheme, url)
    options = options or StorageOptions()
    key = (scheme, options)
    with _lock:
        store = _instances.get(key)
        if store is None:
            store = _instances[key] = cls(options)
        return store


def clear_cache() -> None:
    """Drop cached stores (tests that change the environment between cases)."""
    with _lock:
        for s in _instances.values():
            s.close()
        _instances.clear()
