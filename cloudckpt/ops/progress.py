"""The progress hook of the operations: told the total once, then bytes as they move."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, total: int) -> None:
        """Called once, before any ``update``, with the bytes the operation will move."""

    def update(self, n: int) -> None:
        """``n`` more bytes moved (negative: an attempt restarted and took them back)."""
