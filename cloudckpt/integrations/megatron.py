"""Megatron-core: ``dist_checkpointing`` saves and loads through cloudckpt.

Supported: megatron-core >= 0.19, < 0.20 (tested with 0.19.2, torch 2.13, on CPU with
gloo; the helpers used below are private to Megatron and move between releases, so
other versions are refused at import). Megatron is imported lazily: this module
imports without it, its functions need it.

The change in a Megatron-core script: the entry points and the folder::

    from cloudckpt.integrations import megatron as cloud_megatron
    cloud_megatron.save(model.sharded_state_dict(), "s3://bucket/run-7/iter_0000100")
    state = cloud_megatron.load(model.sharded_state_dict(), "s3://bucket/run-7/iter_0000100")
    model.load_state_dict(state)

(``gs://…`` and local folders work the same.) :func:`save` replays the steps of
Megatron's ``dist_checkpointing.serialization.save`` (factories, non-persistent
values, the sharding check, common state as the ``ShardedObject`` ``common_state``)
and then :class:`CloudSaveStrategy`, a ``TorchDistSaveShardedStrategy`` whose ``save``
runs Megatron's own state-dict translation (``mcore_to_pyt_state_dict``) and
``torch.distributed.checkpoint.save`` with cloudckpt's save planners carrying what
Megatron's ``MCoreSavePlanner`` does (:class:`MegatronItems`) and cloudckpt's uploading
writer, inside cloudckpt's commit protocol: a job's first save is planned by owners of the
keys, no rank gathers every rank's plan, and ``.metadata`` is assembled in the store
(``checkpoint/rank_writer.py``); the saves after it, and the first save after a load,
follow the step's structure. Every rank writes to
its own work dir, uploads are throttled and retried, rank 0 adds Megatron's
``metadata.json`` (an object of the step, in its manifest) and cloudckpt's marker is
written last, so that neither Megatron nor cloudckpt ever sees the step before it is
complete. :func:`load` replays ``serialization.load`` with :class:`CloudLoadStrategy`:
the read goes through cloudckpt's loader (its DCP index, the read-once exchange,
checksums), the common state and every ``ShardedObject`` are unpickled as plain data
only (``weights_only``: an object that is not plain data is refused). Tensors reshard
as DCP reshards: a step saved at one tensor-parallel size loads at another.

Layout: ``{url}/model_and_optim/`` is a stock ``torch_dist`` folder (DCP's files and
Megatron's ``metadata.json``), ``{url}/.metadata.json`` is cloudckpt's marker. After
``cloudckpt download {url} DEST``, Megatron's own ``dist_checkpointing.load(…,
"DEST/model_and_optim")`` reads it; :func:`import_folder` commits a folder Megatron's
own ``dist_checkpointing.save`` wrote as a step (``megatron_folders`` reads Megatron's
``iter_N`` folders and tracker file).

Every failure fails every rank together: each step that could raise on one rank only
(the sharding check raises on rank 0) runs inside one of cloudckpt's named collective
steps, which carry each rank's error to every rank.

``load`` takes Megatron's ``strict`` (``StrictHandling``) and runs Megatron's own
strictness check with the step's keys from cloudckpt's index; :func:`load_sharded_metadata`
and :func:`load_tensors_metadata` read those keys on one process. Where Megatron raises its
``CheckpointingException`` (or DCP's ``CheckpointException``), the cloudckpt error raised
is also one (``MegatronCheckFailed``, ``MegatronNotACheckpoint``, ``MegatronMissingKeys``).

Tested on CPU with gloo (docs/integrations.md): tensor parallel 2 -> 1 and 1 -> 2,
pipeline parallel 2 -> 1, a GPT training run killed and resumed bit-exact with
Megatron's optimizer and RNG states, Megatron's own ``test_serialization.py`` (38 of 40).
An ``allow_shape_mismatch`` target reads the part that lies inside the saved tensor
(zeros elsewhere). Not done: async saves (``async_sharded_save``), the fully-parallel
wrappers, a load into a target of another dtype (refused, as every cloudckpt load
refuses it; Megatron casts), ``remove_sharded_tensors`` (a committed step is never
rewritten), Megatron's distributed optimizer (it refuses CPU parameters, so it is
untested here). The step folder's number is
``step`` or comes from its name (``step{N}`` or Megatron's ``iter_{N:07d}``).
"""

