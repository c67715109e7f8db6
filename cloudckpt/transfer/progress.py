"""Progress plug-ins: subscribe to an engine's transfers.

Callbacks run on the engine's worker threads; keep them quick. An exception in
a subscriber is logged and does not fail the transfer.
"""

from __future__ import annotations

import threading


class ProgressSubscriber:
    """Base class: override what you need.

    - ``on_queued(url, size)``: a transfer was submitted; ``size`` in bytes, or None
      when unknown up front (downloads, open-ended reads).
    - ``on_progress(url, nbytes)``: bytes moved since the last call; negative when an
      attempt is restarted (what the failed attempt had reported is taken back), so
      the calls of a successful transfer sum to its size.
    - ``on_done(url, result_or_exception)``: a TransferResult (or ``bytes`` for range
      reads) on success, else the exception (CancelledError when cancelled).
    """

    def on_queued(self, url: str, size: int | None) -> None:
        pass

    def on_progress(self, url: str, nbytes: int) -> None:
        pass

    def on_done(self, url: str, result_or_exception) -> None:
        pass


class TqdmProgress(ProgressSubscriber):
    """One tqdm bar of total bytes over all transfers (the total grows as transfers
    are queued). ``close()`` when done; also a context manager."""

    def __init__(self, desc: str = "transfer", **tqdm_kwargs):
        from tqdm.auto import tqdm

        kw = dict(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True)
        kw.update(tqdm_kwargs)
        self.bar = tqdm(**kw)
        self._lock = threading.Lock()
        self.failed = 0

    def on_queued(self, url: str, size: int | None) -> None:
        if size:
            with self._lock:
                self.bar.total = (self.bar.total or 0) + size
                self.bar.refresh()

    def on_progress(self, url: str, nbytes: int) -> None:
        with self._lock:
            self.bar.update(nbytes)

    def on_done(self, url: str, result_or_exception) -> None:
        if isinstance(result_or_exception, BaseException):
            with self._lock:
                self.failed += 1
                self.bar.set_postfix(failed=self.failed)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
