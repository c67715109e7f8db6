"""The progress hook of the operations: told the total once, then bytes as they move."""

from __future__ import annotations

from typing import Protocol

from ..transfer import ProgressSubscriber


class Progress(Protocol):
    def start(self, total: int) -> None:
        """Called once, before any ``update``, with the bytes the operation will move."""

    def update(self, n: int) -> None:
        """``n`` more bytes moved (negative: an attempt restarted and took them back)."""


def engine_subscriber(progress: Progress):
    """A transfer-engine progress subscriber feeding ``progress``: ``start`` with the
    size of the first transfer queued whose size is known (later ones add to an
    update-only bar: callers queue one upload, or start the total themselves and
    queue downloads of unknown size), ``update`` with the bytes moved."""
    class _Forward(ProgressSubscriber):
        started = False

        def on_queued(self, url: str, size: int | None) -> None:
            if size is not None and not self.started:
                self.started = True
                progress.start(size)

        def on_progress(self, url: str, nbytes: int) -> None:
            progress.update(nbytes)

    return _Forward()