from __future__ import annotations

import io
import json
import os
import re
import time
from contextlib import contextmanager
from typing import Any, Iterator

from .. import Checkpointer
from .._torch_compat import make_wrapper_subclass
from ..errors import CollectiveError, ConfigError, MissingKeys, NotACheckpoint

SUPPORTED = ((0, 19), (0, 20))
"""megatron-core versions this module supports: ``[low, high)``, by (major, minor)."""

MODEL_DIR = "model_and_optim"  # cloudckpt's DCP folder: the stock torch_dist folder of the step
COMMON_KEY = "common_state"  # Megatron's ShardedObject of the common (non-sharded) state
CONFIG_NAME = "metadata.json"  # Megatron's own commit marker (dist_checkpointing.core.CONFIG_FNAME)
_ITER = re.compile(r"(?:step|iter_)(\d+)")


def _megatron():
    """Megatron's modules this integration uses, after the version check. Raises
    ImportError (no megatron-core, or a version outside ``SUPPORTED``)."""
    import megatron.core
    from megatron.core.dist_checkpointing import core, mapping, serialization, state_dict_utils, validation
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    m = re.match(r"(\d+)\.(\d+)", megatron.core.__version__)
    version = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if not SUPPORTED[0] <= version < SUPPORTED[1]:
        low, high = (".".join(map(str, v)) for v in SUPPORTED)
        raise ImportError(f"cloudckpt.integrations.megatron supports megatron-core >= {low}, < {high}; found "
                          f"{megatron.core.__version__}")
    return core, mapping, serialization, state_dict_utils, validation, mtorch


def step_number(url: str, step: int | None = None) -> int:
    """``step``, or the number in the folder's name (``step{N}``, ``iter_{N}``).
    Raises ConfigError when there is none."""
    if step is not None:
        return int(step)
    m = _ITER.fullmatch(os.path.basename(str(url).rstrip("/")))
    if m is None:
        raise ConfigError(f"{url}: the step folder is not named step{{N}} or iter_{{N}}; pass step=")
    return int(m.group(1))


@contextmanager
def _checkpointer(given: Checkpointer | None, settings: dict) -> Iterator[Checkpointer]:
    if given is not None:
        yield given
        return
    ckpt = Checkpointer(**settings)
    try:
        yield ckpt
    finally:
        ckpt.close()


def _every_rank(ckpt: Checkpointer, name: str, fn):
    """``fn()`` on this rank inside the named collective step ``name``: a failure on any
    rank raises on every rank (CollectiveError naming each rank's error; when one of them
    is Megatron's ``CheckpointingException``, MegatronCheckFailed, which is both)."""
    out: list = []

    def error(step: str, failures: dict) -> CollectiveError:
        megatrons = any(str(m).startswith("CheckpointingException") for m in failures.values())
        return (_errors()["MegatronCheckFailed"] if megatrons else CollectiveError)(step, failures)

    ckpt.coord.all_ranks(name, lambda: out.append(fn()), error=error)  # only the outcome travels, not the value
    return out[0]


_ERRORS: dict = {}


