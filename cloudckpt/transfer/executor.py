"""Executors the engine can run its transfers on."""

from __future__ import annotations

from concurrent.futures import Executor, Future


class SerialExecutor(Executor):
    """Runs each submitted callable inline, in the submitting thread, and returns an
    already-finished future: deterministic tests (``TransferEngine(executor=SerialExecutor())``).
    With it, submit_* returns only after the transfer finished (or was retried out)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the future, like a thread pool does
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing runs in the background: nothing to stop."""
