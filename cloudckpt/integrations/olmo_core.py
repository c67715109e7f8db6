"""OLMo-core: its Trainer checkpoints through cloudckpt.

One change in an OLMo-core (3.x) trainer config::

    from cloudckpt.integrations.olmo_core import CloudCheckpointerConfig
    trainer_config = TrainerConfig(save_folder="s3://bucket/run-7", ...,
                                   checkpointer=CloudCheckpointerConfig())

``TrainerConfig.build`` calls ``checkpointer.build(process_group=…, work_dir=…,
save_overwrite=…)`` and gets a :class:`CloudCheckpointer`: OLMo-core's ``Checkpointer``
(a subclass, so the Trainer and its ``CheckpointerCallback`` use it unchanged) whose
``save``, ``save_async``, ``load`` and discovery go through cloudckpt's Checkpointer:
every rank writes to its own work dir, uploads are throttled and retried, and
``.metadata.json`` is written last, by one rank, with a conditional create, after all
ranks agreed; async saves stage to host memory and upload in the background. The
layout is OLMo-core's (``step{N}/train/rank{R}.pt``, ``step{N}/model_and_optim/``),
so OLMo-core without this adapter still finds and loads these steps, and this
adapter resumes from steps OLMo-core wrote (unverified: they have no manifest).

Fields: OLMo-core's ``CheckpointerConfig`` (``work_dir``, ``save_overwrite``,
``pre_download``, ``save_thread_count``, ``load_thread_count``, ``throttle_uploads``;
cloudckpt always throttles by its transfer budget) plus ``storage``: cloudckpt
StorageOptions fields (``{"endpoint_url": …}``) for the save folder.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Generator, Optional, Tuple

from olmo_core.exceptions import OLMoConfigurationError
from olmo_core.train.checkpoint import Checkpointer as OlmoCheckpointer
from olmo_core.train.checkpoint import CheckpointerConfig

from .. import Checkpointer
from ..errors import NotACheckpoint
from ..storage import StorageOptions


@dataclass
class CloudCheckpointerConfig(CheckpointerConfig):
    """OLMo-core's ``CheckpointerConfig`` whose ``build`` returns a :class:`CloudCheckpointer`."""

    storage: Dict[str, Any] = field(default_factory=dict)

    def build(self, process_group=None, **kwargs) -> "CloudCheckpointer":
        kwargs = {**self.as_dict(exclude_none=True, recurse=False), **kwargs}
        work_dir = kwargs.pop("work_dir", None)
        if work_dir is None:
            raise OLMoConfigurationError("'work_dir' must be provided to build a Checkpointer")
        return CloudCheckpointer(work_dir=Path(work_dir), process_group=process_group, **kwargs)


@dataclass
class CloudCheckpointer(OlmoCheckpointer):
    """OLMo-core's Checkpointer interface on cloudckpt (see the module docstring)."""

    storage: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        self.cloud = Checkpointer(work_dir=str(self.work_dir), save_overwrite=self.save_overwrite,
                                  pre_download=self.pre_download, thread_count=self.save_thread_count or 2,
                                  storage_options=StorageOptions(**self.storage))

    def save(self, dir, train_module, train_state: Dict[str, Any], ephemeral: bool = False):
        """Save and commit ``dir`` (a ``step{N}`` folder). Collective."""
        self.cloud.save(str(dir), _state_to_save(train_module), train_state, ephemeral=ephemeral)

    def save_async(self, dir, train_module, train_state: Dict[str, Any], ephemeral: bool = False) -> Future:
        """Stage in host memory, then save and commit in the background; the Future
        completes when the step is committed (or holds the save's error). Collective."""
        return self.cloud.save_async(str(dir), _state_to_save(train_module), train_state, ephemeral=ephemeral)

    def load(self, dir, train_module, *, load_trainer_state: Optional[bool] = None,
             load_optim_state: Optional[bool] = None,
             reset_optimizer_states_on_load: Optional[bool] = None) -> Optional[Dict[str, Any]]:
        """Load the committed step ``dir`` into ``train_module`` (resharding as needed)
        and return this rank's train state. Collective. Train modules that save and load
        themselves (``load_state_dict_direct``) are refused, as is resetting optimizer
        moments (both are OLMo-core's own DCP paths)."""
        if hasattr(train_module, "load_state_dict_direct") or reset_optimizer_states_on_load:
            raise OLMoConfigurationError(f"{type(train_module).__name__} with CloudCheckpointer: train modules that "
                                         "load themselves, and reset_optimizer_states_on_load, need OLMo-core's "
                                         "own CheckpointerConfig")
        sd, train_state = self.cloud.load_with(
            str(dir), lambda metadata: train_module.state_dict_to_load(metadata, optim=load_optim_state),
            load_optim_state=load_optim_state, load_trainer_state=load_trainer_state)
        train_module.load_state_dict(sd)
        return train_state

    # discovery: committed steps only (the marker decides), OLMo-core's and ours
    @classmethod
    def dir_is_checkpoint(cls, dir) -> bool:
        return Checkpointer.dir_is_checkpoint(str(dir))

    @classmethod
    def find_checkpoints(cls, dir, ephemeral: Optional[bool] = None) -> Generator[Tuple[int, str], None, None]:
        try:
            yield from Checkpointer.find_checkpoints(str(dir), ephemeral)
        except NotACheckpoint as e:  # OLMo-core's callers expect FileNotFoundError for a missing folder
            raise FileNotFoundError(str(e)) from None

    @classmethod
    def latest_checkpoint(cls, dir) -> str:
        return Checkpointer.latest_checkpoint(str(dir))  # NotACheckpoint is a FileNotFoundError


def _state_to_save(train_module) -> dict:
    if hasattr(train_module, "save_state_dict_direct"):
        raise OLMoConfigurationError(f"{type(train_module).__name__} saves itself (save_state_dict_direct): use "
                                     "OLMo-core's own CheckpointerConfig for it")
    return train_module.state_dict_to_save()


__all__ = ["CloudCheckpointer", "CloudCheckpointerConfig"]
