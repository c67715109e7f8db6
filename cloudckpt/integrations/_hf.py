"""What the Hugging Face integrations (Trainer callback, Accelerate helper, HF export)
share: the train state section they write, unwrapping Accelerate's wrappers, the model
config as JSON, building the manager. Imports neither transformers nor accelerate."""

from __future__ import annotations

from typing import Any

from .. import CheckpointConfig, CheckpointManager
from ..errors import IncompatibleCheckpoint

#: top-level key of the per-rank train state that holds the integrations' section
HF_KEY = "hf"
FORMAT = 1  # of that section


def unwrap(obj: Any) -> Any:
    """The torch optimizer/scheduler inside Accelerate's ``AcceleratedOptimizer`` /
    ``AcceleratedScheduler`` (their state lives in the wrapped object)."""
    for attr in ("optimizer", "scheduler"):
        inner = getattr(obj, attr, None)
        if type(obj).__module__.startswith("accelerate.") and inner is not None:
            return inner
    return obj


def config_json(model: Any) -> str | None:
    """The model's ``PretrainedConfig`` as JSON, or None for a model without one."""
    config = getattr(model, "config", None)
    return config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else None


def build_manager(save_folder: str | None, config: CheckpointConfig | None, options: dict) -> CheckpointManager:
    if config is not None:
        if save_folder is not None or options:
            raise TypeError("pass either config=CheckpointConfig(...) or save_folder and options, not both")
        return config.build()
    if save_folder is None:
        raise TypeError("pass save_folder (a local path, s3://bucket/prefix or gs://bucket/prefix) or config=")
    return CheckpointConfig(save_folder=save_folder, **options).build()


def hf_section(train_state: Any, step_url: str) -> dict:
    """The ``hf`` section of a step's train state, checked for shape. Raises
    IncompatibleCheckpoint for a step not written by this integration."""
    section = train_state.get(HF_KEY) if isinstance(train_state, dict) else None
    if not isinstance(section, dict) or section.get("format") != FORMAT:
        raise IncompatibleCheckpoint(
            f"{step_url} was not saved by cloudckpt's Hugging Face integration (its train state has no {HF_KEY!r} "
            f"section of format {FORMAT}); load it with Checkpointer.load and an AppState instead")
    return section
