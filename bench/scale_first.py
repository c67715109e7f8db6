"""A job's first save of an R-rank job, run by the library's own code for one rank (rank
0, or the owner of the most keys) whose R - 1 peers are simulated: ``bench/scale.py``'s
phases ``first`` and ``resumed``.

``first`` (a fresh job) runs, as ``checkpoint/rank_writer.py`` runs them, with the
70B + AdamW state of that rank (DTensors on the meta device over a fake process group):

1. ``any_rank``: plan by owners (one byte);
2. ``OwnersSavePlanner.create_local_plan``: DCP's local plan, then ``owners.plan_by_owners``
   (the records to their owners: one all-to-all; the owner's checks and decisions, the
   library's ``_decide``; the decisions back: one all-to-all);
3. DCP's steps with no collective (``use_collectives=False``): the rank's own empty
   plan through ``create_global_plan`` and the writer's ``prepare_global_plan``;
4. the write (no tensor byte is written: each item's place is the writer's split of the
   rank's items into files), then the writer's ``finish`` and DCP's closing barrier;
5. ``RankWriter._assemble``: the ``.metadata`` fragment, ``assemble_store.assemble_in_store``
   (S3's rules: runs of consecutive ranks of at least 5 MiB, at most 10,000 pieces, on a
   local folder whose pieces of the peers' runs are counted, not written) and
   ``owners.index_header``;
6. ``SavedStructure`` (what the rank keeps once the step is committed),

then the job's **repeated save** in the same process, planned from that structure
(``ResumedSavePlanner``: a tag a rank in DCP's plan step; each rank's write results'
digest gathered; rank 0 copies ``.metadata`` in the store and writes the header it kept).

``resumed`` (a restart) builds ``LoadedStructure`` from the step the ``save`` phase
committed (its marker, the index header and the rank's index part, as the load left
them) and runs the same save planned from it; it also asks the last rank's verdict
(its chunks of tensors with fewer rows than ranks are empty).

Each save runs with the garbage collector paused, as ``Checkpointer.save`` runs a
blocking save (``collector.collector_paused``). The peers' payloads are what they
would send, built with the library's functions (their plan records from this rank's
with their rows; the owners' decisions from
``_decide`` run on one key of each tensor size; their header entries and layouts from
``layout_key``), pickled as the real collectives pickle them; building them is not the
rank's cost (``synth_cpu``). Bytes out / in per collective step are counted as
``bench.scale.SimCoordinator`` counts them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import pickle
import re
import time
import zlib
from pathlib import Path

from bench.scale import STEP, Meter, SimCoordinator, _checkpointer, _payloads, _sharded_target, rows_of, shape_named

MiB = 1 << 20
PLAN_STEP, WRITE_STEP = "dcp plan", "dcp write"  # DCP's names (its _DistWrapper steps), as bench/real_ranks counts them
RECORDS = "send the save plan's records to their owners"
DECISIONS = "tell each rank what it writes"
PLACES = "send where each item was written to the owner of its key"
ENTRIES = "the owners' entries of the DCP index header"
LAYOUTS = "point to point (outside a named step)"  # the layouts of the index header, asked owners to rank 0
ASK_LAYOUTS = "which owner sends each layout of the DCP index header"


# ---------------------------------------------------------------------- the job's peers
class Peers:
    """What the simulated peers of rank ``rank`` hold and send, from the library's own rules."""

    def __init__(self, shape, R: int, rank: int):
        from cloudckpt.dcp.owners import owner_of

        self.shape, self.R, self.rank = shape, R, rank
        self.sizes_of: dict[str, tuple] = {fqn: tuple(g) for fqn, g, _ in shape.tensors()}
        self.sizes_of.update({fqn: () for fqn in shape.scalars()})
        self.owner = {fqn: owner_of(fqn, R) for fqn in self.sizes_of}
        self.keys_of: dict[int, list[str]] = {}
        for fqn in self.sizes_of:  # in plan order (the state dict's): an owner's keys in the order it meets them
            self.keys_of.setdefault(self.owner[fqn], []).append(fqn)
        self._decided: dict[tuple, dict] = {}
        self.my_records: list | None = None  # this rank's records, by owner (the first all-to-all)
        self.fragment_sizes: list[int] | None = None
        self.asks: list | None = None  # rank 0's answer: the layouts each owner sends
        self.assembly = None
        self.entry_bytes = 160.0  # one storage entry of a fragment (measured on this rank's own)
        self._files: dict = {}

    # the owners' decisions, per tensor size: one key of that size decided by the library's _decide
    def decided(self, size: tuple, props) -> dict:
        got = self._decided.get(size)
        if got is None:
            from cloudckpt._torch_compat import MIN_PIECE_BYTES, SMALL_SHARED_BYTES
            from cloudckpt.dcp.owners import _decide

            if props is None:
                import torch
                from torch.distributed.checkpoint.metadata import TensorProperties

                props = TensorProperties(dtype=torch.float32 if size else torch.int64)
            recs = [[self.record(("x", False, tuple(0 for _ in size), size, props, size, 0, None), r)]
                    for r in range(self.R)]
            sdm, _, writes = _decide(recs, self.R, "spread", MIN_PIECE_BYTES, SMALL_SHARED_BYTES)
            writer_of = {}
            for w, ws in enumerate(writes):
                for _, hint in ws:
                    writer_of[hint] = w
            chunks = sdm["x"].chunks
            writers = [writer_of[h] for h in range(len(chunks))]
            got = {"chunks": chunks, "writers": writers, "hint": {w: h for h, w in enumerate(writers)},
                   "props": props}
            self._decided[size] = got
        return got

    def record(self, rec: tuple, r: int) -> tuple:
        """Rank r's plan record of the key of ``rec`` (this rank's): its own rows."""
        fqn, is_bytes, offsets, sizes, props, size, pos, path = rec
        if is_bytes or not size:
            return rec
        lo, hi = rows_of(size, self.R, r)
        return (fqn, is_bytes, (lo, *offsets[1:]), (hi - lo, *sizes[1:]), props, size, pos, path)

    def place(self, fqn: str, size: tuple, w: int) -> tuple[str, int, int]:
        """Where rank w wrote its chunk of ``fqn`` (file, offset, length)."""
        if size:
            lo, hi = rows_of(size, self.R, w)
            n = 4 * (hi - lo) * math.prod(size[1:])
        else:
            n = 8
        k = zlib.crc32(fqn.encode())
        rel = self._files.setdefault((w, k % 4), f"__{w}_{k % 4}.distcp")  # one name a file, as the writer's
        return rel, (k * 4096) % (1 << 31), n

    # what peer r sends this rank, by collective step
    def to_me(self, step: str, r: int, objs: list):
        if step == RECORDS:
            self.my_records = objs
            return [self.record(rec, r) for rec in objs[self.rank]]
        if step == DECISIONS:  # owner r: the positions (and index hints) of this rank's items of r's keys it writes
            out = []
            for rec in self.my_records[r]:
                d = self.decided(rec[5], rec[4])
                if self.rank in d["hint"]:
                    out.append((rec[6], d["hint"][self.rank]))
            return out
        if step == PLACES:  # peer r: where it wrote its chunks of this rank's keys
            out = []
            for rec in self.my_records[self.rank]:
                fqn, size = rec[0], rec[5]
                d = self.decided(size, rec[4])
                if r in d["hint"]:
                    peer = self.record(rec, r)
                    out.append((fqn, tuple(peer[2]), *self.place(fqn, size, r)))
            return out
        raise KeyError(step)

    def _layout(self, size: tuple) -> tuple[tuple, bytes, list]:
        from cloudckpt.dcp.index import layout_key

        d = self.decided(size, None)
        if "key" not in d:
            d["key"] = layout_key(list(size), d["chunks"], d["writers"])
            d["digest"] = hashlib.blake2b(repr(d["key"]).encode(), digest_size=16).digest()
        return d["key"], d["digest"], d["writers"]

    def header_entries(self, p: int):
        """Owner p's entries of the index header (``owners._header_records``)."""
        from cloudckpt.dcp.index import dtype_name

        tensors, values, sizes = [], [], []
        for fqn in self.keys_of.get(p, []):
            size = self.sizes_of[fqn]
            if not size:  # a scalar: stored whole, by rank 0
                tensors.append([fqn, "int64", [], -1, list(self.place(fqn, size, 0))])
                continue
            if size not in sizes:
                sizes.append(size)
            import torch

            tensors.append([fqn, dtype_name(torch.float32, fqn), list(size), sizes.index(size), None])
        return tensors, values, [self._layout(s)[1] for s in sizes]

    def layouts_sent(self, p: int):
        """Owner p's layouts that rank 0 asked it for."""
        sizes = []
        for fqn in self.keys_of.get(p, []):
            size = self.sizes_of[fqn]
            if size and size not in sizes:
                sizes.append(size)
        ask = self.asks[p]
        out = []
        for k, single in zip(ask[::2], ask[1::2], strict=True):
            key, _, writers = self._layout(sizes[k])
            fqn = next(f for f in self.keys_of[p] if self.sizes_of[f] == sizes[k])
            items = [list(self.place(fqn, sizes[k], w)) for w in writers] if single else None
            out.append((k, key, items))
        return out

    def fragment_size(self, r: int, storage_items: int) -> int:
        """Rank r's ``.metadata`` fragment, estimated: the Metadata entries of its keys (one
        key of each size pickled by the library's ``assemble.fragment``) and its storage entries."""
        from cloudckpt.dcp.assemble import fragment

        total = storage_items * self.entry_bytes
        for fqn in self.keys_of.get(r, []):
            size = self.sizes_of[fqn]
            d = self.decided(size, None)
            if "bytes" not in d:
                import torch
                from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

                props = TensorProperties(dtype=torch.float32 if size else torch.int64)
                md = TensorStorageMetadata(props, torch.Size(size), d["chunks"])
                d["bytes"] = len(fragment(state_dict_metadata={"x": md}, planner_data={"x": ("x",)}))
            total += d["bytes"] + 2 * (len(fqn) - 1)
        return int(total)

    def items_written(self, r: int) -> int:
        if not hasattr(self, "_count"):
            self._count: dict[tuple, int] = {}
            for size in self.sizes_of.values():
                self._count[size] = self._count.get(size, 0) + 1
        return sum(n for size, n in self._count.items() if r in self.decided(size, None)["hint"])


