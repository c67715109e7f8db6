"""The one error tree of cloudckpt.

Every error a user can see derives from :class:`CloudCkptError`. Storage backends
translate their own exceptions into the storage branch at the boundary, so callers
never need to know which SDK raised. Messages name the URL (and the rank where
there is one) and say what to do next; they never contain credentials.
"""

from __future__ import annotations

from typing import Mapping


class CloudCkptError(Exception):
    """Base class of every cloudckpt error."""


class ConfigError(CloudCkptError, ValueError):
    """A setting has a bad value. The message names the field, the value and what is allowed."""


# ---------------------------------------------------------------- storage
class StorageError(CloudCkptError):
    """A storage operation failed. ``url`` is the object or prefix concerned."""

    def __init__(self, message: str, *, url: str | None = None):
        self.url = url
        super().__init__(message)


class InvalidURL(StorageError, ValueError):
    """The URL cannot be parsed or names an unknown scheme."""


class ReadOnlyLocation(InvalidURL):
    """The location can be read but not written, deleted or listed: an ``http(s)://``
    source (a published checkpoint). The message says where to save instead, or which
    URL to pass (a step folder) to load."""


class BackendUnavailable(StorageError, ImportError):
    """The backend for a scheme needs an optional dependency that is not installed."""


class NotFound(StorageError, FileNotFoundError):
    """The object, prefix or bucket does not exist."""


class BucketNotFound(NotFound):
    """The bucket itself does not exist."""


class AlreadyExists(StorageError, FileExistsError):
    """A create-if-absent found the object already there."""


class PreconditionFailed(StorageError):
    """A conditional request's precondition did not hold."""


class CopyUnsupported(StorageError):
    """The store cannot copy an object server-side (or the two URLs are in different
    stores): send the bytes instead."""


class AccessDenied(StorageError, PermissionError):
    """The credentials are missing, wrong, or lack a permission."""


class Transient(StorageError):
    """A failure that may succeed when retried (5xx, connection reset, timeout)."""


class Throttled(Transient):
    """The store asked us to slow down (503 SlowDown, 429)."""


class TransferStalled(Transient, TimeoutError):
    """A transfer made no progress for longer than the stall timeout."""


class Timeout(Transient, TimeoutError):
    """The store did not answer in time: a request got no answer within its operation
    deadline (``operation_timeout``, over all the SDK's attempts) or within the
    connect/read timeouts. The message names the endpoint and the setting to change."""


class UnsafeDelete(StorageError):
    """A delete was refused because the prefix is a bucket root or too shallow."""


class DeleteFailed(StorageError):
    """Some objects of a delete were not deleted (each one tried). ``failed``: their
    URLs; ``deleted``: how many objects are gone; the message names the first few
    keys escaped (control characters shown as ``\\xNN``)."""

    def __init__(self, message: str, *, url: str | None = None, failed: tuple[str, ...] = (), deleted: int = 0):
        super().__init__(message, url=url)
        self.failed = tuple(failed)
        self.deleted = deleted


class ObjectTooLarge(StorageError):
    """An object holds (or its server announces) more bytes than the caller expects:
    its size in the manifest, or the stated ceiling for a read with no size. Nothing
    past that size was read or written."""


class RedirectRefused(StorageError):
    """An http(s):// server redirected to another origin (scheme, host or port): only
    redirects within the origin of the URL given are followed."""


# ---------------------------------------------------------------- checkpoints
class CheckpointError(CloudCkptError):
    """Base class of checkpoint-level errors."""


class CheckpointExists(CheckpointError, FileExistsError):
    """The step is already committed and ``save_overwrite`` is off."""


class NotACheckpoint(CheckpointError, FileNotFoundError):
    """The folder is not a committed checkpoint (no marker, or not a ``step{N}`` folder)."""


class CorruptCheckpoint(CheckpointError):
    """An object of a committed checkpoint is missing, truncated or fails its checksum."""


class UnsafeCheckpoint(CorruptCheckpoint):
    """A checkpoint (or a local save folder) holds something cloudckpt refuses to act
    on: an object name that could climb out of its folder, a pickle global outside the
    exact allowlist, a size or count that does not add up, a symbolic link where an
    object or folder is expected. Nothing of it was run, created or deleted."""


class InternalError(CloudCkptError):
    """cloudckpt broke a rule of its own: a read of the load's own plan went wrong (a
    stream read outside the range it opened, an item handed on with the wrong length),
    or bytes a peer checked before sending arrived changed. This is a cloudckpt bug,
    never a verdict on the checkpoint: it is not a :class:`CorruptCheckpoint`, so
    ``CheckpointManager.resume`` does not fall back to an older step for it. Report it
    with the message; loading with ``load_exchange=False`` or ``pre_download=True`` may
    avoid the path that failed."""

    def __init__(self, message: str):
        super().__init__(f"{message} (this is a cloudckpt bug, not damage to the checkpoint: please report it)")

    def __reduce__(self):
        return (_internal_error, (self.args[0],))


