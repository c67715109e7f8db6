"""Megatron's own ``torch_dist`` folders: found, read and imported as cloudckpt steps.

Megatron-LM and Megatron-Bridge save a run as::

    {save}/latest_checkpointed_iteration.txt   the tracker: the newest iteration, or "release"
    {save}/iter_{N:07d}/                       one iteration, a torch_dist folder:
        .metadata  __{R}_{K}.distcp            DCP's files (ShardedObjects and the common
                                               state ``common_state/shard_0_1`` as byte items)
        metadata.json                          Megatron's commit marker, written last
        common.pt                              the common state of older checkpoints

What this module does with them, as untrusted input (``cloudckpt.untrusted``: DCP's
``.metadata`` by the allowlist unpickler, which admits the ``SavePlan`` objects
Megatron's save keeps there as inert stand-ins it drops; every byte item and
``common.pt`` by the plain-data reader; ``metadata.json`` and the tracker as small
bounded documents; every name checked):

- :func:`read_tracker` / :func:`write_tracker`: the tracker file;
- :func:`find_iterations` / :func:`latest_iteration`: the committed iterations of a
  run folder, from one listing: cloudckpt steps (our marker) and Megatron's own folders
  (its ``metadata.json`` naming ``torch_dist`` beside a DCP ``.metadata``);
- :func:`read_iteration`: a Megatron folder's state as a flat dict (tensors, plain objects);
- :func:`import_iteration` / :func:`import_run`: Megatron's folders (local or in a bucket)
  committed as cloudckpt steps ``{dest}/iter_{N:07d}``, tensors and byte items bit for
  bit (a byte item is copied as it is stored, once it parses as plain data), Megatron's
  ``metadata.json`` kept and ``common.pt`` turned into the current format's
  ``common_state`` item, so both ``cloudckpt.integrations.megatron.load`` and Megatron's own
  loader (after ``cloudckpt download``) read the step. Other files of an iteration folder
  (Megatron-Bridge's ``run_config.yaml``, ``train_state.pt``) are not imported: each
  import names them in its result.

A folder's iteration is in its name: ``iter_{N}`` (Megatron writes 7 digits or more).
Not collective: run on one process.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable

from ..errors import ConfigError, CorruptCheckpoint, NotACheckpoint, NotFound
from ..storage import Location, StorageOptions, Where
from ..storage import url as urls

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's tracker file, in the save folder
CONFIG_NAME = "metadata.json"  # Megatron's commit marker (dist_checkpointing.core.CONFIG_FNAME)
COMMON_PT = "common.pt"  # the common state of older torch_dist checkpoints
COMMON_ITEM = "common_state/shard_0_1"  # the current format's common state: a byte item of the DCP
RELEASE = "release"  # the tracker of a released (converted) checkpoint names this folder
MAX_TRACKER_BYTES = 64
MAX_CONFIG_BYTES = 65536
_ITER_RE = re.compile(r"iter_([0-9]{7,19})")


def iteration_name(n: int) -> str:
    """Megatron's folder name of iteration ``n``: ``iter_0000100``."""
    return f"iter_{int(n):07d}"


def iteration_of(url: str) -> int | None:
    """The iteration in a folder's name (``iter_0000100`` -> 100), else None."""
    m = _ITER_RE.fullmatch(urls.basename(url))
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Iteration:
    """A committed iteration folder: ``kind`` is ``"cloudckpt"`` (our marker) or
    ``"megatron"`` (Megatron's ``metadata.json`` and DCP files at its root)."""

    iteration: int
    url: str
    kind: str


@dataclass(frozen=True)
class Imported:
    """What :func:`import_iteration` committed: the step's URL, its iteration, and the
    files of the source folder it did not import (relative names)."""

    url: str
    iteration: int
    skipped: tuple[str, ...] = ()