# ---------------------------------------------------------------------- the simulated collectives
class OwnersSim(SimCoordinator):
    """``SimCoordinator`` with the collectives a save planned by owners adds
    (``all_to_all_objects``, ``all_gather_ints``, point to point bytes) and the peers'
    values of its gathers from :class:`Peers`."""

    def __init__(self, rank: int, world_size: int, payload_dir: str, peers: Peers):
        super().__init__(rank, world_size, payload_dir)
        self.peers = peers
        self.synth_gc = 0.0  # the collector's CPU inside the synthesis (part of synth_cpu)
        self.exchanged = (0, 0)
        self.current = ""  # the step a point-to-point transfer runs in

    def _synth(self, fn):
        from bench.scale import GC_CLOCK

        t, g = time.process_time(), GC_CLOCK.total
        try:
            return fn()
        finally:
            self.synth_cpu += time.process_time() - t
            self.synth_gc += GC_CLOCK.total - g

    def count(self, step: str, out: int, got: int) -> None:
        self.sent[step] = self.sent.get(step, 0) + out
        self.received[step] = self.received.get(step, 0) + got

    def all_to_all_objects(self, objs: list, step: str, *, limit: int) -> list:
        R, me = self.world_size, self.rank

        def blob(o) -> bytes:  # an empty list travels as no bytes (dist.Coordinator.all_to_all_objects)
            return b"" if type(o) is list and not o else pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)

        blobs = [blob(o) for o in objs]
        got = self._synth(lambda: [blob(self.peers.to_me(step, r, objs)) if r != me else b"" for r in range(R)])
        got[me] = blobs[me]
        sent = sum(len(b) for b in blobs)
        self.exchanged = (sent, sum(len(b) for b in got))
        self.count(step, sent + 8 * R + 8, self.exchanged[1] + 8 * R + 8)  # + the lengths and the refusal flag
        lengths = [len(b) for b in got]
        data = b"".join(got)
        del got
        out, at = [], 0
        for n in lengths:
            out.append(pickle.loads(data[at:at + n]) if n else [])
            at += n
        return out

    def any_rank(self, flags, step=None):
        """``dist.Coordinator.any_rank``: one all_reduce of a byte per flag (under its step's name)."""
        self.count(step or "any_rank", len(flags), len(flags))
        return [bool(x) for x in flags]

    def all_gather_ints(self, values, step=None):
        from cloudckpt.dcp.assemble import TRAILER

        R = self.world_size
        if step and step.startswith("sizes of the fragments of"):
            mine = int(values[0])
            # an empty S3 rule: no least piece on a local folder; the simulation keeps S3's (run_first)
            sizes = self._synth(lambda: [mine if r == self.rank else self.peers.fragment_size(
                r, self.peers.items_written(r)) + (len(HEADER) if r == 0 else 0) + (len(TRAILER) if r == R - 1 else 0)
                for r in range(R)])
            self.peers.fragment_sizes = sizes
            self.count(step, 8 * len(values), 8 * len(values) * (R - 1))
            return [[s] for s in sizes]
        raise KeyError(step)

    def send_bytes(self, data: bytes, dst: int) -> None:
        self.count(self.current, 8 + len(data), 0)  # inside the step that uploads the pieces

    def recv_bytes(self, src: int, *, limit: int) -> bytes:
        from cloudckpt.dcp.assemble import TRAILER

        if self.current == LAYOUTS:  # an owner asked for layouts of the index header sends them
            data = self._synth(lambda: pickle.dumps((True, self.peers.layouts_sent(src)),
                                                    protocol=pickle.HIGHEST_PROTOCOL))
            self.count(self.current, 0, 8 + len(data))
            return data
        last = len(TRAILER) if src == self.world_size - 1 else 0  # the trailer: the run's first rank adds it
        data = self._synth(lambda: bytes(self.peers.fragment_sizes[src] - last))
        self.count(self.current, 0, 8 + len(data))
        return data

    def on_coordinator(self, step: str, fn):
        if step.startswith("begin the assembly") and self.rank != 0:
            from cloudckpt import dist

            value = self._synth(fn)  # rank 0's, done there: this rank gets an assembly it can put its piece into
            self.count(step, 0, len(pickle.dumps(dist._Outcome(True, value))))
        else:
            value = super().on_coordinator(step, fn)
        if step.startswith("begin the assembly"):
            self.peers.assembly = value
        if step == ASK_LAYOUTS:  # the asked owners send their layouts next, point to point
            self.peers.asks, self.current = value, LAYOUTS
        return value

    def gather_some(self, step: str, fn, *, error=None):
        self.current = step  # the uploads of the pieces send their bytes point to point inside it
        return super().gather_some(step, fn, error=error)

    def _peer_blob(self, step: str, mine, r: int) -> bytes:
        from cloudckpt import dist

        if not (step.startswith("upload the pieces of") or step == ENTRIES):
            return super()._peer_blob(step, mine, r)
        value = self._peer_value(step, r)
        return b"" if value is None else pickle.dumps(dist._Outcome(True, value), protocol=pickle.HIGHEST_PROTOCOL)

    def _peer_value(self, step: str, r: int):
        if step == ENTRIES:  # a rank that owns no key sends nothing (owners.index_header)
            entries = self.peers.header_entries(r)
            return entries if any(entries) else None
        return self._pieces().get(r)

    def _pieces(self) -> dict:
        """The peers' records of the pieces they uploaded (the first rank of each run), and
        the assembly's file grown to the object's size as their pieces would make it."""
        if getattr(self, "_piece_values", None) is None:
            from cloudckpt.dcp.assemble_store import runs
            from cloudckpt.storage.assembly import Piece

            sizes = self.peers.fragment_sizes
            plan = runs(sizes, min_piece=S3_MIN_PIECE, max_pieces=S3_MAX_PIECES)
            self._piece_values = {x.first: (Piece(x.index, x.offset, x.size), zlib.crc32(str(x).encode()))
                                  for x in plan if x.first != self.rank}
            a = self.peers.assembly
            tmp = os.path.join(os.path.dirname(a.url), f".tmp-assembly-{a.token}")
            os.truncate(tmp, sum(sizes))
        return self._piece_values

