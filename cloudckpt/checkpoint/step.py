"""A step folder as one value: where it is, how it is reached, its number.

A :class:`StepRef` is built once, at the public API, from what the user gave (a URL
or path, or a ``Location`` with its storage options); the user's own links above the
step are followed there, once. Below the API a step travels as this value, never as a
string, and it is the only place that joins a step's object names (``layout.py``
spells them) to its URL: the marker, the lock, rank R's manifest part, the DCP index
header and parts, rank R's train state, the DCP folder and its files.

A step replaced in one step (``save_overwrite``, marker format 4) keeps every object
but its marker and lock under a folder of its own, ``root`` (``.replace/{save id}``);
a ``StepRef`` with that root joins the objects' names under it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from ..storage import Location, StorageOptions, Where
from ..storage import url as urls
from . import layout


@dataclass(frozen=True)
class StepRef:
    """The step folder ``loc`` (resolved above the step), its number (None for a folder
    not named ``step{N}`` whose caller gave no number: a load reads the number from the
    marker) and the folder under it that holds its objects (``root``: "" but for a
    replaced step)."""

    loc: Location
    number: int | None = None
    root: str = ""

    @classmethod
    def of(cls, where: "Where | StepRef", options: StorageOptions | None = None, *, step: int | None = None,
           named: bool = False) -> "StepRef":
        """The step folder ``where``. ``step``: its number, for a folder not named
        ``step{N}``; ``named``: the number must come from the name or ``step`` (a
        save). Raises NotACheckpoint (``named`` and the last component is not
        ``step{N}``), InvalidURL."""
        if isinstance(where, StepRef):
            return where if step is None or step == where.number else cls(where.loc, int(step), where.root)
        loc = Location.of(where, options)
        if step is not None:
            number: int | None = int(step)
        elif named:
            number = layout.parse_step_dir(loc.url)
        else:
            number = layout.step_of_name(loc.name)
        return cls(loc.resolved_step(), number)

    # ------------------------------------------------------------ where
    @property
    def url(self) -> str:
        return self.loc.url

    @property
    def store(self):
        return self.loc.store

    def __str__(self) -> str:
        return self.loc.url

    def connect_in_background(self) -> None:
        """Build the store's client on a daemon thread: ranks other than rank 0 would wait
        anyway while rank 0 reads the marker or takes the lock, and building boto3's client
        costs ~0.15-0.3 s of CPU (and, with the objects it leaves, a full GC) that would
        otherwise land inside the save or load. A failure is left to the first real
        request, which raises it with its URL."""
        def connect() -> None:
            with contextlib.suppress(Exception):
                self.loc.store.connect()

        threading.Thread(target=connect, name="cloudckpt-connect", daemon=True).start()

    def with_root(self, root: str) -> "StepRef":
        """This step with its objects under ``root`` (a replaced step's ``.replace/{id}``;
        "" for the step folder itself). ``root`` comes from a checked marker or from the
        save that chose it."""
        return StepRef(self.loc, self.number, root)

    # ------------------------------------------------------------ its objects
    def url_of(self, rel: str) -> str:
        """The URL of the object ``rel`` (a name relative to the step, as layout.py spells
        it; under ``root`` for a replaced step)."""
        return urls.join(self.loc.url, self.root, rel) if self.root else urls.join(self.loc.url, rel)

    def at(self, rel: str) -> Location:
        """The object or folder ``rel`` of the step as a Location (same storage options)."""
        return self.loc.join(self.root, rel) if self.root else self.loc.join(rel)

    @property
    def prefix(self) -> str:
        """The step folder as a prefix (every object of the step, its marker included, starts with it)."""
        return self.loc.prefix

    @property
    def objects_prefix(self) -> str:
        """The prefix of the step's objects: the step folder, or its ``root`` under it."""
        return self.loc.join(self.root).prefix if self.root else self.loc.prefix

    @property
    def marker_url(self) -> str:
        return urls.join(self.loc.url, layout.MARKER)

    @property
    def lock_url(self) -> str:
        return urls.join(self.loc.url, layout.LOCK)

    @property
    def model(self) -> Location:
        """The DCP folder (``model_and_optim/``)."""
        return self.at(layout.MODEL_DIR)

    @property
    def metadata_url(self) -> str:
        """DCP's ``.metadata``."""
        return self.url_of(layout.DCP_METADATA)

    @property
    def index_header_url(self) -> str:
        return self.url_of(layout.INDEX_HEADER)

    def part_url(self, rank: int) -> str:
        """Rank ``rank``'s manifest part."""
        return self.url_of(layout.part_name(rank))

    def index_part_url(self, rank: int) -> str:
        """Rank ``rank``'s part of the DCP index."""
        return self.url_of(layout.index_part_name(rank))

    def train_state_url(self, rank: int) -> str:
        return self.url_of(layout.train_state_name(rank))


__all__ = ["StepRef"]
