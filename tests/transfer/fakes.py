"""An in-memory ObjectStore with scripted faults, for engine-only tests.

Registered under the ``faulty://`` scheme. ``open_store("faulty://b/k", options)``
returns the (cached) instance, whose ``script(url, *actions)`` queues what the next
calls for that URL do before (or instead of) their normal work:

- an exception instance: raise it
- ``("block",)``: wait until ``release()`` (then carry on normally: a late result)
- ``("sleep", seconds)``: wait, then carry on
- ``("wait", event)``: wait until the test sets ``event`` (30 s at most), then carry on
- ``("wait", event, exc)``: the same, then raise ``exc``
- ``("midway", exc)``: (uploads) read and report half the file, then raise ``exc``
- ``("restart",)``: (uploads) read half the file, ``seek(0)``, then upload all of it
- ``("signal", kind)``: report an SDK retry of ``kind`` to the retry listeners, carry on
"""

from __future__ import annotations

import collections
import threading
import time

from cloudckpt.errors import AlreadyExists, NotFound
from cloudckpt.storage.base import ObjectInfo, ObjectStore
from cloudckpt.storage.registry import register_backend


class FaultyStore(ObjectStore):
    scheme = "faulty"

    def __init__(self, options=None):
        super().__init__(options)
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []
        self.chunk = 64 * 1024
        self._faults: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.active = 0
        self.peak_active = 0

    # -- scripting
    def script(self, url: str, *actions) -> None:
        with self._lock:
            self._faults[url].extend(actions)

    def release(self) -> None:
        self._released.set()

    def _enter(self, op: str, url: str):
        with self._lock:
            self.calls.append((op, url))
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
            q = self._faults.get(url)
            action = q.popleft() if q else None
        if isinstance(action, BaseException):
            raise action
        if action is None:
            return None
        if action[0] == "block":
            self._released.wait(30)
        elif action[0] == "sleep":
            time.sleep(action[1])
        elif action[0] == "wait":
            action[1].wait(30)
            if len(action) > 2:
                raise action[2]
        elif action[0] == "signal":
            self._notify_retry(action[1])
        return action

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1

    # -- primitives
    def put_bytes(self, url, data, *, if_absent=False):
        self.objects[url] = bytes(data)

    def get_bytes(self, url, *, start=None, end=None):
        try:
            self._enter("get", url)
            if url not in self.objects:
                raise NotFound(f"get {url}: no such object", url=url)
            return self.objects[url][start or 0: end]
        finally:
            self._leave()

    def upload_fileobj(self, fileobj, url, *, size, if_absent=False, progress=None):
        try:
            action = self._enter("upload", url)
            if action and action[0] == "restart":
                fileobj.read(size // 2)
                fileobj.seek(0)
            buf = bytearray()
            while True:
                chunk = fileobj.read(self.chunk)
                if not chunk:
                    break
                buf += chunk
                if progress:
                    progress(len(chunk))
                if action and action[0] == "midway" and len(buf) >= size // 2:
                    raise action[1]
            if if_absent and url in self.objects:
                raise AlreadyExists(f"{url} already exists", url=url)
            self.objects[url] = bytes(buf)
        finally:
            self._leave()

    def download_fileobj(self, url, fileobj, *, progress=None):
        try:
            self._enter("download", url)
            if url not in self.objects:
                raise NotFound(f"download {url}: no such object", url=url)
            data = self.objects[url]
            for i in range(0, len(data), self.chunk):
                fileobj.write(data[i: i + self.chunk])
                if progress:
                    progress(len(data[i: i + self.chunk]))
            return len(data)
        finally:
            self._leave()

    def stat(self, url):
        if url not in self.objects:
            raise NotFound(f"stat {url}: no such object", url=url)
        return ObjectInfo(url, len(self.objects[url]))

    def list(self, prefix, *, delimiter="/"):
        return iter(())

    def delete(self, url):
        self.objects.pop(url, None)


register_backend("faulty", f"{__name__}:FaultyStore")
