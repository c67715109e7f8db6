"""A DCP StorageWriter that writes shards to a local work dir and uploads each
file as soon as it is closed (writing and uploading overlap).

The files are standard DCP (``__{R}_{K}.distcp`` + ``.metadata``), so the folder
stays readable by stock ``FileSystemReader`` once downloaded.
"""

from __future__ import annotations

import math
import queue
import threading
from contextlib import contextmanager
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _split_by_size_and_type
from torch.distributed.checkpoint.planner import WriteItemType

_MiB = 1024 * 1024


def _chunk_bytes(item) -> int:
    td = item.tensor_data
    return math.prod(td.chunk.sizes) * torch._utils._element_size(td.properties.dtype)


class _NotifyingFileSystem(FileSystem):
    """A local FileSystem that calls ``on_closed(path)`` for every finished file
    (``.tmp`` files are reported after their rename)."""

    def __init__(self, on_closed: Callable[[str], None]):
        self._on_closed = on_closed

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield stream
        if "w" in mode and not str(path).endswith(".tmp"):
            self._on_closed(str(path))

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        self._on_closed(str(new_path))


class UploadingWriter(FileSystemWriter):
    """Writes into ``local_dir`` and calls ``on_file(local_path)`` when each file
    is complete. ``ranges`` holds, after ``write_data``, the item byte ranges of
    every shard file: ``{file_name: [(offset, length), ...]}``."""

    def __init__(
        self,
        local_dir: str,
        on_file: Callable[[str], None],
        *,
        thread_count: int = 2,
        target_file_size: int = 256 * _MiB,
        max_files_per_rank: int = 64,
    ):
        super().__init__(local_dir, single_file_per_rank=True, sync_files=False, thread_count=thread_count, overwrite=True)
        self.fs = _NotifyingFileSystem(on_file)
        self.target_file_size = target_file_size
        self.max_files_per_rank = max_files_per_rank
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def write_data(self, plan, planner):
        # More, smaller files than stock DCP (one per thread) so uploads start while
        # later files are still being written; bounded to keep request counts low.
        items = plan.items
        # this rank's bytes: DCP's _item_size counts the whole (global) tensor, not the chunk
        total = sum(_chunk_bytes(i) for i in items if i.type != WriteItemType.BYTE_IO)
        bins = max(self.thread_count, min(self.max_files_per_rank, math.ceil(total / self.target_file_size)))
        bins = max(1, min(bins, len(items)))
        file_queue: queue.Queue = queue.Queue()
        for k, bucket in enumerate(b for b in _split_by_size_and_type(bins, list(items)) if b):
            name = f"{plan.storage_data.prefix}{k}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
        fut = self._write_data(planner, file_queue)
        for wr in fut.value():
            sd = wr.storage_data
            with self._lock:
                self.ranges.setdefault(sd.relative_path, []).append((sd.offset, sd.length))
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

