"""Export a committed step as a Hugging Face model folder: ``model.safetensors`` plus
``config.json``, so ``AutoModelForCausalLM.from_pretrained(out_dir)`` (or the model's
own class) opens it.

    from cloudckpt.integrations.hf_export import export_hf
    export_hf("s3://bucket/run-7/step1000", "/models/run-7", dtype="bfloat16")

The weights are the tensors under the ``model`` key of the step (what ``AppState``,
the Trainer callback and the Accelerate helper save), streamed by
:func:`cloudckpt.ops.export.export_weights` (CRC32C-checked, one tensor in memory at a
time). The config is the one the integration saved with the step, or ``config=``.
Needs no transformers import unless ``config`` is a ``PretrainedConfig``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .. import Checkpointer
from ..errors import AlreadyExists, ConfigError, CorruptCheckpoint, IncompatibleCheckpoint
from ..ops.export import export_weights
from ..storage import StorageOptions
from ..storage import url as urls
from ..untrusted import loads_json
from ..untrusted.jsondoc import nesting_depth
from ._hf import HF_KEY

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # a model config with a 100k-entry label map is a few MiB
MAX_TRAINER_STATE_BYTES = 256 << 20  # the Trainer's log history of a long run
JSON_MAX_DEPTH = 32  # configs nest a few levels (text_config.rope_scaling)


def saved_json(text: Any, *, url: str, what: str, limit: int, non_finite: bool = False) -> dict:
    """A JSON object saved as text in a step's train state (the model config, the
    Trainer's state), parsed under untrusted.loads_json's bounds: at most ``limit``
    bytes, nesting at most JSON_MAX_DEPTH (measured before parsing), integers of at
    most 20 digits and finite numbers. ``non_finite``: NaN and Infinity are admitted
    (the Trainer logs a NaN loss as ``NaN``); the size and depth bounds still hold.
    Raises CorruptCheckpoint (over a bound, not JSON), IncompatibleCheckpoint (not
    text, or not a JSON object)."""
    if not isinstance(text, str):
        raise IncompatibleCheckpoint(f"{url}: the saved {what} is not JSON text")
    if len(text) > limit:  # a character is at least one byte: refused before encoding
        raise CorruptCheckpoint(f"{url}: the saved {what} is larger than {limit} bytes; refusing to parse it")
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate then fails as bad UTF-8 below
    if not non_finite:
        value = loads_json(data, url=url, what=f"saved {what}", limit=limit, max_depth=JSON_MAX_DEPTH)
    else:
        depth = nesting_depth(data)
        if len(data) > limit or depth > JSON_MAX_DEPTH:
            raise CorruptCheckpoint(f"{url}: the saved {what} is larger than {limit} bytes or nested {depth} levels "
                                    f"deep (at most {JSON_MAX_DEPTH}); refusing to parse it")
        try:
            value = json.loads(data)
        except (ValueError, RecursionError) as e:  # not JSON, bad UTF-8, an integer of over 4300 digits
            raise CorruptCheckpoint(f"{url}: the saved {what} is not valid JSON ({str(e)[:200]})") from None
    if type(value) is not dict:
        raise IncompatibleCheckpoint(f"{url}: the saved {what} is not a JSON object")
    return value


def _config_text(config: Any, step_url: str, storage_options: StorageOptions | None) -> str:
    """``config`` as JSON text: a ``PretrainedConfig``, a dict, a ``config.json`` path or
    a folder holding one; None: the config saved with the step."""
    if config is None:
        with Checkpointer(distributed=False, storage_options=storage_options) as ckpt:
            ts = ckpt.read_train_state(step_url)
        section = ts.get(HF_KEY) if isinstance(ts, dict) else None
        text = section.get("config") if isinstance(section, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{step_url} has no saved model config (it was not saved by cloudckpt's Hugging Face "
                              "integration): pass config= a PretrainedConfig, a dict or a config.json path")
    elif hasattr(config, "to_json_string"):
        text = config.to_json_string(use_diff=False)
    elif isinstance(config, dict):
        text = json.dumps(config)
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        path = os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read the model config {path}: {e}") from None
    else:
        raise ConfigError(f"config must be a PretrainedConfig, a dict or a path, got {type(config).__name__}")
    where = step_url if config is None else "config="
    try:
        value = saved_json(text, url=where, what="model config", limit=MAX_CONFIG_BYTES)
    except IncompatibleCheckpoint:
        value = None
    if value is None or not isinstance(value.get("model_type"), str):
        where = "the config saved with " + step_url if config is None else "config="
        raise IncompatibleCheckpoint(f"{where} is not a Hugging Face model config (a JSON object with 'model_type')")
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def export_hf(
    step_url: str,
    out_dir: str,
    *,
    config: Any = None,
    dtype: Any = None,
    key_prefix: str = "model",
    overwrite: bool = False,
    storage_options: StorageOptions | None = None,
    **export_options: Any,
) -> dict:
    """Write ``out_dir/model.safetensors`` (the tensors under ``key_prefix`` of the
    committed step ``step_url``, names without the prefix) and ``out_dir/config.json``.

    ``out_dir``: a local folder (created). ``config``: see :func:`_config_text`; the
    JSON is checked to be an object with a ``model_type``. ``dtype`` casts floating-point
    tensors and sets ``torch_dtype``/``dtype`` in the config. ``export_options`` go to
    :func:`~cloudckpt.ops.export.export_weights` (``transfer``, ``work_dir``,
    ``verify_checksums``, ``progress``).

    Returns export_weights' result plus ``"config"`` (the config path).

    Raises NotACheckpoint, CorruptCheckpoint, MissingKeys (nothing under ``key_prefix``),
    ConfigError (no config found or readable, bad ``dtype``), IncompatibleCheckpoint (the
    config is not a model config), AlreadyExists (``out_dir`` has a model or config and
    not ``overwrite``), storage errors.
    """
    local = urls.local_path(os.fspath(out_dir))
    if local is None:
        raise ConfigError(f"export_hf writes a local folder (from_pretrained reads one), got {out_dir}; "
                          "export locally, then upload the folder")
    out_dir = local
    weights, config_path = os.path.join(out_dir, WEIGHTS_NAME), os.path.join(out_dir, CONFIG_NAME)
    if not overwrite:
        for p in (weights, config_path):
            if os.path.exists(p):
                raise AlreadyExists(f"{p} already exists; pass overwrite=True (--force) to replace it", url=p)
    text = _config_text(config, step_url, storage_options)
    os.makedirs(out_dir, exist_ok=True)
    result = export_weights(step_url, weights, dtype=dtype, key_prefix=key_prefix, overwrite=overwrite,
                            storage_options=storage_options, **export_options)
    if result["dtype"] is not None:
        value = json.loads(text)
        name = str(result["dtype"]).removeprefix("torch.")
        value["torch_dtype"] = value["dtype"] = name
        text = json.dumps(value, indent=2, sort_keys=True) + "\n"
    tmp = config_path + ".part"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, config_path)
    return dict(result, config=config_path)