# ================================================================ the tracker
def read_tracker(folder: Where, *, storage_options: StorageOptions | None = None) -> int | str | None:
    """The iteration the tracker of the save folder ``folder`` names (an int), ``"release"``,
    or None when there is no tracker. Raises CorruptCheckpoint (neither a number nor
    ``release``, or over 64 bytes), storage errors."""
    from ..untrusted import read_capped

    loc = Location.of(folder, storage_options)
    url = urls.join(loc.url, TRACKER)
    try:
        raw = read_capped(loc.store, url, limit=MAX_TRACKER_BYTES, what="Megatron tracker")
    except NotFound as e:
        if type(e) is not NotFound:
            raise  # a missing bucket is not a missing tracker
        return None
    text = raw.decode("ascii", errors="replace").strip()
    if text == RELEASE:
        return RELEASE
    if not (text.isascii() and text.isdigit() and len(text) <= 19):
        raise CorruptCheckpoint(f"{url}: Megatron's tracker holds {text[:32]!r}, neither an iteration nor "
                                f"{RELEASE!r}")
    return int(text)


def write_tracker(folder: Where, iteration: int | str, *, storage_options: StorageOptions | None = None) -> None:
    """Write the tracker of ``folder`` naming ``iteration`` (as Megatron does: the number,
    no newline). Call it only once that iteration is committed. Raises storage errors."""
    loc = Location.of(folder, storage_options)
    loc.store.put_bytes(urls.join(loc.url, TRACKER), str(iteration).encode())


# ================================================================ discovery
def _iteration_folders(loc: Location) -> list[tuple[int, str]]:
    out = []
    for e in loc.store.list(loc.prefix, delimiter="/"):
        n = iteration_of(e.url) if e.is_prefix else None
        if n is not None:
            out.append((n, e.url.rstrip("/")))
    return sorted(out)


def _probe(loc: Location) -> tuple[str | None, str | None]:
    """(kind, None) for a committed iteration folder, (None, None) when it has no commit
    marker, (None, reason) when its marker is refused. Storage errors propagate."""
    from ..checkpoint import named

    m, problem = named.probe(loc)
    if m is not None:
        return "cloudckpt", None
    if problem is not None:
        return None, problem
    try:
        _megatron_config(loc)
    except NotACheckpoint:
        return None, None
    except (ConfigError, CorruptCheckpoint) as e:
        return None, str(e)
    return "megatron", None


def find_iterations(folder: Where, *, storage_options: StorageOptions | None = None) -> list[Iteration]:
    """The committed iteration folders (``iter_{N}``) directly under ``folder``, oldest
    first: one listing of ``folder``, then one marker read per folder. A folder whose
    marker is refused is skipped with a warning. Raises storage errors."""
    import logging

    loc = Location.of(folder, storage_options)
    out = []
    for n, url in _iteration_folders(loc):
        kind, problem = _probe(loc.at(url))
        if problem:
            logging.getLogger(__name__).warning("skipping %s: %s", url, problem)
        elif kind is not None:
            out.append(Iteration(n, url, kind))
    return out


def latest_iteration(folder: Where, *, storage_options: StorageOptions | None = None) -> Iteration:
    """The newest committed iteration of ``folder``. The tracker never makes an uncommitted
    or older folder win: a resume takes the newest complete iteration (when the tracker
    names another one, a warning says so). Raises NotACheckpoint (none), storage errors."""
    import logging

    loc = Location.of(folder, storage_options)
    found = find_iterations(loc)
    if not found:
        raise NotACheckpoint(f"{loc.url}: no committed iteration folder (iter_N with cloudckpt's marker or "
                             f"Megatron's {CONFIG_NAME})")
    newest = found[-1]
    tracked = read_tracker(loc)
    if tracked is not None and tracked != newest.iteration:
        logging.getLogger(__name__).warning("%s: the tracker names %s, the newest committed iteration is %d",
                                            loc.url, tracked, newest.iteration)
    return newest


# ================================================================ one Megatron folder
@dataclass(frozen=True)
class _Folder:
    loc: Location
    config: dict  # Megatron's metadata.json (its two known fields)
    files: dict  # relative name -> size, every object of the folder (subfolders included)


def _listing(loc: Location) -> dict[str, int]:
    from ..untrusted import check_name

    prefix = loc.prefix
    return {check_name(e.url[len(prefix):], what="object name in the iteration folder", url=loc.url): e.size
            for e in loc.store.list(prefix, delimiter=None) if not e.is_prefix}


