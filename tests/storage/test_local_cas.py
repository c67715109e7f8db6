"""The local backend's compare-and-replace (``put_bytes_if_match``: the ``latest``
pointer, a stale lock's takeover): one winner per version under contention, and no
sidecar lock file left behind (a folder holding only one would never look empty)."""

from __future__ import annotations

import os
import threading

from cloudckpt.errors import PreconditionFailed
from cloudckpt.storage import open_store


def _race(store, url: str, version: str, round_: int, writers: int = 8) -> list[int]:
    """``writers`` threads replace ``url`` at once, all with ``version``; returns the winners."""
    start = threading.Barrier(writers)
    won: list[int] = []

    def writer(i: int) -> None:
        start.wait()
        try:
            store.put_bytes_if_match(url, f"{round_}-{i}".encode(), version)
            won.append(i)
        except PreconditionFailed:
            pass

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a compare-and-replace hung"
    return won


def test_racing_compare_and_replace_has_one_winner_per_version_and_leaves_no_sidecar(tmp_path):
    url = str(tmp_path / "run" / "latest")
    store = open_store(url)
    store.put_bytes(url, b"0")
    for round_ in range(20):
        _, version = store.get_bytes_versioned(url)
        won = _race(store, url, version, round_)
        assert len(won) == 1, f"round {round_}: winners {won}"
        assert store.get_bytes(url) == f"{round_}-{won[0]}".encode()
    assert sorted(os.listdir(tmp_path / "run")) == ["latest"], "a sidecar or temp file was left behind"
