"""CheckpointConfig: the trainer-facing settings, validated, from kwargs, a dict,
a YAML file, and ``CLOUDCKPT_*`` environment overrides. It is a
:class:`~cloudckpt.options.ManagerOptions` (what the manager takes) built from flat names:
the settings objects and their rules live in ``cloudckpt.options``, below this module and
the checkpointer; the names are re-exported here (``from cloudckpt.config import
CheckpointerOptions`` keeps working).

Every field of the groups ``checkpointer`` (:class:`~cloudckpt.options.CheckpointerOptions`
but ``storage_options`` and ``transfer``), ``local``, ``retention`` and ``shutdown`` is a
flat name of the config, derived from the group's class: a new field there needs no line
here. Strings from YAML and the environment are converted to the field's type first.

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
import types
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union, get_args, get_origin, get_type_hints

from . import rules
from .checkpoint.layout import step_of_name
from .errors import ConfigError
from .options import (  # noqa: F401 - re-exported: the names users import from cloudckpt.config
    CHECKPOINTER_RULES,
    LOCAL_RULES,
    MANAGER_RULES,
    RETENTION_RULES,
    SHUTDOWN_RULES,
    CheckpointerOptions,
    LocalTierConfig,
    ManagerOptions,
    RetentionConfig,
    ShutdownConfig,
    default_work_dir,
    parse_size,
    save_folder_rule,
)
from .storage import StorageOptions
from .storage import url as urls
from .transfer import TransferConfig

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint.manager import CheckpointManager

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
    "CLOUDCKPT_TEST_NO_PREBUILD",  # tests/venv_builds.py: no background build of the integrations' venvs
    "CLOUDCKPT_KILL_TRIALS",  # tests/faults/test_kill.py
})
#: Flat names kept for dicts, YAML, environment variables and keyword arguments: each is
#: the field of the same name in one group. storage and transfer have more fields than
#: flat names (the rest: a mapping or the object); every field of the other groups is one,
#: derived from its class. The checkpointer's storage_options and transfer are the groups
#: storage and transfer.
FLAT_STORAGE = ("endpoint_url", "profile", "region", "addressing_style", "part_size", "sign_payload",
                "connect_timeout", "read_timeout", "operation_timeout")
FLAT_TRANSFER = ("max_concurrency", "bandwidth_limit", "stall_timeout", "request_rate")
_IN_CHECKPOINTER = {"storage": "storage_options", "transfer": "transfer"}  # group -> its CheckpointerOptions field


def _all_fields(cls: type, but: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.name not in but)


GROUPS: dict[str, tuple[type, tuple[str, ...]]] = {  # the checkpointer first: storage and transfer live in it
    "checkpointer": (CheckpointerOptions, _all_fields(CheckpointerOptions, but=tuple(_IN_CHECKPOINTER.values()))),
    "storage": (StorageOptions, FLAT_STORAGE),
    "transfer": (TransferConfig, FLAT_TRANSFER),
    "local": (LocalTierConfig, _all_fields(LocalTierConfig)),
    "retention": (RetentionConfig, _all_fields(RetentionConfig)),
    "shutdown": (ShutdownConfig, _all_fields(ShutdownConfig)),
}
_FLAT = {flat: group for group, (_, names) in GROUPS.items() for flat in names}  # flat name -> its group


@dataclass(frozen=True, init=False)
class CheckpointConfig(ManagerOptions):
    """The trainer's checkpoint settings; ``build()`` makes the :class:`~cloudckpt.CheckpointManager`.

    A :class:`~cloudckpt.options.ManagerOptions` (its own fields are described there:
    ``save_folder``, the intervals, ``async_save``, ``exact_resume``, ``load_step``,
    ``strict_resume``) built from flat names. Intervals are in training steps. Every name
    below is accepted as a keyword argument, a key of a dict or YAML file, and a
    ``CLOUDCKPT_<NAME>`` environment variable, and reads back as an attribute
    (``config.keep_last_local is config.local.keep_last_local``).

    Groups (a group's object, or a mapping of its fields in a dict or YAML; a flat name
    given as well wins, and ``storage`` or ``transfer`` given as well wins over the
    ``checkpointer`` group's ``storage_options`` or ``transfer``):

    - ``checkpointer``: a :class:`~cloudckpt.options.CheckpointerOptions` (the one object the
      Checkpointer takes, ``checkpointer_options()``); every field but ``storage_options``
      and ``transfer`` is a flat name (``work_dir``, ``save_overwrite``, ``thread_count``...).
    - ``storage``: a :class:`~cloudckpt.storage.StorageOptions`; flat names ``endpoint_url``, ``profile``,
      ``region``, ``addressing_style``, ``part_size``, ``sign_payload``, ``connect_timeout``, ``read_timeout``,
      ``operation_timeout``.
    - ``transfer``: a :class:`~cloudckpt.transfer.TransferConfig`; flat names ``max_concurrency``,
      ``bandwidth_limit`` (bytes/s or '200MB/s'), ``stall_timeout``, ``request_rate``.
    - ``local``: a :class:`~cloudckpt.options.LocalTierConfig` (the node-local tier); every field is a flat name.
    - ``retention``: a :class:`~cloudckpt.options.RetentionConfig`; every field is a flat name.
    - ``shutdown``: a :class:`~cloudckpt.options.ShutdownConfig`; every field is a flat name.

    Raises:
        ConfigError: a value not allowed (naming the field, the value and what is
            allowed), an unknown name, or an unknown ``CLOUDCKPT_*`` variable.
    """

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
        unknown = sorted(set(kw) - set(own) - set(GROUPS))
        if unknown:
            raise ConfigError(f"unknown checkpoint config field(s) {unknown}; allowed: {', '.join(self.field_names())}")
        if save_folder is None:
            raise ConfigError("checkpoint config needs save_folder (a local path, s3://bucket/prefix or gs://bucket/prefix)")
        hints = get_type_hints(type(self))
        for name, f in own.items():
            if name in GROUPS:
                continue
            if name == "save_folder":
                v = save_folder
            elif name in kw:
                v = kw[name]
            else:
                v = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, name, _coerce(name, v, hints[name]))
        parts: dict[str, Any] = {}
        for name, (cls, names) in GROUPS.items():
            if name in kw:
                part = kw[name]
            elif name in _IN_CHECKPOINTER:
                part = getattr(parts["checkpointer"], _IN_CHECKPOINTER[name])
            else:
                part = cls()
            if isinstance(part, Mapping):
                part = _build_nested(name, cls, part, allowed=names if name == "checkpointer" else None)
            elif not isinstance(part, cls):
                raise ConfigError(f"{name}={part!r} is not allowed: use a {cls.__name__} or a mapping of its fields")
            given = {k: flat[k] for k in names if k in flat}
            if given:
                part = _build_nested(name, cls, {**_fields_of(part), **given}, shown=lambda k: k)
            parts[name] = part
        parts["checkpointer"] = dataclasses.replace(
            parts["checkpointer"], **{field: parts.pop(group) for group, field in _IN_CHECKPOINTER.items()})
        for name, part in parts.items():
            object.__setattr__(self, name, part)
        rules.check("", self, CONFIG_RULES)

    def __getattr__(self, name: str) -> Any:  # the flat names, read back from their groups
        group = _FLAT.get(name)
        if group is not None:
            return getattr(getattr(self, group), name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        """Every name a dict, YAML file or keyword argument may set (all but the groups also as ``CLOUDCKPT_*``)."""
        own = [f.name for f in fields(cls)]
        return own + [g for g in GROUPS if g not in own] + list(_FLAT)

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
        """The :class:`~cloudckpt.options.CheckpointerOptions` of this config (its ``checkpointer``
        group, whose ``storage_options`` and ``transfer`` are ``storage`` and ``transfer``)."""
        return self.checkpointer

    def build(self) -> CheckpointManager:
        """The CheckpointManager for this config. Collective: call on every rank."""
        from .checkpoint.manager import CheckpointManager  # lazy: the manager imports torch; the config must not

        return CheckpointManager(self)


def _save_folder(v: Any) -> str | None:
    """The rule of ``save_folder``: a run folder the library may prune and gc in (the
    storage layer's rule, ``options.save_folder_rule``, and not inside a step folder)."""
    refused = save_folder_rule(v)
    if refused is not None:
        return refused
    for part in urls.parse_url(v).key.strip("/").split("/"):
        if step_of_name(part) is not None:
            return (f"it is inside a checkpoint step folder ({part}): point save_folder at the run folder that holds "
                    "the step folders")
    return None


#: The rule of each of CheckpointConfig's fields: ManagerOptions' (``options.MANAGER_RULES``),
#: with the whole rule of save_folder. Each group checks its own fields.
CONFIG_RULES: dict[str, rules.Rule] = {**MANAGER_RULES, "save_folder": _save_folder}


def _fields_of(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _build_nested(name: str, cls: type, values: Mapping[str, Any], shown: Callable[[str], str] | None = None,
                  allowed: tuple[str, ...] | None = None) -> Any:
    """``cls(**values)`` with each value coerced to the field's type; errors name ``name.field``.
    ``allowed``: the names a mapping may set (default: every field of ``cls``)."""
    shown = shown or (lambda k: f"{name}.{k}")
    hints = get_type_hints(cls)
    allowed = tuple(hints) if allowed is None else allowed
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown {name} option(s) {[shown(k) for k in unknown]}; "
                          f"allowed: {', '.join(sorted(allowed))}")
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