def _megatron_config(loc: Location, size: int | None = None) -> dict:
    """Megatron's ``metadata.json`` of the folder: its ``sharded_backend`` must be
    ``torch_dist``. Raises NotACheckpoint (none), ConfigError (another backend),
    CorruptCheckpoint (not a small JSON object), storage errors."""
    from ..untrusted import loads_json, read_capped

    url = urls.join(loc.url, CONFIG_NAME)
    try:
        raw = read_capped(loc.store, url, limit=MAX_CONFIG_BYTES, what="Megatron metadata.json")
    except NotFound as e:
        if type(e) is not NotFound:
            raise
        raise NotACheckpoint(f"{loc.url}: no {CONFIG_NAME}; not a folder Megatron's save committed") from None
    d = loads_json(raw, url=url, what="Megatron metadata.json", limit=MAX_CONFIG_BYTES, max_depth=8)
    if type(d) is not dict:
        raise CorruptCheckpoint(f"{url}: not a JSON object")
    backend, version = d.get("sharded_backend"), d.get("sharded_backend_version", 1)
    if backend != "torch_dist" or type(version) is not int:
        shown = backend[:40] if type(backend) is str else type(backend).__name__
        raise ConfigError(f"{url}: a {shown!r} checkpoint; cloudckpt reads Megatron's torch_dist format only")
    return {"sharded_backend": backend, "sharded_backend_version": version}


def _open(src: Where, storage_options: StorageOptions | None) -> _Folder:
    loc = Location.of(src, storage_options).resolved()
    files = _listing(loc)
    if ".metadata" not in files:
        raise NotACheckpoint(f"{loc.url}: no DCP .metadata; not a torch_dist folder")
    return _Folder(loc, _megatron_config(loc), files)


def _metadata(f: _Folder) -> Any:
    from ..untrusted import loads_metadata
    from ..untrusted.limits import read_metadata

    url = urls.join(f.loc.url, ".metadata")
    shards = {k: v for k, v in f.files.items() if k.endswith(".distcp")}
    return loads_metadata(read_metadata(f.loc.store, url, size=f.files[".metadata"], described=sum(shards.values())),
                          url=url, files=shards)


