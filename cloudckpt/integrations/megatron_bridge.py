"""Megatron-Bridge: a checkpoint manager for ``checkpoint.custom_manager_class`` on cloudckpt.

The change in a Megatron-Bridge config (Bridge 0.6)::

    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix
    register_allowed_target_prefix("cloudckpt")   # Bridge's allowlist of classes a config may name
    cfg.checkpoint.custom_manager_class = "cloudckpt.integrations.megatron_bridge.CloudCheckpointManager"
    cfg.checkpoint.save = cfg.checkpoint.load = "s3://bucket/run-7"     # or gs://…, or a folder

:class:`CloudCheckpointManager` implements Bridge's ``CheckpointManager`` protocol
(``training/checkpointing.py``): ``__init__(checkpoint_config)``, ``save(ctx,
callback_manager)``, ``load(ctx) -> (iteration, flops)``, ``finalize_async_saves(state,
blocking, terminate)``, called as Bridge's ``setup`` and ``train`` call them (``load`` once,
``finalize_async_saves(blocking=False)`` every iteration, ``save`` at each interval,
``finalize_async_saves(blocking=True, terminate=True)`` at the end). The state it saves
and restores is the one Bridge's own ``save_checkpoint`` builds (``generate_state_dict``
of the model, optimizer, scheduler, RNG and rerun state, with Bridge's ``TrainState``
and the FLOPs in the common state). :class:`BridgeCheckpoints` does the checkpoint work
and needs no Bridge:

- each save is a committed cloudckpt step ``{save}/iter_{N:07d}`` (Megatron's torch_dist
  folder in ``model_and_optim/``, cloudckpt's marker written last,
  ``cloudckpt.integrations.megatron``);
- the tracker ``{save}/latest_checkpointed_iteration.txt`` is rewritten only once an
  iteration is committed: a tool that reads it finds the newest committed iteration and
  never an uncommitted one;
- ``async_save``: Megatron's preparation (its sharding check, collective on the training
  group) and a host copy of every local shard run in ``save``; the rest (translation,
  write, upload, agreement, commit) runs on cloudckpt's background thread, on its own gloo
  group; ``finalize`` writes the tracker and applies retention for the saves that
  committed, and raises the error of one that failed (it was never committed);
- ``most_recent_k`` > 0 keeps that many persistent iterations; non-persistent
  ``global`` saves are ephemeral steps in ``non_persistent_global_ckpt_dir`` (default
  ``{save}/non_persistent``), ``max(1, most_recent_k)`` of them kept (2 when it is -1),
  as Bridge keeps them;
- ``latest`` (and ``load``) take the newest committed iteration of the persistent and
  non-persistent folders; the tracker never makes an uncommitted folder win.

Not supported (refused at ``__init__`` with a ConfigError): ``non_persistent_ckpt_type``
``"local"`` and ``"in_memory"``, ``ckpt_format`` other than ``torch_dist``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from concurrent.futures import Future
from typing import Any

from .. import Checkpointer, dist
from ..errors import ConfigError
from ..storage import Location
from ..storage import url as urls
from . import megatron_folders as folders

log = logging.getLogger(__name__)

NON_PERSISTENT_DIR = "non_persistent"  # Bridge's _NON_PERSISTENT_CKPT_SUBDIR
TRAIN_STATE_KEY = "train_state"  # Bridge's TrainState.state_dict(), in the common state


def _prepare(coord: Any, sharded_state_dict: dict) -> dict:
    """Megatron's preparation of a save (``dist_checkpointing.save``'s: factories applied,
    non-persistent values dropped, the sharding check, the common state as the
    ShardedObject ``common_state``), as the named collective step "megatron prepare" on
    ``coord``: a failure on any rank (the sharding check raises on rank 0 only) raises on
    every rank. Collective."""
    import torch
    from megatron.core.dist_checkpointing import mapping, state_dict_utils

    from .megatron import COMMON_KEY

    out: list = []

    def prepare() -> None:
        sharded, common = state_dict_utils.save_preprocess(sharded_state_dict, True, None)
        sharded[COMMON_KEY] = mapping.ShardedObject(key=COMMON_KEY, data=common, global_shape=(1,),
                                                    global_offset=(0,), replica_id=torch.distributed.get_rank())
        out.append(sharded)

    coord.all_ranks("megatron prepare", prepare)  # only the outcome travels
    return out[0]


def _stage(tree: Any) -> Any:
    """A host copy of a prepared Megatron state dict: every ShardedTensor's local data
    copied to the CPU, every ShardedObject's data and plain value deep-copied."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    if isinstance(tree, dict):
        return {k: _stage(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_stage(v) for v in tree]
    if isinstance(tree, ShardedTensor):
        return dataclasses.replace(tree, data=tree.data.detach().to("cpu", copy=True))
    if isinstance(tree, ShardedObject):
        return dataclasses.replace(tree, data=copy.deepcopy(tree.data))
    return copy.deepcopy(tree)


class BridgeCheckpoints:
    """Bridge's checkpoint folders on cloudckpt (see the module docstring).

    Args:
        save: the save folder (a URL or a path).
        load: the folder to resume from (default ``save``).
        non_persistent_dir: where non-persistent ``global`` saves go (default ``{save}/non_persistent``).
        most_recent_k: persistent iterations kept (-1: all).
        async_save: save in the background (module docstring).
        **settings: ``CheckpointerOptions`` fields (``work_dir=``, ``storage_options=``).
    """

    def __init__(self, save: str, *, load: str | None = None, non_persistent_dir: str | None = None,
                 most_recent_k: int = -1, async_save: bool = False, **settings: Any):
        self.save_dir, self.load_dir = save, load or save
        self.np_dir = non_persistent_dir or urls.join(save, NON_PERSISTENT_DIR)
        self.most_recent_k, self.async_save = most_recent_k, async_save
        self.np_keep = 2 if most_recent_k < 0 else max(1, most_recent_k)
        self.ckpt = Checkpointer(**settings)
        # the training thread's named steps: the Checkpointer's own group is the background thread's
        self.coord = dist.Coordinator(timeout=self.ckpt.options.collective_timeout)
        self._pending: list[tuple[int, bool, Future]] = []  # (iteration, non-persistent, its save)

    # ------------------------------------------------------------ save
    def save(self, iteration: int, sharded_state_dict: dict, *, non_persistent: bool = False) -> None:
        """Save ``sharded_state_dict`` (Megatron's, common state included) as iteration
        ``iteration``. Collective. Synchronous: committed, tracker written and retention
        applied on return. Async: returns once the host copy is taken (:meth:`finalize`).
        Raises (on every rank together) as ``integrations.megatron.save``; an earlier
        async save's failure."""
        from .megatron import _save_strategy_class

        url = urls.join(self.np_dir if non_persistent else self.save_dir, folders.iteration_name(iteration))
        strategy = _save_strategy_class()(self.ckpt, step=iteration, ephemeral=non_persistent)
        prepared = _prepare(self.coord, sharded_state_dict)
        if not self.async_save:
            strategy.save(prepared, url)
            self._committed(iteration, non_persistent)
            return
        staged = _stage(prepared)
        fut = self.ckpt._run_async(lambda _sd, _ts: strategy.save(staged, url), {}, None)
        self._pending.append((iteration, non_persistent, fut))

    def finalize(self, *, blocking: bool = False, terminate: bool = False) -> list[int]:
        """The async saves that ended since the last call: for each committed one (in
        order) the tracker is written and retention applied. ``blocking``: wait for every
        one first; ``terminate``: then close the Checkpointer. Returns the iterations
        finalized. Raises the error of an async save that failed (nothing of it committed)."""
        done = []
        try:
            while self._pending and (blocking or self._pending[0][2].done()):
                iteration, non_persistent, fut = self._pending.pop(0)
                fut.result()
                self._committed(iteration, non_persistent)
                done.append(iteration)
        finally:
            if terminate:
                self.close()
        return done

    def _committed(self, iteration: int, non_persistent: bool) -> None:
        """Rank 0, once ``iteration`` is committed: the tracker (persistent saves), then retention."""
        from ..checkpoint.retention import delete_step

        if self.ckpt.coord.rank != 0:
            return
        folder = self.np_dir if non_persistent else self.save_dir
        if not non_persistent:
            folders.write_tracker(folder, iteration, storage_options=self.ckpt.storage_options)
        keep = self.np_keep if non_persistent else self.most_recent_k
        if keep > 0:
            found = folders.find_iterations(folder, storage_options=self.ckpt.storage_options)
            for it in found[:-keep]:
                if it.kind == "cloudckpt" and it.iteration != iteration:
                    log.info("most_recent_k: deleting %s", it.url)
                    delete_step(Location.of(it.url, self.ckpt.storage_options))

    # ------------------------------------------------------------ load
    def latest(self) -> folders.Iteration | None:
        """The newest committed iteration of the load folder and the non-persistent one
        (cloudckpt steps only), or None."""
        found = []
        for folder in dict.fromkeys((self.load_dir, self.np_dir)):
            found += [i for i in folders.find_iterations(folder, storage_options=self.ckpt.storage_options)
                      if i.kind == "cloudckpt"]
        return max(found, key=lambda i: i.iteration, default=None)

    def load(self, sharded_state_dict: dict, iteration: folders.Iteration) -> dict:
        """Megatron's load of ``sharded_state_dict`` from the committed ``iteration``.
        Collective. Raises as ``integrations.megatron.load``."""
        from .megatron import load

        self.ckpt.wait()
        return load(sharded_state_dict, iteration.url, checkpointer=self.ckpt)

    def close(self) -> None:
        """Wait for async saves (raising the first failure), then close the Checkpointer."""
        self.ckpt.close()


class CloudCheckpointManager:
    """Bridge's ``CheckpointManager`` protocol on :class:`BridgeCheckpoints` (module docstring).
    Built by Bridge's ``create_checkpoint_manager(checkpoint_config)``. Raises ConfigError
    (a setting it does not support)."""

    def __init__(self, checkpoint_config: Any) -> None:
        c = checkpoint_config
        if c.non_persistent_ckpt_type not in (None, "global"):
            raise ConfigError(f"CloudCheckpointManager: non_persistent_ckpt_type={c.non_persistent_ckpt_type!r} is "
                              "not supported (use 'global': ephemeral steps in the bucket)")
        if getattr(c, "ckpt_format", "torch_dist") != "torch_dist":
            raise ConfigError(f"CloudCheckpointManager: ckpt_format={c.ckpt_format!r}; only torch_dist is supported")
        if c.save is None:
            raise ConfigError("CloudCheckpointManager needs checkpoint.save (a URL or a folder)")
        self.checkpoint_config = c
        self.checkpoints = BridgeCheckpoints(c.save, load=c.load, non_persistent_dir=c.non_persistent_global_ckpt_dir,
                                             most_recent_k=c.most_recent_k if c.most_recent_k is not None else -1,
                                             async_save=bool(c.async_save))

    def save(self, ctx: Any, callback_manager: Any = None) -> None:
        """Bridge's ``save_checkpoint`` state, saved through cloudckpt. Collective."""
        sd = self.state_dict(ctx, loading=False)
        sd[TRAIN_STATE_KEY] = ctx.state.train_state.state_dict()
        sd["num_floating_point_operations_so_far"] = int(ctx.num_floating_point_operations_so_far)
        self.checkpoints.save(ctx.state.train_state.step, sd, non_persistent=bool(ctx.non_persistent_ckpt))

    def load(self, ctx: Any) -> tuple[int, int]:
        """Restore the newest committed iteration into the context's model, optimizer,
        scheduler, RNG and train state. Returns ``(iteration, flops)``, ``(0, 0)`` with
        nothing to load. Collective."""
        it = self.checkpoints.latest()
        if it is None:
            return 0, 0
        state = self.checkpoints.load(self.state_dict(ctx, loading=True), it)
        self.restore(ctx, state)
        return it.iteration, int(state.get("num_floating_point_operations_so_far", 0))

    def finalize_async_saves(self, state: Any = None, blocking: bool = False, terminate: bool = False) -> None:
        """Finalize the async saves that ended (``blocking``: all): tracker, retention. Not collective."""
        self.checkpoints.finalize(blocking=blocking, terminate=terminate)

    # the two places Bridge's own code builds and restores the state (megatron-bridge needed)
    def state_dict(self, ctx: Any, *, loading: bool) -> dict:
        """The sharded state dict of the context, as Bridge's ``save_checkpoint`` builds it."""
        return _bridge_state_dict(ctx, self.checkpoint_config, loading=loading)

    def restore(self, ctx: Any, state: dict) -> None:
        """A loaded state put back into the context's model, optimizer, scheduler and train state."""
        _bridge_restore(ctx, self.checkpoint_config, state)


# ---------------------------------------------------------------- Bridge's own state (needs megatron-bridge)
def _bridge_state_dict(ctx: Any, cfg: Any, *, loading: bool) -> dict:
    """The sharded state dict Bridge's ``save_checkpoint`` builds (its own helpers)."""
    from megatron.bridge.training import checkpointing as bc
    from megatron.bridge.training.utils.pg_utils import get_pg_collection
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.utils import unwrap_model

    model = unwrap_model(ctx.model)
    pg = ctx.pg_collection or get_pg_collection(model)
    gcfg = ctx.state.cfg
    rng = bc.get_rng_state(data_parallel_random_init=gcfg.rng.data_parallel_random_init, ckpt_format=cfg.ckpt_format,
                           pg_collection=pg, module_name=ctx.module_name)
    rerun = get_rerun_state_machine().state_dict(data_iterator=getattr(ctx, "train_data_iterator", None),
                                                 ckpt_format=cfg.ckpt_format)
    meta = bc._build_sharded_state_dict_metadata(gcfg.optimizer.use_distributed_optimizer, cfg)
    meta["dp_cp_group"] = pg.dp_cp
    optim_kwargs = dict(metadata=meta, **({"is_loading": True} if loading else {}))
    return bc.generate_state_dict(cfg, model, ctx.optimizer, ctx.opt_param_scheduler, rng,
                                  iteration=ctx.state.train_state.step, optim_sd_kwargs=optim_kwargs,
                                  model_sd_kwargs=dict(metadata=meta), rerun_state=rerun, pg_collection=pg)


def _bridge_restore(ctx: Any, cfg: Any, state: dict) -> None:
    """Put a loaded state where Bridge's ``_load_checkpoint_from_path`` puts it."""
    from megatron.bridge.training import checkpointing as bc
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.utils import unwrap_model

    model = unwrap_model(ctx.model)
    if not ctx.skip_load_to_model_and_opt:
        if len(model) == 1:
            bc._load_model_state_dict(model[0], state["model"], ctx.strict)
        else:
            for i, m in enumerate(model):
                bc._load_model_state_dict(m, state[f"model{i}"], ctx.strict)
        if ctx.optimizer is not None and "optimizer" in state:
            ctx.optimizer.load_state_dict(state["optimizer"])
    if ctx.opt_param_scheduler is not None and "opt_param_scheduler" in state:
        ctx.opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    if "rerun_state_machine" in state:
        get_rerun_state_machine().load_state_dict(state["rerun_state_machine"])
    ctx.state.train_state.load_state_dict(state[TRAIN_STATE_KEY])


__all__ = ["BridgeCheckpoints", "CloudCheckpointManager"]
