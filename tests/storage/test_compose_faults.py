"""An assembly's complete whose answer is lost (storage/assembly.py), against SeaweedFS
behind the fault proxy: the store applied it and the client's retry (botocore's) is
answered as a success (SeaweedFS answers a repeated CompleteMultipartUpload of a
completed upload with the object; a store that answered NoSuchUpload instead would make
it NotFound, as below), so the complete returns the object; a complete of an upload that
someone aborted is NotFound and changes nothing."""

from __future__ import annotations

import pytest

from cloudckpt.errors import NotFound
from cloudckpt.storage import StorageOptions, open_store
from cloudckpt.testing.conformance import payload
from cloudckpt.testing.faultproxy import FaultProxy, Rule
from cloudckpt.units import MiB


def _pieces(store, assembly, data: bytes) -> list:
    half = 5 * MiB
    return [store.put_piece(assembly, 0, data[:half], offset=0),
            store.put_piece(assembly, 1, data[half:], offset=half)]


def test_a_complete_whose_answer_was_lost_returns_the_object_the_store_made(s3_bucket, seaweed):
    data = payload(5 * MiB + 100)
    url = s3_bucket + "/lost/.metadata"
    with FaultProxy(seaweed.endpoint_url, seed=1, flavor="s3") as proxy:
        proxy.add(Rule("reset", method="POST", key=r"uploadId=", when="response", times=1))
        store = open_store(url, StorageOptions(endpoint_url=proxy.endpoint_url, max_attempts=3))
        assembly = store.begin_assembly(url)
        info = store.complete_assembly(assembly, _pieces(store, assembly, data))
        assert proxy.injected()["reset"] == 1
    assert info.size == len(data)
    assert open_store(url).get_bytes(url) == data


def test_a_lost_answer_over_an_object_the_parts_did_not_make_stays_an_error(s3_bucket, seaweed):
    url = s3_bucket + "/lost/other"
    plain = open_store(url)
    with FaultProxy(seaweed.endpoint_url, seed=1, flavor="s3") as proxy:
        store = open_store(url, StorageOptions(endpoint_url=proxy.endpoint_url, max_attempts=3))
        assembly = store.begin_assembly(url)
        pieces = _pieces(store, assembly, payload(5 * MiB + 100, seed=2))
        plain.abort_assembly(assembly)  # gone before the complete: nobody completed it
        plain.put_bytes(url, b"someone else's")
        with pytest.raises(NotFound):
            store.complete_assembly(assembly, pieces)
    assert plain.get_bytes(url) == b"someone else's"
