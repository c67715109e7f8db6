"""The ``latest`` pointer is no longer written (``docs/protocol.md``, ``bench/discovery.py``):
a save sends it no request, discovery costs 2 requests in the common case (LIST, marker of
the newest step), and a pointer an older version left (or someone planted) is read only by
``cloudckpt latest --pointer``, within its ceiling, refused when crafted, never deciding."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout, pointer
from cloudckpt.errors import CorruptCheckpoint
from cloudckpt.storage import open_store


def _save(ck, folder, step):
    ck.save(layout.step_dir(folder, step), {"w": torch.full((4,), float(step))}, {"step": step})


def _old_pointer(step: int, pending: bool = False) -> bytes:
    """The pointer as versions that wrote one left it."""
    return json.dumps({"step": step, "pending": pending, "dir": f"step{step}", "updated_unix": time.time()}).encode()


def test_a_save_sends_no_request_to_the_latest_pointer(s3_bucket, tmp_path):
    folder = s3_bucket + "/run"
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    _save(ck, folder, 1)  # connections and the bucket check warmed up
    store = open_store(folder)
    urls: list[str] = []
    store.client.meta.events.register("before-send.s3", lambda request, **kw: urls.append(request.url))
    _save(ck, folder, 2)
    assert urls and any(u.split("?")[0].endswith("/step2/.metadata.json") for u in urls), urls
    assert not [u for u in urls if u.split("?")[0].endswith("/run/latest")], urls
    assert not store.exists(pointer.pointer_url(folder))


def test_saves_on_every_backend_leave_no_pointer(any_root, tmp_path):
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    _save(ck, any_root, 5)
    _save(ck, any_root, 9)
    assert pointer.read(any_root) is None and not open_store(any_root).exists(pointer.pointer_url(any_root))
    assert discovery.latest_checkpoint(any_root) == layout.step_dir(any_root, 9)


def test_latest_checkpoint_costs_two_requests_and_three_with_the_pointer(s3_bucket, tmp_path):
    folder = s3_bucket + "/run"
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    for step in (1, 2, 3):
        _save(ck, folder, step)
    store = open_store(folder)
    calls: list[str] = []
    store.client.meta.events.register("before-send.s3", lambda request, **kw: calls.append(request.method))
    assert discovery.latest_checkpoint(folder) == layout.step_dir(folder, 3)
    assert calls == ["GET", "GET"]  # LIST of the step prefixes, GET step3/.metadata.json
    calls.clear()
    assert discovery.latest_checkpoint(folder, use_pointer=True) == layout.step_dir(folder, 3)
    assert calls == ["GET", "GET", "GET"]  # and the (missing) pointer


def test_an_old_pointer_stays_readable_and_never_decides(any_root, tmp_path, caplog):
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    for step in (2, 3):
        _save(ck, any_root, step)
    store = open_store(any_root)
    store.put_bytes(pointer.pointer_url(any_root), _old_pointer(2))
    assert pointer.read(any_root) == (2, False)
    with caplog.at_level(logging.WARNING, logger="cloudckpt.checkpoint.discovery"):
        assert discovery.latest_checkpoint(any_root, use_pointer=True) == layout.step_dir(any_root, 3)
    assert "using step3, newer than step2 named by the latest pointer: an older cloudckpt wrote" in caplog.text
    caplog.clear()
    # a pointer naming a step that is not committed ("pending", pruned, planted): the listing's answer
    store.put_bytes(pointer.pointer_url(any_root), _old_pointer(12, pending=True))
    with caplog.at_level(logging.WARNING, logger="cloudckpt.checkpoint.discovery"):
        assert discovery.latest_checkpoint(any_root, use_pointer=True) == layout.step_dir(any_root, 3)
    assert "using step3, older than step12 named by the latest pointer: that step is not committed" in caplog.text
    # saves leave it as it was
    _save(ck, any_root, 4)
    assert pointer.read(any_root) == (12, True)
    assert discovery.latest_checkpoint(any_root) == layout.step_dir(any_root, 4)


def test_cloudckpt_latest_pointer_shows_an_old_pointer(tmp_path):
    folder = str(tmp_path / "run")
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    for step in (2, 3):
        _save(ck, folder, step)
    open_store(folder).put_bytes(pointer.pointer_url(folder), _old_pointer(2))
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "latest", "--pointer", folder], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == layout.step_dir(folder, 3) + "\n", r
    assert "newer than step2 named by the latest pointer" in r.stderr
    r = subprocess.run([sys.executable, "-m", "cloudckpt", "latest", folder], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout == layout.step_dir(folder, 3) + "\n" and "pointer" not in r.stderr


PLANTED = {
    "infinity": b'{"step": Infinity}',
    "nan": b'{"step": NaN, "pending": false}',
    "huge-float": b'{"step": 1e400}',
    "long-int": b'{"step": ' + b"9" * 5000 + b"}",
    "negative": b'{"step": -3}',
    "above-2**63": b'{"step": 9223372036854775808}',
    "bool-step": b'{"step": true}',
    "string-step": b'{"step": "7"}',
    "float-step": b'{"step": 7.0}',
    "pending-string": b'{"step": 1, "pending": "no"}',
    "list": b"[1, 2, 3]",
    "deep": b'{"step": 1, "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    "deep-over-cap": b"[" * 100_000 + b"]" * 100_000,
    "deep-unbalanced": b"[" * 1_000_000,
    "not-utf8": b'{"step": 1, "x": "\xff"}',
    "empty": b"",
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_pointer_is_refused_typed_and_stops_nothing(case, any_root, tmp_path, caplog):
    store = open_store(any_root)
    url = pointer.pointer_url(any_root)
    store.put_bytes(url, PLANTED[case])
    with pytest.raises(CorruptCheckpoint, match="latest pointer"):
        pointer.parse(PLANTED[case], url=url)
    assert pointer.read(any_root) is None
    assert "ignoring unreadable latest pointer" in caplog.text
    _save(Checkpointer(work_dir=str(tmp_path / "w")), any_root, 3)
    assert discovery.latest_checkpoint(any_root, use_pointer=True) == layout.step_dir(any_root, 3)
    assert store.get_bytes(url) == PLANTED[case]  # left alone: saves never touch it


@pytest.mark.parametrize("backend", ["local", "s3", "gcs"])
def test_an_oversized_pointer_is_read_only_up_to_its_ceiling(backend, request, tmp_path):
    """A 64 MiB planted pointer: ``cloudckpt latest --pointer`` reads at most
    MAX_POINTER_BYTES + 1 bytes of it and refuses it; discovery still answers."""
    root = {"local": lambda: str(tmp_path / "run"), "s3": lambda: request.getfixturevalue("s3_bucket") + "/run",
            "gcs": lambda: request.getfixturevalue("gcs_bucket") + "/run"}[backend]()
    _save(Checkpointer(work_dir=str(tmp_path / "w")), root, 1)
    store = open_store(root)
    url = pointer.pointer_url(root)
    store.put_bytes(url, b'{"step": 1, "pad": "' + b"x" * (64 << 20) + b'"}')
    read: list[int] = []
    real = type(store).get_bytes

    def spy(self, u, **kw):
        out = real(self, u, **kw)
        if u == url:
            read.append(len(out))
        return out

    type(store).get_bytes = spy
    try:
        assert pointer.read(root) is None
        assert discovery.latest_checkpoint(root, use_pointer=True) == layout.step_dir(root, 1)
    finally:
        type(store).get_bytes = real
    assert read == [pointer.MAX_POINTER_BYTES + 1] * 2


def test_a_pointer_that_is_a_link_is_not_followed(tmp_path):
    folder = str(tmp_path / "run")
    _save(Checkpointer(work_dir=str(tmp_path / "w")), folder, 1)
    outside = tmp_path / "outside.json"
    outside.write_bytes(_old_pointer(7))
    os.symlink(outside, pointer.pointer_url(folder))
    with pytest.raises(Exception) as e:  # the local backend refuses a link: typed, never followed
        open_store(folder).get_bytes(pointer.pointer_url(folder))
    assert e.type.__module__ == "cloudckpt.errors"
    assert discovery.latest_checkpoint(folder) == layout.step_dir(folder, 1)
