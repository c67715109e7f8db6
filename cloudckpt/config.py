"""CheckpointConfig: the trainer-facing settings, validated, from kwargs, a dict,
a YAML file, and ``CLOUDCKPT_*`` environment overrides.

Precedence (stated once): defaults < the dict / YAML file you pass < environment
variables ``CLOUDCKPT_<FIELD>`` (e.g. ``CLOUDCKPT_SAVE_FOLDER``,
``CLOUDCKPT_ASYNC_SAVE=true``), so an operator can redirect a job without editing
its config (``from_dict`` / ``from_yaml`` apply them; keyword arguments to the class
are taken as given). Every error names the field, the bad value and what is allowed.

Unknown ``CLOUDCKPT_*`` variables are an error too, with a did-you-mean: a misspelt
variable would otherwise be ignored while the job runs with the default. The few
``CLOUDCKPT_*`` variables that are not config fields (knobs of the test suite and
benchmarks) are listed in :data:`NON_CONFIG_ENV`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union, get_args, get_origin, get_type_hints

from .errors import ConfigError, InvalidURL
from .storage import StorageOptions
from .storage import url as urls
from .transfer import TransferConfig

ENV_PREFIX = "CLOUDCKPT_"
#: ``CLOUDCKPT_*`` variables that are not config fields: knobs of the test suite and
#: benchmarks in this repository. Any other unknown ``CLOUDCKPT_*`` variable is an error.
NON_CONFIG_ENV = frozenset({
    "CLOUDCKPT_BENCH",  # bench/: set in benchmark child processes
    "CLOUDCKPT_FAULT_SEED",  # tests/faults: seed of the fault proxies
    "CLOUDCKPT_FUZZ_EXAMPLES",  # tests/security/test_fuzz.py: hypothesis examples
    "CLOUDCKPT_KEEP_SERVER_DIRS",  # cloudckpt.testing.servers: keep the emulators' data folders
    "CLOUDCKPT_KILL_SEED",  # tests/faults/test_kill.py
    "CLOUDCKPT_KILL_TRIALS",  # tests/faults/test_kill.py
})
_MiB = 1024 * 1024
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*(?:/s)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "ki": 1024, "kib": 1024, "mi": _MiB, "mib": _MiB, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4}


def parse_size(value: Any, name: str) -> int:
    """``123``, ``"64MiB"``, ``"1.5GB"``, ``"200MB/s"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a size: use bytes (an integer) or a string like '64MiB'")
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}={value!r} is not a size: use bytes (an integer) or a string like '64MiB' or '200MB/s'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class CheckpointConfig:
    """Every field with its default. Intervals are in training steps.

    - ``save_folder``: where steps go: a local path, ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix`` (required).
    - ``work_dir``: local scratch for staging files before upload (default: a per-run temp folder).
    - ``save_interval``: persistent checkpoint every N steps (None: never).
    - ``ephemeral_save_interval``: ephemeral checkpoint every N steps (None: never); a step due for both is persistent.
    - ``keep_last_ephemeral``: ephemeral checkpoints kept (>= 1).
    - ``max_checkpoints``: persistent checkpoints kept (None: all).
    - ``keep_every``: persistent steps divisible by this are never pruned (None: off).
    - ``async_save``: save in the background after a staging copy to host memory.
    - ``max_in_flight``: async saves in flight at most; a new save waits for the previous one.
    - ``save_overwrite``: allow replacing a committed step.
    - ``max_concurrency``, ``bandwidth_limit`` (bytes/s or '200MB/s'), ``part_size`` (None: the backend's
      default, S3 64 MiB, GCS 16 MiB), ``stall_timeout`` (s): transfer knobs.
    - ``endpoint_url``, ``profile``, ``region``, ``addressing_style``: storage options (None: the SDK's env/config chain).
    - ``connect_timeout``, ``read_timeout`` (s): one attempt's wait to connect / for the next bytes of an answer.
    - ``operation_timeout`` (s): one request's deadline over all the SDK's retries; a transfer that moved no new
      bytes for this long is not re-attempted either (StorageOptions says how they combine).
    - ``sign_payload``: S3 only: SHA-256 every request body into its SigV4 signature (off: CRC32C checks instead).
    - ``gc_grace_seconds``: uncommitted step folders and multipart uploads older than this are garbage-collected.
    - ``verify_checksums``: check CRC32C of what is loaded.
    - ``pre_download``: download needed files to work_dir before loading instead of streaming ranges.
    - ``exact_resume``: capture and restore RNG states (Python, NumPy, torch) in the train state.
    - ``sigterm``: on SIGTERM, ``"finish"`` the in-flight save (up to ``sigterm_timeout`` s) or ``"abandon"`` it.
    """

    save_folder: str
    work_dir: Optional[str] = None
    save_interval: Optional[int] = None
    ephemeral_save_interval: Optional[int] = None
    keep_last_ephemeral: int = 1
    max_checkpoints: Optional[int] = None
    keep_every: Optional[int] = None
    async_save: bool = False
    max_in_flight: int = 1
    save_overwrite: bool = False
    max_concurrency: int = 8
    bandwidth_limit: Optional[int] = None
    part_size: Optional[int] = None
    stall_timeout: float = 120.0
    endpoint_url: Optional[str] = None
    profile: Optional[str] = None
    region: Optional[str] = None
    addressing_style: Optional[str] = None
    sign_payload: bool = False
    connect_timeout: float = StorageOptions.connect_timeout  # the defaults are StorageOptions'
    read_timeout: float = StorageOptions.read_timeout
    operation_timeout: float = StorageOptions.operation_timeout
    gc_grace_seconds: float = 3600.0
    verify_checksums: bool = True
    pre_download: bool = False
    exact_resume: bool = True
    sigterm: str = "finish"
    sigterm_timeout: float = 120.0

    # ------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, env: Mapping[str, str] | None = None) -> "CheckpointConfig":
        """Build from a mapping (unknown keys are an error), then apply env overrides."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"checkpoint config must be a mapping of field names to values, got {type(d).__name__}")
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown checkpoint config field(s) {unknown}; allowed: {', '.join(cls.field_names())}")
        values = dict(d)
        values.update(cls._env_overrides(os.environ if env is None else env))
        if "save_folder" not in values:
            raise ConfigError("checkpoint config needs save_folder (a local path, s3://bucket/prefix or gs://bucket/prefix)")
        hints = get_type_hints(cls)
        coerced = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
        return cls(**coerced)

    @classmethod
    def from_yaml(cls, path: str, *, section: str | None = None, env: Mapping[str, str] | None = None) -> "CheckpointConfig":
        """Build from a YAML file (optionally one top-level ``section`` of it)."""
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read checkpoint config {path}: {e}") from None
        if section is not None:
            if not isinstance(data, dict) or section not in data:
                raise ConfigError(f"{path} has no section {section!r}")
            data = data[section]
        return cls.from_dict(data, env=env)

    @classmethod
    def _env_overrides(cls, env: Mapping[str, str]) -> dict[str, Any]:
        """``CLOUDCKPT_<FIELD>`` values by field name. Raises ConfigError naming every
        unknown ``CLOUDCKPT_*`` variable (not a field, not in NON_CONFIG_ENV)."""
        out, unknown = {}, []
        names = cls.field_names()
        for k, v in env.items():
            if k.startswith(ENV_PREFIX) and k not in NON_CONFIG_ENV:
                name = k[len(ENV_PREFIX):].lower()
                if name in names:
                    out[name] = v
                else:
                    unknown.append(k)
        if unknown:
            known = [ENV_PREFIX + n.upper() for n in names]
            hints = []
            for k in sorted(unknown):
                close = difflib.get_close_matches(k, known, n=1, cutoff=0.8)
                hints.append(f"{k} (did you mean {close[0]}?)" if close else k)
            raise ConfigError(f"unknown environment variable(s) {', '.join(hints)}: CLOUDCKPT_* variables override "
                              f"checkpoint config fields; known: {', '.join(known)}")
        return out

    def replace(self, **kw) -> "CheckpointConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------ validation
    def _validate(self) -> None:
        hints = get_type_hints(type(self))
        for f in fields(self):
            v = getattr(self, f.name)
            object.__setattr__(self, f.name, _coerce(f.name, v, hints[f.name], strict=True))
        try:
            p = urls.parse_url(self.save_folder)
        except InvalidURL as e:
            raise ConfigError(f"save_folder={self.save_folder!r} is not usable: {e}") from None
        from .storage import known_schemes

        if p.scheme not in known_schemes():
            raise ConfigError(
                f"save_folder={self.save_folder!r} has an unknown scheme {p.scheme + '://'!r}: use a local path, "
                "s3://bucket/prefix or gs://bucket/prefix"
            )
        if p.scheme != "file" and not p.key.strip("/"):
            raise ConfigError(
                f"save_folder={self.save_folder!r} is a bucket root: use a prefix such as {self.save_folder.rstrip('/')}/run-1, "
                "so pruning and gc can never touch the rest of the bucket"
            )
        from .checkpoint.layout import step_of_name

        for part in (p.key.strip("/").split("/")):
            if step_of_name(part) is not None:
                raise ConfigError(
                    f"save_folder={self.save_folder!r} is inside a checkpoint step folder ({part}): "
                    "point save_folder at the run folder that holds the step folders"
                )
        for name in ("save_interval", "ephemeral_save_interval", "max_checkpoints", "keep_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name}={v} is not allowed: use a positive integer, or None to turn it off")
        if self.max_checkpoints is not None and self.max_checkpoints < 1:
            raise ConfigError(f"max_checkpoints={self.max_checkpoints} would delete the newest checkpoint: use >= 1 or None")
        if self.keep_last_ephemeral < 1:
            raise ConfigError(
                f"keep_last_ephemeral={self.keep_last_ephemeral} would delete the newest ephemeral checkpoint, which may be the "
                "newest checkpoint: use >= 1"
            )
        for name in ("max_in_flight", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} is not allowed: use a positive integer")
        for name in ("stall_timeout", "gc_grace_seconds", "sigterm_timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} is not allowed: use a non-negative number of seconds")
        if self.bandwidth_limit is not None and self.bandwidth_limit <= 0:
            raise ConfigError(f"bandwidth_limit={self.bandwidth_limit} is not allowed: use bytes per second > 0, or None")
        if self.sigterm not in ("finish", "abandon"):
            raise ConfigError(f"sigterm={self.sigterm!r} is not allowed: use 'finish' or 'abandon'")
        self.storage_options()  # validates the storage fields
        self.transfer_config()

    # ------------------------------------------------------------ derived
    def storage_options(self) -> StorageOptions:
        return StorageOptions(endpoint_url=self.endpoint_url, profile=self.profile, region=self.region,
                              addressing_style=self.addressing_style, part_size=self.part_size,
                              sign_payload=self.sign_payload, connect_timeout=self.connect_timeout,
                              read_timeout=self.read_timeout, operation_timeout=self.operation_timeout)

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(max_concurrency=self.max_concurrency, bandwidth_limit=self.bandwidth_limit,
                              stall_timeout=self.stall_timeout)

    def build(self):
        """The CheckpointManager for this config. Collective: call on every rank."""
        from .checkpoint.manager import CheckpointManager

        return CheckpointManager(self)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, value: Any, typ: Any, *, strict: bool = False) -> Any:
    """Coerce strings (env, YAML) to the field's type; reject wrong types with a clear error."""
    optional = get_origin(typ) is Union and type(None) in get_args(typ)
    base = next((a for a in get_args(typ) if a is not type(None)), typ) if optional else typ
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"{name} must be set (got None)")
    if name in ("part_size", "bandwidth_limit"):
        return parse_size(value, name)
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{name}={value!r} is not a boolean: use true or false")
    if base is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{name}={value!r} is not an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={value!r} is not an integer") from None
    if base is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} is not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={value!r} is not a number") from None
    if base is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} is not a string")
        return value
    return value
