"""Where a folder or object lives: its URL and the options that reach it, as one value.

A ``Location`` is built once, at the API boundary, from what the user gave (a URL or
path and optional :class:`StorageOptions`); the checkpoint layer, discovery,
retention, the latest pointer, the CLI and the integrations pass it around instead of
``(url, storage_options)`` pairs. Its store is the registry's shared instance for the
URL's scheme and these options (``open_store``), looked up when first used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Union

from . import url as urls
from .base import ObjectStore, StorageOptions
from .registry import open_store


@dataclass(frozen=True)
class Location:
    url: str
    options: StorageOptions = field(default_factory=StorageOptions)

    @classmethod
    def of(cls, where: "Where", options: StorageOptions | None = None) -> "Location":
        """``where`` as a Location: a URL or path with ``options`` (default options when
        None), or a Location as it is (``options``, if given, replace its own)."""
        if isinstance(where, Location):
            return where if options is None or options == where.options else cls(where.url, options)
        return cls(os.fspath(where), options or StorageOptions())

    @property
    def store(self) -> ObjectStore:
        return open_store(self.url, self.options)

    @property
    def prefix(self) -> str:
        """The URL as a folder prefix (one trailing slash)."""
        return urls.as_prefix(self.url)

    @property
    def name(self) -> str:
        return urls.basename(self.url)

    def join(self, *parts: str) -> "Location":
        return Location(urls.join(self.url, *parts), self.options)

    def at(self, url: str) -> "Location":
        """Another URL reached with the same options (e.g. one found by listing this one)."""
        return Location(url, self.options)

    def parent(self) -> "Location":
        return Location(urls.parent(self.url), self.options)

    def resolved(self) -> "Location":
        """Local paths with every link resolved (:func:`~cloudckpt.storage.url.resolve_local`)."""
        return Location(urls.resolve_local(self.url), self.options)

    def resolved_step(self) -> "Location":
        """Like :meth:`resolved` for the parent only (:func:`~cloudckpt.storage.url.resolve_step_dir`)."""
        return Location(urls.resolve_step_dir(self.url), self.options)

    def __str__(self) -> str:
        return self.url


Where = Union[str, "os.PathLike[str]", Location]