def _errors() -> dict:
    """The error classes that are cloudckpt's and Megatron's (or DCP's) at once, built at
    first use (they subclass Megatron's ``CheckpointingException``)."""
    if _ERRORS:
        return _ERRORS
    from torch.distributed.checkpoint.api import CheckpointException

    CheckpointingException = _megatron()[0].CheckpointingException

    class MegatronCheckFailed(CollectiveError, CheckpointingException):
        """Megatron's own check (the sharding check, ``strict`` handling, global shapes)
        failed on some rank: a CollectiveError (on every rank, naming each rank's error)
        and the ``CheckpointingException`` Megatron's ``load`` raises."""

    class MegatronNotACheckpoint(NotACheckpoint, CheckpointingException):
        """The folder is not a committed step: cloudckpt's NotACheckpoint and the
        ``CheckpointingException`` ("... is not a distributed checkpoint") Megatron raises."""

    class MegatronMissingKeys(MissingKeys, CheckpointException):
        """A key asked for (with Megatron's default ``strict``, ``ASSUME_OK_UNEXPECTED``)
        is not in the step: cloudckpt's MissingKeys and the DCP ``CheckpointException``
        Megatron's own load raises there. ``failures``: this rank's MissingKeys."""

        def __init__(self, message: str):
            Exception.__init__(self, message)
            self._failures = {}

        __str__ = MissingKeys.__str__

    for cls in (MegatronCheckFailed, MegatronNotACheckpoint, MegatronMissingKeys):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        _ERRORS[cls.__name__] = cls
    return _ERRORS


@contextmanager
def _megatron_not_a_checkpoint(checkpoint_dir: Any) -> Iterator[None]:
    """NotACheckpoint raised inside as MegatronNotACheckpoint (Megatron's
    ``CheckpointingException`` too), naming ``checkpoint_dir``."""
    try:
        yield
    except NotACheckpoint as e:
        raise _errors()["MegatronNotACheckpoint"](f"{checkpoint_dir} is not a distributed checkpoint "
                                                  f"(no committed cloudckpt step): {e}") from e


def _typed(v: Any) -> Any:
    """Megatron's DCP containers (``CheckpointableShardedTensor``, ``LocalShardsContainer``)
    are tensor wrappers made without a dtype (float32 whatever they hold); the same
    containers with their data's dtype, for cloudckpt's dtype check of the load. Other
    values as they are."""
    import torch
    from megatron.core.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
        LocalShardsContainer,
    )

    if type(v) is CheckpointableShardedTensor:
        t = make_wrapper_subclass(CheckpointableShardedTensor, torch.Size(v._sh_ten.global_shape), dtype=v._data.dtype)
        CheckpointableShardedTensor.__init__(t, v._data, v._sh_ten)
        return t
    if type(v) is LocalShardsContainer:
        shards = [_typed(s) for s in v._local_shards]
        t = make_wrapper_subclass(LocalShardsContainer, shards[0].size(), dtype=shards[0].dtype)
        LocalShardsContainer.__init__(t, shards)
        return t
    return v


def _inside(target: Any, saved_shape: tuple) -> Any:
    """The part of the ``allow_shape_mismatch`` ShardedTensor ``target`` that lies inside a
    tensor saved as ``saved_shape``: a ShardedTensor of that global shape whose data is a
    view of the target's (zero-filled first, as Megatron's load does), or None when the
    target lies wholly outside (it stays zeros)."""
    import dataclasses

    import torch

    if target.data is None:
        target.init_data("cpu", torch.zeros)
    else:
        target.data = target.data.detach()
        target.data.zero_()
    view = target.data
    for d, (offset, size) in enumerate(zip(target.global_offset, saved_shape, strict=True)):
        if d < target.prepend_axis_num:  # an axis of length 1 that the data does not have
            if offset >= size:
                return None
            continue
        keep = min(view.shape[d - target.prepend_axis_num], size - offset)
        if keep <= 0:
            return None
        view = view.narrow(d - target.prepend_axis_num, 0, keep)
    return dataclasses.replace(target, data=view, local_shape=tuple(view.shape), global_shape=saved_shape,
                               axis_fragmentations=None)


def _strategy_bases():
    return _megatron()[5]


