"""Async saving: a synchronous staging copy to host memory, then the whole save
protocol (write, upload, agree, commit) in one background thread.

- The background thread coordinates only on the checkpointer's own gloo group,
  never on the training process group, so training collectives go on meanwhile.
  Saves run one after another on that thread, so every rank issues the group's
  collectives in the same order.
- At most ``max_in_flight`` saves are staged or running; a new save waits.
- A failed async save is never committed (the protocol guarantees it); its error
  surfaces once, on the first of: ``wait()``, the next save, ``close()``. A save
  submitted with ``commit=False`` (its Future holds a PendingCommit the caller
  commits, as the Lightning plugin does) reports its error through that Future only.
- Memory: with ``max_in_flight=1`` one set of host buffers (pinned when CUDA is
  present) is allocated at the first save and reused by every later save, so
  host memory above baseline is the state size S plus the transfer buffers;
  ``release()`` frees them (``close()`` does).
"""

from __future__ import annotations

import copy
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


def _structure(sd: Any) -> Any:
    if isinstance(sd, dict):
        return tuple((k, _structure(v)) for k, v in sd.items())
    if isinstance(sd, (list, tuple)):
        return tuple(_structure(v) for v in sd)
    if isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return ("T", tuple(local.shape), local.dtype)
    return type(sd).__name__


def _alloc_like(obj: Any, pin: bool) -> Any:
    """Empty host buffers shaped like ``obj`` (DTensors keep their spec). Unlike DCP's
    ``_create_cpu_state_dict`` it does not deep-copy a DTensor first (which holds a
    second copy of every local shard at the first save)."""
    from torch.distributed.tensor import DTensor

    from .._torch_compat import dtensor_like

    def buf(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.size(), dtype=t.dtype, device="cpu")
        return out.pin_memory() if pin else out

    if isinstance(obj, DTensor):
        return dtensor_like(buf(obj.to_local()), obj)
    if isinstance(obj, torch.Tensor):
        return buf(obj)
    if isinstance(obj, dict):
        return {k: _alloc_like(v, pin) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_alloc_like(v, pin) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_alloc_like(v, pin) for v in obj)
    return obj


class AsyncSaver:
    def __init__(self, save_fn: Callable[..., Any], *, max_in_flight: int = 1):
        self._save_fn = save_fn
        self.max_in_flight = max_in_flight
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloudckpt-async")
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._pending: list[Future] = []
        self._unreported: list[BaseException] = []
        self._lock = threading.Lock()
        self._cache: dict | None = None
        self._cache_key: Any = None
        self._cache_busy = False

    # ------------------------------------------------------------ staging
    def _stage(self, state_dict: dict) -> tuple[dict, bool]:
        from .._torch_compat import copy_state_dict, stateful_to_state_dict

        sd = stateful_to_state_dict(state_dict)
        key = _structure(sd)
        pin = torch.cuda.is_available()
        with self._lock:
            reuse = self.max_in_flight == 1 and not self._cache_busy
            if reuse:
                if self._cache is None or self._cache_key != key:
                    self._cache = None  # drop the old buffers before allocating new ones
                    self._cache = _alloc_like(sd, pin)
                    self._cache_key = key
                self._cache_busy = True
                target = self._cache
        if not reuse:
            target = _alloc_like(sd, pin)
        staged = copy_state_dict(sd, target, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        return staged, reuse

    # ------------------------------------------------------------ API
    def submit(self, dir: str, state_dict: dict, train_state: Any, ephemeral: bool, step: int | None = None,
               commit: bool = True) -> Future:
        return self.submit_call(
            lambda staged, ts: self._save_fn(dir, staged, ts, ephemeral=ephemeral, step=step, commit=commit),
            state_dict, train_state, report=commit)

    def submit_call(self, fn: Callable[[dict, Any], Any], state_dict: dict, train_state: Any, *,
                    report: bool = True) -> Future:
        """Stage ``state_dict`` and ``train_state`` here, then run ``fn(staged, train_state)``
        on the background thread (in submission order). ``report=False``: the caller
        takes the error from the Future; it is not raised again later."""
        self.raise_unreported()
        self._slots.acquire()
        try:
            staged, uses_cache = self._stage(state_dict)
            ts = copy.deepcopy(train_state)
        except BaseException:
            self._slots.release()
            raise

        def run():
            try:
                return fn(staged, ts)
            finally:
                if uses_cache:
                    with self._lock:
                        self._cache_busy = False
                self._slots.release()

        fut = self._pool.submit(run)
        with self._lock:
            self._pending.append(fut)
        fut.add_done_callback(lambda f: self._on_done(f, report=report))
        return fut

    def _on_done(self, fut: Future, *, report: bool) -> None:
        with self._lock:
            if fut in self._pending:
                self._pending.remove(fut)
            exc = fut.exception() if not fut.cancelled() else None
            if exc is not None and report:
                self._unreported.append(exc)
                log.error("async save failed (nothing was committed): %s", exc)

    def raise_unreported(self) -> None:
        with self._lock:
            errs, self._unreported = self._unreported, []
        if errs:
            raise errs[0]

    def in_flight(self) -> list[Future]:
        with self._lock:
            return list(self._pending)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every in-flight save; raise the first unreported failure."""
        for f in self.in_flight():
            try:
                f.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - collected by _on_done, raised below
                pass
        self.raise_unreported()

    def release(self) -> None:
        with self._lock:
            if not self._cache_busy:
                self._cache = None
                self._cache_key = None

    def close(self, wait: bool = True) -> None:
        try:
            if wait:
                self.wait()
        finally:
            self._pool.shutdown(wait=wait, cancel_futures=not wait)
            self.release()
