"""A finished transfer's result is freed as soon as the caller drops its future (no reference cycle)."""

from __future__ import annotations

import gc
import os
import weakref

from cloudckpt.transfer import TransferEngine


def test_finished_read_is_freed_without_the_garbage_collector(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    with TransferEngine() as eng:
        gc.disable()
        try:
            fut = eng.submit_read(str(path), 0, 1 << 20)
            assert len(fut.result()) == 1 << 20
            ref = weakref.ref(fut)
            del fut
            assert ref() is None, "the future (and its bytes) outlived the caller's reference"
        finally:
            gc.enable()