class MegatronItems:
    """What Megatron's ``MCoreSavePlanner`` (megatron-core 0.19) does beyond DCP's
    ``DefaultSavePlanner``, put before whichever of cloudckpt's save planners a save uses
    (``RankWriter.write``'s ``flavour``): the keys as they are (``flatten_state_dict`` and
    ``flatten_sharded_tensors`` off, so ``.metadata`` holds no planner data) and each
    ``io.BytesIO`` value (a ``ShardedObject``, ``torch.save``'d by
    ``mcore_to_pyt_state_dict``) written as its bytes. Nothing else: in 0.19 its global
    plan and Metadata are DefaultSavePlanner's (no ``mcore_data``, no flattened ranges:
    Megatron refuses ``flattened_range``), and replicas are dropped before planning
    (``keep_only_main_replica``) or deduplicated by the planner, one writer a chunk."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.flatten_state_dict = self.flatten_sharded_tensors = False
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def transform_object(self, write_item: Any, object: Any) -> Any:
        return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)


def _save_pyt(ckpt: Checkpointer, url: str, number: int, pyt_state_dict: dict, config: dict, *,
              ephemeral: bool) -> None:
    """Save the DCP state dict ``pyt_state_dict`` (Megatron's translation, or Megatron's
    items as ``megatron_folders`` read them) as the step ``url`` with cloudckpt's planners
    and :class:`MegatronItems`, rank 0 adding Megatron's ``metadata.json`` (``config``) to
    ``model_and_optim/``, all inside cloudckpt's commit protocol (the marker last).
    Collective."""
    from ..checkpoint import layout, saving
    from ..checkpoint.entries import ObjectEntry
    from ..checkpoint.rank_writer import RankResult
    from ..transfer import TransferEngine, crc32c_file

    def produce(ref, work):
        t0 = time.monotonic()
        res = ckpt._writer.write(ref, work, pyt_state_dict, None, flavour=MegatronItems)
        if ckpt.coord.rank != 0:
            return res
        try:  # rank 0: Megatron's metadata.json, one more object of the step (in the manifest)
            entries = list(res.result().objects)
            rel = f"{layout.MODEL_DIR}/{CONFIG_NAME}"
            path = os.path.join(work, rel)
            with open(path, "w") as f:
                json.dump(config, f)
            done = TransferEngine.wait_all([ckpt.engine.submit_upload(path, ref.url_of(rel),
                                                                      crc32c=crc32c_file(path))])[0]
            entries.append(ObjectEntry(rel, done.size, done.crc32c))
        except BaseException as e:  # noqa: BLE001 - carried to every rank by AGREE
            return RankResult([], t0, e)
        return RankResult(entries, t0, None, res.committed)  # what the writer keeps once committed, kept

    step = ckpt._step(url, number, named=True)
    ckpt._commit(saving.save(ckpt.coord, ckpt.engine, ckpt.options, step, produce, ephemeral=ephemeral))


def _save_strategy_class():
    mtorch = _strategy_bases()
    core = _megatron()[0]

    class CloudSaveStrategy(mtorch.TorchDistSaveShardedStrategy):
        """Megatron's ``torch_dist`` save strategy writing through cloudckpt (module docstring).

        Args:
            checkpointer: the cloudckpt Checkpointer to save with (None: one made from
                ``settings`` at the first save, kept for the next ones, closed by :meth:`close`).
            step: the step number, for a folder not named ``step{N}`` / ``iter_{N}``.
            ephemeral: mark the steps ephemeral.
            keep_only_main_replica: as Megatron's: only main replicas are planned (False:
                every replica is, and the planning picks one writer for each chunk).
            **settings: ``CheckpointerOptions`` fields (``work_dir=…``) for the Checkpointer made here.
        """

        def __init__(self, checkpointer: Checkpointer | None = None, *, step: int | None = None,
                     ephemeral: bool = False, keep_only_main_replica: bool = True, backend: str = "torch_dist",
                     version: int = 1, **settings: Any):
            super().__init__(backend, version, keep_only_main_replica=keep_only_main_replica)
            self.checkpointer, self._own = checkpointer, checkpointer is None
            self.settings, self.step, self.ephemeral = settings, step, ephemeral

        def _ckpt(self) -> Checkpointer:
            if self.checkpointer is None:
                self.checkpointer = Checkpointer(**self.settings)
            return self.checkpointer

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            """Translate (Megatron's own steps) and save the step ``checkpoint_dir`` (a URL or
            a folder) with cloudckpt's commit protocol. Collective. Raises as
            ``Checkpointer.save`` (CheckpointExists, SaveFailed naming each rank's error …)."""
            ckpt, url = self._ckpt(), str(checkpoint_dir)
            number = step_number(url, self.step)

            def translate():
                sd, _, _ = mtorch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                             self.keep_only_main_replica)
                return mtorch.mcore_to_pyt_state_dict(sd, False)

            pyt_state_dict = _every_rank(ckpt, "megatron translate", translate)
            config = core.CheckpointingConfig(self.backend, self.version)
            _save_pyt(ckpt, url, number, pyt_state_dict, dict(config.__dict__), ephemeral=self.ephemeral)

        def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "nvrx"):
            raise ConfigError("CloudSaveStrategy does not save asynchronously yet (async_sharded_save=True); "
                              "save synchronously, or use cloudckpt's Checkpointer.save_async")

        def can_handle_sharded_objects(self) -> bool:
            return True

        def close(self) -> None:
            """Close the Checkpointer made here (not one that was passed in)."""
            if self._own and self.checkpointer is not None:
                self.checkpointer.close()
                self.checkpointer = None

    return CloudSaveStrategy


