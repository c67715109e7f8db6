"""Batches of transfers: submit many, collect the results in order, stop at the
first error (``TransferEngine.upload_all`` / ``download_all`` / ``read_all`` /
``wait_all``)."""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Sequence


def run_all(submit: Callable[[Any], Future], items: Iterable) -> list:
    """``submit`` each item; the results in input order. The first fatal error
    cancels the transfers that have not started and is raised (started ones finish
    in the background)."""
    failed = threading.Event()
    futures: list[Future] = []
    # held while a transfer is submitted and listed, and while a failure cancels the
    # listed ones: a transfer queued by ``submit`` is listed before a failure's
    # callback looks at the list (re-entrant: an inline executor fails inside submit)
    listing = threading.RLock()

    def on_done(f: Future) -> None:
        # runs in the failing worker inside set_exception, while the engine still
        # holds the failed transfer's slot: the rest are cancelled before any of
        # them can be admitted
        if f.cancelled() or f.exception() is not None:
            with listing:
                failed.set()
                for other in list(futures):
                    other.cancel()

    for item in items:
        with listing:
            if failed.is_set():
                break  # do not even queue the rest (matters with an inline executor)
            f = submit(item)
            futures.append(f)
            f.add_done_callback(on_done)  # at once if it already failed: before the next submit
    try:
        return wait_all(futures)
    finally:
        # the callbacks' closure holds this list: empty it, or futures -> callback ->
        # list -> futures keeps every result (read bytes) alive until the GC runs
        futures.clear()


def wait_all(futures: Sequence[Future]) -> list:
    """Results of ``futures`` in order. On the first error (in time) cancel the
    futures that have not started and raise that error."""
    futures = list(futures)
    done: queue.SimpleQueue = queue.SimpleQueue()
    for f in futures:
        f.add_done_callback(done.put)
    for _ in range(len(futures)):
        f = done.get()
        if f.cancelled() or f.exception() is not None:
            for other in futures:
                other.cancel()
            if f.cancelled():
                # a cancellation is usually the echo of an error (the batch cancels
                # the rest from the failing future's callbacks): raise the error
                failed = [x for x in futures if x.done() and not x.cancelled() and x.exception() is not None]
                if failed:
                    raise failed[0].exception()
                raise cf.CancelledError("a transfer was cancelled")
            raise f.exception()
    return [f.result() for f in futures]
