"""What one rank pays as the job grows: the library's own code for one ordinary rank
and for the coordinator (rank 0) of an R-rank job whose R - 1 peers are simulated.

    .venv/bin/python -m bench.scale                       # R = 64 ... 16,384, the 70B shape
    .venv/bin/python -m bench.scale --quick               # a smoke run: tiny shape, R = 4, 16
    .venv/bin/python -m bench.scale --confirm             # + real gloo ranks (R = 2, 4, 8) on the T-tensor shape
    .venv/bin/python -m bench.scale --phases first --first-reps 3          # a job's first save only, R = 64 ... 16,384
    .venv/bin/python -m bench.scale --confirm-first bench/results/real_ranks_owners.json  # its real-rank check

The shape: Llama-3-70B with AdamW, fp32 (80 layers, 723 parameters; weights,
``exp_avg`` and ``exp_avg_sq`` sharded on dim 0 over every rank: 2,169 sharded tensors,
and 723 replicated ``step`` scalars; about 847 GB). Everything a rank holds is built
with torch's own DCP classes (``Metadata``, ``TensorStorageMetadata``, ``_StorageInfo``)
and the library's own types; no byte of tensor data is written.

Each phase runs in its own process (its CPU seconds and peak RSS are its own; RSS is
reported above the process's baseline after imports) and calls the library's real
functions with the simulated peers:

- ``save``: rank 0 runs ``Checkpointer``'s save protocol (prepare, AGREE, COMMIT) with
  a synthetic ``produce`` (its own manifest) on a local folder; the AGREE collective is
  simulated by ``SimCoordinator``: every peer's value is this rank's with its rank
  number substituted, pickled as ``all_gather_object`` would send it. Reported: bytes
  each rank sends and receives in AGREE, CPU and peak RSS of the protocol on rank 0
  (building the peers' values is not counted), the marker's size.
- ``resume``: rank 0 of a new job: ``CheckpointManager.step_to_resume`` (discovery,
  gc of leftovers) and its part of ``Checkpointer.load`` up to its first data byte
  (``before_read``): the marker and what it broadcasts, recorded for the next phase.
- ``load``: an ordinary rank's ``Checkpointer.load`` of its shard (DTensors on the
  meta device, over a fake process group of R ranks), from what rank 0 broadcast to
  its first data byte: the load prologue.
- ``stock``: stock DCP's per-rank metadata cost: C ``pickle.loads`` of the same
  ``.metadata`` (every rank of a stock DCP load does it).
- ``finish``: rank 0's side of DCP's save ``finish`` through the library's writer
  (``.metadata`` and the index header): a job's first save (every rank's write results
  gathered whole, merged, ``.metadata`` pickled) and a repeated one (digests only, the
  ``.metadata`` reused).
- ``maintain``: ``retention.Maintenance`` after a save with N kept steps (copies of
  this step's marker), once on a fresh manager and once in steady state; store
  calls counted.
- ``first`` (bench/scale_first.py): a job's first save planned by owners, as
  ``checkpoint/rank_writer.py`` runs it, on rank 0 and on the owner of the most keys
  (the owners' all-to-alls, DCP's plan and write steps, ``.metadata`` assembled in the
  store with S3's part rules, the index header from the owners), then the job's
  repeated save planned from that step; the peers' payloads are built with the
  library's own functions. ``finish`` beside it is stock DCP's path (every write result
  gathered on rank 0), where it fits.
- ``resumed``: a restart's first save, planned from the step ``save`` committed
  (``LoadedStructure``), then its next save, on ranks 0 and 1.

``--confirm-first`` runs the ``first`` phase at each R of a ``bench/real_ranks.py``
result on its state and compares, collective by collective, the bytes each rank sends
and receives, and the planning and metadata CPU.

A phase whose input would not fit the ``--mem-gib`` budget on this machine is not run
(the row says so, with the estimate). Results: ``bench/results/scale.{json,md}``
(the latest run only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import ROOT, git_state, loadavg, short_error

GB = 1e9
STEP = 100
RANKS = [64, 256, 1024, 4096, 16384]


# ---------------------------------------------------------------------- the shape
@dataclasses.dataclass(frozen=True)
class Shape:
    """Parameters ``(name, global shape)``; each has a weight and two AdamW moments,
    sharded on dim 0 over every rank, and one replicated ``step`` scalar (``optim``
    False: the weights only, under ``{"model": {name: tensor}}``, as bench/real_ranks.py's)."""

    name: str
    params: tuple
    optim: bool = True

    @property
    def sharded(self) -> int:
        return (3 if self.optim else 1) * len(self.params)

    def tensors(self):
        """``(fqn, global shape, elements)`` of every sharded tensor, in save order."""
        for p, shape in self.params:
            n = math.prod(shape)
            yield f"model.{p}", shape, n
            if self.optim:
                yield f"optim.state.{p}.exp_avg", shape, n
                yield f"optim.state.{p}.exp_avg_sq", shape, n

    def scalars(self):
        for p, _ in self.params:
            if self.optim:
                yield f"optim.state.{p}.step"

    def total_bytes(self) -> int:
        return sum(4 * n for _, _, n in self.tensors()) + 8 * len(self.params)


def llama3_70b() -> Shape:
    d, kv, ffn, vocab = 8192, 1024, 28672, 128256
    params = [("tok_embeddings.weight", (vocab, d))]
    for i in range(80):
        a = f"layers.{i}."
        params += [(a + "attention.wq.weight", (d, d)), (a + "attention.wk.weight", (kv, d)),
                   (a + "attention.wv.weight", (kv, d)), (a + "attention.wo.weight", (d, d)),
                   (a + "feed_forward.w1.weight", (ffn, d)), (a + "feed_forward.w2.weight", (d, ffn)),
                   (a + "feed_forward.w3.weight", (ffn, d)), (a + "attention_norm.weight", (d,)),
                   (a + "ffn_norm.weight", (d,))]
    params += [("norm.weight", (d,)), ("output.weight", (vocab, d))]
    return Shape("llama3-70b+adamw-fp32", tuple(params))


def small(tensors: int, rows: int = 64, cols: int = 16) -> Shape:
    """``tensors`` sharded tensors (a third of them parameters), each ``rows x cols``."""
    return Shape(f"small-T{tensors}", tuple((f"p{i}.weight", (rows, cols)) for i in range(max(1, tensors // 3))))


def per_rank(tensors: int, rows: int, cols: int, R: int) -> Shape:
    """bench/real_ranks.py's state at R ranks: ``tensors`` weights of ``(rows R, cols)``,
    each rank's shard ``rows x cols``, no optimizer."""
    return Shape(f"perrank-T{tensors}x{rows}x{cols}-R{R}",
                 tuple((f"layer{t}.weight", (rows * R, cols)) for t in range(tensors)), optim=False)


def shape_named(name: str) -> Shape:
    if name in ("llama3-70b", "llama3-70b+adamw-fp32"):
        return llama3_70b()
    m = re.fullmatch(r"small-T(\d+)", name)
    if m:
        return small(int(m.group(1)))
    m = re.fullmatch(r"perrank-T(\d+)x(\d+)x(\d+)-R(\d+)", name)
    if m:
        return per_rank(*map(int, m.groups()))
    raise SystemExit(f"unknown shape {name!r}")


def rows_of(shape: tuple, R: int, r: int) -> tuple[int, int]:
    """Rank r's rows of a Shard(0) tensor over R ranks (torch.chunk: ceil-sized pieces)."""
    c = -(-shape[0] // R)
    lo = min(shape[0], r * c)
    return lo, min(shape[0], lo + c)


def rank_items(shape: Shape, R: int, r: int) -> list[tuple[str, tuple, tuple, int]]:
    """Rank r's items ``(fqn, offsets, sizes, bytes)``: its chunk of every sharded
    tensor (none where its rows are empty) and the scalars it writes (the save gives
    each small replicated item to the lowest rank holding it: rank 0)."""
    out = []
    for fqn, gshape, _ in shape.tensors():
        lo, hi = rows_of(gshape, R, r)
        if hi > lo:
            sizes = (hi - lo, *gshape[1:])
            out.append((fqn, (lo, *(0 for _ in gshape[1:])), sizes, 4 * math.prod(sizes)))
    for fqn in shape.scalars():
        if r == 0:
            out.append((fqn, (), (), 8))
    return out


def rank_files(items, *, target=256 << 20, max_files=64, threads=2) -> list[list[tuple[int, int, int]]]:
    """The writer's split of a rank's items into files (dcp/writer.py: max(threads,
    min(64, bytes / 256 MiB)) files, greedy by size): per file ``(item index, offset, length)``."""
    total = sum(i[3] for i in items)
    bins = max(1, min(max(threads, min(max_files, math.ceil(total / target))), len(items)))
    sizes = [0] * bins
    files: list[list] = [[] for _ in range(bins)]
    for idx in sorted(range(len(items)), key=lambda k: -items[k][3]):
        b = sizes.index(min(sizes))
        files[b].append((idx, sizes[b], items[idx][3]))
        sizes[b] += items[idx][3]
    return [f for f in files if f]


def estimate_items(shape: Shape, R: int) -> int:
    return sum(sum(1 for r in range(min(R, g[0])) if rows_of(g, R, r)[1] > rows_of(g, R, r)[0])
               for _, g, _ in shape.tensors()) + len(shape.params)


# ---------------------------------------------------------------------- the simulated collectives
class SimCoordinator:
    """Stands in for ``dist.Coordinator`` (same calls, same pickled payloads) on rank
    ``rank`` of ``world_size``: the peers' values are this rank's with its rank number
    substituted (``peer_value``). ``on_coordinator`` on rank 0 runs the step and stores
    what it would broadcast in ``payload_dir``; on another rank it receives that.
    Counts bytes sent and received per step, and the CPU spent building peers' values
    (``synth_cpu``: not the rank's own cost)."""

    def __init__(self, rank: int, world_size: int, payload_dir: str):
        self.rank, self.world_size = rank, world_size
        self.group, self.local, self.timeout = None, True, 600.0
        self.payload_dir = payload_dir
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.synth_cpu = 0.0
        # objects each peer makes itself (its uploaded manifest part): ``(type name, rank)``
        # -> the peer's own value, made by ``before_gather`` with the library's classes
        self.peer_objects: dict = {}
        self.before_gather = None
        self.kinds: dict[str, str] = {}  # step -> "all_gather" (every rank receives all) or "gather" (rank 0 only)
        self._gather_out = None  # gather_some's outputs on rank 0 (dist.Coordinator._lengths)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _path(self, step: str) -> str:
        return os.path.join(self.payload_dir, re.sub(r"\W", "_", step) + ".pkl")

    def on_coordinator(self, step: str, fn):
        from cloudckpt import dist

        if self.rank == 0:
            out = dist._portable(dist._run(fn))
            data = pickle.dumps(out)
            with open(self._path(step), "wb") as f:
                f.write(data)
            self.sent[step] = self.sent.get(step, 0) + len(data) * (self.world_size - 1)
        else:
            with open(self._path(step), "rb") as f:
                data = f.read()
            self.received[step] = self.received.get(step, 0) + len(data)
            out = pickle.loads(data)
        del data
        if not out.ok:
            raise out.error or RuntimeError(out.error_text)
        return out.value

    def _gather(self, step: str, mine):
        t = time.process_time()
        if self.before_gather is not None:
            self.before_gather(step)
        blobs = []
        for r in range(self.world_size):
            if r != self.rank:
                blobs.append(pickle.dumps(peer_value(mine, self.rank, r, self.peer_objects)))
        own = pickle.dumps(mine)
        self.synth_cpu += time.process_time() - t
        self.sent[step] = self.sent.get(step, 0) + len(own)
        self.received[step] = self.received.get(step, 0) + sum(len(b) for b in blobs)
        values = [pickle.loads(b) for b in blobs]  # what every rank of all_gather_object does
        values.insert(self.rank, mine)
        del blobs
        return values

    def all_gather(self, value):
        return self._gather("all_gather", value)

    def all_ranks(self, step: str, fn, *, error=None):
        from cloudckpt import dist

        mine = dist._run(fn)
        self.kinds[step] = "all_gather"
        outs = self._gather(step, dist._Outcome(mine.ok, mine.value, None, mine.error_text))
        bad = {r: o.error_text for r, o in enumerate(outs) if not o.ok}
        if bad:
            raise (error(step, bad) if error else RuntimeError(f"{step}: {bad}"))
        return [o.value for o in outs]

    def to_coordinator(self, step: str, fn, *, error=None):
        """A gather to rank 0 (``dist.Coordinator.to_coordinator``): only the coordinator
        receives the peers' values; every rank gets the (empty) failures broadcast."""
        from cloudckpt import dist

        mine = dist._run(fn)
        self.kinds[step] = "gather"
        o = dist._Outcome(mine.ok, mine.value, None, mine.error_text)
        if self.rank != 0:
            self.sent[step] = self.sent.get(step, 0) + len(pickle.dumps(o))
            self.received[step] = self.received.get(step, 0) + len(pickle.dumps(None))
            if not mine.ok:
                raise (error(step, {self.rank: mine.error_text}) if error else RuntimeError(mine.error_text))
            return None
        outs = self._gather(step, o)
        bad = {r: x.error_text for r, x in enumerate(outs) if not x.ok}
        if bad:
            raise (error(step, bad) if error else RuntimeError(f"{step}: {bad}"))
        return [x.value for x in outs]

    def gather_some(self, step: str, fn, *, error=None):
        """``dist.Coordinator.gather_some``: a rank sends one int64 length and, if its
        value is not None, the value; rank 0 receives ``R`` lengths (the gather's outputs
        made as the real one makes them) and the values sent (``_peer_blob``), and runs
        the library's ``gathered_some`` on them."""

        from cloudckpt import dist

        mine = dist._run(fn)
        self.kinds[step] = "gather"
        o = dist._Outcome(mine.ok, mine.value, None, mine.error_text)
        blob = b"" if mine.ok and mine.value is None else pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)
        none = len(pickle.dumps(None))  # the failures' broadcast, empty
        if self.rank != 0:
            self.sent[step] = self.sent.get(step, 0) + 8 + len(blob)
            self.received[step] = self.received.get(step, 0) + none
            if not mine.ok:
                raise (error(step, {self.rank: mine.error_text}) if error else RuntimeError(mine.error_text))
            return None
        blobs, filled = self._synth(lambda: self._peer_blobs(step, mine, len(blob)))
        sizes, _ = dist.Coordinator._lengths(self)  # the gather's outputs, made once as dist.Coordinator makes them
        sizes.copy_(filled)  # gloo's gather (its copy into each output, in C++, is not counted)
        outs = dist.gathered_some(o, sizes.tolist(), lambda r, n: blobs.pop(r))
        self.sent[step] = self.sent.get(step, 0) + none * (self.world_size - 1)
        self.received[step] = self.received.get(step, 0) + 8 * (self.world_size - 1) + int(sizes[1:].sum())
        bad = {r: x.error_text for r, x in enumerate(outs) if x is not None and not x.ok}
        if bad:
            raise (error(step, bad) if error else RuntimeError(f"{step}: {bad}"))
        return [None if x is None else x.value for x in outs]

    def _synth(self, fn):
        """``fn()``, its CPU counted as the peers' (``synth_cpu``), not this rank's."""
        t = time.process_time()
        try:
            return fn()
        finally:
            self.synth_cpu += time.process_time() - t

    def _peer_blobs(self, step: str, mine, own: int) -> tuple:
        """The peers' payloads of :meth:`gather_some` (``{rank: bytes}``, the ranks that
        send one) and every rank's length as gloo's gather fills them."""
        import torch

        blobs = {r: b for r in range(1, self.world_size) if (b := self._peer_blob(step, mine, r))}
        lengths = [own] + [len(blobs.get(r, b"")) for r in range(1, self.world_size)]
        return blobs, torch.tensor(lengths, dtype=torch.int64)

    def _peer_blob(self, step: str, mine, r: int) -> bytes:
        """What rank ``r`` sends in :meth:`gather_some`: nothing where this rank's value is
        None, else this rank's value as rank ``r`` would send it (``peer_value``)."""
        from cloudckpt import dist

        if not mine.ok or mine.value is None:
            return b""
        return pickle.dumps(dist._Outcome(True, peer_value(mine.value, self.rank, r, self.peer_objects)),
                            protocol=pickle.HIGHEST_PROTOCOL)


    def agree(self, step: str, fn):
        """``dist.Coordinator.agree``: this rank's value; one all_reduce of an int64."""
        value = fn()
        self.sent[step] = self.sent.get(step, 0) + 8
        self.received[step] = self.received.get(step, 0) + 8
        return value

    def ask_coordinator(self, step: str, request, answer):
        """``dist.Coordinator.ask_coordinator``: fixed-size int64 rows gathered to rank 0,
        one reply row scattered to each rank. Rank 0 answers every rank of the job (its
        cost: the answers for the other ranks are counted as theirs, ``synth_cpu``) and
        leaves its answer table in ``payload_dir``; an ordinary rank takes its reply
        from that table (``synth_cpu``: rank 0's work, not this rank's)."""
        from array import array

        from cloudckpt.checkpoint.parts import REF_INTS

        path = self._path(step)
        width = 8 * (len(request) + 2)
        if self.rank == 0:
            everyone = answer([list(range(self.world_size))])[0]  # every rank's reference: what rank 0 serves from
            with open(path, "wb") as f:
                f.write(array("q", everyone).tobytes())
            self.sent[step] = self.sent.get(step, 0) + 8 * (REF_INTS + 2) * (self.world_size - 1)
            return answer([list(request)])[0]
        t = time.process_time()
        table = array("q")
        with open(path, "rb") as f:
            table.frombytes(f.read())
        reply = []
        for r in request:
            reply.extend(table[r * REF_INTS:(r + 1) * REF_INTS] if 0 <= r < self.world_size else [r, -1, -1, -1, -1])
        del table
        self.synth_cpu += time.process_time() - t
        self.sent[step] = self.sent.get(step, 0) + width
        self.received[step] = self.received.get(step, 0) + 8 * (len(reply) + 3)
        return reply

    def any_rank(self, flags):
        """``dist.Coordinator.any_rank``: one all_reduce of a byte per flag."""
        n = len(flags)
        self.sent["any_rank"] = self.sent.get("any_rank", 0) + n
        self.received["any_rank"] = self.received.get("any_rank", 0) + n
        return [bool(x) for x in flags]


_RANK_TOKENS = {}


def peer_value(obj, a: int, b: int, own: dict | None = None):
    """``obj`` as rank ``b`` would send it, from rank ``a``'s: every rank-numbered name
    (``__{a}_``, ``rank{a}``) renamed, an int field ``rank`` equal to ``a`` set to ``b``;
    entries with a ``path`` that names no rank (objects only the coordinator writes,
    such as DCP's ``.metadata``) are left out; a dataclass of rank ``a`` whose type has
    an entry in ``own`` (``(type name, b)``: what the peer made itself, such as the
    reference of its uploaded manifest part) is replaced by it."""
    own = own or {}
    pat = _RANK_TOKENS.get(a)
    if pat is None:
        pat = _RANK_TOKENS[a] = re.compile(rf"(__){a}(_)|(rank){a}(?!\d)")

    def sub(s: str) -> str:
        return pat.sub(lambda m: f"__{b}_" if m.group(1) else f"rank{b}", s)

    def walk(x):
        if isinstance(x, str):
            return sub(x) if ("__" in x or "rank" in x) else x
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            kept = [walk(v) for v in x if not _shared(v)]
            return kept if type(x) is list else tuple(kept)
        if isinstance(x, dict):
            return {walk(k): walk(v) for k, v in x.items()}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            if getattr(x, "rank", None) == a and (type(x).__name__, b) in own:
                return own[(type(x).__name__, b)]
            changes = {}
            for f in dataclasses.fields(x):
                if not f.init:
                    continue
                v = getattr(x, f.name)
                nv = b if (f.name == "rank" and v == a and type(v) is int) else walk(v)
                if nv is not v:
                    changes[f.name] = nv
            return dataclasses.replace(x, **changes) if changes else x
        return x

    return walk(obj)


def _shared(v) -> bool:
    path = getattr(v, "path", None)
    return isinstance(path, str) and "__" not in path and "rank" not in path and dataclasses.is_dataclass(v)


# ---------------------------------------------------------------------- inputs
def entries_of(shape: Shape, R: int, r: int, extra=()):
    """Rank r's manifest entries (the library's ObjectEntry): its shard files with every
    item's range and CRC32C, its train state, and ``extra`` (rank 0: the metadata)."""
    from cloudckpt.checkpoint.entries import ObjectEntry

    items = rank_items(shape, R, r)
    out = []
    for k, f in enumerate(rank_files(items)):
        size = sum(n for _, _, n in f)
        chunks = tuple(sorted((off, n, f"{(r * 7919 + k * 104729 + off) & 0xffffffff:08x}") for _, off, n in f))
        out.append(ObjectEntry(f"model_and_optim/__{r}_{k}.distcp", size, f"{(r * 31 + k) & 0xffffffff:08x}", chunks))
    out.append(ObjectEntry(f"train/rank{r}.pt", 1234, f"{r & 0xffffffff:08x}"))
    part = index_part(shape, R, r)  # written beside the manifest part (_publish_peer_parts): export reads them all
    if part is not None:
        out.append(ObjectEntry(f"index/rank{r}.json", len(part), _crc(part)))
    return out + list(extra)


def _crc(data: bytes) -> str:
    from cloudckpt.transfer import crc32c_bytes

    return crc32c_bytes(data)


_PARTS: dict = {}


def index_part(shape: Shape, R: int, r: int) -> bytes | None:
    """Rank r's part of the DCP index (dcp/index/), as the writer makes it: its chunks
    of sharded tensors at their places in its files."""
    from cloudckpt.dcp import index

    key = (shape.name, R, r)
    if key not in _PARTS:
        peer = next((k for k in _PARTS if k[2] > 1), None)
        if peer is not None:  # the parts of ranks 0 and 1 are asked again; a peer's once (R of them)
            del _PARTS[peer]
        items = rank_items(shape, R, r)
        out = []
        for k, f in enumerate(rank_files(items)):
            for idx, off, n in f:
                fqn, offsets, sizes, _ = items[idx]
                if offsets:  # a chunk of a sharded tensor (scalars are stored whole: in the header)
                    out.append([fqn, list(offsets), list(sizes), f"__{r}_{k}.distcp", off, n])
        out.sort(key=lambda e: (e[0], e[1]))
        _PARTS[key] = index.part_bytes(r, out) if out else None
    return _PARTS[key]


class _LazyStorage:
    """``Metadata.storage_data`` of the whole job for ``index.header_bytes``, computed per
    key instead of held (R x T entries): a chunk's file names its rank (its rows), a
    scalar's item is where rank 0's files hold it."""

    def __init__(self, shape: Shape, R: int):
        from cloudckpt._torch_compat import StorageInfo

        self.info = StorageInfo
        self.rows = {fqn: -(-g[0] // R) for fqn, g, _ in shape.tensors()}
        items = rank_items(shape, R, 0)
        self.rank0 = {}
        for k, f in enumerate(rank_files(items)):
            for idx, off, n in f:
                if not items[idx][1]:
                    self.rank0[items[idx][0]] = self.info(f"__0_{k}.distcp", off, n)

    def __getitem__(self, key):
        if not key.offset:
            return self.rank0[key.fqn]
        return self.info(f"__{key.offset[0] // self.rows[key.fqn]}_0.distcp", 0, 0)


def index_metadata(shape: Shape, R: int):
    """What ``index.header_bytes`` reads of DCP's global ``Metadata``: every tensor with
    its chunk list (one list per distinct shape, as DCP's cached metadata shares nothing
    but holds the same values) and the storage of every item (computed per key)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    props = TensorProperties(dtype=torch.float32)
    lists: dict = {}
    sdm = {}
    for fqn, g, _ in shape.tensors():
        if g not in lists:
            lists[g] = [ChunkStorageMetadata(offsets=torch.Size((lo, *(0 for _ in g[1:]))),
                                             sizes=torch.Size((hi - lo, *g[1:])))
                        for lo, hi in (rows_of(g, R, r) for r in range(R)) if hi > lo]
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(g), chunks=lists[g])
    one = [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
    for fqn in shape.scalars():
        sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.int64), size=torch.Size([]),
                                         chunks=one)
    return type("JobMetadata", (), {"state_dict_metadata": sdm, "storage_data": _LazyStorage(shape, R),
                                    "version": "1.0.0"})()


def dcp_metadata(shape: Shape, R: int):
    """DCP's ``Metadata`` of the whole job, built with torch's classes."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from cloudckpt._torch_compat import StorageInfo

    props = TensorProperties(dtype=torch.float32)
    sdm, sd = {}, {}
    chunks_of: dict[str, list] = {}
    for r in range(R):
        items = rank_items(shape, R, r)
        for k, f in enumerate(rank_files(items)):
            for idx, off, n in f:
                fqn, offsets, sizes, _ = items[idx]
                c = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                chunks_of.setdefault(fqn, []).append(c)
                sd[MetadataIndex(fqn, torch.Size(offsets), len(chunks_of[fqn]) - 1)] = StorageInfo(
                    f"__{r}_{k}.distcp", off, n)
    for fqn, gshape, _ in shape.tensors():
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(gshape),
                                         chunks=sorted(chunks_of.get(fqn, []), key=lambda c: tuple(c.offsets)))
    for fqn in shape.scalars():
        sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.int64), size=torch.Size([]),
                                         chunks=chunks_of.get(fqn, []))
    mappings = {fqn: tuple(fqn.split(".", 1)) for fqn in sdm}
    return Metadata(state_dict_metadata=sdm, storage_data=sd, planner_data=mappings)


def make_inputs(args) -> dict:
    """The step folder of the job: the DCP index our writer writes (the header, built by
    the library's ``index.header_bytes`` from the job's metadata; the parts of ranks 0
    and 1) and DCP's ``.metadata`` (stock pickle, for the ``stock`` phase) where building
    it fits ``--mem-gib`` (else a stand-in: no load of a step with the index reads it).
    Reports the header's size and what building it costs rank 0 at a save: the first
    save of a job, and a repeated one (its layouts cached while DCP hands the same
    chunk lists)."""
    from cloudckpt.checkpoint import layout
    from cloudckpt.dcp import index
    from cloudckpt.transfer import crc32c_file

    shape = shape_named(args.shape)
    step = Path(args.work) / "run" / f"step{STEP}"
    (step / "model_and_optim").mkdir(parents=True, exist_ok=True)
    (step / "index").mkdir(parents=True, exist_ok=True)
    jmd = index_metadata(shape, args.ranks)
    cache: dict = {}
    t = time.process_time()
    header = index.header_bytes(jmd, cache)
    first = time.process_time() - t
    t = time.process_time()
    assert index.header_bytes(jmd, cache) == header
    again = time.process_time() - t
    (step / layout.INDEX_HEADER).write_bytes(header)
    for r in (0, 1):
        part = index_part(shape, args.ranks, r)
        if part is not None:
            (step / layout.index_part_name(r)).write_bytes(part)
    out = {"index_header_bytes": len(header), "index_header_crc32c": _crc(header),
           "index_header_build_cpu_s": round(first, 3), "index_header_rebuild_cpu_s": round(again, 3),
           "index_part_bytes": len(index_part(shape, args.ranks, 1) or b"")}
    path = step / "model_and_optim" / ".metadata"
    if estimate_gb(shape, args.ranks) <= args.mem_gib:
        md = dcp_metadata(shape, args.ranks)
        with open(path, "wb") as f:
            pickle.dump(md, f, protocol=pickle.HIGHEST_PROTOCOL)
        out["items"] = len(md.storage_data)
        del md
    else:
        path.write_bytes(b"stand-in: the job's .metadata does not fit this machine")
        out["metadata_stand_in"] = True
    out.update(metadata_bytes=path.stat().st_size, metadata_crc32c=crc32c_file(str(path)))
    return out


# ---------------------------------------------------------------------- phases (each in its own process)
def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> None:
    """Start the peak RSS count from now (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return _peak()


class _GcClock:
    """The CPU seconds the garbage collector has run in this process (``total``)."""

    def __init__(self):
        import gc

        self.total, self._at = 0.0, None
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._at = time.process_time()
        elif self._at is not None:
            self.total += time.process_time() - self._at
            self._at = None


GC_CLOCK = _GcClock()


class Meter:
    """CPU, wall time and peak RSS of a phase; ``gc_cpu_s``: the CPU of the garbage
    collector's runs inside it (``minus_gc``: those the synthesis of the peers' values
    set off; a collection of the whole heap lands on whichever step allocates past its
    threshold, and a simulated rank's heap holds the peers' synthesized values), and
    ``cpu_s_without_gc``: the rest, which compares across R."""

    def __enter__(self):
        import gc

        gc.collect()
        self.base = _rss()
        _reset_peak()
        self.gc_cpu = GC_CLOCK.total
        self.cpu = time.process_time()
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.cpu = time.process_time() - self.cpu
        self.wall = time.perf_counter() - self.wall
        self.gc_cpu = GC_CLOCK.total - self.gc_cpu
        self.peak = _peak_hwm()

    def report(self, minus_cpu: float = 0.0, minus_gc: float = 0.0) -> dict:
        cpu, gc_cpu = self.cpu - minus_cpu, max(0.0, self.gc_cpu - minus_gc)
        return {"cpu_s": round(cpu, 3), "gc_cpu_s": round(gc_cpu, 3), "cpu_s_without_gc": round(cpu - gc_cpu, 3),
                "peak_rss_above_base_mb": round((self.peak - self.base) / 1e6, 1),
                "peak_rss_mb": round(self.peak / 1e6, 1)}


def _checkpointer(work: str):
    from cloudckpt import Checkpointer

    # no read-once exchange: its census is an all_to_all across the job, simulated by bench/exchange.py
    return Checkpointer(work_dir=os.path.join(work, "w"), distributed=False, load_exchange=False)


def phase_save(args) -> dict:
    from cloudckpt.checkpoint import rank_writer, saving
    from cloudckpt.checkpoint.entries import ObjectEntry
    from cloudckpt.checkpoint.step import StepRef

    shape = shape_named(args.shape)
    inputs = json.loads(Path(args.work, "inputs.json").read_text())
    md = ObjectEntry("model_and_optim/.metadata", inputs["metadata_bytes"], inputs["metadata_crc32c"])
    header = ObjectEntry("index/header.json", inputs["index_header_bytes"], inputs["index_header_crc32c"])
    entries = entries_of(shape, args.ranks, 0, extra=[md, header])
    ck = _checkpointer(args.work)
    sim = ck.coord = SimCoordinator(0, args.ranks, _payloads(args))
    step = str(Path(args.work) / "run" / f"step{STEP}")
    save_id = uuid.UUID(int=0x5CA1E)  # known to the peers' parts before the coordinator broadcasts it
    saving.uuid.uuid4 = lambda: save_id
    sim.before_gather = lambda name: _publish_peer_parts(sim, shape, args.ranks, step, save_id.hex) \
        if name == "agree" else None
    produce = lambda ref, work: rank_writer.RankResult(entries, time.monotonic(), None)  # noqa: E731
    with Meter() as m:
        saving.save(sim, ck.engine, ck.options, StepRef.of(step, named=True), produce, ephemeral=False,
                    needs_work=False)
    marker = Path(step) / ".metadata.json"
    kind = sim.kinds.get("agree")
    received = sim.received.get("agree", 0)
    out = {"agree_collective": kind, "agree_sent_bytes": sim.sent.get("agree", 0), "agree_received_bytes": received,
           "agree_received_bytes_ordinary_rank": received if kind == "all_gather" else 0,
           "marker_bytes": marker.stat().st_size, **m.report(minus_cpu=sim.synth_cpu)}
    ck.close()
    return out


def _publish_peer_parts(sim: SimCoordinator, shape: Shape, R: int, step: str, save_id: str) -> None:
    """What each peer uploads itself before AGREE in a protocol with per-rank manifest
    parts (``marker.ManifestPart``): its part, written to the step folder with the
    library's classes; its reference replaces the one substituted from rank 0's."""
    try:
        from cloudckpt.checkpoint.parts import ManifestPart, PartRef
    except ImportError:
        return  # one manifest in the marker: nothing per peer to upload
    from cloudckpt.checkpoint import layout

    for r in range(1, R):
        part = ManifestPart(step=STEP, rank=r, save_id=save_id, objects=tuple(entries_of(shape, R, r)))
        index = index_part(shape, R, r)
        if index is not None:
            Path(step, layout.index_part_name(r)).write_bytes(index)
        data = part.to_bytes()
        ref = PartRef.of(r, data, part)
        path = Path(step) / ref.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        sim.peer_objects[(type(ref).__name__, r)] = ref


def _payloads(args) -> str:
    d = os.path.join(args.work, "payloads")
    os.makedirs(d, exist_ok=True)
    return d


class _FirstByte(Exception):
    """Raised in ``before_read``: the load prologue is over."""


def _stop(ranges):
    raise _FirstByte(sum(len(v) for v in ranges.values()))


def _sharded_target(shape: Shape, R: int, r: int) -> dict:
    """Rank r's state dict: a DTensor (meta device, Shard(0)) per sharded tensor and a
    replicated scalar per parameter, over a fake process group of R ranks."""
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not tdist.is_initialized():
        tdist.init_process_group("fake", store=FakeStore(), rank=r, world_size=R)
    mesh = init_device_mesh("cpu", (R,))
    sd: dict = {}
    for fqn, gshape, _ in shape.tensors():
        lo, hi = rows_of(gshape, R, r)
        local = torch.empty((hi - lo, *gshape[1:]), device="meta")
        stride = tuple(math.prod(gshape[i + 1:]) for i in range(len(gshape)))
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(gshape), stride=stride)
        if shape.optim:
            sd[fqn] = dt
        else:  # nested as bench/real_ranks.py's: DCP's planner_data path ("model", name)
            sd.setdefault("model", {})[fqn.split(".", 1)[1]] = dt
    for fqn in shape.scalars():
        sd[fqn] = torch.zeros((), dtype=torch.int64)
    return sd


def _time_metadata_parse() -> dict:
    """From now on, the CPU seconds of making the metadata a load plans against add up
    in the returned ``{"s": ...}``: ``CommittedStep.metadata`` (a step without the DCP
    index: the whole ``.metadata``), ``CommittedStep.select`` (the header parsed and
    checked, this rank's chunks selected) and ``CommittedStep.plan_metadata`` (its index
    parts read, its Metadata built) and ``CommittedStep.shapes`` (``load_with``: every
    key's size and dtype handed to ``build``)."""
    from cloudckpt.checkpoint.committed import CommittedStep

    parse = {"s": 0.0}

    def timed(orig):
        def run(*a, **kw):
            t = time.process_time()
            try:
                return orig(*a, **kw)
            finally:
                parse["s"] += time.process_time() - t
        return run

    for name in ("metadata", "select", "plan_metadata", "shapes"):
        setattr(CommittedStep, name, timed(getattr(CommittedStep, name)))
    return parse


def _build_from(target: dict, seen: list):
    """``load_with``'s ``build``: the caller's targets (made before the phase, as the
    integrations make them from what they are handed) checked against the metadata
    handed over: every key, its size."""
    def build(md) -> dict:
        sdm = md.state_dict_metadata
        seen.append(len(sdm))
        for k, v in target.items():
            if tuple(sdm[k].size) != tuple(v.shape):
                raise RuntimeError(f"{k}: handed {tuple(sdm[k].size)}, target {tuple(v.shape)}")
        return target
    return build


def _load_prologue(args, rank: int, *, with_build: bool = False) -> dict:
    shape = shape_named(args.shape)
    target = _sharded_target(shape, args.ranks, rank)
    seen: list = []
    ck = _checkpointer(args.work)
    sim = ck.coord = SimCoordinator(rank, args.ranks, _payloads(args))
    step = str(Path(args.work) / "run" / f"step{STEP}")
    reads = None
    mgr = _manager(args, ck) if rank == 0 else None
    parse = _time_metadata_parse()
    with Meter() as m:
        if mgr is not None:
            found = mgr.step_to_resume()
            assert found is not None and found.endswith(f"step{STEP}"), found
        try:
            if with_build:
                ck.load_with(step, _build_from(target, seen), load_trainer_state=False, before_read=_stop)
            else:
                ck.load(step, target, load_trainer_state=False, before_read=_stop)
        except _FirstByte as e:
            reads = e.args[0]
    ck.close()
    if reads is None:
        raise RuntimeError("the load read data without calling before_read first")
    return {"received_bytes": sum(sim.received.values()), "broadcast_sent_bytes": sum(sim.sent.values()),
            "items_to_read": reads, "metadata_parse_cpu_s": round(parse["s"], 3),
            "collectives": {k: [sim.sent.get(k, 0), sim.received.get(k, 0)]
                            for k in sorted({*sim.sent, *sim.received})},
            **({"keys_handed": seen[0]} if with_build else {}), **m.report(sim.synth_cpu)}


def _manager(args, ck):
    """A ``CheckpointManager`` of the run whose checkpointer (and so coordinator) is ``ck``'s."""
    from cloudckpt import CheckpointConfig
    from cloudckpt.checkpoint import manager as manager_mod

    cfg = CheckpointConfig(save_folder=str(Path(args.work) / "run"), work_dir=os.path.join(args.work, "w"))
    made = manager_mod.Checkpointer
    manager_mod.Checkpointer = lambda *a, **kw: ck  # its own would create a process group of R ranks
    try:
        return manager_mod.CheckpointManager(cfg)
    finally:
        manager_mod.Checkpointer = made


def phase_resume(args) -> dict:
    return _load_prologue(args, 0)


def phase_load(args) -> dict:
    return _load_prologue(args, 1)


def phase_load_with(args) -> dict:
    """An ordinary rank's ``Checkpointer.load_with`` (the Lightning and OLMo-core
    integrations) to its first data byte: the targets built from the metadata handed over."""
    return _load_prologue(args, 1, with_build=True)


def phase_stock(args) -> dict:
    path = Path(args.work) / "run" / f"step{STEP}" / "model_and_optim" / ".metadata"
    if json.loads(Path(args.work, "inputs.json").read_text()).get("metadata_stand_in"):
        return {"skipped": f"the job's .metadata (~{estimate_gb(shape_named(args.shape), args.ranks):.0f} GB to build) "
                           f"does not fit --mem-gib {args.mem_gib:g}"}
    data = path.read_bytes()
    with Meter() as m:
        md = pickle.loads(data)
    n = len(md.storage_data)
    del md
    return {"metadata_bytes": len(data), "items": n, **m.report()}


def phase_finish(args) -> dict:
    """Rank 0's side of DCP's save ``finish``, through the library's own writer
    (``UploadingWriter.finish``: DCP's ``.metadata`` and the index header): a job's first
    save (every rank's write results gathered whole, merged, ``.metadata`` pickled) and a
    repeated one (each rank sends a digest of its unchanged results; the ``.metadata``
    written before is reused). Built untimed from the job's ``.metadata``: each rank's
    ``WriteResult`` list (the rank from each item's file name), pickled as DCP's gather
    sends it; timed: the unpickling on rank 0 and ``finish``."""
    import gc

    from torch.distributed.checkpoint.storage import WriteResult

    from cloudckpt.dcp.writer import RankResults, UploadingWriter, results_digest

    path = Path(args.work) / "run" / f"step{STEP}" / "model_and_optim" / ".metadata"
    if json.loads(Path(args.work, "inputs.json").read_text()).get("metadata_stand_in") or \
            estimate_gb(shape_named(args.shape), args.ranks) > args.mem_gib:
        return {"skipped": f"the job's .metadata and its gathered write results (~"
                           f"{estimate_gb(shape_named(args.shape), args.ranks):.0f} GB) do not fit --mem-gib "
                           f"{args.mem_gib:g}"}
    md = pickle.loads(path.read_bytes())
    by_rank: list[list] = [[] for _ in range(args.ranks)]
    for idx, info in md.storage_data.items():
        r = int(info.relative_path.split("_")[2])  # "__{rank}_{k}.distcp"
        by_rank[r].append(WriteResult(index=idx, size_in_bytes=info.length, storage_data=info))
    digests = [results_digest(rs) for rs in by_rank]
    first_blobs = [pickle.dumps(RankResults(d, rs)) for d, rs in zip(digests, by_rank, strict=True)]
    again_blobs = [pickle.dumps(RankResults(d, None)) for d in digests]
    del by_rank
    md.storage_data = None  # what DCP's plan hands the coordinator's finish
    cache: dict = {}
    work = Path(args.work) / "finish"
    keep = work / "cache"
    keep.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    for name, blobs in (("first", first_blobs), ("repeated", again_blobs)):
        folder = work / name / "model_and_optim"
        folder.mkdir(parents=True, exist_ok=True)
        writer = UploadingWriter(str(folder), lambda *a: None, index_cache=cache, cache_dir=lambda: str(keep))
        gc.collect()
        with Meter() as m:
            writer.finish(md, [pickle.loads(b) for b in blobs])  # what DCP's gather hands rank 0
        out[name] = {"gathered_bytes": sum(len(b) for b in blobs), **m.report()}
    out["metadata_bytes"] = (work / "first" / "model_and_optim" / ".metadata").stat().st_size
    out["same_metadata"] = (work / "first" / "model_and_optim" / ".metadata").read_bytes() == \
        (work / "repeated" / "model_and_optim" / ".metadata").read_bytes()
    shutil.rmtree(work, ignore_errors=True)
    return out


def phase_export(args) -> dict:
    """``cloudckpt export`` of the model's weights, all but the bytes of the tensors:
    ``ops.export``'s own opening of the step (the index header, every rank's manifest
    part and index part read, checked and spilled to its chunk index) and each tensor's
    chunk list fetched in turn as the safetensors writer fetches it, with its items and
    CRC32Cs. Reading, casting and writing the weights (bounded by the largest tensor,
    the same at every R) is not run: 280 GB here."""
    from cloudckpt.checkpoint.step import StepRef
    from cloudckpt.ops import export

    step = StepRef.of(str(Path(args.work) / "run" / f"step{STEP}"))
    spill = os.path.join(args.work, "export.chunks")
    with Meter() as m:
        c, entries, skipped, locate, stored, chunks = export._open(step, "model", None, verify=True,
                                                                   safetensors=True, spill=spill)
        longest = located = 0
        try:
            for e in entries:
                got = locate(e)
                located += len(got)
                longest = max(longest, len(got))
                del got
        finally:
            if chunks is not None:
                chunks.close()
    return {"tensors": len(entries), "chunks": located, "largest_chunk_list": longest, "stored_bytes": stored,
            "non_tensors": len(skipped), **m.report()}


class _Counting:
    """Counts the store calls of one phase (the local backend has no requests to count)."""

    CALLS = ("get_bytes", "list", "exists", "stat", "delete", "delete_many", "delete_prefix", "walk",
             "list_multipart_uploads", "put_bytes")

    def __init__(self):
        from cloudckpt.storage import local as local_store

        self.cls = next(c for c in vars(local_store).values()
                        if isinstance(c, type) and hasattr(c, "list_multipart_uploads")
                        and c.__module__ == local_store.__name__)
        self.counts: dict[str, int] = {}
        self.bytes = 0

    def __enter__(self):
        self.saved = {}
        for name in self.CALLS:
            orig = getattr(self.cls, name, None)
            if orig is None:
                continue
            self.saved[name] = orig

            def wrap(*a, _orig=orig, _name=name, **kw):
                self.counts[_name] = self.counts.get(_name, 0) + 1
                out = _orig(*a, **kw)
                if _name == "get_bytes":
                    self.bytes += len(out)
                return out

            setattr(self.cls, name, wrap)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(self.cls, name, orig)


def phase_maintain(args) -> dict:
    """N committed steps (hard links to this step's marker and metadata), then
    Maintenance after a save of one more: on a fresh manager, then in steady state."""
    from cloudckpt.checkpoint import retention

    src = Path(args.work) / "run" / f"step{STEP}"
    folder = Path(args.work) / f"kept{args.kept}"
    shutil.rmtree(folder, ignore_errors=True)
    for s in range(1, args.kept + 2):
        d = folder / f"step{s}"
        (d / "model_and_optim").mkdir(parents=True)
        os.link(src / "model_and_optim" / ".metadata", d / "model_and_optim" / ".metadata")
        marker = json.loads((src / ".metadata.json").read_text()) if s == 1 else None
        if marker is not None:
            _marker_template = marker
        m = dict(_marker_template, step=s)
        (d / ".metadata.json").write_text(json.dumps(m, separators=(",", ":")))
    policy = retention.Policy(max_checkpoints=args.kept)
    out = {}
    maint = retention.Maintenance(str(folder), policy)
    for name in ("fresh", "steady"):
        if name == "steady":
            s = args.kept + 2 + 0
            d = folder / f"step{s}"
            shutil.copytree(folder / f"step{args.kept + 1}", d)
            (d / ".metadata.json").write_text(json.dumps(dict(_marker_template, step=s), separators=(",", ":")))
            maint.committed(s, ephemeral=False)
        with _Counting() as c, Meter() as m:
            pruned, _ = maint.run(keep_above=args.kept + 2)
        out[name] = {"store_calls": sum(c.counts.values()), "calls": c.counts, "read_bytes": c.bytes,
                     "pruned": len(pruned), **m.report()}
    # the one-shot prune + gc (the CLI's; what every save ran before Maintenance): every marker read
    with _Counting() as c, Meter() as m:
        retention.prune(str(folder), policy)
        retention.gc(str(folder), keep_above=args.kept + 2)
    out["oneshot"] = {"store_calls": sum(c.counts.values()), "calls": c.counts, "read_bytes": c.bytes, **m.report()}
    shutil.rmtree(folder, ignore_errors=True)
    return out


def phase_first(args) -> dict:
    from bench.scale_first import phase_first

    return phase_first(args)


def phase_resumed(args) -> dict:
    from bench.scale_first import phase_resumed

    return phase_resumed(args)


PHASES = {"save": phase_save, "resume": phase_resume, "load": phase_load, "load_with": phase_load_with,
          "export": phase_export, "stock": phase_stock,
          "finish": phase_finish,
          "maintain": phase_maintain, "first": phase_first, "resumed": phase_resumed}


def _child(args) -> None:
    if args.phase == "inputs":
        out = make_inputs(args)
        Path(args.work, "inputs.json").write_text(json.dumps(out))
    else:
        import cloudckpt.checkpoint.checkpointer  # noqa: F401 - imports are the baseline, not the phase
        out = PHASES[args.phase](args)
    print("RESULT " + json.dumps(out))


def run_phase(phase: str, shape: str, R: int, work: str, *, kept: int = 0, timeout: float = 3600,
              mem_gib: float = 10.0, rank: int = 0) -> dict:
    argv = [sys.executable, "-m", "bench.scale", "--child", phase, "--shape", shape, "--ranks", str(R), "--work", work,
            "--kept", str(kept), "--mem-gib", str(mem_gib), "--rank", str(rank)]
    t = time.perf_counter()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        return {"error": short_error(p.stderr or p.stdout), "wall_s": round(wall, 1)}
    return json.loads(line[len("RESULT "):])


# ---------------------------------------------------------------------- real ranks (confirmation)
def gloo_worker(rank, world_size, folder, work, tensors):
    """Save and load a T-tensor state on real gloo ranks; measure what the simulation
    reports: bytes each rank receives in AGREE, the marker, the metadata parse."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from cloudckpt import Checkpointer, dist

    got = {"agree": 0}

    def counted(name):
        orig = getattr(dist.Coordinator, name)

        def wrapper(self, step, fn, *, error=None):
            out = orig(self, step, fn, error=error)
            if step == "agree" and out is not None:  # what this rank received: the others' outcomes
                got["agree"] += sum(len(pickle.dumps(dist._Outcome(True, v))) for r, v in enumerate(out)
                                    if r != self.rank)
            return out

        setattr(dist.Coordinator, name, wrapper)

    for name in ("all_ranks", "to_coordinator"):
        if hasattr(dist.Coordinator, name):
            counted(name)
    shape = small(tensors)
    mesh = init_device_mesh("cpu", (world_size,))
    sd = {}
    for fqn, gshape, _ in shape.tensors():
        sd[fqn] = distribute_tensor(torch.ones(gshape), mesh, [Shard(0)])
    for fqn in shape.scalars():
        sd[fqn] = torch.tensor(3)
    from torch.distributed.checkpoint import utils as dcp_utils

    sent: list[int] = []  # bytes this rank sends in DCP's own gathers (plans, write results) per save
    orig_gather = dcp_utils._DistWrapper.gather_object

    def gather(self, obj):
        sent[-1] += len(pickle.dumps(obj))
        return orig_gather(self, obj)

    dcp_utils._DistWrapper.gather_object = gather
    ck = Checkpointer(work_dir=work)
    path = f"{folder}/step{STEP}"
    for s in (STEP + 1, STEP):  # the first planned by owners, the second from the first's structure
        sent.append(0)
        got["agree"] = 0  # the last save's
        ck.save(f"{folder}/step{s}", sd)
    parse = _time_metadata_parse()
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    from bench.real_load import Collectives

    col = Collectives().install()  # each torch.distributed call's bytes, by the named step it runs in
    try:
        ck.load(path, target)
    finally:
        col.uninstall()
    ck.close()
    load_steps = {step: [sum(v[1] for v in ops.values()), sum(v[2] for v in ops.values())]
                  for step, ops in col.calls.items()}
    marker = os.path.getsize(os.path.join(path, ".metadata.json"))
    return {"agree_received_bytes": got["agree"], "marker_bytes": marker, "metadata_parse_cpu_s": round(parse["s"], 3),
            "dcp_gather_sent_bytes": sent, "load_collectives": load_steps}


def confirm(tensors: int, ranks: list[int], tmp: str) -> list[dict]:
    from cloudckpt.testing.multiprocess import run_ranks

    rows = []
    for R in ranks:
        shape = small(tensors).name
        work = tempfile.mkdtemp(dir=tmp, prefix=f"real-R{R}-")
        real = run_ranks(R, gloo_worker, os.path.join(work, "run"), os.path.join(work, "w"), tensors)
        swork = tempfile.mkdtemp(dir=tmp, prefix=f"sim-R{R}-")
        sim_inputs = run_phase("inputs", shape, R, swork)
        sim = run_phase("save", shape, R, swork) if "error" not in sim_inputs else sim_inputs
        sim_resume = run_phase("resume", shape, R, swork) if "error" not in sim else sim
        sim_load = run_phase("load", shape, R, swork) if "error" not in sim_resume else sim_resume
        rows.append({"ranks": R, "tensors": small(tensors).sharded + len(small(tensors).params),
                     "real": real, "sim": {"agree_received_bytes": sim.get("agree_received_bytes"),
                                           "marker_bytes": sim.get("marker_bytes"),
                                           "load_cpu_s": sim_load.get("cpu_s"),
                                           "metadata_parse_cpu_s": sim_load.get("metadata_parse_cpu_s"),
                                           "load_collectives": sim_load.get("collectives"),
                                           "error": sim.get("error") or sim_load.get("error")}})
        rows[-1]["load_payloads_agree"] = payloads_agree(real[1]["load_collectives"] if R > 1 else {},
                                                         sim_load.get("collectives") or {})
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(swork, ignore_errors=True)
    return rows


def payloads_agree(real: dict, sim: dict) -> bool:
    """An ordinary rank's load: every named step the simulation runs (its prologue, up
    to the first data byte: not ``load read``), bytes out and in, real (each
    ``torch.distributed`` call counted) against the simulation's model of the same
    collective, within 5 % and 16 bytes (pickled payloads differ by a few bytes of ids)."""
    if not sim or not set(sim) <= set(real):
        return False
    return all(abs(a - b) <= 0.05 * max(a, b) + 16 for k in sim for a, b in zip(real[k], sim[k], strict=True))


# ---------------------------------------------------------------------- driver
def estimate_gb(shape: Shape, R: int) -> float:
    """Memory today's code needs on one rank at R: the whole job's items parsed (~3.4 KB
    each in the allowlist unpickler) and the whole marker (every item's CRC)."""
    return estimate_items(shape, R) * 3.6e3 / GB


def _first_runs(shape, ranks: list[int], reps: int, tmp: str) -> dict[int, list]:
    """A fresh job's first save by owners, then a repeated save, on rank 0 and on the
    busiest owner: ``reps`` runs per R, the R interleaved (every R once, then again), so
    that a drift of the machine's speed during the run falls on every R alike (the
    ratios between R are the targets). ``{R: [(rank 0's run, the owner's run), ...]}``."""
    from bench.scale_first import busiest_owner

    out: dict[int, list] = {R: [] for R in ranks}
    for _ in range(reps):
        for R in ranks:
            print(f"first save, R={R}", file=sys.stderr, flush=True)
            d = tempfile.mkdtemp(dir=tmp, prefix=f"first-R{R}-")  # an owner's run reads what rank 0's left
            out[R].append([run_phase("first", shape.name, R, d, rank=r) for r in (0, busiest_owner(shape, R))])
            shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="llama3-70b")
    ap.add_argument("--ranks", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--kept", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-ranks", type=int, default=RANKS[-1])
    ap.add_argument("--quick", action="store_true", help="smoke run: the small shape at R = 4, 16")
    ap.add_argument("--mem-gib", type=float, default=10.0, help="skip a phase whose estimate is above this")
    ap.add_argument("--confirm", action="store_true", help="also real gloo ranks (R = 2, 4, 8) with --tensors")
    ap.add_argument("--tensors", type=int, default=4000)
    ap.add_argument("--only", default=None, help="comma-separated R to run (default: every R up to --max-ranks)")
    ap.add_argument("--load-reps", type=int, default=1,
                    help="run the load and load_with prologues this many times per R; report the run of median CPU")
    ap.add_argument("--first-reps", type=int, default=1,
                    help="run the first-save phase this many times per R and rank; report the run of median CPU")
    ap.add_argument("--confirm-first", metavar="REAL_JSON", default=None,
                    help="compare the first-save phase with a bench/real_ranks.py result (its R and state); "
                         "writes results/scale_confirm_first.{json,md}")
    ap.add_argument("--confirm-only", action="store_true",
                    help="run only the real-rank confirmation and put it into the existing results/scale.json")
    ap.add_argument("--phases", default="load,load_with,export,stock,finish,maintain,first,resumed",
                    help="comma-separated phases besides save and resume (always run)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default=None)
    args = ap.parse_args()
    if args.child:
        args.phase = args.child
        _child(args)
        return
    if args.confirm_first:
        from bench.scale_first import confirm_first, confirm_report

        tmp = tempfile.mkdtemp(prefix="cloudckpt-scale-")
        try:
            rows = confirm_first(args.confirm_first, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        res = {"command": ".venv/bin/python -m bench.scale " + " ".join(sys.argv[1:]), "real": args.confirm_first,
               "rows": rows, "machine": {"cpus": os.cpu_count(), "loadavg": loadavg()}, "git": git_state(),
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        out = Path(args.out_dir)
        (out / "scale_confirm_first.json").write_text(json.dumps(res, indent=1))
        (out / "scale_confirm_first.md").write_text(confirm_report(res))
        print(confirm_report(res))
        return
    if args.confirm_only:
        out = Path(args.out_dir)
        res = json.loads((out / "scale.json").read_text())
        tmp = tempfile.mkdtemp(prefix="cloudckpt-scale-")
        try:
            res["confirm"] = confirm(args.tensors, [2, 4, 8], tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        res["confirm_command"] = ".venv/bin/python -m bench.scale " + " ".join(sys.argv[1:])
        (out / "scale.json").write_text(json.dumps(res, indent=1))
        (out / "scale.md").write_text(report(res))
        print(report(res))
        return
    shape = small(300) if args.quick else shape_named(args.shape)
    ranks = [4] if args.quick else [r for r in RANKS if r <= args.max_ranks]
    if args.only:
        ranks = [int(x) for x in args.only.split(",")]
    kept = [3] if args.quick else [10, 100]
    wanted = set(args.phases.split(","))
    if wanted - {"first"}:
        wanted |= {"save", "resume"}  # the other phases read the step these leave
    tmp = args.tmp or tempfile.mkdtemp(prefix="cloudckpt-scale-")
    rows = []
    first_runs = _first_runs(shape, ranks, args.first_reps, tmp) if "first" in wanted else {}
    for R in ranks:
        est = estimate_gb(shape, R)
        row = {"ranks": R, "items": estimate_items(shape, R), "estimate_gb": round(est, 1)}
        print(f"R={R}: {row['items']:,} DCP items", file=sys.stderr, flush=True)
        work = tempfile.mkdtemp(dir=tmp, prefix=f"R{R}-")
        if "first" in wanted:
            pairs = first_runs[R]
            row["first"] = {"rank0": _median_run([a for a, _ in pairs], "first"),
                            "owner": _median_run([b for _, b in pairs], "first")}
        row["inputs"] = run_phase("inputs", shape.name, R, work, mem_gib=args.mem_gib) if "save" in wanted else {}
        if "save" in wanted and "error" not in row["inputs"]:
            for phase in ("save", "resume", "load", "load_with", "export", "stock", "finish"):
                if phase in wanted:
                    row[phase] = run_phase(phase, shape.name, R, work, mem_gib=args.mem_gib)
            for phase in ("load", "load_with"):
                if args.load_reps > 1 and "error" not in row.get(phase, {"error": "not run"}):
                    # the prologue again (its inputs stay): CPU seconds vary by run on a shared machine
                    runs = [row[phase]] + [run_phase(phase, shape.name, R, work, mem_gib=args.mem_gib)
                                           for _ in range(args.load_reps - 1)]
                    ok = [r for r in runs if "error" not in r]
                    mid = statistics.median(x["cpu_s"] for x in ok)
                    row[phase] = dict(min(ok, key=lambda r: abs(r["cpu_s"] - mid)))
                    row[phase]["cpu_s_runs"] = [r["cpu_s"] for r in ok]
            if "resumed" in wanted and "error" not in row["save"]:  # the first save after a resume of the step saved
                row["resumed"] = {who: run_phase("resumed", shape.name, R, work, mem_gib=args.mem_gib, rank=r)
                                  for who, r in (("rank0", 0), ("rank1", 1))}
            if "error" not in row["save"] and "maintain" in wanted:
                for n in kept:
                    row[f"maintain_N{n}"] = run_phase("maintain", shape.name, R, work, kept=n)
        shutil.rmtree(work, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    confirmed = confirm(args.tensors if not args.quick else 300, [2] if args.quick else [2, 4, 8], tmp) \
        if args.confirm else []
    if not args.tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    command = ".venv/bin/python -m bench.scale " + " ".join(a for a in sys.argv[1:])
    result = {"command": command.strip(), "shape": shape.name, "shape_bytes": shape.total_bytes(),
              "sharded_tensors": shape.sharded, "scalars": len(shape.params), "rows": rows, "confirm": confirmed,
              "machine": {"cpus": os.cpu_count(), "loadavg": loadavg()}, "git": git_state(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "scale_quick" if args.quick else "scale" if not args.only else "scale_" + "_".join(map(str, ranks))
    if not args.quick and wanted - {"save", "resume"} != set(ap.get_default("phases").split(",")):
        stem += "_" + "_".join(sorted(wanted - {"save", "resume"}))
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(report(result))
    print(report(result))


def _median_run(runs: list[dict], key: str) -> dict:
    """Of runs of one phase, the run of median CPU-s (``key``'s), with every run's CPU-s;
    a failed run if none succeeded."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    cpus = sorted(r[key]["cpu_s"] for r in ok)
    best = dict(next(r for r in ok if r[key]["cpu_s"] == cpus[(len(cpus) - 1) // 2]))
    best["cpu_s_runs"] = [r[key]["cpu_s"] for r in ok]
    return best


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f}"


def _cell(row: dict, p: str, *keys, fmt="{:,.2f}") -> str:
    d = row.get(p) or {}
    if "error" in d:
        return f"error: {d['error'][:80]}"
    if "skipped" in d:
        return "not run (memory)"
    return " / ".join("-" if d.get(k) is None else fmt.format(d[k]) for k in keys)


def _finish(row: dict) -> str:
    d = row.get("finish") or {}
    if "error" in d or "skipped" in d or not d:
        return _cell(row, "finish", "cpu_s")
    return "; ".join(f"{_mb(d[k]['gathered_bytes'])}, {d[k]['cpu_s']:,.2f} / {d[k]['peak_rss_above_base_mb']:,.1f}"
                     for k in ("first", "repeated"))


def _maint(row: dict, n: int) -> str:
    d = row.get(f"maintain_N{n}") or {}
    if "error" in d:
        return f"error: {d['error'][:60]}"
    if not d:
        return "-"
    f, s, o = d["fresh"], d["steady"], d.get("oneshot") or {}
    return (f"fresh {f['store_calls']}, {f['cpu_s']:.2f}; then {s['store_calls']}, {s['cpu_s']:.2f} "
            f"(one-shot prune+gc: {o.get('store_calls', '-')}, {o.get('cpu_s', 0):.2f})")


def report(res: dict) -> str:
    lines = [f"# bench.scale: per-rank cost against the job's ranks R ({res['shape']}, "
             f"{res['shape_bytes'] / GB:,.0f} GB, {res['sharded_tensors']:,} sharded tensors + "
             f"{res['scalars']} scalars)",
             "", f"Command: `{res['command']}`  ", f"Measured {res['when']} on {res['machine']['cpus']} CPUs.", "",
             "| R | DCP items | AGREE in, rank 0 / other rank (MB) | rank 0 save CPU-s / peak MB | marker (MB) | "
             "DCP index header (MB); its build on rank 0, CPU-s: first save / repeated | "
             "resume on rank 0 CPU-s / peak MB | load prologue CPU-s / peak MB / MB in | "
             "load_with prologue CPU-s / peak MB | export (all but the weights' bytes): CPU-s / peak MB | "
             "stock DCP .metadata "
             "pickle.loads CPU-s / peak MB | DCP's save finish on rank 0 (.metadata, index header): results "
             "gathered (MB), CPU-s / peak MB, first save; repeated save | maintenance: store calls, CPU-s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        save, load, inputs = row.get("save") or {}, row.get("load") or {}, row.get("inputs") or {}
        lines.append(
            f"| {row['ranks']:,} | {row['items']:,} | {_mb(save.get('agree_received_bytes'))} / "
            f"{_mb(save.get('agree_received_bytes_ordinary_rank'))} | "
            f"{_cell(row, 'save', 'cpu_s', 'peak_rss_above_base_mb')} | {_mb(save.get('marker_bytes'))} | "
            f"{_mb(inputs.get('index_header_bytes'))}; "
            f"{_cell(row, 'inputs', 'index_header_build_cpu_s', 'index_header_rebuild_cpu_s')} | "
            f"{_cell(row, 'resume', 'cpu_s', 'peak_rss_above_base_mb')} | "
            f"{_cell(row, 'load', 'cpu_s', 'peak_rss_above_base_mb')} / {_mb(load.get('received_bytes'))} | "
            f"{_cell(row, 'load_with', 'cpu_s', 'peak_rss_above_base_mb')} | "
            f"{_cell(row, 'export', 'cpu_s', 'peak_rss_above_base_mb')} | "
            f"{_cell(row, 'stock', 'cpu_s', 'peak_rss_above_base_mb')} | "
            f"{_finish(row)} | "
            + "; ".join(f"N={n}: {_maint(row, n)}" for n in _kept(row)) + " |")
    reps = [(row["ranks"], row["load"]["cpu_s_runs"]) for row in res["rows"] if row.get("load", {}).get("cpu_s_runs")]
    if reps:
        lines += ["", "The load prologue's CPU-s, every run (the table shows the run of median CPU): "
                  + "; ".join(f"R = {r:,}: {', '.join(f'{x:.3f}' for x in xs)}" for r, xs in reps) + "."]
    if any(row.get("first") or row.get("resumed") for row in res["rows"]):
        from bench.scale_first import report_first

        lines += report_first(res)
    if res["confirm"]:
        lines += ["", "Real gloo ranks against the simulation, same shape and R"
                  + (f" (`{res['confirm_command']}`)" if res.get("confirm_command") else "") + ":", "",
                  "| R | tensors | AGREE in per rank, real / sim (bytes) | marker, real / sim (bytes) | "
                  "load metadata CPU-s per rank, real / sim | DCP save gathers, bytes sent per rank: "
                  "first / repeated save |",
                  "|---|---|---|---|---|---|"]
        for c in res["confirm"]:
            real = c["real"]
            ag = ", ".join(f"{r['agree_received_bytes']:,}" for r in real)
            sim = c["sim"]
            lines.append(f"| {c['ranks']} | {c['tensors']:,} | {ag} / {_n(sim['agree_received_bytes'])} | "
                         f"{real[0]['marker_bytes']:,} / {_n(sim['marker_bytes'])} | "
                         f"{', '.join(str(r['metadata_parse_cpu_s']) for r in real)} / "
                         f"{sim.get('metadata_parse_cpu_s', '-')} | "
                         + ", ".join(" / ".join(f"{x:,}" for x in r.get("dcp_gather_sent_bytes", [])) for r in real)
                         + " |")
        lines += ["", "An ordinary rank's load (rank 1), bytes out / in of each named collective step: real "
                  "(every torch.distributed call counted) against the simulation's model of it:", "",
                  "| R | step | real | simulated |", "|---|---|---|---|"]
        for c in res["confirm"]:
            real = c["real"][1].get("load_collectives", {}) if len(c["real"]) > 1 else {}
            sim = c["sim"].get("load_collectives") or {}
            for step in sorted({*real, *sim}):
                a, b = real.get(step), sim.get(step)
                lines.append(f"| {c['ranks']} | {step} | {' / '.join(f'{x:,}' for x in a) if a else '-'} | "
                             f"{' / '.join(f'{x:,}' for x in b) if b else '-'} |")
            lines.append(f"| {c['ranks']} | agree (5 % + 16 B) | {c.get('load_payloads_agree')} | |")
    return "\n".join(lines) + "\n"


def _n(v) -> str:
    return "-" if v is None else f"{v:,}"


def _kept(row) -> list[int]:
    return sorted(int(k[len("maintain_N"):]) for k in row if k.startswith("maintain_N"))


if __name__ == "__main__":
    main()