def _load_strategy_class():
    mtorch = _strategy_bases()
    _, mapping, _, _, _, _ = _megatron()
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from ..checkpoint import loading
    from ..checkpoint.committed import CommittedStep
    from ..checkpoint.loading import LoadRequest

    class CloudLoadStrategy(mtorch.TorchDistLoadShardedStrategy):
        """Megatron's ``torch_dist`` load strategy reading a committed cloudckpt step (a URL
        or a folder) through cloudckpt's loader. ``checkpointer``/``settings``: as for
        :class:`CloudSaveStrategy`."""

        def __init__(self, checkpointer: Checkpointer | None = None, **settings: Any):
            super().__init__()
            self.checkpointer, self._own, self.settings = checkpointer, checkpointer is None, settings

        def _ckpt(self) -> Checkpointer:
            if self.checkpointer is None:
                self.checkpointer = Checkpointer(**self.settings)
            return self.checkpointer

        def load(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "mcore"):
            """Load ``sharded_state_dict``'s tensors and objects from the step. Collective."""
            return self._load(sharded_state_dict, checkpoint_dir, common=False)[0]

        def _load(self, sharded_state_dict, checkpoint_dir, *, common: bool) -> tuple[dict, Any]:
            """Megatron's ``TorchDistLoadShardedStrategy.load`` with cloudckpt's read; with
            ``common`` the common state is read in the same load. Returns (the loaded state
            dict, the common state or None)."""
            ckpt = self._ckpt()
            common_key = mapping.ShardedObject(COMMON_KEY, None, (1,), (0,)).unique_key

            ckpt._async.wait()
            committed = self._open(checkpoint_dir)
            shapes = committed.shapes().state_dict_metadata
            padded: dict = {}  # sharded key -> (the targets, their parts inside the saved shape)

            def translate():
                checked = [t for t in nested_values(sharded_state_dict) if isinstance(t, mapping.ShardedTensor)]
                sd, flat, renamed = mtorch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
                for k, shards in list(sd.items()):
                    first = shards[0]
                    if isinstance(first, mapping.ShardedTensor) and first.allow_shape_mismatch and k in shapes \
                            and tuple(shapes[k].size) != tuple(first.global_shape):
                        inside = [_inside(t, tuple(shapes[k].size)) for t in shards]
                        padded[k] = (shards, inside)
                        sd[k] = [t for t in inside if t is not None]
                        if not sd[k]:
                            del sd[k]
                pyt = {k: _typed(v) for k, v in mtorch.mcore_to_pyt_state_dict(sd, True).items()}
                if common and common_key not in pyt:  # the state dict may ask for it too (load_sharded_metadata's)
                    pyt[common_key] = io.BytesIO()
                return pyt, flat, renamed, checked

            pyt, flat, renamed, checked = _every_rank(ckpt, "megatron translate", translate)

            def shapes_match():  # Megatron's MCoreLoadPlanner._validate_global_shapes
                for t in checked:
                    if t.key in shapes and tuple(shapes[t.key].size) != tuple(t.global_shape) \
                            and not t.allow_shape_mismatch:  # those load the overlap, zeros elsewhere
                        raise mtorch.CheckpointingException(
                            f"{checkpoint_dir}: global shape mismatch for {t.key}: saved {tuple(shapes[t.key].size)}"
                            f", expected {tuple(t.global_shape)}")

            _every_rank(ckpt, "megatron shapes", shapes_match)
            # keys the target does not ask for stay behind (Megatron's strict handling ran before)
            try:
                # a tensor saved with another dtype is cast, as Megatron's own load does (logged, LoadInfo.cast)
                ckpt._load(committed, pyt, LoadRequest(load_trainer_state=False, allow_partial=True, cast_dtypes=True))
            except MissingKeys as e:  # as Megatron's load raises it (DCP's CheckpointException)
                raise _errors()["MegatronMissingKeys"](str(e)) from e
            found = None
            if common:
                found = (pyt[common_key] if common_key in renamed else pyt.pop(common_key))[0]
            state = {k: mtorch._unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()}
            for k, (shards, inside) in padded.items():  # each target whole: what was read, zeros around it
                read = iter(state.get(k, []))
                for part in inside:
                    if part is not None:
                        got = next(read)
                        if got is not part.data:
                            part.data.copy_(got)
                state[k] = [t.data for t in shards]
            state = mtorch._replace_sharded_keys_with_state_dict_keys(state, flat, renamed)
            mtorch._restore_dict_types(state, sharded_state_dict)
            return state, found

        def _open(self, checkpoint_dir):
            """The committed step (collective); MegatronNotACheckpoint when it is not one."""
            ckpt = self._ckpt()
            with _megatron_not_a_checkpoint(checkpoint_dir):
                return loading.open_step(ckpt.coord, ckpt.engine, ckpt.options, ckpt._step(str(checkpoint_dir)))

        def _shapes(self, checkpoint_dir):
            """DCP Metadata of every key of the step, from cloudckpt's index. Not collective."""
            ckpt = self._ckpt()
            with _megatron_not_a_checkpoint(checkpoint_dir):
                step = CommittedStep.open(ckpt._step(str(checkpoint_dir)), verify=ckpt.options.verify_checksums)
            return step.shapes()

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            """Every tensor of the step (key, global shape, dtype) as unsharded
            ShardedTensors without data, from cloudckpt's index. Not collective."""
            md = metadata or self._shapes(checkpoint_dir)
            return mtorch.TorchDistLoadShardedStrategy.load_tensors_metadata(self, checkpoint_dir, md) \
                if md is not None else {}

        def load_sharded_metadata(self, checkpoint_dir):
            """Megatron's ``load_sharded_metadata``: every tensor (as
            :meth:`load_tensors_metadata`) and every ``ShardedObject`` (without data, by its
            unique key) of the step, from cloudckpt's index. Not collective."""
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata

            md = self._shapes(checkpoint_dir)
            if md is None:
                return {}
            out = {}
            for key, item in md.state_dict_metadata.items():
                if isinstance(item, BytesStorageMetadata):
                    obj = mapping.ShardedObject.empty_from_unique_key(key)
                    out[obj.unique_key] = obj
            out.update(self.load_tensors_metadata(checkpoint_dir, md))
            return out

        def remove_sharded_tensors(self, checkpoint_dir, key_prefix):
            raise ConfigError(f"{checkpoint_dir}: a committed cloudckpt step is never rewritten in place "
                              "(remove_sharded_tensors); load it and save the state without those keys as a new step")

        def close(self) -> None:
            if self._own and self.checkpointer is not None:
                self.checkpointer.close()
                self.checkpointer = None

    return CloudLoadStrategy


