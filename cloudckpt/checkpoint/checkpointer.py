"""The Checkpointer: save and load with the marker-last commit protocol.

A facade: a save runs ``saving.save`` around this rank's ``RankWriter`` (the call
order with roles is in saving.py's docstring), a load runs ``loading.load`` (its
order in loading.py's), async saves run the same save on ``AsyncSaver``'s thread. A
step folder given here becomes a ``StepRef`` once, at this boundary.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

from .. import dist
from ..collector import collector_paused
from ..options import CheckpointerOptions
from ..storage import Location, StorageOptions, Where
from ..transfer import TransferEngine
from . import discovery, loading, saving
from .async_save import AsyncSaver
from .committed import CommittedStep
from .entries import ObjectEntry
from .loading import LoadInfo, LoadRequest
from .marker import Marker
from .rank_writer import RankWriter
from .saving import PendingCommit, SaveStats
from .step import StepRef


class Checkpointer:
    """Save and load checkpoints to a local folder, ``s3://`` or ``gs://``.

    Create it on every rank at the same point, with the same settings (it creates a
    dedicated gloo group when torch.distributed is initialised). ``dir`` arguments are
    step folders: ``{save_folder}/step{N}``.

    Args:
        options: every setting in one :class:`~cloudckpt.options.CheckpointerOptions`
            (None: the defaults).
        progress: called with the number of bytes moved since the last call, from the
            transfer threads (a progress bar).
        distributed: False: this process acts alone even when torch.distributed is
            initialised (no collectives; every process saves or loads by itself).
        **settings: fields of ``CheckpointerOptions`` by name, each replacing the one in
            ``options``: ``Checkpointer(work_dir="/scratch")``.

    Raises:
        ConfigError: a setting not allowed (naming it, the value and what is allowed).
        TypeError: a keyword argument that is not a setting.

    Attributes:
        options: the settings (a ``CheckpointerOptions``).
        last_load_info: a :class:`~cloudckpt.checkpoint.loading.LoadInfo` of this rank's
            last load (None before one).
        last_save_stats: a :class:`~cloudckpt.checkpoint.saving.SaveStats` of the last
            committed save (None before one).
        coord: the coordinator of the checkpointer's collectives (rank, world size).
        engine: the transfer engine (``engine.stats()``: its counters).
    """

    def __init__(self, options: CheckpointerOptions | None = None, *, progress: Any = None, distributed: bool = True,
                 **settings: Any):
        if options is not None and not isinstance(options, CheckpointerOptions):
            raise TypeError(f"Checkpointer(options=...) takes a CheckpointerOptions, got {type(options).__name__}")
        if settings:
            known = {f.name for f in dataclasses.fields(CheckpointerOptions)}
            unknown = sorted(set(settings) - known)
            if unknown:
                raise TypeError(f"Checkpointer() got unknown setting(s) {unknown}; the settings are "
                                f"{', '.join(sorted(known))} (CheckpointerOptions), progress and distributed")
            options = dataclasses.replace(options or CheckpointerOptions(), **settings)
        self.options: CheckpointerOptions = options or CheckpointerOptions()
        self.coord = dist.Coordinator(timeout=self.options.collective_timeout, local=not distributed)
        self.engine = TransferEngine(self.options.transfer, storage_options=self.options.storage_options,
                                     progress=progress, world_size=self.coord.world_size)
        self.last_save_stats: SaveStats | None = None
        self.last_load_info: LoadInfo | None = None
        self._writer = RankWriter(self.coord, self.engine, self.options)
        self._async = AsyncSaver(self._save_now, max_in_flight=self.options.max_in_flight)

    @property
    def work_dir(self) -> str:
        """``options.work_dir``: the local scratch folder."""
        return self.options.work_dir

    @property
    def storage_options(self) -> StorageOptions:
        """``options.storage_options``: how the stores are reached."""
        return self.options.storage_options

    def _step(self, dir: Where, step: int | None = None, *, named: bool = False) -> StepRef:
        """The step folder ``dir`` with this checkpointer's storage options."""
        return StepRef.of(dir, self.storage_options, step=step, named=named)

    # ================================================================ save
    def save_async(self, dir: str, state_dict: dict, train_state: Any = None, *, ephemeral: bool = False,
                   step: int | None = None, commit: bool = True) -> Future:
        """Stage ``state_dict`` and ``train_state`` in host memory, then save in the
        background; returns a Future of the Marker. Collective (call on every rank).
        Waits while ``max_in_flight`` saves are in flight; raises here the error of an
        earlier async save that failed and was not reported yet. ``commit=False``: the
        Future holds a :class:`PendingCommit` once everything is uploaded and agreed; the
        caller commits it (``.commit()``) and gets the save's error from the Future."""
        return self._async.submit(dir, state_dict, train_state, ephemeral, step, commit=commit)

    def _run_async(self, fn: Callable[[dict, Any], Any], state_dict: dict, train_state: Any = None) -> Future:
        """Stage like :meth:`save_async`, then run ``fn(staged, train_state)`` in order with
        the other async saves (the node-local tier's writes)."""
        return self._async.submit_call(fn, state_dict, train_state)

    def in_flight(self) -> list[Future]:
        """The Futures of async saves staged or running, oldest first."""
        return self._async.in_flight()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for in-flight async saves; raise the first failure not reported yet."""
        self._async.wait(timeout)

    def save(self, dir: str, state_dict: dict, train_state: Any = None, *, ephemeral: bool = False,
             step: int | None = None, commit: bool = True) -> "Marker | PendingCommit":
        """Save ``state_dict`` (DCP) and this rank's ``train_state`` to the step folder
        ``dir`` and commit it, after any in-flight async saves finish. Collective: call
        on every rank. ``last_save_stats`` tells what it did.

        Args:
            dir: the step folder, ``{save_folder}/step{N}``.
            state_dict: the model/optimizer state (tensors, DTensors, plain values).
            train_state: this rank's picklable extras (plain data), loaded back by ``load``.
            ephemeral: mark the step ephemeral (retention keeps fewer of them).
            step: the step number, for a ``dir`` not named ``step{N}``.
            commit: False stops once everything is uploaded and agreed and returns a
                :class:`PendingCommit`: nothing is visible until its ``commit()``.

        Returns:
            The marker as written (every rank gets rank 0's), or a PendingCommit.

        Raises:
            CheckpointExists: the step is committed and ``save_overwrite`` is off.
            SaveInProgress: another save holds the step's lock.
            SaveFailed: a rank failed; nothing was committed (naming each rank's error).
            NotACheckpoint: ``dir`` is not named ``step{N}`` and no ``step`` is given.
            StorageError: the store's errors.
        """
        self._async.wait()
        with collector_paused():  # blocking: training waits anyway (async saves do not pause it)
            return self._save_now(dir, state_dict, train_state, ephemeral=ephemeral, step=step, commit=commit)

    def _save_now(self, dir: str, state_dict: dict, train_state: Any = None, *, ephemeral: bool = False,
                  step: int | None = None, commit: bool = True) -> "Marker | PendingCommit":
        """:meth:`save` without waiting for async saves (the async saver's thread runs it)."""
        return self._commit(saving.save(
            self.coord, self.engine, self.options, self._step(dir, step, named=True),
            lambda ref, work: self._writer.write(ref, work, state_dict, train_state), ephemeral=ephemeral,
            commit=commit))

    def _persist_files(self, dir: str, files: Sequence[tuple[str, ObjectEntry]], *, ephemeral: bool = False,
                       step: int | None = None) -> Marker:
        """Commit the step folder ``dir`` from files already written (each rank's ``(local
        path, ObjectEntry)`` pairs of a local step): uploaded as they are, committed with
        the usual protocol. Collective. Raises as :meth:`save`."""
        return self._commit(saving.save(
            self.coord, self.engine, self.options, self._step(dir, step, named=True),
            lambda ref, work: self._writer.upload(ref, files), ephemeral=ephemeral, needs_work=False))

    def _write_local(self, folder: str, state_dict: dict, train_state: Any = None) -> list[ObjectEntry]:
        """Write this rank's part of a step into the local ``folder`` and keep it there
        (nothing is uploaded). Collective. Returns this rank's entries; raises SaveFailed
        on every rank if any rank failed (the caller removes the folders)."""
        return saving.write_local(self.coord, lambda: self._writer.write(None, folder, state_dict, train_state))

    def _commit(self, done: "tuple[Marker, SaveStats] | PendingCommit") -> "Marker | PendingCommit":
        if isinstance(done, PendingCommit):
            return done
        self.last_save_stats = done[1]
        return done[0]

    # ================================================================ load
    def load(self, dir: str, state_dict: dict, *, load_optim_state: bool | None = None,
             load_trainer_state: bool | None = None, strict: bool = True, pre_download: bool | None = None,
             exclude_from_loading: Sequence[str] = (), model_only: bool = False, allow_partial: bool = False,
             before_read: Callable[[dict[str, list[tuple[int, int]]]], None] | None = None) -> Any:
        """Load the committed step ``dir`` into ``state_dict`` in place (resharding as
        needed) and return this rank's train state. Collective: call on every rank.

        Nothing is left behind silently: checkpoint keys the target does not ask for
        under ``model``, ``optim`` or a top-level key the target has raise KeysNotLoaded
        (use ``AppState``, or ``allow_partial``); other leftovers are logged.
        ``last_load_info.not_loaded`` lists the keys not loaded.

        Args:
            dir: the step folder, ``{save_folder}/step{N}`` (a URL or a local path).
            state_dict: what to load into: tensors (DTensors, sharded or not) are filled in
                place, other top-level values replaced (``state_dict[key] = value``).
            load_optim_state: False skips the top-level ``optim`` key; None loads it if the
                checkpoint has it; True requires it.
            load_trainer_state: False skips the train state (returns None); None loads it
                if present; True requires it (CorruptCheckpoint if missing).
            strict: False loads what exists instead of raising MissingKeys.
            pre_download: download this rank's items to ``work_dir`` first instead of
                streaming them (None: ``options.pre_download``).
            exclude_from_loading: top-level keys not loaded; they keep their values.
            model_only: load only the top-level ``model`` key and no train state.
            allow_partial: leave the checkpoint's other keys instead of raising KeysNotLoaded.
            before_read: (advanced) called on every rank once the load is planned and
                before any shard is read, with ``{path under model_and_optim/: [(offset,
                length), ...]}``: the items this rank reads from storage itself (with
                ``load_exchange``, its share). The node-local tier fetches them from peers.

        Returns:
            This rank's train state (rank 0's when the world size changed), or None.

        Raises:
            ValueError: an excluded key is not in ``state_dict``; ``model_only`` without a
                ``model`` key or with ``load_trainer_state=True``.
            NotACheckpoint: ``dir`` holds no committed step.
            IncompatibleCheckpoint: a marker format this version cannot read.
            CorruptCheckpoint: a size or CRC32C that does not match the manifest; a
                required train state missing.
            UnsafeCheckpoint: a checkpoint that tries to run code or escape its folder.
            MissingKeys, KeysNotLoaded, ShapeMismatch: the target and the step differ.
            ExchangeFailed: a peer failed during the read-once exchange.
            StorageError: the store's errors (NotFound, AccessDenied, Timeout...).
        """
        unknown = [k for k in exclude_from_loading if k not in state_dict]
        if unknown:
            raise ValueError(f"exclude_from_loading names keys that are not in the state dict: {unknown} "
                             f"(top-level keys are: {sorted(state_dict)})")
        if model_only:
            if "model" not in state_dict:
                raise ValueError(f"model_only=True needs a top-level 'model' key (got: {sorted(state_dict)})")
            if load_trainer_state:
                raise ValueError("model_only=True loads no train state: do not pass load_trainer_state=True")
            exclude_from_loading, load_trainer_state = [k for k in state_dict if k != "model"], False
        req = LoadRequest(load_optim_state=load_optim_state, load_trainer_state=load_trainer_state, strict=strict,
                          pre_download=pre_download, exclude_from_loading=tuple(exclude_from_loading),
                          allow_partial=allow_partial, only="model" if model_only else None, before_read=before_read)
        self._async.wait()
        with collector_paused():
            return self._load(loading.open_step(self.coord, self.engine, self.options, self._step(dir)), state_dict,
                              req)

    def load_with(self, dir: str, build: Callable[[Any], dict], **load_kwargs: Any) -> tuple[dict, Any]:
        """Load a step whose shapes the caller does not know, into the state dict
        ``build(metadata)`` makes from a DCP ``Metadata`` of the step (every key, dtype
        and size; from the index header, no chunks or storage; a step without the index
        gives its whole ``.metadata``). Collective. The Lightning and OLMo-core
        integrations load this way. ``load_kwargs``: as for :meth:`load`. Returns
        ``(state_dict, train_state)``; raises what :meth:`load` raises."""
        self._async.wait()
        committed = loading.open_step(self.coord, self.engine, self.options, self._step(dir))
        state_dict = build(committed.shapes())
        with collector_paused():
            return state_dict, self._load(committed, state_dict, LoadRequest(**load_kwargs))

    def _load(self, committed: CommittedStep, state_dict: dict, req: LoadRequest) -> Any:
        ts, self.last_load_info = loading.load(self.coord, self.engine, self.options, committed, state_dict, req)
        self._writer.loaded(committed)  # the next saves are planned from its structure while the state keeps it
        return ts

    def read_train_state(self, dir: str) -> Any:
        """This rank's train state of the committed step ``dir`` (what ``load`` returns),
        without loading the model or optimizer; None if the step has none. Not
        collective (the Hugging Face integrations read it before loading the weights).
        Raises NotACheckpoint, CorruptCheckpoint, UnsafeCheckpoint."""
        committed = CommittedStep.open(self._step(dir), verify=self.options.verify_checksums)
        return committed.train_state(self.coord.rank, world_size=self.coord.world_size)

    # ================================================================ discovery
    @staticmethod
    def find_checkpoints(folder: Where, ephemeral: bool | None = None, *,
                         storage_options: StorageOptions | None = None) -> Iterator[tuple[int, str]]:
        return discovery.find_checkpoints(Location.of(folder, storage_options), ephemeral)

    @staticmethod
    def latest_checkpoint(folder: Where, *, storage_options: StorageOptions | None = None) -> str:
        return discovery.latest_checkpoint(Location.of(folder, storage_options))

    @staticmethod
    def dir_is_checkpoint(dir: Where, *, storage_options: StorageOptions | None = None) -> bool:
        return discovery.dir_is_checkpoint(Location.of(dir, storage_options))

    @staticmethod
    def contains_checkpoint(folder: Where, *, storage_options: StorageOptions | None = None) -> bool:
        return discovery.contains_checkpoint(Location.of(folder, storage_options))

    def close(self) -> None:
        """Wait for in-flight async saves (raising an unreported failure), then release resources."""
        try:
            self._async.close()
        finally:
            self.engine.close()
            self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Checkpointer", "LoadInfo", "PendingCommit", "SaveStats"]