S3_MIN_PIECE, S3_MAX_PIECES = 5 * MiB, 10_000
HEADER = b""  # set at import of the library (the header's size counts in rank 0's run)


# ---------------------------------------------------------------------- DCP's own steps, emulated
class Steps:
    """CPU seconds (process, the peers' synthesis left out) of each named step. With
    ``$SCALE_PROFILE`` naming a folder, each step of rank 0 also runs under cProfile
    (``{folder}/R{R}-{step}.prof``, the peers' synthesis included: read it with pstats)."""

    def __init__(self, sim: OwnersSim):
        self.sim, self.cpu = sim, {}
        self.profile = os.environ.get("SCALE_PROFILE") if sim.rank == 0 else None

    def __call__(self, name: str):
        steps = self

        class _Step:
            def __enter__(self):
                if steps.profile:
                    import cProfile

                    self.prof = cProfile.Profile()
                    self.prof.enable()
                self.t, self.s = time.process_time(), steps.sim.synth_cpu

            def __exit__(self, *exc):
                spent = time.process_time() - self.t - (steps.sim.synth_cpu - self.s)
                steps.cpu[name] = round(steps.cpu.get(name, 0.0) + spent, 3)
                if steps.profile:
                    self.prof.disable()
                    safe = re.sub(r"\W+", "_", name)[:40]
                    self.prof.dump_stats(os.path.join(steps.profile, f"R{steps.sim.world_size}-{safe}.prof"))

        return _Step()


def dcp_local_steps(sim: OwnersSim, planner, writer, rank: int, local):
    """DCP's save with ``use_collectives=False`` (a save planned by owners): this rank's
    ``local`` plan through the writer's prepare, ``create_global_plan`` and
    ``prepare_global_plan`` of its own plan alone, then ``finish_plan``; nothing crosses
    ranks (DCP's closing barrier: :func:`dcp_local_finish`)."""
    local = writer.prepare_local_plan(local)
    plans, md = planner.create_global_plan([local])
    return planner.finish_plan(writer.prepare_global_plan(plans)[0]), md