_CLASSES: dict = {}


def __getattr__(name: str):
    """``CloudSaveStrategy``, ``CloudLoadStrategy`` and the errors ``MegatronCheckFailed``,
    ``MegatronNotACheckpoint``, ``MegatronMissingKeys``: built (Megatron imported) at first use."""
    if name in ("CloudSaveStrategy", "CloudLoadStrategy"):
        if name not in _CLASSES:
            _CLASSES[name] = _save_strategy_class() if name == "CloudSaveStrategy" else _load_strategy_class()
        return _CLASSES[name]
    if name in ("MegatronCheckFailed", "MegatronNotACheckpoint", "MegatronMissingKeys"):
        return _errors()[name]
    raise AttributeError(name)


# ================================================================ entry points
def save(sharded_state_dict: dict, url: str, *, step: int | None = None, ephemeral: bool = False,
         checkpointer: Checkpointer | None = None, validate_access_integrity: bool = True,
         content_metadata: dict | None = None, preprocess_common_before_consistancy_check: Any = None,
         keep_only_main_replica: bool = True, **settings: Any) -> None:
    """Megatron's ``dist_checkpointing.save(sharded_state_dict, url)`` with every byte
    through cloudckpt: ``url`` is the step folder (``s3://…``, ``gs://…`` or a local
    folder; named ``step{N}`` or ``iter_{N}``, or pass ``step``). Collective: call on
    every rank. ``checkpointer``: a cloudckpt Checkpointer to reuse across saves (None:
    one is made from ``settings``, ``CheckpointerOptions`` fields, and closed; one reused
    plans its saves after the first from that save's structure: no plan exchanged).
    ``keep_only_main_replica``: as ``TorchDistSaveShardedStrategy``'s (False: every
    replica is planned and one writer picked for each chunk).

    Raises (on every rank together): CollectiveError (Megatron's preparation failed on
    some rank, e.g. the sharding check), CheckpointExists (the step is committed),
    SaveFailed, ConfigError, storage errors."""
    _, mapping, _, state_dict_utils, _, _ = _megatron()
    import torch

    with _checkpointer(checkpointer, settings) as ckpt:
        strategy = _save_strategy_class()(ckpt, step=step, ephemeral=ephemeral,
                                          keep_only_main_replica=keep_only_main_replica)
        step_number(url, step)  # the same answer on every rank: no collective needed to refuse

        def prepare():
            if content_metadata is not None:
                sharded_state_dict["content_metadata"] = content_metadata
            sharded, common = state_dict_utils.save_preprocess(sharded_state_dict, validate_access_integrity,
                                                               preprocess_common_before_consistancy_check)
            sharded[COMMON_KEY] = mapping.ShardedObject(key=COMMON_KEY, data=common, global_shape=(1,),
                                                        global_offset=(0,), replica_id=torch.distributed.get_rank())
            return sharded

        strategy.save(_every_rank(ckpt, "megatron prepare", prepare), url)


