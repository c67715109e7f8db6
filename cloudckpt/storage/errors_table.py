"""One table from an HTTP status to the error cloudckpt raises for it.

The S3, GCS and http(s) backends translate a store's answer with it
(``s3.translate``, ``gcs.translate``, ``HTTPStore._check_status``), so a status means
the same error whichever store sent it. A backend adds only what a status cannot say:
which error code stands for which status (S3), whether a 404 means the bucket or the
object, a name the store rejected, and its own hint (where its credentials come from).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from ..errors import AccessDenied, NotFound, PreconditionFailed, StorageError, Throttled, Transient

STATUS_ERRORS: Mapping[int, type[StorageError]] = MappingProxyType({
    401: AccessDenied,
    403: AccessDenied,
    404: NotFound,
    410: NotFound,  # gone: as missing
    408: Transient,  # request timeout
    409: Transient,  # a conflicting request in flight (S3 ConditionalRequestConflict, GCS)
    412: PreconditionFailed,
    429: Throttled,
    503: Throttled,  # S3 SlowDown, GCS backend overload
})
"""Statuses with an error of their own. Any other 5xx is Transient; any other status a
plain StorageError (``error_class``)."""

WHAT: Mapping[type[StorageError], str] = MappingProxyType({
    NotFound: "no such object",
    AccessDenied: "access denied",
    PreconditionFailed: "precondition failed",
    Throttled: "the store is throttling requests",
    Transient: "server error",
    StorageError: "unexpected answer",
})
"""What each error's message says happened."""

HINTS: Mapping[type[StorageError], str] = MappingProxyType({
    Throttled: "retries were exhausted; try again later",
})
"""What to do, where a backend gives no hint of its own for that error."""


def error_class(status: int) -> type[StorageError]:
    """The error for an answer with HTTP ``status`` (an error status: 4xx or 5xx)."""
    cls = STATUS_ERRORS.get(status)
    if cls is None:
        cls = Transient if 500 <= status <= 599 else StorageError
    return cls


def status_error(status: int, url: str, op: str, *, hints: Mapping[type[StorageError], str],
                 detail: str = "", message: str = "") -> StorageError:
    """The error for an answer with ``status`` to ``op`` on ``url``, reading
    ``"{op} {url}: {what} ({detail}): {message}; {hint}"``: ``detail`` names the answer
    (an error code; the status when empty), ``message`` is the store's own text (given
    for an unexpected answer only), the hint is the backend's ``hints`` entry for the
    error, else :data:`HINTS`'. ``url`` must already be free of credentials."""
    cls = error_class(status)
    text = f"{op} {url}: {WHAT[cls]} ({detail or status})"
    if message and cls is StorageError:
        text += f": {message}"
    hint = hints.get(cls) or HINTS.get(cls)
    if hint:
        text += f"; {hint}"
    return cls(text, url=url)
