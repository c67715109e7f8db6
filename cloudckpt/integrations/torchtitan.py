"""torchtitan: its Trainer checkpoints to a bucket through cloudckpt.

One line in a torchtitan trainer config (torchtitan 0.3)::

    from cloudckpt.integrations.torchtitan import CloudCheckpointManager
    config.checkpoint = CloudCheckpointManager.Config(enable=True, folder="s3://bucket/run-7", interval=500)

``CloudCheckpointManager`` implements torchtitan's ``BaseCheckpointManager`` contract
(``load``, ``save``, ``maybe_wait_for_staging``, ``maybe_wait_for_saving``, ``close``)
and is built by the Trainer exactly as its own ``CheckpointManager`` is
(``config.checkpoint.build(dataloader=…, model_parts=…, optimizers=…, lr_schedulers=…,
states={"train_state": trainer}, sd_adapter=…, base_folder=dump_folder)``). It saves the
state dict torchtitan saves (model FQNs flattened at the top level, ``optimizer``,
``lr_scheduler``, ``dataloader``, ``train_state``) with cloudckpt's Checkpointer: each
save is a committed step with the marker written last, uploads are throttled and
retried, and resume picks the newest *committed* step.

Folder names: torchtitan writes ``{folder}/step-N/`` with DCP's files at its root;
this manager writes cloudckpt's layout, ``{folder}/step{N}/model_and_optim/`` (the
same DCP state dict, keys unchanged) plus the marker. ``import_torchtitan_step``
turns an existing torchtitan ``step-N`` folder into a committed ``step{N}``.

Options kept from torchtitan's ``CheckpointManager.Config``: ``folder`` (a URL, or a
path relative to ``dump_folder``), ``interval``, ``keep_latest_k`` (retention of
committed steps), ``load_step``, ``exclude_from_loading``, ``load_only``,
``enable_first_step_checkpoint``, ``last_save_model_only`` with ``export_dtype``,
``initial_load_path`` with ``initial_load_model_only`` (a cloudckpt step folder), and
``async_mode`` (``"async"`` and ``"async_with_pinned_mem"`` both mean cloudckpt's async
save: a staging copy to host memory, pinned when CUDA is present, then upload in the
background). Refused with ValueError: the Hugging Face safetensors options
(``last_save_in_hf``, ``initial_load_in_hf``): use ``cloudckpt.ops.export`` instead.
Added: ``work_dir`` and ``storage`` (cloudckpt's StorageOptions fields, e.g.
``{"endpoint_url": …}``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.components.checkpointer import CheckpointManager as _TitanManager

from .. import CheckpointConfig, Checkpointer
from ..checkpoint import layout
from ..errors import ConfigError, NotACheckpoint
from ..storage import StorageOptions
from ..storage import url as urls

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TORCHTITAN_STEP = "step-{step}"  # torchtitan's own step folder name


class CloudCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract on cloudckpt (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanManager.Config):
        work_dir: str | None = None
        """Local scratch folder for cloudckpt (default: its per-user temp folder)."""

        storage: dict[str, Any] = field(default_factory=dict)
        """cloudckpt StorageOptions fields for ``folder`` (endpoint_url, profile, …)."""

        def __post_init__(self) -> None:
            _TitanManager.Config.__post_init__(self)
            if self.last_save_in_hf or self.initial_load_in_hf:
                raise ValueError("CloudCheckpointManager does not read or write Hugging Face safetensors "
                                 "(last_save_in_hf / initial_load_in_hf): export a step with cloudckpt.ops.export "
                                 "or `cloudckpt export` instead")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list, optimizers: Any, lr_schedulers: Any,
                 states: dict[str, Any], sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        self.config = config
        self.folder = config.folder if not urls.is_plain_path(config.folder) or os.path.isabs(config.folder) \
            else os.path.join(base_folder, config.folder)
        self.states = dict(states)
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.states = {k: v for k, v in self.states.items() if v is not None}
        unknown = [k for k in config.exclude_from_loading if k not in self.states]
        if unknown:
            raise ValueError(f"checkpoint.exclude_from_loading names {unknown}, which are not saved "
                             f"(the saved keys are {sorted(self.states)})")
        self.manager = CheckpointConfig(
            save_folder=self.folder, work_dir=config.work_dir, save_interval=config.interval,
            max_checkpoints=config.keep_latest_k or None, async_save=config.async_mode != "disabled",
            storage=StorageOptions(**config.storage), exact_resume=False,
        ).build()
        self.checkpointer: Checkpointer = self.manager.checkpointer

    # ------------------------------------------------------------ state dicts
    def _state_dict(self, states: dict[str, Any]) -> dict[str, Any]:
        """torchtitan's layout: model FQNs at the top level beside the other states."""
        sd = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            sd.update(states[MODEL].state_dict())
        return sd

    def _after_load(self, sd: dict[str, Any]) -> None:
        # the model's tensors are flattened into sd: hand them back to the modules
        self.states[MODEL].load_state_dict(sd)

    # ------------------------------------------------------------ save
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        c = self.config
        if c.load_only or not (last_step or curr_step % c.interval == 0
                               or (curr_step == 1 and c.enable_first_step_checkpoint)):
            return False
        self.maybe_wait_for_saving()
        if last_step and c.last_save_model_only:
            dtype = _DTYPES[c.export_dtype]
            sd = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in self.states[MODEL].state_dict().items()}
            self.checkpointer.save(layout.step_dir(self.folder, curr_step), sd)  # final weights: synchronous
            return True
        result = self.manager.save(curr_step, self._state_dict(self.states))
        if c.async_mode != "disabled":
            self.save_future = result
        return True

    def _maybe_wait_for_staging(self) -> None:
        """cloudckpt's save_async returns once the staging copy is taken: nothing to wait for."""

    def _wait_for_saving(self) -> None:
        fut, self.save_future = self.save_future, None
        fut.result()

    # ------------------------------------------------------------ load
    def _load(self, step: int = -1) -> bool:
        """Resume from ``step`` (or the newest committed step of ``folder``); with no
        committed step, load ``initial_load_path`` if set; else a fresh start (False).
        Step 0 (torchtitan's seed checkpoint) loads the model only, as torchtitan does.
        Raises NotACheckpoint when ``step`` is given and not committed."""
        c = self.config
        if step == -1:
            step = self.checkpointer.coord.on_coordinator("discover", self._newest_step)
        if step == 0:
            return self._load_model_only(layout.step_dir(self.folder, 0))
        sd = self._state_dict(self.states)
        load = dict(load_trainer_state=False, exclude_from_loading=list(c.exclude_from_loading))
        if step != -1:
            self.manager.resume(sd, load_step=step, **load)
        elif not c.initial_load_path:
            return False
        elif c.initial_load_model_only:
            return self._load_model_only(c.initial_load_path)
        else:
            self.checkpointer.load(c.initial_load_path, sd, **load)
        self._after_load(sd)
        return True

    def _newest_step(self) -> int:
        try:
            latest = self.checkpointer.latest_checkpoint(self.folder, storage_options=self.checkpointer.storage_options)
            return layout.parse_step_dir(latest)
        except NotACheckpoint:
            return -1

    def _load_model_only(self, dir: str) -> bool:
        sd = self.states[MODEL].state_dict()
        self.checkpointer.load(dir, sd, load_trainer_state=False, allow_partial=True)
        self._after_load(sd)
        return True

    def _close(self) -> None:
        self.manager.close()