def dcp_local_finish(sim: OwnersSim, writer, md) -> None:
    """The end of DCP's save with ``use_collectives=False``: the writer's ``finish`` on
    this rank's own (empty) results, then one barrier (no payload: nothing counted, as
    ``bench/real_ranks.py`` counts none)."""
    writer.finish(md, [[]])


def write_results(items: list, rank: int, places: dict | None = None) -> list:
    """This rank's WriteResults: each item where ``places`` says (a save planned from a
    loaded step writes where it wrote), else where the writer's split puts it."""
    from torch.distributed.checkpoint.storage import WriteResult

    from cloudckpt._torch_compat import StorageInfo, element_size, split_by_size_and_type

    def nbytes(it) -> int:
        td = it.tensor_data
        return math.prod(td.chunk.sizes) * element_size(td.properties.dtype) if td.chunk.sizes else 8

    out = []
    if places is not None:
        for it in items:
            rel, off, n = places[it.index]
            out.append(WriteResult(index=it.index, size_in_bytes=n, storage_data=StorageInfo(rel, off, n)))
        return out
    total = sum(nbytes(i) for i in items)
    bins = max(1, min(max(2, min(64, math.ceil(total / (256 * MiB)))), len(items)))
    for k, bucket in enumerate(b for b in split_by_size_and_type(bins, list(items)) if b):
        at, rel = 0, f"__{rank}_{k}.distcp"  # one string a file, as the writer's results hold it
        for it in bucket:
            n = nbytes(it)
            out.append(WriteResult(index=it.index, size_in_bytes=n, storage_data=StorageInfo(rel, at, n)))
            at += n
    return out


# ---------------------------------------------------------------------- the phases
def busiest_owner(shape, R: int) -> int:
    """The rank other than 0 that owns the most keys (each key: R records, one a rank)."""
    from cloudckpt.dcp.owners import owner_of

    n: dict[int, int] = {}
    for fqn in [f for f, _, _ in shape.tensors()] + list(shape.scalars()):
        o = owner_of(fqn, R)
        if o:
            n[o] = n.get(o, 0) + 1
    return max(sorted(n), key=lambda r: n[r]) if n else 1


def _setup(args, rank: int):
    from cloudckpt.checkpoint.rank_writer import RankWriter
    from cloudckpt.checkpoint.step import StepRef

    global HEADER
    from cloudckpt.dcp.assemble import header

    HEADER = header()
    shape = shape_named(args.shape)
    sd = _sharded_target(shape, args.ranks, rank)
    peers = Peers(shape, args.ranks, rank)
    sim = OwnersSim(rank, args.ranks, _payloads(args), peers)
    ck = _checkpointer(args.work)
    rw = RankWriter(sim, ck.engine, ck.options)
    return shape, sd, peers, sim, ck, rw, StepRef


def _writer(folder: Path, **kw):
    from cloudckpt.dcp import UploadingWriter

    folder.mkdir(parents=True, exist_ok=True)
    return UploadingWriter(str(folder), lambda *a, **k: None, **kw)


def _resumed_save(sim: OwnersSim, steps: Steps, sd: dict, kept, rank: int, folder: Path, places_of) -> dict:
    """A save planned from a kept structure (``kept``: SavedStructure or LoadedStructure):
    what ``RankWriter.write`` runs for it, the data write left out."""
    from cloudckpt._torch_compat import ResumedSavePlanner

    with steps("any_rank: plan by owners or from the kept step"):
        sim.any_rank([False], "plan by owners or from the loaded step")
    planner = ResumedSavePlanner(kept.final_plan, sim)
    writer = _writer(folder, loaded=kept if rank == 0 else None)
    with steps("DCP's local plan, from the kept structure"):
        planner.set_up_planner(sd, None, rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=False)
        try:
            local = planner.create_local_plan()  # with the agreement that every rank's state has the structure
        except Exception as e:  # noqa: BLE001 - reported
            return {"error": f"not planned from the kept step: {e}"}
    with steps(PLAN_STEP):
        final, md = dcp_local_steps(sim, planner, writer, rank, local)
    results = sim._synth(lambda: write_results(final.items, rank, places_of(planner)))
    with steps("write results: same places"):
        same = len(results) == len(planner.expected) and all(
            planner.expected.get(wr.index) == (wr.storage_data.relative_path, wr.storage_data.offset,
                                               wr.storage_data.length) for wr in results)
        writer._resumed, writer._moved, writer.results = True, not same, [] if same else results
    with steps(WRITE_STEP):
        dcp_local_finish(sim, writer, md)
        writer.finish_kept(sim)  # what RankWriter.write runs after DCP's save
    return {"items": len(final.items), "same_places": same}


