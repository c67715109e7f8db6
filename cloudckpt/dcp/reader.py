"""A DCP StorageReader that reads byte ranges straight from the store.

This module is the reader's DCP protocol side (metadata, checks, putting an item in
place, the memory budget); the two ways of loading live beside it: streaming.py (the
default) and predownload.py (``pre_download=True``), both built on resumable.py.

Requests are grouped per shard file, sorted, and coalesced into streams (never
splitting an item; neighbours closer than ``max_gap`` join; streams of about
``budget()[1]`` bytes, within one file). Each stream is one ranged read
(``store.open_range``: one GET on S3) run by the transfer engine; on the stream's
thread, each item is read, checked against its CRC32C from the commit marker and
put into its target (items.py: straight into the target tensor where it can be),
then the next one is read. The thread running ``read_data`` waits for them all.

Memory stays bounded and proportional to what the rank loads: items being read or
put in place hold at most a sixteenth of the rank's planned bytes (32 MiB to
``max_inflight_bytes``; one item at least), and a stream waits for room before it
reads its next item. Streams are a quarter of the planned bytes (16 MiB to
``max_stream_size``), so a rank reads through about four requests at once.

A stream that fails part-way (a reset, a timeout, a stall) is retried by the engine
from its first item not taken yet; an attempt the engine gave up on takes nothing
more, so no item is put in place twice; once the load has failed, no stream starts
another item, and ``read_data`` returns only when none is being put in place.

``pre_download=True`` (``local_dir``) instead downloads each run of needed items
to a local file and reads the items back from there (predownload.py).
"""

from __future__ import annotations

import io
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .. import dist
from ..errors import CorruptCheckpoint, InternalError
from ..storage import url as urls
from ..transfer import crc32c_bytes
from ..units import MiB
from .exchange import for_coordinator
from .items import load_tensor_into
from .predownload import read_predownloaded
from .resumable import coalesce  # noqa: F401 - imported from here too (dcp/__init__, callers)
from .streaming import read_streamed

log = logging.getLogger(__name__)

# (offset, length) -> crc32c hex, per relative file name
Checksums = dict[str, dict[tuple[int, int], str]]


@dataclass
class ShardSource:
    """Where a rank's load reads the DCP shards from, and what it checks them against.

    Attributes:
        url: the DCP folder (``{step}/model_and_optim``).
        stream: ``stream(url, start, end, job)`` runs ``job(open_from, progress)`` on a
            transfer thread and returns its Future (``TransferEngine.submit_stream``).
        streamed: the store reads a range as one streamed request
            (``ObjectStore.streams_ranges``); if not, streams are kept to a quarter of
            the in-flight budget (each is then one request, held whole).
        checksums: ``{file: {(offset, length): crc32c}}`` known before the plan (the
            files a marker lists itself).
        verify: check each item's CRC32C (sizes are always checked).
        manifest: for a manifest in parts, ``manifest(files)`` gives the ``(checksums,
            sizes)`` of the files this rank's plan reads, asked for once the plan is
            known; every item the plan reads must then lie inside one of them.
    """

    url: str
    stream: Callable[[str, int, int, Callable], Future]
    streamed: bool = True
    checksums: Checksums = field(default_factory=dict)
    verify: bool = True
    manifest: Callable[[list[str]], tuple[Checksums, dict[str, int]]] | None = None