# ================================================================ import
def import_torchtitan_step(src: str, save_folder: str, *, step: int | None = None, work_dir: str | None = None,
                           storage_options: StorageOptions | None = None) -> str:
    """Write the torchtitan checkpoint folder ``src`` (a local ``step-N`` folder: DCP's
    ``.metadata`` and ``__R_K.distcp`` files) as the committed cloudckpt step
    ``{save_folder}/step{N}`` (``step`` defaults to N from the folder name), then load
    it back and compare every tensor and value with what was read. Returns the step's URL.

    ``src`` is read as untrusted input (allowlisted metadata unpickling, byte items
    with torch's weights-only loader); the whole state is held in memory once, as one
    rank. Raises ConfigError, a ValueError (``src`` is not a local torchtitan folder, or no
    step number), UnsafeCheckpoint / CorruptCheckpoint (refused or unreadable input),
    CheckpointExists (the step is already committed), storage errors."""
    local = urls.local_path(src)
    if local is None:
        raise ConfigError(f"import_torchtitan_step reads a local folder; download {src} first "
                         "(e.g. `aws s3 cp --recursive` or `gcloud storage cp -r`)")
    src = local
    if step is None:
        name = os.path.basename(os.path.normpath(src))
        if not (name.startswith("step-") and name[5:].isdigit()):
            raise ConfigError(f"{src}: not named step-N; pass step=")
        step = int(name[5:])
    sd = read_dcp_folder(src)
    dest = layout.step_dir(save_folder, step)
    with Checkpointer(work_dir=work_dir, storage_options=storage_options, distributed=False) as ck:
        ck.save(dest, sd)
        back = _empty_like(sd)
        ck.load(dest, back, load_trainer_state=False)
    bad = [k for k in sd if not _same(sd[k], back[k])]
    if bad:
        raise RuntimeError(f"{dest}: what was loaded back differs from {src} at {bad[:10]}")
    return dest


