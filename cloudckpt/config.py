"""CheckpointConfig: the trainer-facing settings, validated, from kwargs, a dict,
a YAML file, and ``CLOUDCKPT_*`` environment overrides; its groups (``LocalTierConfig``,
``RetentionConfig``, ``ShutdownConfig``, with ``StorageOptions`` and ``TransferConfig``);
and ``CheckpointerOptions``, the one object a ``Checkpointer`` takes.

Each class checks every field with its table of rules (``cloudckpt.rules``) when it is
made; strings from YAML and the environment are converted to the field's type first.

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

from . import rules
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


# ---------------------------------------------------------------- the groups
@dataclass(frozen=True)
class LocalTierConfig:
    """The node-local tier (docs/local-tier.md): ``CheckpointConfig.local``.

    Attributes:
        local_dir: the tier's folder on each node, e.g. ``/dev/shm/ckpt`` (``{node}`` is
            replaced by the node index); None: no local tier.
        local_save_interval: a local step every N steps (needs ``local_dir``); steps due
            for the bucket are written locally too and persisted from the local files.
        keep_last_local: complete local steps kept (>= 1).
        replication_factor: copies of each rank's part on distinct nodes, its own included
            (None: 2 when there are two nodes or more, else 1).
        replication_jump: ranks per failure domain, a node or a rack (a multiple of
            ``LOCAL_WORLD_SIZE``; None: ``LOCAL_WORLD_SIZE``, else 1).
    """

    local_dir: Optional[str] = None
    local_save_interval: Optional[int] = None
    keep_last_local: int = 2
    replication_factor: Optional[int] = None
    replication_jump: Optional[int] = None

    def __post_init__(self) -> None:
        rules.check("local tier option ", self, LOCAL_RULES)
        if self.local_save_interval is not None and self.local_dir is None:
            raise ConfigError(f"local_save_interval={self.local_save_interval} needs local_dir (a node-local "
                              "folder such as /dev/shm/ckpt) to write local steps to")


@dataclass(frozen=True)
class RetentionConfig:
    """What the manager keeps and garbage-collects after each save: ``CheckpointConfig.retention``.

    Attributes:
        keep_last_ephemeral: ephemeral checkpoints kept (>= 1).
        max_checkpoints: persistent checkpoints kept (>= 1; None: all).
        keep_every: persistent steps divisible by this are never pruned (None: off).
        gc_grace_seconds: uncommitted step folders and multipart uploads older than this
            are garbage-collected.
    """

    keep_last_ephemeral: int = 1
    max_checkpoints: Optional[int] = None
    keep_every: Optional[int] = None
    gc_grace_seconds: float = 3600.0

    def __post_init__(self) -> None:
        rules.check("retention option ", self, RETENTION_RULES)


@dataclass(frozen=True)
class ShutdownConfig:
    """What the manager does on SIGTERM: ``CheckpointConfig.shutdown``.

    Attributes:
        sigterm: ``"finish"`` the in-flight saves (up to ``sigterm_timeout`` seconds) or
            ``"abandon"`` them; either way the process then exits with the signal.
        sigterm_timeout: seconds to wait for in-flight saves with ``"finish"``.
    """

    sigterm: str = "finish"
    sigterm_timeout: float = 120.0

    def __post_init__(self) -> None:
        rules.check("shutdown option ", self, SHUTDOWN_RULES)


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every setting of a :class:`~cloudckpt.Checkpointer`, in one object.

    ``Checkpointer(options)`` takes it; ``Checkpointer(work_dir=..., ...)`` builds one
    from the same names; ``CheckpointConfig.checkpointer_options()`` builds one from a
    config (its fields of the same names, ``storage_options`` from ``storage``).

    Attributes:
        work_dir: local scratch: each rank writes its files into a private (0700) folder
            here before upload (None: :func:`default_work_dir`).
        save_overwrite: allow replacing a committed step.
        storage_options: endpoint, credentials profile, region, part size, timeouts
            (:class:`~cloudckpt.storage.StorageOptions`; None: the defaults).
        transfer: concurrency, byte budget, bandwidth limit, stall watchdog, retries
            (:class:`~cloudckpt.transfer.TransferConfig`; None: the defaults).
        verify_checksums: check the CRC32C of everything loaded.
        pre_download: download each rank's items to ``work_dir`` before putting them in
            place instead of streaming ranges (``load(pre_download=)`` decides per call).
        load_exchange: a load on several ranks reads each stored byte range from the
            bucket once and passes it to the other ranks that need it (the read-once
            exchange); False: every rank reads everything it needs from the bucket.
        thread_count: threads writing DCP files per rank.
        stale_lock_seconds: a step's ``.lock`` older than this is taken over.
        collective_timeout: seconds a rank waits for the others in a save's or load's
            collective steps.
        max_in_flight: async saves staged or running at most; a new save waits.
    """

    work_dir: Optional[str] = None
    save_overwrite: bool = False
    storage_options: Optional[StorageOptions] = None
    transfer: Optional[TransferConfig] = None
    verify_checksums: bool = True
    pre_download: bool = False
    load_exchange: bool = True
    thread_count: int = 2
    stale_lock_seconds: float = 600.0
    collective_timeout: float = 600.0
    max_in_flight: int = 1

    def __post_init__(self) -> None:
        work_dir = default_work_dir() if self.work_dir is None else self.work_dir
        object.__setattr__(self, "work_dir", os.fspath(work_dir) if isinstance(work_dir, os.PathLike) else work_dir)
        object.__setattr__(self, "storage_options", self.storage_options or StorageOptions())
        object.__setattr__(self, "transfer", self.transfer or TransferConfig())
        rules.check("checkpointer option ", self, CHECKPOINTER_RULES)