def phase_first(args) -> dict:
    """A fresh job's first save planned by owners on rank ``args.rank`` (0: the
    coordinator; else an owner), then its repeated save (see the module docstring)."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from cloudckpt._torch_compat import MIN_PIECE_BYTES, SMALL_SHARED_BYTES
    from cloudckpt.checkpoint import layout
    from cloudckpt.checkpoint.structure import SavedStructure
    from cloudckpt.collector import collector_paused
    from cloudckpt.dcp.owners import OwnersSavePlanner, index_header, plan_by_owners

    rank = args.rank
    shape, sd, peers, sim, ck, rw, StepRef = _setup(args, rank)
    step = StepRef.of(str(Path(args.work) / "first" / f"step{STEP + 1}"), named=True)
    store = step.store
    store.min_piece_size, store.max_pieces = S3_MIN_PIECE, S3_MAX_PIECES  # S3's rules, on a local folder
    Path(step.url, layout.MODEL_DIR).mkdir(parents=True, exist_ok=True)
    steps = Steps(sim)
    uploads: list = []
    with Meter() as m, collector_paused():  # as Checkpointer.save runs a blocking save
        with steps("any_rank: plan by owners or from the kept step"):
            sim.any_rank([True], "plan by owners or from the loaded step")
        planner = OwnersSavePlanner(sim, shared_limit=MIN_PIECE_BYTES, small=SMALL_SHARED_BYTES)
        writer = _writer(Path(args.work) / f"w{rank}" / "first" / layout.MODEL_DIR, owners=True)
        with steps("DCP's local plan"):
            planner.set_up_planner(sd, None, rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=False)
            local = super(OwnersSavePlanner, planner).create_local_plan()
        # the owners' planning, as OwnersSavePlanner.create_local_plan runs it after DCP's local plan
        with steps("owners: records, checks, decisions (plan_by_owners)"):
            planner.local_plan = local
            planner.owned = plan_by_owners(sim, local, writer=planner.writer, shared_limit=planner.shared_limit,
                                           small=planner.small)
        with steps(PLAN_STEP):
            final, md = dcp_local_steps(sim, planner, writer, rank, type(local)([]))
        writer.results = results = sim._synth(lambda: write_results(final.items, rank))
        sim._synth(lambda: setattr(peers, "entry_bytes", _entry_bytes(results)))
        with steps(WRITE_STEP):
            dcp_local_finish(sim, writer, md)
        with steps(".metadata assembled in the store"):
            _assemble_metadata(rw, step, writer, planner, uploads)
        with steps("index header by owners"):
            header_bytes = index_header(sim, planner.owned, writer.results, dcp_version=CURRENT_DCP_VERSION)
            if header_bytes is not None:
                writer.put_index_header(header_bytes)
        marker = sim._synth(lambda: _commit_marker(args, step, uploads, header_bytes) if rank == 0 else None)
        with steps("keep the saved structure"):
            kept = SavedStructure(step, marker, rank, planner.local_plan.items, planner.owned.plan.items, results,
                                  header_bytes)
    first = {"steps": steps.cpu, **m.report(minus_cpu=sim.synth_cpu, minus_gc=sim.synth_gc),
             "items_written": len(results),
             "owned_keys": len(peers.keys_of.get(rank, [])), "metadata_bytes": sum(peers.fragment_sizes or [0]),
             "collectives": _bytes(sim)}
    if rank == 0:
        first["header_bytes"] = len(header_bytes)
        first["pieces"] = len(sim._pieces()) + 1
    # the repeated save: planned from the step just saved
    synth0, gc0 = sim.synth_cpu, sim.synth_gc
    sim.sent, sim.received = {}, {}
    steps2 = Steps(sim)
    places = {wr.index: (wr.storage_data.relative_path, wr.storage_data.offset, wr.storage_data.length)
              for wr in results}
    with Meter() as m2, collector_paused():
        got = _resumed_save(sim, steps2, sd, kept, rank, Path(args.work) / f"w{rank}" / "again" / layout.MODEL_DIR,
                            lambda p: places)
    repeated = {"steps": steps2.cpu, **m2.report(minus_cpu=sim.synth_cpu - synth0, minus_gc=sim.synth_gc - gc0), **got,
                "collectives": _bytes(sim)}
    ck.close()
    return {"rank": rank, "first": first, "repeated": repeated}


def _entry_bytes(results: list) -> float:
    from cloudckpt.dcp.assemble import fragment

    some = results[: min(len(results), 2000)]
    return len(fragment(storage_data=[(wr.index, wr.storage_data) for wr in some])) / max(1, len(some))


def _assemble_metadata(rw, step, writer, planner, uploads):
    """``RankWriter._assemble``'s first half: the fragment, then ``.metadata`` joined in
    the store (the index header is timed on its own)."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from cloudckpt.checkpoint import layout
    from cloudckpt.dcp.assemble import TRAILER, header
    from cloudckpt.dcp.assemble_store import assemble_in_store
    from cloudckpt.dcp.owners import fragment_of

    coord, url = rw.coord, step.url_of(layout.DCP_METADATA)
    mine = coord.agree("the .metadata fragments of " + step.url, lambda: fragment_of(planner.owned, writer.results))
    info = assemble_in_store(coord, step.store, url, mine, trailer=TRAILER,
                             header=header(planner_data=planner.flatten_state_dict, version=CURRENT_DCP_VERSION))
    if coord.is_coordinator:
        uploads.append((layout.DCP_METADATA, info))
    return info


def _commit_marker(args, step, uploads, header_bytes):
    """Rank 0: the step's marker (``.metadata`` and the index header in its manifest),
    committed by the library's save protocol on one rank: what ``SavedStructure`` reads."""
    from cloudckpt.checkpoint import layout, rank_writer, saving
    from cloudckpt.checkpoint.entries import ObjectEntry
    from cloudckpt.transfer import crc32c_bytes

    info = dict(uploads)[layout.DCP_METADATA]
    # the peers' shards stand in one entry (their manifest parts are the save phase's, not simulated here):
    # the step's bytes bound what a reader accepts as its .metadata (untrusted.limits.metadata_limit)
    entries = [ObjectEntry(layout.DCP_METADATA, info.size, info.crc32c),
               ObjectEntry(layout.INDEX_HEADER, len(header_bytes), crc32c_bytes(header_bytes)),
               ObjectEntry(f"{layout.MODEL_DIR}/__0_999.distcp", shape_named(args.shape).total_bytes(), "00000000")]
    Path(step.url, layout.INDEX_HEADER).parent.mkdir(parents=True, exist_ok=True)
    Path(step.url, layout.INDEX_HEADER).write_bytes(header_bytes)
    one = SimCoordinator(0, 1, _payloads(args))
    ck = _checkpointer(args.work)
    try:
        saving.save(one, ck.engine, ck.options, step, lambda ref, work: rank_writer.RankResult(
            entries, time.monotonic(), None), ephemeral=False, needs_work=False)
    finally:
        ck.close()
    from cloudckpt.checkpoint.committed import CommittedStep

    return CommittedStep.open(step).marker


def _bytes(sim: OwnersSim) -> dict:
    return {k: [sim.sent.get(k, 0), sim.received.get(k, 0)] for k in sorted({*sim.sent, *sim.received})}


