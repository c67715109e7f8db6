"""A pickled store is its options: what a process hangs on it (a transfer engine's retry
listener, with its locks and queues) stays behind, so a store pickles whatever ran
before in the process (stores are shared per process: ``open_store``)."""

from __future__ import annotations

import pickle
import queue

from cloudckpt.storage import StorageOptions
from cloudckpt.storage.local import LocalStore


def test_a_store_with_a_listener_pickles_to_a_copy_with_its_options_only(tmp_path):
    store = LocalStore(StorageOptions(max_attempts=3))
    held = queue.SimpleQueue()  # what a transfer engine's listener holds: not picklable
    store.add_retry_listener(lambda url, q=held: q.put(url))
    copy = pickle.loads(pickle.dumps(store))
    assert type(copy) is LocalStore and copy.options == store.options
    url = str(tmp_path / "obj")
    copy.put_bytes(url, b"by the copy")
    assert store.get_bytes(url) == b"by the copy"
