"""Data loaders registered for exact resume (``CheckpointManager.register_data_loader``).

Two things make a loader resume exactly, and both are checked or handled here:

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
"""

from __future__ import annotations

import logging
from typing import Any

import torch

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