def phase_resumed(args) -> dict:
    """The first save after a resume on rank ``args.rank``: planned from the step the
    ``save`` phase committed (``LoadedStructure``, the header read and parsed as the load
    left it), then the job's next save (planned from the same structure: a repeated
    save after a resume); and the last rank's verdict on that step."""
    from cloudckpt.checkpoint import layout
    from cloudckpt.checkpoint.committed import CommittedStep
    from cloudckpt.checkpoint.structure import LoadedStructure
    from cloudckpt.collector import collector_paused

    rank = args.rank
    shape, sd, peers, sim, ck, rw, StepRef = _setup(args, rank)
    step = StepRef.of(str(Path(args.work) / "run" / f"step{STEP}"))
    committed = CommittedStep.open(step)
    committed.header()  # parsed by the load (its prologue: bench.scale's load phase)
    committed.index_part(rank)  # read by the load (its own chunks: the same world size), kept by the step
    out: dict = {"rank": rank}
    kept = None
    for name in ("first", "next"):  # the job's first save after the load, then its next save (the same structure)
        steps, synth0, gc0 = Steps(sim), sim.synth_cpu, sim.synth_gc
        sim.sent, sim.received = {}, {}
        with Meter() as m, collector_paused():
            if kept is None:
                with steps("LoadedStructure of the loaded step"):
                    kept = LoadedStructure.of(committed, rank, args.ranks)
                if kept is None:
                    return {"error": "the loaded step cannot be planned from (LoadedStructure.of: None)"}
            got = _resumed_save(sim, steps, sd, kept, rank, Path(args.work) / f"w{rank}" / name / layout.MODEL_DIR,
                                lambda p: p.expected)
        out[name] = {"steps": steps.cpu, **m.report(minus_cpu=sim.synth_cpu - synth0, minus_gc=sim.synth_gc - gc0),
                     **got,
                     "collectives": _bytes(sim)}
    # the last rank: its items from this rank's with its rows
    last = args.ranks - 1
    if last > 1:
        from torch.distributed.checkpoint import DefaultSavePlanner

        dp = DefaultSavePlanner()
        dp.set_up_planner(sd, None, False)
        items = [_peer_item(it, shape, args.ranks, last) for it in dp.create_local_plan().items]
        verdict = LoadedStructure(committed, last).final_plan(items)
        out["last_rank_verdict"] = "planned from the loaded step" if not isinstance(verdict, str) else verdict
    ck.close()
    return out


def _peer_item(it, shape, R: int, r: int):
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    td = it.tensor_data
    if td is None or not len(td.size):
        return it
    lo, hi = rows_of(tuple(td.size), R, r)
    off = torch.Size((lo, *td.chunk.offsets[1:]))
    chunk = ChunkStorageMetadata(offsets=off, sizes=torch.Size((hi - lo, *td.chunk.sizes[1:])))
    return dataclasses.replace(it, index=MetadataIndex(it.index.fqn, off),
                               tensor_data=dataclasses.replace(td, chunk=chunk))


# ---------------------------------------------------------------------- real ranks against the simulation
def _norm(step: str) -> str:
    """A step's name without the URL it names (``... of s3://b/R8/step1/...``)."""
    import re

    return re.sub(r" of \S+$", "", step)


def _real_bytes(rank_res: dict, phase: str) -> dict:
    out: dict = {}
    for step, calls in rank_res[phase]["calls"].items():
        o = out.setdefault(_norm(step), [0, 0])
        for _, sent, got in calls.values():
            o[0] += sent
            o[1] += got
    return out


#: the steps of a first save planned by owners (and of the repeated save) that the simulation runs
PLANNING = ("any_rank", "plan by owners or from the loaded step", "dcp plan", RECORDS, "owners check the save plan",
            DECISIONS, "the .metadata fragments", "begin the assembly", "sizes of the fragments",
            "upload the pieces", "complete the assembly", PLACES, ENTRIES, ASK_LAYOUTS, LAYOUTS)


def _names_url(step: str) -> bool:
    """A step whose payload holds the object's URL (an Assembly, an ObjectInfo), broadcast
    to R - 1 ranks: the simulation's local path and the real ranks' S3 URL differ in length."""
    return any(x in step for x in ("begin the assembly", "complete the assembly"))


#: (step, rank, 0 out / 1 in) where bench/real_ranks.py's count is not the wire's: an ordinary rank
#: sizes what a broadcast gave it by pickling it again, and the CoordinatorMetadata rank 0 sends
#: (74 bytes) unpickles as a plain Metadata (159 bytes)
PROBE_REPICKLES = {("repeated save: dcp write", 1, 1)}


