"""Data loaders registered for exact resume (``CheckpointManager.register_data_loader``).

Three things make a loader resume exactly, and all are checked or handled here:

- It must be *stateful*: ``state_dict()`` and ``load_state_dict()`` (torchdata's
  ``StatefulDataLoader`` is the drop-in replacement for ``torch.utils.data.DataLoader``).
  A plain ``DataLoader`` is refused when it is registered, not a thousand steps later
  at the first save.
- The usual loop calls ``iter(loader)`` *after* ``resume()``. ``DataLoader.__iter__``
  draws its base seed from the global torch RNG (unless the loader has its own
  ``generator``), which ``resume()`` has just restored to its state at the save. The
  uninterrupted run made that draw at the start of the epoch, before the save, so the
  resumed run would draw once more and every later dropout mask would shift. After a
  resume, the first ``iter()`` of each registered loader therefore puts the torch RNG
  back as it found it, if nothing else drew from it since the restore (if something
  did, the draw is left alone and a warning says so). This lasts until the first
  ``iter()`` or the first ``maybe_save()``, whichever comes first.
- Loader workers have RNG states of their own, and torchdata does not save them: its
  per-worker state is the dataset's ``state_dict()`` (when the dataset has one) and,
  for an ``IterableDataset``, its iterator's; a resumed worker is seeded afresh from
  the saved base seed (``base_seed + worker_id``), as at the start of the epoch, not
  where the saved worker was. So a random augmentation in ``__getitem__`` (or dropout
  in a ``collate_fn``) would draw other numbers after a resume. For a map-style dataset
  with ``num_workers > 0``, each iterator the loader starts hands its workers the
  dataset inside :class:`WorkerRNGDataset`, whose ``state_dict()`` (which torchdata
  calls in the worker, right after the fetch of every batch it snapshots, and ships
  with that batch) adds the worker's Python, NumPy and torch RNG states, and whose
  ``load_state_dict()`` (called in the new worker after seeding and
  ``worker_init_fn``) puts them back. Prefetching does not matter: a state travels
  with its batch, and the main process keeps the one of the last batch it handed out.
  ``loader.dataset`` stays the user's object. What cannot be made exact is said when
  the loader is registered (:func:`watch_workers`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from .. import exact_resume
from ..errors import ConfigError

log = logging.getLogger(__name__)

_ORIGINAL = "_cloudckpt_original_class"


def check_stateful(loader: Any, name: str) -> None:
    """Raises ConfigError unless ``loader`` has callable ``state_dict``/``load_state_dict``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"register_data_loader(name={name!r}): the name must be a non-empty string")
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(loader, m, None))]
    if missing:
        kind = type(loader).__name__
        raise ConfigError(
            f"register_data_loader({kind}, name={name!r}): a {kind} has no {' or '.join(f'{m}()' for m in missing)}, "
            "so its position cannot be saved and resumed. Use torchdata's StatefulDataLoader, a drop-in "
            "replacement for torch.utils.data.DataLoader (pip install torchdata; from torchdata.stateful_dataloader "
            "import StatefulDataLoader), or pass an object with state_dict()/load_state_dict()")


def keep_rng_across_first_iter(loader: Any, name: str) -> None:
    """Make the next ``iter(loader)`` (only the next one) leave the global torch RNG as
    it found it, when that is still the state ``resume()`` restored."""
    cls = type(loader)
    restored = torch.get_rng_state()

    def __iter__(self):
        self.__class__ = cls  # one shot: later epochs draw as an uninterrupted run does
        before = torch.get_rng_state()
        it = cls.__iter__(self)
        if torch.equal(before, restored):
            torch.set_rng_state(before)
        else:
            log.warning("exact resume: the torch RNG was used between resume() and the first iter() of loader %r; "
                        "its base-seed draw is kept, so random ops may differ from an uninterrupted run. Call "
                        "iter() right after resume(), or give the loader its own generator=", name)
        return it

    try:
        loader.__class__ = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__, _ORIGINAL: cls})
    except TypeError:  # a class whose instances cannot change class (slots, extension types)
        log.warning("exact resume: cannot watch the first iter() of loader %r (%s); if it draws from the global "
                    "torch RNG, give it its own generator= to resume exactly", name, cls.__name__)


def release(loader: Any) -> None:
    """Undo :func:`keep_rng_across_first_iter` if its ``iter()`` has not come (the
    manager calls it at the first save after a resume: the first step has run)."""
    original = getattr(type(loader), _ORIGINAL, None)
    if original is not None:
        loader.__class__ = original


