"""The settings objects: :class:`CheckpointerOptions` (what a ``Checkpointer`` takes),
:class:`ManagerOptions` (what a ``CheckpointManager`` takes) and their groups
(:class:`LocalTierConfig`, :class:`RetentionConfig`, :class:`ShutdownConfig`, with
``StorageOptions`` and ``TransferConfig``).

Each is a frozen dataclass that checks itself when it is made: one loop over its fields
(``cloudckpt.rules.check_fields``), each field's rule declared with the field
(``rules.knob``) or given by its type. A new setting is one field here, with its type,
default, rule and docstring; ``CheckpointConfig`` (``cloudckpt.config``), which builds
these objects from keyword arguments, dicts, YAML and ``CLOUDCKPT_*`` variables, takes
every field of a group by its flat name without a line of its own.

This module sits below both ``cloudckpt.config`` and ``cloudckpt.checkpoint``: it imports
neither, so the Checkpointer and the manager import their settings from here.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from . import rules
from .errors import ConfigError, InvalidURL
from .rules import knob
from .storage import StorageOptions, known_schemes
from .storage import url as urls
from .transfer import TransferConfig
from .units import GiB, KiB, MiB, TiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*(?:/s)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "ki": KiB, "kib": KiB, "mi": MiB, "mib": MiB, "gi": GiB, "gib": GiB, "ti": TiB, "tib": TiB}


def parse_size(value: Any, name: str) -> int:
    """``123``, ``"64MiB"``, ``"1.5GB"``, ``"200MB/s"`` -> bytes.

    Raises:
        ConfigError: not a size (naming ``name`` and the value).
    """
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


def _local_path(v: str) -> bool:
    return "://" not in v


def save_folder_rule(v: Any) -> str | None:
    """The rule of ``save_folder`` that needs only the storage layer: a string naming a
    known scheme, and not a bucket root (pruning and gc must never reach the rest of the
    bucket). ``CheckpointConfig`` adds that it is not inside a step folder."""
    if not isinstance(v, str):
        return "use a local path, s3://bucket/prefix or gs://bucket/prefix"
    try:
        p = urls.parse_url(v)
    except InvalidURL as e:
        return str(e)
    if p.scheme not in known_schemes():
        return f"it has an unknown scheme {p.scheme + '://'!r}: use a local path, s3://bucket/prefix or gs://bucket/prefix"
    if p.scheme != "file" and not p.key.strip("/"):
        return (f"it is a bucket root: use a prefix such as {v.rstrip('/')}/run-1, so pruning and gc can never touch "
                "the rest of the bucket")
    return None


# ---------------------------------------------------------------- the groups
@dataclass(frozen=True)
class LocalTierConfig:
    """The node-local tier (docs/local-tier.md): ``CheckpointConfig.local``."""

    local_dir: Optional[str] = knob(None, rules.text(
        none="for no local tier", ok=_local_path,
        allowed="use a node-local path such as /dev/shm/ckpt, not a URL (the bucket is save_folder)"))
    """The tier's folder on each node, e.g. ``/dev/shm/ckpt`` (``{node}`` is replaced by
    the node index); None: no local tier."""
    local_save_interval: Optional[int] = knob(None, rules.integer(1, none="for no local steps"))
    """A local step every N steps (needs ``local_dir``); steps due for the bucket are
    written locally too and persisted from the local files."""
    keep_last_local: int = knob(2, rules.integer(1, why=" (0 would delete the newest local step)"))
    """Complete local steps kept (>= 1)."""
    replication_factor: Optional[int] = knob(None, rules.integer(1, none="for 2 with two nodes or more, else 1"))
    """Copies of each rank's part on distinct nodes, its own included (None: 2 when there
    are two nodes or more, else 1)."""
    replication_jump: Optional[int] = knob(None, rules.integer(1, none="for LOCAL_WORLD_SIZE"))
    """Ranks per failure domain, a node or a rack (a multiple of ``LOCAL_WORLD_SIZE``;
    None: ``LOCAL_WORLD_SIZE``, else 1)."""

    def __post_init__(self) -> None:
        rules.check_fields("local tier option ", self)
        if self.local_save_interval is not None and self.local_dir is None:
            raise ConfigError(f"local_save_interval={self.local_save_interval} needs local_dir (a node-local "
                              "folder such as /dev/shm/ckpt) to write local steps to")


@dataclass(frozen=True)
class RetentionConfig:
    """What the manager keeps and garbage-collects after each save: ``CheckpointConfig.retention``."""

    keep_last_ephemeral: int = knob(1, rules.integer(1, why=" (0 would delete the newest ephemeral checkpoint, "
                                                            "which may be the newest checkpoint)"))
    """Ephemeral checkpoints kept (>= 1)."""
    max_checkpoints: Optional[int] = knob(None, rules.integer(1, why=" (0 would delete the newest checkpoint)",
                                                              none="to keep all"))
    """Persistent checkpoints kept (>= 1; None: all)."""
    keep_every: Optional[int] = knob(None, rules.integer(1, none="to turn it off"))
    """Persistent steps divisible by this are never pruned (None: off)."""
    gc_grace_seconds: float = knob(3600.0, rules.number(0, finite=False))
    """Uncommitted step folders and multipart uploads older than this are garbage-collected."""

    def __post_init__(self) -> None:
        rules.check_fields("retention option ", self)


@dataclass(frozen=True)
class ShutdownConfig:
    """What the manager does on SIGTERM: ``CheckpointConfig.shutdown``."""

    sigterm: str = knob("finish", rules.choice("finish", "abandon"))
    """``"finish"`` the in-flight saves (up to ``sigterm_timeout`` seconds) or ``"abandon"``
    them; either way the process then exits with the signal."""
    sigterm_timeout: float = 120.0
    """Seconds to wait for in-flight saves with ``"finish"``."""

    def __post_init__(self) -> None:
        rules.check_fields("shutdown option ", self)


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every setting of a :class:`~cloudckpt.Checkpointer`, in one object.

    ``Checkpointer(options)`` takes it; ``Checkpointer(work_dir=..., ...)`` builds one
    from the same names. In a ``CheckpointConfig`` it is the ``checkpointer`` group:
    every field but ``storage_options`` and ``transfer`` (the config's ``storage`` and
    ``transfer`` groups) is also a flat name of the config.
    """

    work_dir: Optional[str] = knob(None, rules.text(allowed="use a local folder path"))
    """Local scratch: each rank writes its files into a private (0700) folder here before
    upload (None: :func:`default_work_dir`)."""
    save_overwrite: bool = False
    """Allow replacing a committed step (in one conditional request where the store can:
    the step number always holds the old step or the new one)."""
    storage_options: Optional[StorageOptions] = knob(None, rules.instance(StorageOptions))
    """Endpoint, credentials profile, region, part size, timeouts
    (:class:`~cloudckpt.storage.StorageOptions`; None: the defaults)."""
    transfer: Optional[TransferConfig] = knob(None, rules.instance(TransferConfig))
    """Concurrency, byte budget, bandwidth limit, stall watchdog, retries
    (:class:`~cloudckpt.transfer.TransferConfig`; None: the defaults)."""
    verify_checksums: bool = True
    """Check the CRC32C of everything loaded."""
    pre_download: bool = False
    """Download each rank's items to ``work_dir`` before putting them in place instead of
    streaming ranges (``load(pre_download=)`` decides per call)."""
    load_exchange: bool = True
    """A load on several ranks reads each stored byte range from the bucket once and passes
    it to the other ranks that need it (the read-once exchange); False: every rank reads
    everything it needs from the bucket."""
    thread_count: int = 2
    """Threads writing DCP files per rank."""
    stale_lock_seconds: float = knob(600.0, rules.number(0, finite=False))
    """A step's ``.lock`` older than this is taken over."""
    collective_timeout: float = knob(600.0, rules.number(0, strict=True))
    """Seconds a rank waits for the others in a save's or load's collective steps."""
    max_in_flight: int = 1
    """Async saves staged or running at most; a new save waits."""

    def __post_init__(self) -> None:
        work_dir = default_work_dir() if self.work_dir is None else self.work_dir
        object.__setattr__(self, "work_dir", os.fspath(work_dir) if isinstance(work_dir, os.PathLike) else work_dir)
        object.__setattr__(self, "storage_options", self.storage_options or StorageOptions())
        object.__setattr__(self, "transfer", self.transfer or TransferConfig())
        rules.check_fields("checkpointer option ", self)