def _read(f: _Folder, *, raw: bool) -> dict[str, Any]:
    """The folder's flat state: tensors, and byte items as plain data (``raw``: as
    ``io.BytesIO`` of their stored bytes, once they parse as plain data); a legacy
    ``common.pt`` becomes the ``common_state`` item."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from ..ops.export import read_dcp_state
    from ..untrusted import load_plain
    from ..untrusted.limits import MAX_TRAIN_STATE_BYTES

    md = _metadata(f)
    tensors = {k: v for k, v in md.state_dict_metadata.items() if not isinstance(v, BytesStorageMetadata)}
    out = read_dcp_state(f.loc, replace(md, state_dict_metadata=tensors))
    legacy = COMMON_PT in f.files  # Megatron reads common.pt, when there is one, instead of the item
    byte_items = [(k, md.storage_data[MetadataIndex(k)]) for k, v in md.state_dict_metadata.items()
                  if isinstance(v, BytesStorageMetadata) and not (legacy and k == COMMON_ITEM)]
    if legacy:
        byte_items.append((COMMON_ITEM, None))
    for key, info in byte_items:
        if info is None:
            url, start, length = urls.join(f.loc.url, COMMON_PT), 0, f.files[COMMON_PT]
            if length > MAX_TRAIN_STATE_BYTES:
                raise CorruptCheckpoint(f"{url}: {length} bytes of common state; refusing to read it")
        else:
            url, start, length = urls.join(f.loc.url, info.relative_path), info.offset, info.length
        data = f.loc.store.get_bytes(url, start=start, end=start + length)
        if len(data) != length:
            raise CorruptCheckpoint(f"{url}: {len(data)} bytes of {key!r} where {length} were listed; truncated")
        value = load_plain(data, url=url, what=f"Megatron object {key!r}")
        if info is None:  # common.pt holds the common state; the item holds [it] (Megatron's ShardedObject)
            value, data = [value], None
        if not raw:
            out[key] = value
        elif data is not None:
            out[key] = io.BytesIO(data)
        else:
            buf = io.BytesIO()
            torch.save(value, buf)
            out[key] = buf
    return out


def read_iteration(src: Where, *, storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """The state of the Megatron ``torch_dist`` folder ``src`` (local or in a bucket) as a
    flat dict: each tensor whole (Megatron's key), each ``ShardedObject`` and the common
    state (``common_state/shard_0_1``, from ``common.pt`` in older checkpoints) as plain
    data. Holds the whole state in memory once. Raises NotACheckpoint (no ``.metadata``
    or no ``metadata.json``), ConfigError (not torch_dist), UnsafeCheckpoint /
    CorruptCheckpoint, storage errors."""
    return _read(_open(src, storage_options), raw=False)


def import_iteration(src: Where, dest: str, *, iteration: int | None = None,
                     storage_options: StorageOptions | None = None, **settings: Any) -> Imported:
    """Commit the Megatron ``torch_dist`` folder ``src`` (local or in a bucket) as the
    cloudckpt step ``dest`` (a URL or folder), as one process: tensors and byte items
    bit for bit, Megatron's ``metadata.json`` in the step's ``model_and_optim/`` (so
    Megatron's loader reads a download of it). ``iteration``: the step number, by default
    from ``src``'s or ``dest``'s name. ``storage_options``: for ``src``; ``settings``:
    ``CheckpointerOptions`` fields for the save (``storage_options=`` for ``dest``,
    ``work_dir=``). Returns :class:`Imported`. Raises ConfigError (no step number, not
    torch_dist), NotACheckpoint, UnsafeCheckpoint, CorruptCheckpoint, CheckpointExists,
    storage errors."""
    from .. import Checkpointer
    from .megatron import _save_pyt

    number = iteration if iteration is not None else iteration_of(str(src))
    if number is None:
        number = iteration_of(dest)
    if number is None:
        raise ConfigError(f"{src}: not named iter_N and neither is {dest}; pass iteration=")
    f = _open(src, storage_options)
    sd = _read(f, raw=True)
    used = {".metadata", CONFIG_NAME, COMMON_PT, *(k for k in f.files if k.endswith(".distcp"))}
    with Checkpointer(distributed=False, **settings) as ckpt:
        _save_pyt(ckpt, dest, number, sd, f.config, ephemeral=False)
    return Imported(dest, number, tuple(sorted(k for k in f.files if k not in used)))


def import_run(src: Where, dest: str, *, iterations: Iterable[int] | str = "all",
               storage_options: StorageOptions | None = None, **settings: Any) -> list[Imported]:
    """Import the committed Megatron iteration folders of the save folder ``src`` into
    ``{dest}/iter_{N:07d}`` (:func:`import_iteration`), oldest first, then write ``dest``'s
    tracker naming the newest one imported. ``iterations``: ``"all"``, ``"latest"`` or
    the numbers to import (each must be committed in ``src``). Steps already committed
    in ``dest`` are kept and not imported again. Returns what was imported. Raises
    NotACheckpoint (nothing to import, or a number that is not committed), and as
    :func:`import_iteration`."""
    from ..checkpoint.named import probe

    found = [i for i in find_iterations(src, storage_options=storage_options) if i.kind == "megatron"]
    if iterations == "latest":
        found = found[-1:]
    elif iterations != "all":
        want = sorted(set(int(n) for n in iterations))  # type: ignore[union-attr]
        have = {i.iteration: i for i in found}
        missing = [n for n in want if n not in have]
        if missing:
            raise NotACheckpoint(f"{src}: no committed Megatron iteration {missing[:10]}")
        found = [have[n] for n in want]
    if not found:
        raise NotACheckpoint(f"{src}: no committed Megatron iteration folder to import")
    dest_loc = Location.of(dest, settings.get("storage_options"))
    out = []
    for it in found:
        target = urls.join(dest, iteration_name(it.iteration))
        if probe(dest_loc.at(target))[0] is not None:
            continue
        out.append(import_iteration(it.url, target, iteration=it.iteration, storage_options=storage_options,
                                    **settings))
    write_tracker(dest_loc, found[-1].iteration)
    return out


__all__ = [
    "COMMON_ITEM",
    "TRACKER",
    "Imported",
    "Iteration",
    "find_iterations",
    "import_iteration",
    "import_run",
    "iteration_name",
    "iteration_of",
    "latest_iteration",
    "read_iteration",
    "read_tracker",
    "write_tracker",
]
