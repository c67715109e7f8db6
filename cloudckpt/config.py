"""CheckpointConfig: the trainer-facing settings, validated, from kwargs, a dict,
a YAML file, and ``CLOUDCKPT_*`` environment overrides.

Precedence (stated once): defaults < the dict / YAML file you pass < environment
variables ``CLOUDCKPT_<FIELD>`` (e.g. ``CLOUDCKPT_SAVE_FOLDER``,
``CLOUDCKPT_ASYNC_SAVE=true``), so an operator can redirect a job without editing
its config. They apply however the config is built: ``from_dict``, ``from_yaml`` and
keyword arguments to the class alike (each applied variable is logged at INFO). Every
error names the field, the bad value and what is allowed.

Unknown ``CLOUDCKPT_*`` variables are an error too, with a did-you-mean: a misspelt
variable would otherwise be ignored while the job runs with the default. The few
``CLOUDCKPT_*`` variables that are not config fields (knobs of the test suite and
benchmarks) are listed in :data:`NON_CONFIG_ENV`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import tempfile
import types
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union, get_args, get_origin, get_type_hints

from .errors import ConfigError, InvalidURL
from .storage import StorageOptions
from .storage import url as urls
from .transfer import TransferConfig
from .units import GiB, KiB, MiB, TiB

_log = logging.getLogger(__name__)

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
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*(?:/s)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "ki": KiB, "kib": KiB, "mi": MiB, "mib": MiB, "gi": GiB, "gib": GiB, "ti": TiB, "tib": TiB}


def parse_size(value: Any, name: str) -> int:
    """``123``, ``"64MiB"``, ``"1.5GB"``, ``"200MB/s"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a size: use bytes (an integer) or a string like '64MiB'")
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}={value!r} is not a size: use bytes (an integer) or a string like '64MiB' "
                          "or '200MB/s'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_work_dir() -> str:
    """The local scratch folder every writer uses unless told otherwise: per user, in the
    system's temp folder (``$TMPDIR``), so two users of one machine never share it."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return os.path.join(tempfile.gettempdir(), f"cloudckpt-work-{uid}")


#: Flat names kept for dicts, YAML, environment variables and keyword arguments: each is
#: the field of the same name in ``storage`` (StorageOptions) or ``transfer`` (TransferConfig).
FLAT_STORAGE = ("endpoint_url", "profile", "region", "addressing_style", "part_size", "sign_payload",
                "connect_timeout", "read_timeout", "operation_timeout")
FLAT_TRANSFER = ("max_concurrency", "bandwidth_limit", "stall_timeout", "request_rate")
_NESTED = {"storage": (StorageOptions, FLAT_STORAGE), "transfer": (TransferConfig, FLAT_TRANSFER)}


@dataclass(frozen=True, init=False)
class CheckpointConfig:
    """Every field with its default. Intervals are in training steps.

    - ``save_folder``: where steps go: a local path, ``file://``, ``s3://bucket/prefix`` or
      ``gs://bucket/prefix`` (required).
    - ``work_dir``: local scratch for staging files before upload (default: :func:`default_work_dir`).
    - ``save_interval``: persistent checkpoint every N steps (None: never).
    - ``ephemeral_save_interval``: ephemeral checkpoint every N steps (None: never); a step due for both is persistent.
    - ``keep_last_ephemeral``: ephemeral checkpoints kept (>= 1).
    - ``max_checkpoints``: persistent checkpoints kept (None: all).
    - ``keep_every``: persistent steps divisible by this are never pruned (None: off).
    - ``async_save``: save in the background after a staging copy to host memory.
    - ``max_in_flight``: async saves in flight at most; a new save waits for the previous one.
    - ``save_overwrite``: allow replacing a committed step.
    - ``gc_grace_seconds``: uncommitted step folders and multipart uploads older than this are garbage-collected.
    - ``verify_checksums``: check CRC32C of what is loaded.
    - ``pre_download``: download needed files to work_dir before loading instead of streaming ranges.
    - ``exact_resume``: capture and restore RNG states (Python, NumPy, torch) in the train state.
    - ``sigterm``: on SIGTERM, ``"finish"`` the in-flight save (up to ``sigterm_timeout`` s) or ``"abandon"`` it.
    - ``local_dir``: the node-local tier's folder (``{node}`` is replaced by the node index); None: no local tier.
    - ``local_save_interval``: a local step every N steps (needs ``local_dir``); steps due for the bucket are written
      locally too and persisted from the local files.
    - ``keep_last_local``: complete local steps kept (>= 1).
    - ``replication_factor``: copies of each rank's part on distinct nodes, its own included (None: 2 when there are two
      nodes or more, else 1); ``replication_jump``: ranks per failure domain, a node or a rack (a multiple of
      ``LOCAL_WORLD_SIZE``; None: ``LOCAL_WORLD_SIZE``, else 1).
    - ``load_step``: ``resume()`` loads this committed step instead of the newest (None: the newest).
    - ``strict_resume``: a newest step that fails its checks stops ``resume()`` (CorruptCheckpoint) instead of
      being logged, recorded in ``CheckpointManager.skipped_steps`` and skipped for the previous committed step.
    - ``thread_count``: threads writing DCP files per rank; ``stale_lock_seconds``: a step's ``.lock`` older than
      this is taken over; ``collective_timeout`` (s): how long a rank waits for the others in a save/load step.
    - ``storage``: a :class:`~cloudckpt.storage.StorageOptions` (endpoint, credentials profile, region, part size,
      timeouts, ...). ``transfer``: a :class:`~cloudckpt.transfer.TransferConfig` (concurrency, byte budget,
      bandwidth limit, stall watchdog, retries).

    The flat names of the storage and transfer knobs users set most are accepted
    everywhere a field is (keyword arguments, dicts, YAML, ``CLOUDCKPT_*``) and read
    back as attributes: ``endpoint_url``, ``profile``, ``region``, ``addressing_style``,
    ``part_size`` (None: the backend's default, S3 64 MiB, GCS 16 MiB), ``sign_payload``,
    ``connect_timeout``, ``read_timeout``, ``operation_timeout`` go to ``storage``;
    ``max_concurrency``, ``bandwidth_limit`` (bytes/s or '200MB/s'), ``stall_timeout``
    (s), ``request_rate`` (requests/s per prefix for the whole job; None: the store's
    default, 0: no pacing) go to ``transfer``. A dict or YAML may also give ``storage:`` / ``transfer:``
    mappings of any of their fields.
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
    gc_grace_seconds: float = 3600.0
    verify_checksums: bool = True
    pre_download: bool = False
    exact_resume: bool = True
    sigterm: str = "finish"
    sigterm_timeout: float = 120.0
    load_step: Optional[int] = None
    strict_resume: bool = False
    local_dir: Optional[str] = None
    local_save_interval: Optional[int] = None
    keep_last_local: int = 2
    replication_factor: Optional[int] = None
    replication_jump: Optional[int] = None
    thread_count: int = 2
    stale_lock_seconds: float = 600.0
    collective_timeout: float = 600.0
    storage: StorageOptions = field(default_factory=StorageOptions)
    transfer: TransferConfig = field(default_factory=TransferConfig)

    # ------------------------------------------------------------ construction
    def __init__(self, save_folder: Any = None, *, _env: Mapping[str, str] | None = None, **kw: Any) -> None:
        # CLOUDCKPT_* overrides apply however the config is built (keyword arguments
        # included); from_dict passes the variables it already applied as ``_env={}``.
        overrides = self._env_overrides(os.environ if _env is None else _env)
        if overrides:
            hints = _hints()
            for name, raw in overrides.items():
                value = _coerce(name, raw, hints[name])
                if name == "save_folder":
                    save_folder = value
                else:
                    kw[name] = value
            _log.info("checkpoint config: environment overrides %s",
                      ", ".join(f"{ENV_PREFIX}{n.upper()}" for n in sorted(overrides)))
        own = {f.name: f for f in fields(self)}
        flat = {k: kw.pop(k) for k in list(kw) if k in FLAT_STORAGE + FLAT_TRANSFER}
        unknown = sorted(set(kw) - set(own))
        if unknown:
            raise ConfigError(f"unknown checkpoint config field(s) {unknown}; allowed: {', '.join(self.field_names())}")
        if save_folder is None:
            raise ConfigError("checkpoint config needs save_folder (a local path, s3://bucket/prefix or gs://bucket/prefix)")
        for name, f in own.items():
            if name == "save_folder":
                v = save_folder
            elif name in kw:
                v = kw[name]
            else:
                v = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, name, v)
        for name, (cls, names) in _NESTED.items():
            part = getattr(self, name)
            if isinstance(part, Mapping):
                part = _build_nested(name, cls, part)
            elif not isinstance(part, cls):
                raise ConfigError(f"{name}={part!r} is not allowed: use a {cls.__name__} or a mapping of its fields")
            given = {k: flat[k] for k in names if k in flat}
            if given:
                part = _build_nested(name, cls, {**_fields_of(part), **given}, shown=lambda k: k)
            object.__setattr__(self, name, part)
        self._validate()

    def __getattr__(self, name: str) -> Any:  # the flat names, read back
        if name in FLAT_STORAGE:
            return getattr(self.storage, name)
        if name in FLAT_TRANSFER:
            return getattr(self.transfer, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        """Every name a dict, YAML file or ``CLOUDCKPT_*`` variable may set."""
        return [f.name for f in fields(cls)] + list(FLAT_STORAGE + FLAT_TRANSFER)

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
        hints = _hints()
        coerced = {k: v if k in _NESTED else _coerce(k, v, hints[k]) for k, v in values.items()}
        return cls(**coerced, _env={})

    @classmethod
    def from_yaml(cls, path: str, *, section: str | None = None,
                  env: Mapping[str, str] | None = None) -> "CheckpointConfig":
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
        names = [n for n in cls.field_names() if n not in _NESTED]
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
        """A copy with ``kw`` changed (flat storage/transfer names included)."""
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------ validation
    def _validate(self) -> None:
        hints = get_type_hints(type(self))
        for f in fields(self):
            if f.name in _NESTED:
                continue  # validated by their own classes
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
                f"save_folder={self.save_folder!r} is a bucket root: use a prefix such as "
                f"{self.save_folder.rstrip('/')}/run-1, "
                "so pruning and gc can never touch the rest of the bucket"
            )
        from .checkpoint.layout import step_of_name

        for part in (p.key.strip("/").split("/")):
            if step_of_name(part) is not None:
                raise ConfigError(
                    f"save_folder={self.save_folder!r} is inside a checkpoint step folder ({part}): "
                    "point save_folder at the run folder that holds the step folders"
                )
        for name in ("local_save_interval", "replication_factor", "replication_jump"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name}={v} is not allowed: use a positive integer, or None")
        if self.keep_last_local < 1:
            raise ConfigError(f"keep_last_local={self.keep_last_local} would delete the newest local step: use >= 1")
        if self.local_save_interval is not None and self.local_dir is None:
            raise ConfigError(f"local_save_interval={self.local_save_interval} needs local_dir (a node-local "
                              "folder such as /dev/shm/ckpt) to write local steps to")
        if self.local_dir is not None and "://" in self.local_dir:
            raise ConfigError(f"local_dir={self.local_dir!r} must be a node-local path (e.g. /dev/shm/ckpt), "
                              "not a URL: the bucket is save_folder")
        if self.load_step is not None and self.load_step < 0:
            raise ConfigError(f"load_step={self.load_step} is not allowed: use a step number >= 0, "
                              "or None for the newest")
        for name in ("save_interval", "ephemeral_save_interval", "max_checkpoints", "keep_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name}={v} is not allowed: use a positive integer, or None to turn it off")
        if self.max_checkpoints is not None and self.max_checkpoints < 1:
            raise ConfigError(f"max_checkpoints={self.max_checkpoints} would delete the newest checkpoint: "
                              "use >= 1 or None")
        if self.keep_last_ephemeral < 1:
            raise ConfigError(
                f"keep_last_ephemeral={self.keep_last_ephemeral} would delete the newest ephemeral checkpoint, "
                "which may be the newest checkpoint: use >= 1"
            )
        for name in ("max_in_flight", "max_concurrency", "thread_count"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} is not allowed: use a positive integer")
        for name in ("stall_timeout", "gc_grace_seconds", "sigterm_timeout", "stale_lock_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} is not allowed: use a non-negative number of seconds")
        if self.bandwidth_limit is not None and self.bandwidth_limit <= 0:
            raise ConfigError(f"bandwidth_limit={self.bandwidth_limit} is not allowed: use bytes per second > 0, "
                              "or None")
        if self.sigterm not in ("finish", "abandon"):
            raise ConfigError(f"sigterm={self.sigterm!r} is not allowed: use 'finish' or 'abandon'")
        if not self.collective_timeout > 0:
            raise ConfigError(f"collective_timeout={self.collective_timeout} is not allowed: "
                              "use a number of seconds > 0")

    # ------------------------------------------------------------ derived
    def storage_options(self) -> StorageOptions:
        """``self.storage`` (kept for callers of the flat form)."""
        return self.storage

    def transfer_config(self) -> TransferConfig:
        """``self.transfer`` (kept for callers of the flat form)."""
        return self.transfer

    def build(self):
        """The CheckpointManager for this config. Collective: call on every rank."""
        from .checkpoint.manager import CheckpointManager

        return CheckpointManager(self)