def load(sharded_state_dict: dict, url: str, *, checkpointer: Checkpointer | None = None,
         validate_access_integrity: bool = True, strict: Any = "assume_ok_unexpected", **settings: Any) -> Any:
    """Megatron's ``dist_checkpointing.load(sharded_state_dict, url, strict=…)`` reading the
    committed cloudckpt step ``url`` through cloudckpt (resharding as DCP does).
    Collective. Returns the loaded state dict (the common state with the loaded tensors
    and objects merged in, factories merged back), as Megatron's does; with ``strict``
    ``RETURN_UNEXPECTED`` / ``RETURN_ALL`` (a ``StrictHandling`` or its value) also the
    sets of missing and unexpected keys, as Megatron's. ``strict`` is handled by
    Megatron's own ``validate_integrity_and_strict_load``, with the step's keys from
    cloudckpt's index (:func:`load_sharded_metadata`).

    Raises (on every rank together): MegatronNotACheckpoint (a NotACheckpoint and
    Megatron's ``CheckpointingException``), MegatronCheckFailed (a CollectiveError and a
    ``CheckpointingException``: Megatron's checks, ``RAISE_*`` strictness or a global
    shape mismatch failed on some rank), MegatronMissingKeys (a MissingKeys and DCP's
    ``CheckpointException``: with ``ASSUME_OK_UNEXPECTED``, a key that is not in the
    step), CollectiveError, CorruptCheckpoint, UnsafeCheckpoint (an object that is not
    plain data), storage errors."""
    from megatron.core.dist_checkpointing.dict_utils import merge

    _, mapping, serialization, state_dict_utils, validation, _ = _megatron()
    strict = validation.parse_strict_flag(strict)
    handling = validation.StrictHandling
    with _checkpointer(checkpointer, settings) as ckpt:
        strategy = _load_strategy_class()(ckpt)

        def prepare():
            sharded, nonpersistent, factories = state_dict_utils.load_preprocess(sharded_state_dict)
            sharded, _ = serialization.extract_sharded_base(sharded)
            return sharded, nonpersistent, factories

        sharded, nonpersistent, factories = _every_rank(ckpt, "megatron prepare", prepare)
        in_step = None
        if handling.requires_explicit_ckpt_mismatch_check(strict):  # the step's keys, from its index
            in_step = _every_rank(ckpt, "megatron step keys", lambda: {
                k: v for k, v in strategy.load_sharded_metadata(url).items() if v.key != COMMON_KEY})
        local_md = global_md = None
        if validate_access_integrity or handling.requires_global_app_metadata(strict):
            local_md, global_md = validation.determine_global_metadata(sharded)  # Megatron's gather

        def check():  # Megatron's checks, which may fail on some ranks only
            return validation.validate_integrity_and_strict_load(sharded, strict, validate_access_integrity,
                                                                 local_md, global_md, in_step)

        sharded, missing, unexpected = _every_rank(ckpt, "megatron check", check)
        loaded, common = strategy._load(sharded, url, common=True)
        merge(common, nonpersistent)
        merge(common, loaded)
        state = mapping.apply_factory_merges(common, factories)
        return (state, missing, unexpected) if handling.requires_returning_mismatch_keys(strict) else state