class StreamingReader(StorageReader):
    """DCP's StorageReader over a :class:`ShardSource`: plans are checked against the
    manifest (:meth:`check_plan`), items are read in streams and put in place
    (:meth:`read_data`). The DCP ``Metadata`` comes from the caller
    (``set_up_storage_reader``: a load plans against what ``CommittedStep`` read).

    Args:
        source: where the shards are and what they are checked against.
        local_dir: pre-download into this folder (streams too: one per file, written to
            disk) instead of streaming into the targets.
        exchange: the read-once exchange (exchange.py; collective: on every rank or
            none), or a ``dist.Coordinator``: the job's exchange, on a group of its own
            made at the first load (none for one process). Items several ranks need are
            then read from the bucket by one of them and sent to the others.
        max_gap, max_stream_size, max_inflight_bytes, download_ahead: the streams'
            shape and the memory bound (:meth:`budget`).
    """

    def __init__(self, source: ShardSource, *, local_dir: str | None = None, exchange: Any = None,
                 max_gap: int = 1 * MiB, max_stream_size: int = 512 * MiB, max_inflight_bytes: int = 512 * MiB,
                 download_ahead: int = 2):
        super().__init__()
        self.source = source
        self.remote_dir = source.url
        self._stream = source.stream
        self.checksums = dict(source.checksums)
        self.verify = source.verify
        self.streamed = source.streamed
        self.local_dir = local_dir
        self.max_gap = max_gap
        self.max_stream_size = max_stream_size
        self.max_inflight_bytes = max_inflight_bytes
        self.download_ahead = max(1, download_ahead)
        self.metadata: Metadata | None = None
        self.storage_data: dict = {}
        if isinstance(exchange, dist.Coordinator):  # the job's: its exchange, on a group of its own
            exchange = for_coordinator(exchange)
        self.exchange = exchange
        self.bytes_read = 0  # from the bucket
        self.bytes_from_peers = 0  # from other ranks (the exchange)
        self.direct_items = 0  # tensor items copied straight from the fetched bytes (items.py)
        self._values_lock = threading.Lock()

    # ---------------------------------------------------------------- protocol
    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The ``Metadata`` this reader was set up with (the caller reads and checks it)."""
        if self.metadata is None:
            raise RuntimeError("StreamingReader.read_metadata: set_up_storage_reader was not called (the caller "
                               "hands the reader its Metadata)")
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        self.metadata = metadata
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """DCP's hook; the planned load checks the plan itself (:meth:`check_plan`)."""
        return plan

    def check_plan(self, plan: LoadPlan) -> dict[str, list[tuple[int, int]]]:
        """``{relative path: [(offset, length), ...]}`` of the items ``plan`` reads, each
        checked to lie inside its file as the manifest records it (for a manifest in
        parts: reading the parts of those files only). Not collective."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for r in plan.items:
            s = self.storage_data[r.storage_index]
            ranges.setdefault(s.relative_path, []).append((s.offset, s.length))
        if self.source.manifest is not None:
            self._check_planned(ranges)
        return ranges

    def _check_planned(self, ranges: dict[str, list[tuple[int, int]]]) -> None:
        """Read the manifest of the files this rank reads (and only those), and refuse
        an item that lies outside its file before any byte is read."""
        sums, sizes = self.source.manifest(sorted(ranges))
        self.checksums.update(sums)
        for rel, spans in ranges.items():
            url = urls.join(self.remote_dir, rel)
            if rel not in sizes:
                raise CorruptCheckpoint(f"{url}: DCP's metadata places items in this file, but the checkpoint's "
                                        "manifest "
                                        "does not list it; the step is damaged: load an older step")
            end = max(off + n for off, n in spans)
            if end > sizes[rel]:
                raise CorruptCheckpoint(f"{url}: DCP's metadata places an item at byte {end}, past the file's "
                                        f"{sizes[rel]} bytes in the manifest; the step is damaged: load an older step")

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    @property
    def checkpoint_id(self):
        return self.remote_dir

    # ---------------------------------------------------------------- reading
    def _check(self, rel: str, offset: int, length: int, data, url: str, *, peer: int | None = None) -> None:
        """Check one item's bytes: its length (what the load itself cut: a wrong one is
        its bug, InternalError) and its CRC32C from the manifest (a mismatch in bytes read
        from the store: CorruptCheckpoint; in bytes received from rank ``peer``, which
        checked them against the same CRC32C when it read them: InternalError)."""
        if len(data) != length:
            raise InternalError(f"{url}: the load cut {len(data)} bytes for the item at offset {offset} of "
                                f"{length} bytes")
        if not self.verify:
            return
        want = self.checksums.get(rel, {}).get((offset, length))
        if want is None:
            return
        got = crc32c_bytes(data)
        if got == want:
            return
        if peer is not None:
            raise InternalError(f"{url}: bytes [{offset}, {offset + length}) received from rank {peer} fail their "
                                f"CRC32C (expected {want}, got {got}), which rank {peer} checked when it read them")
        raise CorruptCheckpoint(
            f"{url}: CRC32C mismatch in bytes [{offset}, {offset + length}) (expected {want}, got {got}); "
            "the object is corrupt: restore it or load an older step"
        )

    def _consume(self, req: ReadItem, planner: LoadPlanner, data: memoryview, url: str) -> bool:
        """Put one item into place; True if it was copied straight into its target."""
        sinfo = self.storage_data[req.storage_index]
        if getattr(sinfo, "transform_descriptors", None):
            raise CorruptCheckpoint(f"{url}: stream transforms {sinfo.transform_descriptors} are not supported by "
                                    "cloudckpt")
        if req.type == LoadItemType.BYTE_IO:
            # streams put items in place concurrently; setting a value can create the
            # containers on its path (DCP's set_element), so values go one at a time
            with self._values_lock:
                planner.load_bytes(req, io.BytesIO(bytes(data)))
            return False
        target = planner.resolve_tensor(req).detach()
        direct = load_tensor_into(data, req.storage_offsets, req.lengths, target, url=url, fqn=req.storage_index.fqn)
        planner.commit_tensor(req, target)
        return direct

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        per_file: dict[str, list[tuple[int, int, ReadItem]]] = {}
        for req in plan.items:
            s = self.storage_data[req.storage_index]
            per_file.setdefault(s.relative_path, []).append((s.offset, s.length, req))

        def plain(per_file: dict) -> None:
            if self.local_dir is not None:
                read_predownloaded(self, per_file, planner)
            else:
                read_streamed(self, per_file, planner)

        if self.exchange is None:
            plain(per_file)
        else:
            self.exchange.read(self, per_file, planner, plain)
            log.info("load of %s: %d bytes from the bucket, %d bytes from peers", self.remote_dir, self.bytes_read,
                     self.bytes_from_peers)
        f: torch.futures.Future = torch.futures.Future()
        f.set_result(None)
        return f

    def budget(self, planned_bytes: int) -> tuple[int, int]:
        """(in-flight bytes, stream size) for a rank that reads ``planned_bytes``: a
        sixteenth of them in flight (32 MiB to ``max_inflight_bytes``), in streams of a
        quarter of them (16 MiB to ``max_stream_size``), so about four requests at once
        (one more per shard file a stream cannot span). Ranges fetched whole, before
        streams, took 70 requests per 512 MiB, and botocore spends ~2.6 ms of CPU on
        each; eight streams were no faster than four and kept more memory. Stores that fetch a
        range in pieces (``streamed=False``: GCS) get streams of a quarter of the
        in-flight budget instead, one request each, as ranges were before."""
        inflight = min(self.max_inflight_bytes, max(32 * MiB, planned_bytes // 16))
        if not self.streamed:  # each stream is fetched whole (store.streams_ranges is False)
            return inflight, min(self.max_stream_size, inflight // 4)
        return inflight, min(self.max_stream_size, max(16 * MiB, planned_bytes // 4))
