"""Lightning ``CheckpointIO`` plugins that save and load through cloudckpt.

    from lightning.pytorch import Trainer
    from cloudckpt.integrations.lightning import CloudCheckpointIO

    trainer = Trainer(default_root_dir="s3://bucket/run-7", plugins=[CloudCheckpointIO()])

The path Lightning gives (``…/checkpoints/epoch=0-step=100.ckpt``) is a
checkpoint *folder*, committed by its marker like any cloudckpt step::

    epoch=0-step=100.ckpt/
        model_and_optim/   DCP: ``model.<name>`` = the tensors of checkpoint["state_dict"],
                           ``optim.<i>.<path>`` = the tensors of checkpoint["optimizer_states"]
        train/rank0.pt     everything else (loops, callbacks, hyper-parameters, …), with the
                           tensors above replaced by references into the DCP state
        .metadata.json     the commit marker, written last

so ``cloudckpt list/latest/inspect/verify/export`` work on Lightning checkpoints too
(``export`` takes the ``model`` tensors: the LightningModule's state dict).

Importing this module changes nothing global. Building a plugin (``CloudCheckpointIO``,
``AsyncCloudCheckpointIO``) registers the fsspec shim for ``s3://``/``gs://`` (logs,
folder checks: see ``_fsspec``) and makes ``fit(ckpt_path="last")`` resolve to
:func:`last_checkpoint` of the ``ModelCheckpoint``'s folder (:func:`install_last_resolution`);
both are done once per process, whatever the number of plugins.

Lightning calls ``save_checkpoint``/``remove_checkpoint`` on global rank 0 only,
so the plugin's Checkpointer acts alone (``distributed=False``); every rank loads
for itself. Strategies that write sharded checkpoints themselves (FSDP with
sharded state dicts, DeepSpeed) do not go through a CheckpointIO and are not
covered. Loading always unpickles with ``weights_only=True``: hyper-parameters
must be plain data (Lightning's own default since torch 2.6).

``AsyncCloudCheckpointIO`` + ``AsyncFinalizerCallback`` (NeMo's
``AsyncFinalizableCheckpointIO`` + ``AsyncFinalizerCallback``): ``save_checkpoint``
copies the tensors to host memory and returns; the Checkpointer's async saver
writes and uploads the folder in the background (``Checkpointer.save_async(commit=False)``:
the step's lock is held, no marker; the same staging buffers and thread as every
async save). *Finalize* runs on the training thread: it takes the saves whose
upload finished, in submission order, and commits each one (writes its marker),
raises the error of a failed one (nothing of it is committed), and then runs the
``remove_checkpoint`` calls Lightning made meanwhile (they are deferred until
every save submitted before them is committed, so the newer checkpoint exists
before the older one is deleted). The callback finalizes without blocking at
every train batch and epoch end and blocking at train end; teardown finalizes
what is left.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..checkpoint import named, retention
from ..checkpoint.checkpointer import Checkpointer
from ..errors import CorruptCheckpoint
from ..storage import Location, StorageOptions
from . import _fsspec

log = logging.getLogger(__name__)

_REF = "cloudckpt.dcp:"  # a tensor's place in the train state: "cloudckpt.dcp:{top}/{name}"
_SPLIT = {"state_dict": "model", "optimizer_states": "optim"}  # Lightning key -> top-level DCP key

__all__ = ["AsyncCloudCheckpointIO", "AsyncFinalizerCallback", "CloudCheckpointIO", "install_last_resolution",
           "join_checkpoint", "last_checkpoint", "register_fsspec", "split_checkpoint"]


def register_fsspec(storage_options: StorageOptions | None = None) -> list[str]:
    """Serve ``s3://``/``gs://`` in fsspec with cloudckpt's stores where s3fs/gcsfs are
    not installed (never replacing a registered class). Done when a plugin is built (with
    its ``storage_options``); call it again to set the storage options the shim uses.
    Returns the protocols served."""
    return _fsspec.register(storage_options)


# ---------------------------------------------------------------- checkpoint dict <-> (DCP state, train state)
def split_checkpoint(checkpoint: dict) -> tuple[dict, dict]:
    """Split a Lightning checkpoint into the DCP state (``{"model": {...}, "optim": {...}}``,
    tensors only) and the rest, where each moved tensor is replaced by a reference."""
    tensors: dict[str, dict] = {}
    rest = dict(checkpoint)
    for key, top in _SPLIT.items():
        if key in checkpoint:
            out: dict[str, torch.Tensor] = {}
            rest[key] = _extract(checkpoint[key], top, out, ())
            if out:
                tensors[top] = out
    return tensors, rest


def _extract(obj: Any, top: str, out: dict, path: tuple) -> Any:
    if isinstance(obj, torch.Tensor):
        name = ".".join(str(p) for p in path)
        if name in out:
            raise ValueError(f"two tensors of the checkpoint map to the DCP key {top}.{name}; rename one")
        out[name] = obj
        return f"{_REF}{top}/{name}"
    if isinstance(obj, dict):
        cls = OrderedDict if isinstance(obj, OrderedDict) else dict
        return cls((k, _extract(v, top, out, path + (k,))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_extract(v, top, out, path + (i,)) for i, v in enumerate(obj))
    return obj


def join_checkpoint(rest: dict, tensors: dict) -> dict:
    """Inverse of :func:`split_checkpoint`. Raises CorruptCheckpoint for a reference
    to a tensor the DCP state does not have."""

    def fill(obj: Any) -> Any:
        if isinstance(obj, str) and obj.startswith(_REF):
            top, _, name = obj[len(_REF):].partition("/")
            try:
                return tensors[top][name]
            except KeyError:
                raise CorruptCheckpoint(f"the train state refers to tensor {top}.{name}, "
                                        "which the DCP state lacks") from None
        if isinstance(obj, dict):
            return type(obj)((k, fill(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(v) for v in obj)
        return obj

    out = dict(rest)
    for key in _SPLIT:
        if key in out:
            out[key] = fill(out[key])
    return out


def _targets(metadata) -> dict:
    """Empty tensors for every ``model.*``/``optim.*`` tensor of the DCP metadata."""
    out: dict[str, dict] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        top, _, name = fqn.partition(".")
        if top in _SPLIT.values() and isinstance(md, TensorStorageMetadata):
            out.setdefault(top, {})[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return out


def _url(path: Any) -> str:
    return os.fspath(path)


def _ephemeral(storage_options: Any) -> bool:
    if storage_options is None:
        return False
    if not isinstance(storage_options, dict) or set(storage_options) - {"ephemeral"}:
        raise TypeError("cloudckpt's CheckpointIO accepts storage_options=None or {'ephemeral': bool}, "
                        f"got {storage_options!r}")
    return bool(storage_options.get("ephemeral", False))


def _move(obj: Any, map_location: Any) -> Any:
    if not isinstance(map_location, (str, torch.device, int)):
        raise ValueError(f"map_location must be a device for cloudckpt checkpoints, got {map_location!r}")
    if isinstance(obj, torch.Tensor):
        return obj.to(map_location)
    if isinstance(obj, dict):
        return type(obj)((k, _move(v, map_location)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, map_location) for v in obj)
    return obj


def last_checkpoint(dirpath: str, *, storage_options: StorageOptions | None = None) -> str | None:
    """The newest committed checkpoint folder directly under ``dirpath`` (highest
    ``global_step``, then newest commit), or None. ``fit(ckpt_path="last")`` resolves
    to the same folder (see :func:`install_last_resolution`)."""
    found = named.newest(Location.of(dirpath, storage_options))
    return found[0] if found else None


def install_last_resolution() -> bool:
    """Make ``fit(ckpt_path="last")`` resolve to :func:`last_checkpoint` of each
    ``ModelCheckpoint``'s folder when that folder holds committed cloudckpt
    checkpoints. Done when a plugin is built (once: the wrapper is never wrapped again);
    returns whether it is in place.

    Lightning finds "last" candidates by listing the folder with fsspec and passing
    each name through ``os.path.normpath``, which turns ``s3://b/…`` into a local
    path: for a URL it never finds anything and trains from step 0. The wrapper asks
    ``last_checkpoint`` instead (committed folders only, newest by step), and leaves
    Lightning's own answer where the folder holds no committed cloudckpt checkpoint
    (a local folder of ordinary ``.ckpt`` files). It wraps the private
    ``ModelCheckpoint._find_last_checkpoints``; if a Lightning version lacks it, it
    logs a warning and returns False (pass ``ckpt_path=last_checkpoint(dirpath)`` then)."""
    original = getattr(ModelCheckpoint, "_find_last_checkpoints", None)
    resolve = getattr(ModelCheckpoint, "_ModelCheckpoint__resolve_ckpt_dir", None)
    if getattr(original, "_cloudckpt", False):
        return True
    if original is None or resolve is None:
        log.warning("this Lightning version has no ModelCheckpoint._find_last_checkpoints: fit(ckpt_path='last') "
                    "does not see cloudckpt checkpoints; pass ckpt_path=last_checkpoint(dirpath)")
        return False

    def _find_last_checkpoints(self, trainer) -> set[str]:
        dirpath = os.fspath(resolve(self, trainer))
        newest = last_checkpoint(dirpath)
        if newest is not None:
            return {newest}
        return original(self, trainer)  # for a URL: local names that do not exist, dropped by Lightning

    _find_last_checkpoints._cloudckpt = True  # type: ignore[attr-defined]
    _find_last_checkpoints.__wrapped__ = original  # type: ignore[attr-defined]
    ModelCheckpoint._find_last_checkpoints = _find_last_checkpoints
    return True


# ---------------------------------------------------------------- sync plugin
class CloudCheckpointIO(CheckpointIO):
    """Saves and loads Lightning checkpoints through cloudckpt (local paths, ``s3://``, ``gs://``).

    Keyword options go to :class:`~cloudckpt.Checkpointer` (``work_dir``, ``transfer``,
    ``verify_checksums``, …), except ``distributed`` (always False: Lightning saves from
    rank 0 only). ``save_overwrite`` defaults to True because Lightning re-saves paths
    such as ``last.ckpt`` (the old marker is deleted first, then the folder rewritten).
    """

    def __init__(self, *, storage_options: StorageOptions | None = None, save_overwrite: bool = True,
                 **checkpointer_options: Any):
        super().__init__()
        if "distributed" in checkpointer_options:
            raise TypeError("CloudCheckpointIO always saves from one process (distributed=False); "
                            "do not pass distributed")
        self.storage_options = storage_options
        self._options = dict(checkpointer_options, storage_options=storage_options, save_overwrite=save_overwrite,
                             distributed=False)
        self._ckpt: Checkpointer | None = None
        register_fsspec(storage_options)  # what Lightning reaches through fsspec (logs, folder checks)
        install_last_resolution()  # fit(ckpt_path="last") for a URL

    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer (created on first use; closed by ``teardown``)."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(**self._options)
        return self._ckpt

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Save and commit the checkpoint folder ``path``. ``storage_options`` may be
        ``{"ephemeral": True}``. Raises SaveFailed, SaveInProgress, storage errors."""
        tensors, rest = split_checkpoint(checkpoint)
        self.checkpointer.save(_url(path), tensors, rest, step=int(checkpoint.get("global_step", 0)),
                               ephemeral=_ephemeral(storage_options))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the committed checkpoint folder ``path`` (tensors on CPU unless
        ``map_location`` names a device). Always ``weights_only=True``. Raises
        NotACheckpoint (no marker), CorruptCheckpoint, storage errors."""
        url = _url(path)
        if weights_only is False:
            log.info("cloudckpt loads %s with weights_only=True regardless of weights_only=False", url)
        tensors, rest = self.checkpointer.load_with(url, _targets, load_trainer_state=True)
        checkpoint = join_checkpoint(rest, tensors)
        return _move(checkpoint, map_location) if map_location is not None else checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint folder: its marker first, then its objects."""
        retention.delete_step(Location.of(_url(path), self.storage_options))

    def teardown(self) -> None:
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()


# ---------------------------------------------------------------- async plugin
@dataclass
class _InFlight:
    index: int
    path: str
    future: Future  # of a PendingCommit


class AsyncCloudCheckpointIO(CloudCheckpointIO):
    """Like :class:`CloudCheckpointIO`, but ``save_checkpoint`` returns after a copy to
    host memory; the folder is written and uploaded in a background thread and
    committed by :meth:`maybe_finalize_save_checkpoint` on the training thread (use
    :class:`AsyncFinalizerCallback`). See the module docstring for what finalize does.

    ``max_in_flight``: saves uploaded-or-uploading but not finalized at most; one more
    waits (blocking finalize) first, as does a save to a path still in flight. Host
    memory above baseline is at most ``max_in_flight`` copies of the checkpoint's
    tensors. All methods are meant for the training thread.
    """

    def __init__(self, *, max_in_flight: int = 2, **options: Any):
        super().__init__(**options)
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self._options["max_in_flight"] = max_in_flight
        self._inflight: deque[_InFlight] = deque()
        self._submitted = 0  # saves submitted so far
        self._finalized = 0  # saves finalized (committed or failed), in submission order
        self._first_failed: int | None = None  # index of the first save that failed
        self._removals: list[tuple[int, str]] = []  # (saves to finalize first, path)

    @property
    def in_flight(self) -> list[str]:
        """Paths saved but not committed yet, oldest first."""
        return [f.path for f in self._inflight]

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Stage and start saving ``path``; it is committed by a later finalize. Raises
        here the error of an earlier save that failed and was not reported yet."""
        url = _url(path)
        ephemeral = _ephemeral(storage_options)
        self._finalize(block_until=0)
        deps = [f.index + 1 for f in self._inflight if f.path == url] + [n for n, p in self._removals if p == url]
        if len(self._inflight) >= self.max_in_flight:
            deps.append(self._inflight[len(self._inflight) - self.max_in_flight].index + 1)
        if deps:
            self._finalize(block_until=max(deps))
        tensors, rest = split_checkpoint(checkpoint)  # save_async stages both on this thread
        fut = self.checkpointer.save_async(url, tensors, rest, step=int(checkpoint.get("global_step", 0)),
                                           ephemeral=ephemeral, commit=False)
        self._inflight.append(_InFlight(self._submitted, url, fut))
        self._submitted += 1

    def remove_checkpoint(self, path: Any) -> None:
        """Delete now if nothing is in flight; else after every save submitted so far
        is committed (skipped, keeping the old checkpoint, if one of them failed)."""
        if self._inflight:
            self._removals.append((self._submitted, _url(path)))
        else:
            super().remove_checkpoint(path)

    def maybe_finalize_save_checkpoint(self, blocking: bool = False) -> int:
        """Commit the saves whose upload finished, in order (``blocking``: wait for all),
        then run the removals they unblock. Returns how many were committed. Raises
        the first error of a save that failed (nothing of it was committed)."""
        return self._finalize(block_until=self._submitted if blocking else 0)

    def _finalize(self, *, block_until: int) -> int:
        committed = 0
        errors: list[BaseException] = []
        while self._inflight:
            item = self._inflight[0]
            if item.index >= block_until and not item.future.done():
                break
            failed = None
            try:
                pending = item.future.result()
            except Exception as e:  # noqa: BLE001 - the save failed: reported below
                self._inflight.popleft()
                failed = e
            else:
                self._inflight.popleft()
                try:
                    pending.commit()
                    committed += 1
                    log.info("committed %s", item.path)
                except Exception as e:  # noqa: BLE001 - reported below; commit() cleaned up
                    failed = e
            if failed is not None:
                errors.append(failed)
                if self._first_failed is None:
                    self._first_failed = item.index
            self._finalized = item.index + 1
            self._run_removals()
        if errors:
            for e in errors[1:]:
                log.error("async checkpoint save failed (not committed): %s", e)
            raise errors[0]
        return committed

    def _run_removals(self) -> None:
        due = [(n, p) for n, p in self._removals if n <= self._finalized]
        self._removals = [(n, p) for n, p in self._removals if n > self._finalized]
        for n, path in due:
            if self._first_failed is not None and self._first_failed < n:
                log.warning("not removing %s: a checkpoint saved before it was to be removed failed, so it stays", path)
                continue
            CloudCheckpointIO.remove_checkpoint(self, path)

    def teardown(self) -> None:
        """Finalize (blocking) what is in flight, then release the thread and the Checkpointer."""
        try:
            if self._inflight:
                log.info("finalizing %d async checkpoint save(s) at teardown", len(self._inflight))
            self._finalize(block_until=self._submitted)
        finally:
            super().teardown()


class AsyncFinalizerCallback(Callback):
    """Finalizes the saves of :class:`AsyncCloudCheckpointIO`: without blocking at each
    train batch end and epoch end, blocking at train end (so every checkpoint is
    committed when ``fit`` returns)."""

    def on_train_batch_end(self, trainer, *args: Any, **kwargs: Any) -> None:
        _async_io(trainer).maybe_finalize_save_checkpoint(blocking=False)

    def on_train_epoch_end(self, trainer, *args: Any, **kwargs: Any) -> None:
        _async_io(trainer).maybe_finalize_save_checkpoint(blocking=False)

    def on_train_end(self, trainer, *args: Any, **kwargs: Any) -> None:
        io = _async_io(trainer)
        if io.in_flight:
            log.info("train end: committing %d checkpoint(s) still in flight", len(io.in_flight))
        io.maybe_finalize_save_checkpoint(blocking=True)


def _async_io(trainer) -> AsyncCloudCheckpointIO:
    io = trainer.strategy.checkpoint_io
    while not isinstance(io, AsyncCloudCheckpointIO) and getattr(io, "checkpoint_io", None) is not None:
        io = io.checkpoint_io  # unwrap Lightning's _WrappingCheckpointIO
    if not isinstance(io, AsyncCloudCheckpointIO):
        raise ValueError(f"AsyncFinalizerCallback needs Trainer(plugins=[AsyncCloudCheckpointIO(...)]), "
                         f"the trainer's CheckpointIO is {type(trainer.strategy.checkpoint_io).__name__}")
    return io