def _internal_error(text: str) -> "InternalError":
    """An InternalError with ``text`` as it is (unpickling: the suffix is there already)."""
    e = InternalError.__new__(InternalError)
    Exception.__init__(e, text)
    return e


class IncompatibleCheckpoint(CheckpointError):
    """The marker has a format version this library cannot read."""


class KeysNotLoaded(CheckpointError):
    """The checkpoint holds model or optimizer state that the load's target did not ask
    for (e.g. a fresh optimizer's ``state_dict()`` has no per-parameter state), so it
    would have been dropped silently. Use ``AppState``, or pass ``allow_partial=True``
    or ``model_only=True`` to mean it."""


class ShapeMismatch(CheckpointError, ValueError):
    """A tensor asked for has another shape or dtype than the one saved."""


class SaveInProgress(CheckpointError, FileExistsError):
    """Another save of the same step holds the step's lock."""


class MissingKeys(CheckpointError, KeyError):
    """Keys asked for are absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class SaveFailed(CheckpointError):
    """A save failed on one or more ranks. ``failures`` maps rank to its error text."""

    def __init__(self, message: str, failures: Mapping[int, str] | None = None):
        self.failures = dict(failures or {})
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0], self.failures))

    @classmethod
    def from_failures(cls, step: str, failures: Mapping[int, str]) -> "SaveFailed":
        lines = "\n".join(f"  rank {r}: {m}" for r, m in sorted(failures.items()))
        return cls(f"{step} failed on {len(failures)} rank(s); nothing was committed:\n{lines}", failures)


class LocalCapacityError(CheckpointError, OSError):
    """The node-local tier's folder has no room for the next local step."""


class CollectiveError(CloudCkptError):
    """A named collective step failed on one or more ranks (carried to every rank)."""

    def __init__(self, step: str, failures: Mapping[int, BaseException | str]):
        self.step = step
        self.failures = {r: (e if isinstance(e, str) else f"{type(e).__name__}: {e}") for r, e in failures.items()}
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{step} failed on {len(self.failures)} rank(s): {lines}")

    def __reduce__(self):
        return (type(self), (self.step, self.failures))


class ExchangeFailed(CollectiveError):
    """A load's read-once exchange (each shared byte range read from the bucket by one
    rank and sent to the others) failed: ``failures`` maps the rank that failed or
    vanished (a peer that did not send or receive within the collective timeout, or
    whose connection closed) to what was seen. Nothing more is put in place; load again
    once the rank is back (a restart of the job)."""


class PeerLost(CollectiveError):
    """A collective step could not complete because a rank of the job is gone: its
    process died (gloo: its connection closed or was reset) or it did not answer within
    ``collective_timeout``. Raised on every surviving rank that meets the step, at the
    latest ``collective_timeout`` seconds after it got there; from then on every step of
    the same group raises it at once (the group cannot be used again).

    ``step``: the collective (a named step of the save or load such as ``agree`` or
    ``load read``, or DCP's own ``save plan`` / ``save finish``); ``where``: the step
    folder, where known; ``gone``: the ranks known to be gone (empty when gloo does not
    say which: its text names the peer's address); ``timed_out``: no answer within
    ``timeout`` seconds rather than a closed connection. A step is committed only after
    every rank agreed, so nothing partial is committed: restart the job, which resumes
    from the newest committed step."""

    def __init__(self, step: str, failures: Mapping[int, BaseException | str], *, where: str | None = None,
                 gone: tuple[int, ...] = (), timeout: float | None = None, timed_out: bool = False,
                 also: str | None = None, earlier: str | None = None):
        super().__init__(step, failures)
        self.where, self.gone, self.timeout, self.timed_out = where, tuple(gone), timeout, timed_out
        self.also = also  # this rank's own error, when it had failed before the peer was lost
        self.earlier = earlier  # the step at which the group lost the peer, when that was an earlier one

    def at(self, where: str) -> "PeerLost":
        """Name the step folder (once: the first caller that knows it)."""
        if self.where is None:
            self.where = where
        return self

    def __str__(self) -> str:
        of = f" of {self.where}" if self.where else ""
        ranks = f" (rank {', '.join(map(str, self.gone))})" if self.gone else ""
        limit = f"{self.timeout:g} s" if self.timeout is not None else "collective_timeout"
        if self.earlier is not None:
            what = f"the group lost a peer rank earlier, at {self.earlier}{ranks}"
        elif self.timed_out:
            what = (f"a peer rank{ranks} did not answer within collective_timeout ({limit}): it died, hangs or lags "
                    "that far behind")
        else:
            what = f"a peer rank{ranks} is gone (its connection closed: its process died or exited)"
        seen = "; ".join(f"rank {r} saw: {m}" for r, m in sorted(self.failures.items()))
        also = f"; this rank had failed before: {self.also}" if self.also else ""
        return (f"collective step '{self.step}'{of} failed: {what}; {seen}{also}. Restart the job: a step is "
                f"committed only once every rank agreed, so nothing partial was committed and the job resumes from "
                f"the newest committed step. A survivor gives up on a silent peer after collective_timeout ({limit}).")

    def __reduce__(self):
        return (type(self), (self.step, self.failures), dict(self.__dict__))