def _fields_of(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _build_nested(name: str, cls: type, values: Mapping[str, Any], shown=None) -> Any:
    """``cls(**values)`` with each value coerced to the field's type; errors name ``name.field``."""
    shown = shown or (lambda k: f"{name}.{k}")
    hints = get_type_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ConfigError(f"unknown {name} option(s) {[shown(k) for k in unknown]}; "
                          f"allowed: {', '.join(sorted(hints))}")
    try:
        return cls(**{k: _coerce(shown(k), v, hints[k]) for k, v in values.items()})
    except TypeError as e:
        raise ConfigError(f"{name}: {e}") from None


def _hints() -> dict[str, Any]:
    """Types of every name ``from_dict`` takes: the config's fields and the flat names."""
    out = dict(get_type_hints(StorageOptions))
    out.update(get_type_hints(TransferConfig))
    out.update(get_type_hints(CheckpointConfig))
    return out


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, value: Any, typ: Any, *, strict: bool = False) -> Any:
    """Coerce strings (env, YAML) to the field's type; reject wrong types with a clear error."""
    optional = get_origin(typ) in (Union, types.UnionType) and type(None) in get_args(typ)
    base = next((a for a in get_args(typ) if a is not type(None)), typ) if optional else typ
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"{name} must be set (got None)")
    if name.rsplit(".", 1)[-1] in ("part_size", "bandwidth_limit", "multipart_threshold", "max_bytes_in_flight"):
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