def _metadata(url: str, what: str, checkpointer: Checkpointer | None, settings: dict) -> dict:
    """The load strategy's ``what`` for ``url``, on this process alone (a Checkpointer
    made here is not distributed: no process group is made, no rank waits)."""
    with _checkpointer(checkpointer, {"distributed": False, **settings}) as ckpt:
        return getattr(_load_strategy_class()(ckpt), what)(url)


def load_tensors_metadata(url: str, *, checkpointer: Checkpointer | None = None, **settings: Any) -> dict:
    """Megatron's ``dist_checkpointing.load_tensors_metadata`` for the committed step
    ``url``: every tensor (key, global shape, dtype) as an unsharded ShardedTensor without
    data, from cloudckpt's index. One process, not collective. Raises
    MegatronNotACheckpoint, CorruptCheckpoint, storage errors."""
    return _metadata(url, "load_tensors_metadata", checkpointer, settings)


def load_sharded_metadata(url: str, *, checkpointer: Checkpointer | None = None, **settings: Any) -> dict:
    """Megatron's ``dist_checkpointing.load_sharded_metadata`` for the committed step
    ``url``: :func:`load_tensors_metadata` and every ``ShardedObject`` (without data,
    keyed by its unique key, the common state's included). One process, not collective;
    the result can be passed to :func:`load` as the state dict. Raises as
    :func:`load_tensors_metadata`."""
    return _metadata(url, "load_sharded_metadata", checkpointer, settings)


def import_folder(src: str, url: str, *, step: int | None = None, **settings: Any) -> str:
    """Commit the ``torch_dist`` folder ``src`` that Megatron's own
    ``dist_checkpointing.save`` wrote as the cloudckpt step ``url``: one process, every
    byte read as untrusted input, Megatron's ``metadata.json`` kept (so Megatron's loader
    reads a download of it). The importer is
    :func:`cloudckpt.integrations.megatron_folders.import_iteration`; this is it with the
    step number of :func:`step_number`. Not collective. Returns the step's URL. Raises as
    ``import_iteration`` (ConfigError, NotACheckpoint, UnsafeCheckpoint, CorruptCheckpoint,
    CheckpointExists, storage errors)."""
    from .megatron_folders import import_iteration

    return import_iteration(src, url, iteration=step_number(url, step), **settings).url


__all__ = ["SUPPORTED", "MegatronItems", "import_folder", "load", "load_sharded_metadata", "load_tensors_metadata",
           "save", "step_number"]
