"""Conditional replace is a capability a backend declares (``ObjectStore.conditional_replace``):
the declaration holds against the real servers, a store without it gets a typed error from
the base methods, and a save to it commits without calling them (the checkpointer reads
the capability; it does not call and catch)."""

from __future__ import annotations

import os

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout, pointer
from cloudckpt.errors import AlreadyExists, PreconditionFailed, StorageError
from cloudckpt.storage import ObjectStore, open_store
from cloudckpt.storage import url as urls
from cloudckpt.storage.gcs import GCSStore
from cloudckpt.storage.http import HTTPStore
from cloudckpt.storage.local import LocalStore
from cloudckpt.storage.s3 import S3Store


def test_each_backend_declares_whether_it_can_replace_conditionally():
    assert ObjectStore.conditional_replace is False  # a backend has to say it can
    assert {c.__name__: c.conditional_replace for c in (LocalStore, S3Store, GCSStore, HTTPStore)} == {
        "LocalStore": True, "S3Store": True, "GCSStore": True, "HTTPStore": False}


def test_a_declared_conditional_replace_holds_on_the_real_store(any_root):
    """What the declaration promises: a replace with the version read wins once; a replace
    with a stale version, or of an object deleted since, is PreconditionFailed."""
    store = open_store(any_root)
    assert store.conditional_replace
    url = urls.join(any_root, "latest")
    store.put_bytes(url, b"v1", if_absent=True)
    with pytest.raises(AlreadyExists):
        store.put_bytes(url, b"other", if_absent=True)
    data, v1 = store.get_bytes_versioned(url)
    assert data == b"v1"
    store.put_bytes_if_match(url, b"v2", v1)
    with pytest.raises(PreconditionFailed):
        store.put_bytes_if_match(url, b"stale", v1)
    assert store.get_bytes(url) == b"v2"
    _, v2 = store.get_bytes_versioned(url)
    store.delete(url)
    with pytest.raises(PreconditionFailed):
        store.put_bytes_if_match(url, b"gone", v2)


class _Plain(ObjectStore):
    """A backend that implements the primitives only (as a third-party one might)."""

    scheme = "plain"
    put_bytes = get_bytes = upload_fileobj = download_fileobj = stat = list = delete = None  # type: ignore[assignment]


def test_a_store_without_the_capability_raises_a_typed_error_naming_the_url():
    store = _Plain()
    for call in (lambda: store.get_bytes_versioned("plain://bucket/run/latest"),
                 lambda: store.put_bytes_if_match("plain://bucket/run/latest", b"x", "1")):
        with pytest.raises(StorageError, match="plain://bucket/run/latest") as ei:
            call()
        assert "conditional_replace" in str(ei.value) and type(ei.value) is StorageError


def test_a_save_to_a_store_without_the_capability_commits_without_calling_it(tmp_path, monkeypatch):
    folder = str(tmp_path / "run")
    asked: list[str] = []
    monkeypatch.setattr(LocalStore, "conditional_replace", False)
    for name in ("get_bytes_versioned", "put_bytes_if_match"):
        real = getattr(LocalStore, name)
        monkeypatch.setattr(LocalStore, name,
                            lambda self, url, *a, _real=real, **kw: asked.append(url) or _real(self, url, *a, **kw))
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    for step in (1, 2):
        ck.save(layout.step_dir(folder, step), {"w": torch.full((4,), float(step))}, {"step": step})
    assert not os.path.exists(pointer.pointer_url(folder)) and asked == []
    assert discovery.latest_checkpoint(folder) == layout.step_dir(folder, 2)  # found by listing
    target = {"w": torch.zeros(4)}
    assert ck.load(layout.step_dir(folder, 2), target) == {"step": 2}
    assert torch.equal(target["w"], torch.full((4,), 2.0))