def read_dcp_folder(src: str) -> dict[str, Any]:
    """Every entry of the local DCP folder ``src`` as a plain state dict, read as
    untrusted input: ``.metadata`` unpickled with the allowlist and validated against
    the folder's files, every file read through the local backend (never through a
    symbolic link: a shard that is a link is refused, its target never opened), tensors
    assembled as export assembles them (dense CPU items of the chunk's dtype and size;
    what is allocated is bounded by the items' bytes), byte items unpickled by
    ``untrusted.load_plain``, and the planner data's paths checked before the flat keys
    are nested again. The user's own path ``src`` is resolved once, so a link above the
    folder keeps working. Raises ConfigError (no ``.metadata``: not a DCP folder),
    UnsafeCheckpoint / CorruptCheckpoint, storage errors."""
    from ..ops.export import read_dcp_state
    from ..storage import Location
    from ..untrusted import loads_metadata
    from ..untrusted.limits import read_metadata

    folder = Location.of(urls.resolve_local(src))
    prefix = folder.url.rstrip("/") + "/"
    files = {e.url[len(prefix):]: e.size for e in folder.store.list(prefix) if not e.is_prefix}
    listed = files.pop(".metadata", None)
    if listed is None:
        raise ConfigError(f"{src}: no DCP .metadata; not a torchtitan checkpoint folder")
    meta_url = prefix + ".metadata"
    md = loads_metadata(read_metadata(folder.store, meta_url, size=listed, described=sum(files.values())),
                        url=meta_url, files=files)
    return _unflatten(read_dcp_state(folder, md), md.planner_data, meta_url)


def _unflatten(sd: dict[str, Any], mapping: Any, url: str) -> dict[str, Any]:
    """DCP's flat keys (``optimizer.state.w.exp_avg``) back into nested dicts and lists,
    as saved (what DCP's ``unflatten_state_dict`` does), with the planner data's paths
    checked first: one per key, of strings (dict keys) and ints (list indices), and
    lists grown by at most ``len(sd) + 65536`` empty slots in all (a path may name
    index 10^10). A path that contradicts another is refused. Raises UnsafeCheckpoint."""
    from ..errors import UnsafeCheckpoint

    if mapping is None or (type(mapping) is dict and not mapping):
        return sd
    if type(mapping) is not dict:
        raise UnsafeCheckpoint(f"{url}: the planner data is a {type(mapping).__name__}, not DCP's map of key paths")
    room = [len(sd) + (1 << 16)]

    def bad(key: str, why: str) -> UnsafeCheckpoint:
        shown = key if len(key) <= 120 else key[:117] + "..."
        return UnsafeCheckpoint(f"{url}: the planner data's path for {shown!r} {why}; the checkpoint was tampered with")

    def slot(cur: Any, part: Any, key: str) -> None:
        if type(cur) is dict:
            if type(part) is not str:
                raise bad(key, "indexes a dict with a number")
            return
        if type(part) is not int:
            raise bad(key, "indexes a list with a string")
        grow = part + 1 - len(cur)
        if grow > 0:
            room[0] -= grow
            if room[0] < 0:
                raise bad(key, "names a list index far past every value saved")
            cur.extend([None] * grow)

    nested: dict[str, Any] = {}
    for key, value in sd.items():
        path = mapping.get(key)
        if type(path) is not tuple or not path or type(path[0]) is not str or not all(
                type(p) is str or (type(p) is int and p >= 0) for p in path):
            raise bad(key, "is missing or not a tuple of names and list indices")
        cur: Any = nested
        for part, after in zip(path, path[1:], strict=False):
            slot(cur, part, key)
            nxt = cur.get(part) if type(cur) is dict else cur[part]
            if nxt is None:
                nxt = {} if type(after) is str else []
                cur[part] = nxt
            elif type(nxt) not in (dict, list):
                raise bad(key, "runs through another saved value")
            cur = nxt
        slot(cur, path[-1], key)
        cur[path[-1]] = value
    return nested


def _empty_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _empty_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_empty_like(v) for v in tree]
    return None if dataclasses.is_dataclass(tree) else tree


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


__all__ = ["CloudCheckpointManager", "import_torchtitan_step", "read_dcp_folder"]
