"""A finished transfer's result is freed as soon as the caller drops its future (no reference cycle)."""

from __future__ import annotations

import gc
import os
import sys
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


def test_read_all_keeps_no_reference_to_its_results(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    with TransferEngine() as eng:
        gc.disable()
        try:
            out = eng.read_all([(str(path), 0, 1 << 19), (str(path), 1 << 19, 1 << 20)])
            assert sum(map(len, out)) == 1 << 20
            # as many references as bytes held by a plain list only: one more would be a
            # finished future kept alive by a reference cycle
            control = [os.urandom(8), os.urandom(8)]
            assert [sys.getrefcount(b) for b in out] == [sys.getrefcount(b) for b in control]
        finally:
            gc.enable()