class WorkerRNGDataset:
    """A map-style dataset as a loader worker sees it: the user's dataset plus the
    worker's RNG states in its ``state_dict()``. Reads and writes of other attributes
    go to the user's dataset (a ``worker_init_fn`` that sets
    ``get_worker_info().dataset.x`` sets it there)."""

    def __init__(self, dataset: Any):
        object.__setattr__(self, "_cloudckpt_inner", dataset)

    def __getitem__(self, index):
        return self._cloudckpt_inner[index]

    def __len__(self) -> int:
        return len(self._cloudckpt_inner)

    def __getattr__(self, name: str):
        if name == "_cloudckpt_inner":  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self._cloudckpt_inner, name)  # __getitems__ too, when the dataset has it

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cloudckpt_inner, name, value)

    def __reduce__(self):  # spawn / forkserver workers get it pickled
        return (WorkerRNGDataset, (self._cloudckpt_inner,))

    def state_dict(self) -> dict[str, Any]:
        from torch.utils.data import get_worker_info

        inner = self._cloudckpt_inner
        state: dict[str, Any] = {}
        if get_worker_info() is not None:  # only a worker's RNG is this dataset's to keep
            state[exact_resume.WORKER_KEY] = exact_resume.capture_rng_state(cuda=False)
        if _is_stateful(inner):
            state["dataset"] = inner.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        inner = self._cloudckpt_inner
        if not isinstance(state, dict) or exact_resume.WORKER_KEY not in state and "dataset" not in state:
            if _is_stateful(inner):  # saved before cloudckpt kept worker RNGs: the dataset's own state
                inner.load_state_dict(state)
            return
        if "dataset" in state and _is_stateful(inner):
            inner.load_state_dict(state["dataset"])
        if exact_resume.WORKER_KEY in state:  # last: the states as they were after the saved batch
            exact_resume.restore_rng_state(state[exact_resume.WORKER_KEY], where="a loader worker's saved state")


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class _WorkersGetWorkerRNG:
    """``loader._get_iterator`` (an instance attribute, ahead of the class's method):
    the iterator it starts, and so its workers, get the dataset in a WorkerRNGDataset."""

    def __init__(self, loader: Any):
        self._loader = weakref.ref(loader)  # no cycle: the loader holds this object

    def __deepcopy__(self, memo):  # a deep copy of the loader starts its own iterators
        loader = self._loader()
        return _WorkersGetWorkerRNG(memo.get(id(loader), loader))

    def __reduce__(self):  # a pickled loader (the loader is memoised before its attributes)
        return (_WorkersGetWorkerRNG, (self._loader(),))

    def __call__(self):
        loader = self._loader()
        get = type(loader)._get_iterator
        if loader.num_workers == 0:  # __getitem__ runs here: the rank's RNG, saved and restored already
            return get(loader)
        dataset = loader.dataset
        object.__setattr__(loader, "dataset", WorkerRNGDataset(dataset))  # DataLoader forbids a plain set
        try:
            return get(loader)
        finally:
            object.__setattr__(loader, "dataset", dataset)


def watch_workers(loader: Any, name: str) -> None:
    """Make the workers of a torchdata ``StatefulDataLoader`` keep their RNG states in
    the loader's state, and warn, naming the case, where a resume cannot repeat them."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return
    if not isinstance(loader, StatefulDataLoader) or isinstance(loader.__dict__.get("_get_iterator"),
                                                                 _WorkersGetWorkerRNG):
        return
    from torch.utils.data import IterableDataset

    try:
        from torch.utils.data import IterDataPipe, MapDataPipe
        pipes: tuple = (IterDataPipe, MapDataPipe)
    except ImportError:
        pipes = ()
    dataset, workers = loader.dataset, loader.num_workers
    if isinstance(dataset, IterableDataset) or (pipes and isinstance(dataset, pipes)):
        if workers > 0:
            log.warning(WORKER_RNG_NOT_KEPT, name, type(dataset).__name__)
        return
    if workers > 0 and not loader.in_order:
        log.warning(NOT_IN_ORDER, name)
    loader._get_iterator = _WorkersGetWorkerRNG(loader)


WORKER_RNG_NOT_KEPT = (
    "exact resume: loader %r has num_workers > 0 and an IterableDataset (%s): its workers' RNG states are not saved, "
    "so random ops in the dataset (augmentation with torch.rand*, random, numpy.random) draw other numbers after a "
    "resume than the uninterrupted run. Resumes repeat them for map-style datasets, or with num_workers=0, or "
    "when the dataset draws from a generator it saves in its own state_dict()")
NOT_IN_ORDER = (
    "exact resume: loader %r has in_order=False and num_workers > 0: torchdata gives no guarantee for the state of "
    "such a loader, so a resume may repeat or skip batches and random ops; use in_order=True (the default) to "
    "resume exactly")