def _local_path(v: str) -> bool:
    return "://" not in v


LOCAL_RULES: dict[str, rules.Rule] = {
    "local_dir": rules.text(none="for no local tier", ok=_local_path,
                            allowed="use a node-local path such as /dev/shm/ckpt, not a URL (the bucket is "
                                    "save_folder)"),
    "local_save_interval": rules.integer(1, none="for no local steps"),
    "keep_last_local": rules.integer(1, why=" (0 would delete the newest local step)"),
    "replication_factor": rules.integer(1, none="for 2 with two nodes or more, else 1"),
    "replication_jump": rules.integer(1, none="for LOCAL_WORLD_SIZE"),
}
RETENTION_RULES: dict[str, rules.Rule] = {
    "keep_last_ephemeral": rules.integer(1, why=" (0 would delete the newest ephemeral checkpoint, which may be "
                                                "the newest checkpoint)"),
    "max_checkpoints": rules.integer(1, why=" (0 would delete the newest checkpoint)", none="to keep all"),
    "keep_every": rules.integer(1, none="to turn it off"),
    "gc_grace_seconds": rules.number(0, finite=False),
}
SHUTDOWN_RULES: dict[str, rules.Rule] = {
    "sigterm": rules.choice("finish", "abandon"),
    "sigterm_timeout": rules.number(0),
}
CHECKPOINTER_RULES: dict[str, rules.Rule] = {
    "work_dir": rules.text(allowed="use a local folder path"),
    "save_overwrite": rules.boolean(),
    "storage_options": rules.instance(StorageOptions),
    "transfer": rules.instance(TransferConfig),
    "verify_checksums": rules.boolean(),
    "pre_download": rules.boolean(),
    "load_exchange": rules.boolean(),
    "thread_count": rules.integer(1),
    "stale_lock_seconds": rules.number(0, finite=False),
    "collective_timeout": rules.number(0, strict=True),
    "max_in_flight": rules.integer(1),
}

#: Flat names kept for dicts, YAML, environment variables and keyword arguments: each is
#: the field of the same name in one group. storage and transfer have more fields than
#: flat names (the rest: a mapping or the object); every field of the other groups is one.
FLAT_STORAGE = ("endpoint_url", "profile", "region", "addressing_style", "part_size", "sign_payload",
                "connect_timeout", "read_timeout", "operation_timeout")