@dataclass(frozen=True)
class ManagerOptions:
    """Every setting of a :class:`~cloudckpt.CheckpointManager`: the run's own fields and
    one object per group. ``CheckpointConfig`` is one, built from flat names, dicts, YAML
    and ``CLOUDCKPT_*`` variables; build the manager with ``CheckpointConfig(...).build()``."""

    save_folder: str = knob(rule=save_folder_rule)
    """Where steps go: a local path, ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix``."""
    save_interval: Optional[int] = knob(None, rules.integer(1, none="to turn it off"))
    """A persistent checkpoint every N steps (None: never)."""
    ephemeral_save_interval: Optional[int] = knob(None, rules.integer(1, none="to turn it off"))
    """An ephemeral checkpoint every N steps (None: never); a step due for both is persistent."""
    async_save: bool = False
    """Save in the background after a staging copy to host memory."""
    exact_resume: bool = True
    """Capture and restore RNG states (Python, NumPy, torch) and data loaders in the train state."""
    load_step: Optional[int] = knob(None, rules.integer(0, none="for the newest"))
    """``resume()`` loads this committed step instead of the newest (None: the newest)."""
    strict_resume: bool = False
    """A newest step that fails its checks stops ``resume()`` (CorruptCheckpoint) instead of
    being logged, recorded in ``CheckpointManager.skipped_steps`` and skipped for the
    previous committed step."""
    checkpointer: CheckpointerOptions = knob(default_factory=CheckpointerOptions)
    """The Checkpointer's settings (its ``storage_options`` and ``transfer`` are the
    ``storage`` and ``transfer`` groups)."""
    local: LocalTierConfig = knob(default_factory=LocalTierConfig)
    """The node-local tier."""
    retention: RetentionConfig = knob(default_factory=RetentionConfig)
    """Pruning and gc."""
    shutdown: ShutdownConfig = knob(default_factory=ShutdownConfig)
    """SIGTERM."""

    def __post_init__(self) -> None:
        rules.check_fields("", self)

    @property
    def storage(self) -> StorageOptions:
        """Reaching the store: ``checkpointer.storage_options``."""
        return self.checkpointer.storage_options

    @property
    def transfer(self) -> TransferConfig:
        """The transfer engine: ``checkpointer.transfer``."""
        return self.checkpointer.transfer


#: Each class's rule of each field (``rules.table``): the tables the docs name.
LOCAL_RULES = rules.table(LocalTierConfig)
RETENTION_RULES = rules.table(RetentionConfig)
SHUTDOWN_RULES = rules.table(ShutdownConfig)
CHECKPOINTER_RULES = rules.table(CheckpointerOptions)
MANAGER_RULES = rules.table(ManagerOptions)