def _median_of(runs: list[dict]) -> dict:
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["first"]["cpu_s"])
    return ok[(len(ok) - 1) // 2] if ok else runs[0]


def confirm_first(real_path: str, tmp: str, reps: int = 3) -> list[dict]:
    """For each R of a bench/real_ranks.py result (``real_path``), the simulation of
    ranks 0 and 1 of the same state (``per_rank``): every collective step of the first
    save and of the repeated save, bytes out / in per rank, real against simulated; and
    the CPU of the planning and ``.metadata`` steps (real: those steps' main-thread CPU;
    simulated: the phase's) at each R."""
    import json
    import tempfile

    from bench.scale import run_phase

    real = json.loads(Path(real_path).read_text())
    tensors, rows, cols = real["tensors"], real["rows"], real["cols"]
    out = []
    for R_text, ranks in sorted(real["results"].items(), key=lambda kv: int(kv[0])):
        R = int(R_text)
        work = tempfile.mkdtemp(dir=tmp, prefix=f"first-R{R}-")
        shape = f"perrank-T{tensors}x{rows}x{cols}-R{R}"
        runs = []
        for _ in range(reps):  # CPU-s vary from run to run here (a shared machine, GC passes): the median run
            d = tempfile.mkdtemp(dir=work)
            runs.append([run_phase("first", shape, R, d, rank=r) for r in (0, 1)])
        sims = [_median_of([p[w] for p in runs]) for w in (0, 1)]
        row = {"ranks": R, "steps": {}, "cpu": {}, "sim_cpu_runs": [[x.get("first", {}).get("cpu_s") for x in p]
                                                                     for p in runs]}
        for who, sim in zip((0, 1), sims, strict=True):
            if "error" in sim:
                row["error"] = sim["error"]
                continue
            for phase, sphase in (("first save", "first"), ("repeated save", "repeated")):
                got = _real_bytes(ranks[who], phase)
                for step, b in sim[sphase]["collectives"].items():
                    name = _norm(step)
                    r = got.get(name)
                    row["steps"].setdefault(f"{phase}: {name}", {})[who] = {"real": r, "sim": b}
                steps = ranks[who][phase]["steps"]
                real_cpu = sum(v for k, v in steps.items() if any(_norm(k).startswith(p) for p in PLANNING))
                row["cpu"].setdefault(phase, {})[who] = {"real": round(real_cpu, 3), "sim": sim[sphase]["cpu_s"]}
        row["bytes_agree"] = all(
            v["real"] is not None and all(abs(a - b) <= 0.05 * max(a, b) + 64 * (R if _names_url(step) else 1)
                                          or (step, who, k) in PROBE_REPICKLES
                                          for k, (a, b) in enumerate(zip(v["real"], v["sim"], strict=True)))
            for step, per in row["steps"].items() for who, v in per.items())
        out.append(row)
    return out


# ---------------------------------------------------------------------- the report
def _ok(d: dict | None) -> bool:
    return bool(d) and "error" not in d


def _cpu_mb(d: dict) -> str:
    return f"{d['cpu_s']:.2f} / {d['peak_rss_above_base_mb']:.0f}"


def _largest(collectives: dict) -> str:
    step, (out, got) = max(collectives.items(), key=lambda kv: max(kv[1]))
    return f"{_norm(step)}: {out / 1e6:.2f} / {got / 1e6:.2f}"


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, judged on the rows: rank 0 at 4,096 ranks, every simulated
    rank's first save beyond its repeated save, rank 0 at the largest R against the
    smallest, the first save after a resume against a repeated save."""
    out = []
    first = {r["ranks"]: r["first"] for r in rows if r.get("first") and _ok(r["first"].get("rank0"))}
    if 4096 in first:
        f = first[4096]["rank0"]["first"]
        out.append(f"rank 0 at R = 4,096: {f['cpu_s']:.2f} CPU-s (target <= 10), {f['peak_rss_above_base_mb']:.0f} MB "
                   f"above its baseline, {f['peak_rss_mb']:.0f} MB resident (target <= 1,000): "
                   + ("met" if f["cpu_s"] <= 10 and f["peak_rss_mb"] <= 1000 else "NOT met"))
    beyond = [(R, who, v["first"]["cpu_s"] - v["repeated"]["cpu_s"],
               v["first"].get("cpu_s_without_gc", 0.0) - v["repeated"].get("cpu_s_without_gc", 0.0))
              for R, d in first.items() for who, v in d.items() if _ok(v)]
    if beyond:
        R, who, worst, bare = max(beyond, key=lambda x: x[2])
        out.append(f"largest first save beyond the repeated save, any simulated rank, any R: {worst:.2f} CPU-s "
                   f"({who} at R = {R:,}; {bare:.2f} without the garbage collector; target <= 1): "
                   + ("met" if worst <= 1 else "NOT met"))
    if len(first) > 1:
        lo, hi = min(first), max(first)
        a, b = first[lo]["rank0"]["first"]["cpu_s"], first[hi]["rank0"]["first"]["cpu_s"]
        ga, gb = (first[R]["rank0"]["first"].get("gc_cpu_s", 0.0) for R in (lo, hi))
        out.append(f"rank 0's first save at R = {hi:,} against {lo:,}: {b:.2f} / {a:.2f} CPU-s = x{b / a:.2f} "
                   f"(target <= x1.5; of which the garbage collector {gb:.2f} / {ga:.2f}, without it "
                   f"x{(b - gb) / max(a - ga, 1e-9):.2f}): " + ("met" if b <= 1.5 * a else "NOT met"))
    for r in rows:
        for who, got in (r.get("resumed") or {}).items():
            if _ok(got):
                a, b = got["first"]["cpu_s"], got["next"]["cpu_s"]
                ga, gb = got["first"].get("gc_cpu_s", 0.0), got["next"].get("gc_cpu_s", 0.0)
                out.append(f"R = {r['ranks']:,}, {who}: first save after a resume {a:.2f} CPU-s against the next "
                           f"(repeated) save's {b:.2f} = x{a / max(b, 1e-9):.2f} (target <= x1.2; of which the "
                           f"garbage collector {ga:.2f} / {gb:.2f}): "
                           + ("met" if a <= 1.2 * b else "NOT met")
                           + (f"; the last rank: {got['last_rank_verdict']}" if "last_rank_verdict" in got else ""))
    return out


def _first_tables(rows: list[dict]) -> list[str]:
    lines = ["", "## A job's first save, planned by owners (bench/scale_first.py)", "",
             "Rank 0 and the owner of the most keys, each in its own process: planning and metadata of the save "
             "(no tensor byte written), then the job's repeated save planned from the step it made. CPU-s / peak MB "
             "above the baseline; bytes in MB out / in.", "",
             "| R | rank 0, first save | rank 0, repeated save | owner (rank; keys), first save | owner, repeated "
             "save | rank 0's largest collective, MB out / in | `.metadata` (MB, estimated) / S3 parts | "
             "stock DCP's finish on rank 0 (every write result gathered), CPU-s / peak MB; x rank 0's first save |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f0, fo = r["first"].get("rank0") or {}, r["first"].get("owner") or {}
        if not (_ok(f0) and _ok(fo)):
            lines.append(f"| {r['ranks']:,} | error: {(f0.get('error') or fo.get('error') or '')[:120]} | | | | | | |")
            continue
        fin = (r.get("finish") or {}).get("first")
        x = fin["cpu_s"] / f0["first"]["cpu_s"] if fin else 0
        stock = (f"{fin['cpu_s']:.1f} / {fin['peak_rss_above_base_mb']:,.0f}; x{x:.0f}" if fin
                 else "not run (memory)" if "skipped" in (r.get("finish") or {}) else "-")
        lines.append(f"| {r['ranks']:,} | {_cpu_mb(f0['first'])} | {_cpu_mb(f0['repeated'])} | "
                     f"{_cpu_mb(fo['first'])} ({fo['rank']}; {fo['first']['owned_keys']}) | "
                     f"{_cpu_mb(fo['repeated'])} | "
                     f"{_largest(f0['first']['collectives'])} | {f0['first']['metadata_bytes'] / 1e6:,.0f} / "
                     f"{f0['first'].get('pieces', '-')} | {stock} |")
    runs = [(r["ranks"], who, r["first"][who]["cpu_s_runs"]) for r in rows for who in ("rank0", "owner")
            if _ok(r["first"].get(who)) and r["first"][who].get("cpu_s_runs")]
    if runs and any(len(x) > 1 for _, _, x in runs):
        lines += ["", "First-save CPU-s, every run (the table shows the run of median CPU): "
                  + "; ".join(f"R = {R:,} {who}: {', '.join(f'{x:.2f}' for x in xs)}" for R, who, xs in runs) + "."]
    steps = sorted({k for r in rows for who in ("rank0", "owner") if _ok(r["first"].get(who))
                    for k in r["first"][who]["first"]["steps"]}, key=lambda k: list(STEP_ORDER).index(k)
                   if k in STEP_ORDER else 99)
    lines += ["", "First save, CPU-s by step, rank 0 / owner:", "",
              "| step | " + " | ".join(f"R = {r['ranks']:,}" for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for k in steps:
        cells = []
        for r in rows:
            a, b = (r["first"].get(w) or {} for w in ("rank0", "owner"))
            cells.append(" / ".join(f"{x['first']['steps'].get(k, 0):.3f}" if _ok(x) else "-" for x in (a, b)))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    names = sorted({_norm(k) for r in rows for who in ("rank0", "owner") if _ok(r["first"].get(who))
                    for k in r["first"][who]["first"]["collectives"]})
    lines += ["", "First save, bytes by collective step (out / in): rank 0; owner:", "",
              "| step | " + " | ".join(f"R = {r['ranks']:,}" for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for k in names:
        cells = []
        for r in rows:
            got = []
            for who in ("rank0", "owner"):
                d = r["first"].get(who)
                c = {_norm(s): v for s, v in d["first"]["collectives"].items()} if _ok(d) else {}
                got.append(f"{c[k][0]:,} / {c[k][1]:,}" if k in c else "-")
            cells.append("; ".join(got))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def report_first(res: dict) -> list[str]:
    rows = [r for r in res["rows"] if r.get("first")]
    lines = _first_tables(rows) if rows else []
    res_rows = [r for r in res["rows"] if r.get("resumed")]
    if res_rows:
        lines += ["", "A restart: the job's first save after its load (planned from the loaded step), then its next "
                  "save (the same structure: a repeated save), CPU-s / peak MB:", "",
                  "| R | rank 0: first save after the resume; next save | rank 1: the same | "
                  "the last rank's verdict on the loaded step |", "|---|---|---|---|"]
        for r in res_rows:
            a, b = r["resumed"].get("rank0") or {}, r["resumed"].get("rank1") or {}
            cell = [f"{_cpu_mb(x['first'])}; {_cpu_mb(x['next'])}" if _ok(x) else
                    f"error: {x.get('error', '')[:100]}" for x in (a, b)]
            lines.append(f"| {r['ranks']:,} | {cell[0]} | {cell[1]} | {b.get('last_rank_verdict', '-')} |")
    t = targets(res["rows"])
    if t:
        lines += ["", "Targets (issue 42):", ""] + [f"- {x}" for x in t]
    return lines


STEP_ORDER = ("any_rank: plan by owners or from the kept step", "DCP's local plan",
              "owners: records, checks, decisions (plan_by_owners)", PLAN_STEP, WRITE_STEP,
              ".metadata assembled in the store", "index header by owners", "keep the saved structure")


def confirm_report(res: dict) -> str:
    rows = res["rows"]
    lines = ["# bench.scale --confirm-first: a job's first save, real gloo ranks against the simulation", "",
             f"Command: `{res['command']}` (real ranks: `{res['real']}`)  ",
             f"Measured {res['when']} on {res['machine']['cpus']} CPUs.", "",
             "Bytes out / in of each collective step, rank 0; rank 1: real (every torch.distributed call counted "
             "by bench/real_ranks.py) | simulated. Within 5 % + 64 bytes: "
             + ", ".join(f"R = {r['ranks']}: {r['bytes_agree']}" for r in rows)
             + " (but an ordinary rank's `in` of the repeated save's `dcp write`: the real count pickles again the "
             "CoordinatorMetadata it received, 159 bytes for the 74 sent; and 64 bytes a rank where the payload "
             "holds the URL of `.metadata`: a local path here, an S3 URL there).", "",
             "| step | " + " | ".join(f"R = {r['ranks']}" for r in rows) + " |", "|---|" + "---|" * len(rows)]

    def pair(v) -> str:
        return "-" if v is None else f"{v[0]:,} / {v[1]:,}"

    for step in sorted({k for r in rows for k in r["steps"]}):
        cells = []
        for r in rows:
            per = r["steps"].get(step, {})
            cells.append("; ".join(f"{pair(per[w]['real'])} \\| {pair(per[w]['sim'])}" if w in per else "-"
                                   for w in per) or "-")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", "CPU-s of the planning and `.metadata` steps (real: those steps' main-thread CPU; simulated: "
              "the phase's), rank 0; rank 1, real | simulated:", "",
              "| save | " + " | ".join(f"R = {r['ranks']}" for r in rows) + " | real x / sim x (last R / first) |",
              "|---|" + "---|" * (len(rows) + 1)]
    for phase in ("first save", "repeated save"):
        cells, ends = [], {}
        for r in rows:
            per = r["cpu"].get(phase, {})
            cells.append("; ".join(f"{per[w]['real']:.3f} \\| {per[w]['sim']:.3f}" for w in sorted(per)))
            for w in per:
                ends.setdefault(w, []).append((per[w]["real"], per[w]["sim"]))
        trend = "; ".join(f"rank {w}: x{v[-1][0] / max(v[0][0], 1e-9):.2f} / x{v[-1][1] / max(v[0][1], 1e-9):.2f}"
                          for w, v in sorted(ends.items()))
        lines.append(f"| {phase} | " + " | ".join(cells) + f" | {trend} |")
    return "\n".join(lines) + "\n"