FLAT_TRANSFER = ("max_concurrency", "bandwidth_limit", "stall_timeout", "request_rate")
GROUPS: dict[str, tuple[type, tuple[str, ...]]] = {
    "storage": (StorageOptions, FLAT_STORAGE),
    "transfer": (TransferConfig, FLAT_TRANSFER),
    "local": (LocalTierConfig, tuple(f.name for f in fields(LocalTierConfig))),
    "retention": (RetentionConfig, tuple(f.name for f in fields(RetentionConfig))),
    "shutdown": (ShutdownConfig, tuple(f.name for f in fields(ShutdownConfig))),
}
_FLAT = {flat: group for group, (_, names) in GROUPS.items() for flat in names}  # flat name -> its group


@dataclass(frozen=True, init=False)
class CheckpointConfig:
    """The trainer's checkpoint settings; ``build()`` makes the :class:`~cloudckpt.CheckpointManager`.

    Intervals are in training steps. Every name below is accepted as a keyword argument,
    a key of a dict or YAML file, and a ``CLOUDCKPT_<NAME>`` environment variable, and
    reads back as an attribute (``config.keep_last_local is config.local.keep_last_local``).

    Own fields:

    - ``save_folder``: where steps go: a local path, ``file://``, ``s3://bucket/prefix`` or
      ``gs://bucket/prefix`` (required).
    - ``save_interval``: persistent checkpoint every N steps (None: never).
    - ``ephemeral_save_interval``: ephemeral checkpoint every N steps (None: never); a step due for both is persistent.
    - ``async_save``: save in the background after a staging copy to host memory.
    - ``exact_resume``: capture and restore RNG states (Python, NumPy, torch) and data loaders in the train state.
    - ``load_step``: ``resume()`` loads this committed step instead of the newest (None: the newest).
    - ``strict_resume``: a newest step that fails its checks stops ``resume()`` (CorruptCheckpoint) instead of
      being logged, recorded in ``CheckpointManager.skipped_steps`` and skipped for the previous committed step.

    The Checkpointer's settings: every field of :class:`CheckpointerOptions` (described
    there) is a field of the config of the same name, but ``storage_options`` and
    ``transfer``, which are the ``storage`` and ``transfer`` groups; ``checkpointer_options()``
    hands them to the Checkpointer as one object.

    Groups (a group's object, or a mapping of its fields in a dict or YAML; a flat name
    given as well wins):

    - ``storage``: a :class:`~cloudckpt.storage.StorageOptions`; flat names ``endpoint_url``, ``profile``,
      ``region``, ``addressing_style``, ``part_size``, ``sign_payload``, ``connect_timeout``, ``read_timeout``,
      ``operation_timeout``.
    - ``transfer``: a :class:`~cloudckpt.transfer.TransferConfig`; flat names ``max_concurrency``,
      ``bandwidth_limit`` (bytes/s or '200MB/s'), ``stall_timeout``, ``request_rate``.
    - ``local``: a :class:`LocalTierConfig` (the node-local tier): ``local_dir``, ``local_save_interval``,
      ``keep_last_local``, ``replication_factor``, ``replication_jump``.
    - ``retention``: a :class:`RetentionConfig`: ``keep_last_ephemeral``, ``max_checkpoints``, ``keep_every``,
      ``gc_grace_seconds``.
    - ``shutdown``: a :class:`ShutdownConfig`: ``sigterm``, ``sigterm_timeout``.

    Raises:
        ConfigError: a value not allowed (naming the field, the value and what is
            allowed), an unknown name, or an unknown ``CLOUDCKPT_*`` variable.
    """

    save_folder: str
    work_dir: Optional[str] = None
    save_interval: Optional[int] = None
    ephemeral_save_interval: Optional[int] = None
    async_save: bool = False
    max_in_flight: int = 1
    save_overwrite: bool = False
    verify_checksums: bool = True
    pre_download: bool = False
    load_exchange: bool = True
    exact_resume: bool = True
    load_step: Optional[int] = None
    strict_resume: bool = False
    thread_count: int = 2
    stale_lock_seconds: float = 600.0
    collective_timeout: float = 600.0
    storage: StorageOptions = field(default_factory=StorageOptions)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    local: LocalTierConfig = field(default_factory=LocalTierConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)

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
        flat = {k: kw.pop(k) for k in list(kw) if k in _FLAT}
        unknown = sorted(set(kw) - set(own))
        if unknown:
            raise ConfigError(f"unknown checkpoint config field(s) {unknown}; allowed: {', '.join(self.field_names())}")
        if save_folder is None:
            raise ConfigError("checkpoint config needs save_folder (a local path, s3://bucket/prefix or gs://bucket/prefix)")
        hints = get_type_hints(type(self))
        for name, f in own.items():
            if name == "save_folder":
                v = save_folder
            elif name in kw:
                v = kw[name]
            else:
                v = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if name not in GROUPS:
                v = _coerce(name, v, hints[name])
            object.__setattr__(self, name, v)
        for name, (cls, names) in GROUPS.items():
            part = getattr(self, name)
            if isinstance(part, Mapping):
                part = _build_nested(name, cls, part)
            elif not isinstance(part, cls):
                raise ConfigError(f"{name}={part!r} is not allowed: use a {cls.__name__} or a mapping of its fields")
            given = {k: flat[k] for k in names if k in flat}
            if given:
                part = _build_nested(name, cls, {**_fields_of(part), **given}, shown=lambda k: k)
            object.__setattr__(self, name, part)
        rules.check("", self, CONFIG_RULES)
        self.checkpointer_options()  # checks the Checkpointer's settings (CHECKPOINTER_RULES)

    def __getattr__(self, name: str) -> Any:  # the flat names, read back from their groups
        group = _FLAT.get(name)
        if group is not None:
            return getattr(getattr(self, group), name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        """Every name a dict, YAML file or keyword argument may set (all but the groups also as ``CLOUDCKPT_*``)."""
        return [f.name for f in fields(cls)] + list(_FLAT)

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
        coerced = {k: v if k in GROUPS else _coerce(k, v, hints[k]) for k, v in values.items()}
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
        names = [n for n in cls.field_names() if n not in GROUPS]
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
        """A copy with ``kw`` changed (flat names included)."""
        return dataclasses.replace(self, **kw)

    def checkpointer_options(self) -> CheckpointerOptions:
        """The :class:`CheckpointerOptions` of this config: its fields of the same names,
        ``storage_options`` from ``storage``."""
        names = [f.name for f in fields(CheckpointerOptions) if f.name != "storage_options"]
        return CheckpointerOptions(storage_options=self.storage, **{n: getattr(self, n) for n in names})

    def build(self):
        """The CheckpointManager for this config. Collective: call on every rank."""
        from .checkpoint.manager import CheckpointManager

        return CheckpointManager(self)


def _save_folder(v: Any) -> str | None:
    """The rule of ``save_folder``: a run folder the library may prune and gc in."""
    if not isinstance(v, str):
        return "use a local path, s3://bucket/prefix or gs://bucket/prefix"
    try:
        p = urls.parse_url(v)
    except InvalidURL as e:
        return str(e)
    from .storage import known_schemes

    if p.scheme not in known_schemes():
        return f"it has an unknown scheme {p.scheme + '://'!r}: use a local path, s3://bucket/prefix or gs://bucket/prefix"
    if p.scheme != "file" and not p.key.strip("/"):
        return (f"it is a bucket root: use a prefix such as {v.rstrip('/')}/run-1, so pruning and gc can never touch "
                "the rest of the bucket")
    from .checkpoint.layout import step_of_name

    for part in p.key.strip("/").split("/"):
        if step_of_name(part) is not None:
            return (f"it is inside a checkpoint step folder ({part}): point save_folder at the run folder that holds "
                    "the step folders")
    return None


#: The rule of each of CheckpointConfig's own fields; the Checkpointer's settings follow
#: CHECKPOINTER_RULES, each group its own table.
CONFIG_RULES: dict[str, rules.Rule] = {
    "save_folder": _save_folder,
    "save_interval": rules.integer(1, none="to turn it off"),
    "ephemeral_save_interval": rules.integer(1, none="to turn it off"),
    "async_save": rules.boolean(),
    "exact_resume": rules.boolean(),
    "load_step": rules.integer(0, none="for the newest"),
    "strict_resume": rules.boolean(),
    **{name: rules.instance(cls) for name, (cls, _) in GROUPS.items()},
}


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
    out = dict(get_type_hints(CheckpointConfig))
    for flat, group in _FLAT.items():
        out[flat] = get_type_hints(GROUPS[group][0])[flat]
    return out


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, value: Any, typ: Any) -> Any:
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
