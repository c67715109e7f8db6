"""Each stored byte range read from the bucket once per job at load (issue 33).

When several ranks need the same stored item (replicated tensors: DDP, the replica
groups of HSDP, replicated scalars such as Adam's ``step``), one of them reads it from
the bucket and sends it to the others over a dedicated gloo group.

**Census** (:meth:`Exchange.census`, four ``all_to_all_single`` of int64 rows; nothing a
rank sends or receives grows with the world size R beyond two lists of R counts):

1. each needed range ``(file, offset, length)`` goes to an *owner* rank, a hash of the
   file and the range's 1 GiB block (in effect the file: the writer's files are about
   256 MiB), so the ranges of one file meet at one rank; a tiny range (a replicated
   scalar, which all R ranks need) goes to an owner of its own (``owner_of``);
2. the owner groups the ranges of a block by the set of ranks that need them, cuts each
   group into contiguous runs of about equal bytes, one per rank of the set (never
   splitting an item: an item goes to the run holding most of it; the runs go to the
   ranks the owner has given the fewest bytes so far, starting at a point that depends
   on the group's first range), and answers each request with
   the rank that reads it (and, to that rank, how many others need it);
3. the reading rank receives, from the owner, the ranks it sends each range to.

A rank that shares nothing reads as before (the census is its only extra cost).

**Exchange** (:meth:`Exchange.read`): each rank reads its runs through the streaming
path (coalesced streams, each item checked against its CRC32C and put in place as it
arrives), and a sender thread sends each item other ranks need to them; a receiver
thread receives the rest, checks each against the manifest's CRC32C like a bucket read
and puts it in place. Memory is bounded: received items are posted a window at a time
(the reader's in-flight budget), items waiting to be sent count in the streams' budget.
Items are sent and received in one global order (file id, offset) on every rank, and a
rank's smallest item not read yet may always take budget, so the smallest item not yet
delivered anywhere in the job always moves: no rank waits on another in a cycle.

A peer that fails or dies: the ranks waiting on it (a closed connection, or nothing
within the collective timeout) raise :class:`ExchangeFailed` naming it.

**After a failure, the drain.** A gloo send or receive that was posted cannot be taken
back (torch binds no ``abort`` of a Work), and a thread left waiting in one when the
process exits is destroyed inside gloo: ``terminate called without an active
exception`` (SIGABRT), seen on the rank that was not at fault. So a rank whose exchange
fails first tells its peers (``_Status``: the word travels ahead of anything else on
each connection), then delivers the rest of its schedule: every item it owes is sent
(zeros for those it does not have; a peer that heard of the failure drops them unread)
and every item it awaits is received and dropped. Both sides go in the global order, so
the drain ends (a dead peer's operations fail at once, a hung one's within the
collective timeout); :meth:`Exchange.read` raises only once no thread of the exchange
runs. Item tags carry the load's number, so nothing of a failed load matches the next.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import struct
import threading
import time
import warnings
import weakref
from typing import Callable

import torch

from .. import dist
from ..checkpoint.layout import shard_writer
from ..errors import CorruptCheckpoint, ExchangeFailed
from ..storage import url as urls
from ..units import MiB
from .streaming import _Stopped, read_streamed

log = logging.getLogger(__name__)

BLOCK = 1024 * MiB  # ranges of one block of a file meet at one owner (contiguous runs)
# a range shorter than this (a 0-dim tensor as DCP stores it: torch.save, 1,577 bytes in
# torch 2.13; a small pickled value) meets at an owner of its own (owner_of)
TINY = 1600
OWN_READS = 8  # a tiny range that at most this many ranks need: each reads it (no exchange for a few bytes)
EACH = -1  # assign's reader of such a range: every rank that needs it

Key = tuple[int, int, int]  # (file id, offset, length)
# an item read from the bucket (bytes) is sent as it is, without a copy: the send only
# reads it (torch warns, once per process, that the buffer is not writable)
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


def file_id(rel: str) -> int:
    """A signed 64-bit id of a relative file name (the same on every rank)."""
    return int.from_bytes(hashlib.blake2b(rel.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little",
                          signed=True)


def owner_of(fid: int, offset: int, length: int, world_size: int) -> int:
    """The rank that decides who reads the range: a hash of the file and the range's
    block; for a tiny range (under ``TINY`` bytes: replicated scalars, which every rank
    of the job needs), of the file and its offset, so the R requests for each scalar
    meet at ranks of their own instead of all at the owner of their block."""
    where = offset // BLOCK if length >= TINY else -1 - offset
    h = hashlib.blake2b(struct.pack("<qq", fid, where), digest_size=8).digest()
    return int.from_bytes(h, "little") % world_size


def _tag(key: Key, load: int) -> int:
    """The tag of ``key``'s message in the ``load``-th load of the group: the load's number
    (mod 1024) in the high bits, so a message of an earlier load that failed (the same
    file names and ranges at the next step, or at the step a resume falls back to) never
    matches a later load's. Keys of one load that share a tag match in order (both sides
    go in the global order)."""
    h = int.from_bytes(hashlib.blake2b(struct.pack("<qqq", *key), digest_size=4).digest(), "little")
    return ((load % 1024) << 20) | (h & 0xFFFFF)


class Plan:
    """What one rank does in the exchange: ``reads`` ``{key: [ranks to send to]}`` (every
    range it reads from the bucket, shared or not), ``recvs`` ``{key: source rank}``."""

    def __init__(self, rels: dict[int, str]):
        self.rels = rels  # file id -> relative name
        self.reads: dict[Key, list[int]] = {}
        self.recvs: dict[Key, int] = {}

    @property
    def shared(self) -> bool:
        return bool(self.recvs) or any(self.reads.values())


def assign(requests: dict[Key, list[int]], load: dict[int, int]) -> dict[Key, int]:
    """The owner's choice: for each key (all of one owner), the rank that reads it.
    Keys of one block needed by the same set of ranks are cut, in offset order, into
    contiguous runs of about equal bytes, one run per rank of the set; runs go to the
    ranks with the fewest bytes in ``load`` (updated) first, ties broken from a point
    that depends on the group's first range. A tiny range (under ``TINY`` bytes) that
    at most ``OWN_READS`` ranks need is read by each of them (``EACH``): a load whose
    only shared items are a few scalars (FSDP's ``step``) then reads as without the
    exchange."""
    groups: dict[tuple, list[Key]] = collections.defaultdict(list)
    for key, ranks in requests.items():
        groups[(key[0], key[1] // BLOCK, tuple(sorted(set(ranks))))].append(key)
    out: dict[Key, int] = {}
    for (fid, _block, ranks), keys in sorted(groups.items()):
        if len(ranks) == 1:
            out.update((k, ranks[0]) for k in keys)
            continue
        if len(ranks) <= OWN_READS:
            out.update((k, EACH) for k in keys if k[2] < TINY)
            keys = [k for k in keys if k[2] >= TINY]
            if not keys:
                continue
        keys.sort(key=lambda k: (k[1], k[2]))
        total = sum(k[2] for k in keys)
        n = min(len(ranks), len(keys))
        # (of the group's first range: the tiny ranges of one block, each at an owner of its
        # own, start at different ranks)
        start = int.from_bytes(hashlib.blake2b(struct.pack("<qq", fid, keys[0][1]), digest_size=4).digest(), "little")
        order = sorted(ranks, key=lambda r: (load.get(r, 0), (ranks.index(r) - start) % len(ranks)))
        run, acc = 0, 0
        for k in keys:
            # the next run starts where this one holds its share of the bytes (an item
            # across the boundary goes to the run holding more of it)
            while run < n - 1 and acc + k[2] / 2 >= total * (run + 1) / n:
                run += 1
            reader = order[run]
            out[k] = reader
            load[reader] = load.get(reader, 0) + k[2]
            acc += k[2]
    return out


class Exchange:
    """The read-once exchange of one job: a dedicated gloo group (``coord``)."""

    def __init__(self, coord: dist.Coordinator):
        self.coord = coord
        self.last_error: ExchangeFailed | None = None
        self.last_census_seconds = 0.0
        self.loads = 0  # census calls: the same count on every rank (a collective each)
        # reader of a load -> (its keys, the plan): a census made before its read (plan_ahead);
        # kept with the load's reader, so a load that failed before reading leaves nothing behind
        self._ahead: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def rank(self) -> int:
        return self.coord.rank

    # ------------------------------------------------------------ census
    def census(self, needed: dict[str, list[tuple[int, int]]]) -> Plan:
        """Which ranges this rank reads (and for whom) and which it receives (from
        whom). Collective over the group: every rank calls it once per load. When no
        rank reads another rank's shard files (but, in a job of at most ``OWN_READS``
        ranks, tiny ranges, which each reads anyway) nothing can be shared: one
        all_reduce of a flag says so, and every rank reads its own ranges."""
        t0 = time.monotonic()
        self.loads += 1
        self.last_error = None
        R, me = self.coord.world_size, self.rank
        rels: dict[int, str] = {}
        for rel in needed:
            fid = file_id(rel)
            if rels.setdefault(fid, rel) != rel:  # two names, one id: share nothing of this load
                raise CorruptCheckpoint(f"{rel!r} and {rels[fid]!r} have the same file id; load without the exchange")
        keys = sorted({(file_id(rel), off, n) for rel, spans in needed.items() for off, n in spans})
        # 0. nothing to share when every rank reads only its own shard files (a restart with
        # the saved layout: FSDP) or, in a job of at most OWN_READS ranks, only tiny ranges
        # besides (each reads them anyway): one all_reduce of a flag instead of the census
        private = all(shard_writer(rel) == me or (R <= OWN_READS and all(n < TINY for _, n in spans))
                      for rel, spans in needed.items())
        if not self.coord.any_rank([not private])[0]:
            plan = Plan(rels)
            plan.reads = {k: [] for k in keys}
            self.last_census_seconds = time.monotonic() - t0
            return plan
        by_owner: list[list[Key]] = [[] for _ in range(R)]
        for k in keys:
            by_owner[owner_of(k[0], k[1], k[2], R)].append(k)
        send_n = [len(b) for b in by_owner]
        recv_n = self.coord.all_to_all_int64(torch.tensor(send_n, dtype=torch.int64), [1] * R, [1] * R).tolist()
        # 2. the requests, to their owners
        rows = torch.tensor([x for b in by_owner for k in b for x in k], dtype=torch.int64)
        got = self.coord.all_to_all_int64(rows, [3 * n for n in send_n], [3 * n for n in recv_n]).view(-1, 3).tolist()
        requests: dict[Key, list[int]] = collections.defaultdict(list)
        asked: list[tuple[int, Key]] = []  # (requester, key) in the order received
        at = 0
        for src, n in enumerate(recv_n):
            for row in got[at:at + n]:
                k = (row[0], row[1], row[2])
                if k[1] < 0 or k[2] < 0:
                    raise CorruptCheckpoint(f"rank {src} asked for a range at a negative offset or length: {k}")
                requests[k].append(src)
                asked.append((src, k))
            at += n
        reader = assign(requests, {})
        # 3. answers: (reader, how many others need it when the requester is the reader)
        answers = [x for src, k in asked
                   for x in ((src, 0) if reader[k] == EACH else (reader[k], len(requests[k]) - 1 if reader[k] == src
                                                                   else 0))]
        ans = self.coord.all_to_all_int64(torch.tensor(answers, dtype=torch.int64), [2 * n for n in recv_n],
                                          [2 * n for n in send_n]).view(-1, 2).tolist()
        # 4. to each reader, the ranks it sends each of its shared ranges to
        dests = [[] for _ in range(R)]
        for src, k in asked:
            if reader[k] == src:
                dests[src].extend(r for r in requests[k] if r != src)
        mine = [k for b in by_owner for k in b]
        incoming = [0] * R
        at = 0
        for o, b in enumerate(by_owner):
            incoming[o] = sum(a[1] for a in ans[at:at + len(b)])
            at += len(b)
        flat = self.coord.all_to_all_int64(torch.tensor([r for d in dests for r in d], dtype=torch.int64),
                                           [len(d) for d in dests], incoming).tolist()
        plan = Plan(rels)
        at = 0
        for k, (rd, n) in zip(mine, ans, strict=True):
            if not 0 <= rd < R:
                raise CorruptCheckpoint(f"the exchange's census named rank {rd} of {R} as the reader of a range")
            if rd == me:
                plan.reads[k] = flat[at:at + n]
                at += n
            else:
                plan.recvs[k] = rd
        self.last_census_seconds = time.monotonic() - t0
        return plan

    # ------------------------------------------------------------ the load
    def read(self, reader, per_file: dict[str, list], planner, plain: Callable[[dict], None]) -> None:
        """Load ``per_file`` (``{relative path: [(offset, length, ReadItem)]}``, this rank's
        plan) with ``reader`` (a StreamingReader): the census, then this rank's share from
        the bucket (``streaming.read_streamed``; ``plain(per_file)``, the reader's usual way,
        when nothing is shared), the rest from peers. Adds to ``reader.bytes_read`` (from
        the bucket) and ``reader.bytes_from_peers``."""
        needed = {rel: [(off, n) for off, n, _ in reqs] for rel, reqs in per_file.items()}
        ahead = self._ahead.pop(reader, None)
        if ahead is None:
            plan = self._census(needed)
        elif ahead[0] != _keys(needed):  # (the same plan on every rank: cannot happen)
            raise RuntimeError("the load reads other ranges than its census (plan_ahead) was made for")
        else:
            plan = ahead[1]
        if not plan.shared:
            plain(per_file)
            return
        items: dict[Key, list] = collections.defaultdict(list)  # key -> ReadItems
        for rel, reqs in per_file.items():
            fid = file_id(rel)
            for off, n, req in reqs:
                items[(fid, off, n)].append(req)
        mine: dict[str, list] = {}
        for k in sorted(plan.reads):
            rel = plan.rels[k[0]]
            mine.setdefault(rel, []).extend((k[1], k[2], req) for req in items[k])
        to_send = sorted(k for k, d in plan.reads.items() if d)
        status = _Status(self, plan)
        sender = _Sender(self, plan, to_send)
        receiver = _Receiver(self, reader, planner, plan, {k: items[k] for k in plan.recvs}, status)
        streams = _Worker(self, "cloudckpt-exchange-read")
        streams.run = lambda: read_streamed(reader, mine, planner, max_gap=0, hold=sender)
        workers = (streams, sender, receiver)
        wake = threading.Event()  # a worker ended
        for w in workers:
            w.wake = wake
            w.start()
        try:
            while not all(w.done for w in workers):
                status.check()  # a peer said it failed: fail now, naming the rank it names
                for w in workers:
                    if w.error is not None:
                        raise w.error
                wake.wait(0.02)
                wake.clear()
            for w in workers:
                w.join()
        except BaseException as e:  # noqa: BLE001 - re-raised (peers told which rank failed)
            sender.halt_streams()
            streams._thread.join()  # its streams stop before their next item: no target is written after this
            e = status.failing(e)  # peers are told first: their word arrives before any message of the drain
            for w in (sender, receiver):
                w.stop()  # the drain: the rest of the schedule, nothing put in place
            for w in (sender, receiver):
                w._thread.join()  # no thread of the exchange waits in gloo once the load raised
            raise self._raised(e) from None
        finally:
            reader.bytes_from_peers += receiver.bytes
            reader.direct_items += receiver.direct
        try:
            status.finish()
        except ExchangeFailed as e:
            raise self._raised(e) from None

    def plan_ahead(self, needed: dict[str, list[tuple[int, int]]], reader) -> dict[str, list[tuple[int, int]]]:
        """The census of the load of ``reader``, made before its reading (collective, as
        :meth:`census`: on every rank or none), kept for its :meth:`read`. Returns the
        ranges of ``needed`` this rank reads from storage itself (the others come from
        peers): what the node-local tier's recovery fetches before the read."""
        plan = self._census(needed)
        self._ahead[reader] = (_keys(needed), plan)
        mine: dict[str, list[tuple[int, int]]] = {}
        for rel, spans in needed.items():
            fid = file_id(rel)
            kept = [(off, n) for off, n in spans if (fid, off, n) in plan.reads]
            if kept:
                mine[rel] = kept
        return mine

    def _census(self, needed: dict[str, list[tuple[int, int]]]) -> Plan:
        try:
            return self.census(needed)
        except RuntimeError as e:  # a collective of the census failed (a peer died or timed out)
            why = f"the census (an all_to_all of the group) failed: {e}; a rank died or did not join within " \
                  f"{self.coord.timeout:g} s"
            raise self._raised(self._failed({"?": why})) from None

    def _raised(self, e: BaseException) -> BaseException:
        if isinstance(e, ExchangeFailed):
            self.last_error = e
        return e

    def _failed(self, failures: dict) -> ExchangeFailed:
        return ExchangeFailed("read-once exchange", failures)


def _keys(needed: dict[str, list[tuple[int, int]]]) -> frozenset:
    return frozenset((file_id(rel), off, n) for rel, spans in needed.items() for off, n in spans)


class _Worker:
    """A thread of the exchange whose first error is kept and raised by ``join``."""

    def __init__(self, exchange: Exchange, name: str):
        self.ex = exchange
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._ended

    wake: threading.Event | None = None  # set when the thread ends

    def _main(self) -> None:
        try:
            self.run()
        except BaseException as e:  # noqa: BLE001 - raised by join on the loading thread
            self.error = e
        finally:
            self._ended = True
            if self.wake is not None:
                self.wake.set()

    def stop(self) -> None:
        self._stopped.set()

    def _failed_with(self, e: BaseException) -> None:
        """Keep the first error (the loading thread raises it) and go on draining."""
        if self.error is None:
            self.error = e
        if self.wake is not None:
            self.wake.set()

    @property
    def draining(self) -> bool:
        """The load failed (here or as told): deliver the rest of the schedule, place nothing."""
        return self._stopped.is_set() or self.error is not None

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error

    def post(self, start, tensor, peer: int, tag: int, *, what: str):
        """``start(tensor, peer, tag)`` (isend/irecv): a closed connection names the peer."""
        try:
            return start(tensor, peer, tag)
        except RuntimeError as e:
            raise self.ex._failed({peer: f"{what} rank {peer} failed: {e}"}) from None

    def wait(self, work, peer: int, what: str) -> None:
        try:
            self.ex.coord.wait(work)
        except RuntimeError as e:
            raise self.ex._failed({peer: f"{what} rank {peer} failed: {e}"}) from None


_STATUS_TAG = 0x40000000  # above every item's tag
_OK = 0


class _Status:
    """Each rank tells the ranks it exchanges with how its exchange ended: 0 (done) or
    1 + the rank it found failed. Posted before any item moves; a rank that fails
    tells its peers which rank failed before it raises, so a peer waiting on it (and
    seeing its connection close once it exits) names the rank that failed first; a
    rank that is done waits for its peers' word (a peer that fails later fails it too)."""

    def __init__(self, exchange: Exchange, plan: Plan):
        self.ex = exchange
        self.peers = sorted(set(plan.recvs.values()) | {d for ds in plan.reads.values() for d in ds})
        self.box = {p: torch.full((1,), -1, dtype=torch.int64) for p in self.peers}
        self.tag = _STATUS_TAG + exchange.loads % 0x100000  # a late word of an earlier load matches nothing here
        self.works = {p: exchange.coord.irecv(self.box[p], p, self.tag) for p in self.peers}
        self._told: list = []  # (tensor, work): kept alive until the next load

    def _reported(self) -> tuple[int, int] | None:
        """(peer, rank it named) of the first peer that reported a failure."""
        for p in self.peers:
            # (the box, not the Work: gloo's is_completed stays False until someone waits)
            if int(self.box[p][0]) > _OK:
                return p, int(self.box[p][0]) - 1
        return None

    def check(self) -> None:
        hit = self._reported()
        if hit is not None:
            peer, bad = hit
            raise self.ex._failed({bad: f"failed during the exchange (reported by rank {peer})"})

    def _tell(self, code: int, within: float) -> None:
        """Send ``code`` to every peer; wait up to ``within`` seconds for the sends (a
        process that exits right after must not lose them)."""
        for p in self.peers:
            t = torch.tensor([code], dtype=torch.int64)
            try:
                self._told.append((p, t, self.ex.coord.isend(t, p, self.tag)))
            except RuntimeError:  # its connection is closed (a dead peer)
                if code == _OK:
                    raise self.failing(self.ex._failed({p: f"rank {p} failed or vanished"}), tell=False) from None
        deadline = time.monotonic() + within
        for p, _, w in self._told:
            try:
                self.ex.coord.wait(w, deadline - time.monotonic())
            except RuntimeError:
                if code == _OK:
                    raise self.failing(self.ex._failed({p: f"rank {p} failed or vanished"}), tell=False) from None

    def failing(self, e: BaseException, *, tell: bool = True) -> BaseException:
        """The error to raise for ``e``: the rank a peer reported failed, if one did
        (a peer tells before it raises, so its word is here before its connection
        closes), else ``e``'s own; peers are told at once which rank it names."""
        deadline = time.monotonic() + 0.3  # two ranks that saw the same failure at once
        hit = self._reported()
        while hit is None and time.monotonic() < deadline and isinstance(e, ExchangeFailed):
            time.sleep(0.01)
            hit = self._reported()
        if hit is not None:
            peer, bad = hit
            e = self.ex._failed({bad: f"failed during the exchange (reported by rank {peer})"})
        if isinstance(e, ExchangeFailed):
            bad = next((r for r in e.failures if isinstance(r, int)), self.ex.rank)
        else:
            bad = self.ex.rank  # this rank failed (a bucket read, a check)
        if tell:
            self._tell(1 + bad, within=2.0)
        _keep.append(self)
        return e

    def finish(self) -> None:
        """This rank is done: tell its peers, and wait for their word."""
        self._tell(_OK, within=self.ex.coord.timeout)
        for p in self.peers:
            try:
                self.ex.coord.wait(self.works[p])
            except RuntimeError as e:
                raise self.failing(self.ex._failed({p: f"rank {p} failed or vanished: {e}"}), tell=False) from None
            try:
                self.check()
            except ExchangeFailed as e:
                raise self.failing(e, tell=False) from None
        _keep.append(self)


_keep: collections.deque = collections.deque(maxlen=4)  # the last loads' status messages, alive while they travel


class _Sender(_Worker):
    """Sends this rank's shared items, in the global order, to the ranks that need
    them; an item's bytes stay held (in the streams' budget) until every send is done.
    Also the streams' ``hold`` (``read_streamed``)."""

    def __init__(self, exchange: Exchange, plan: Plan, order: list[Key]):
        super().__init__(exchange, "cloudckpt-exchange-send")
        self.plan = plan
        self.order = order
        self._ready: dict[Key, tuple[torch.Tensor, Callable[[], None]]] = {}
        self._read: set[Key] = set()
        self._first_unread = 0
        self._cv = threading.Condition()
        self.bytes = 0
        self._stop_streams: Callable[[BaseException], None] | None = None

    def attach(self, stop: Callable[[BaseException], None]) -> None:
        """``read_streamed``'s way to end its streams (called before any starts)."""
        self._stop_streams = stop

    # called on stream threads
    def urgent(self, rel: str, off: int, length: int) -> bool:
        """This rank's smallest shared item not read yet: it may always take budget."""
        with self._cv:
            return (self._first_unread < len(self.order)
                    and self.order[self._first_unread] == (file_id(rel), off, length))

    def keep(self, rel: str, off: int, length: int, data, release: Callable[[], None]) -> bool:
        """An item was read and put in place here: True if it is to be sent (its bytes
        stay held until sent; ``release`` gives them back)."""
        key = (file_id(rel), off, length)
        if not self.plan.reads.get(key):
            return False
        buf = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        with self._cv:
            if self._stopped.is_set() or key in self._read:  # (an item two ReadItems of the plan share: sent once)
                return False
            tensor = torch.frombuffer(buf, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
            self._ready[key] = (tensor, release)
            self._read.add(key)
            while self._first_unread < len(self.order) and self.order[self._first_unread] in self._read:
                self._first_unread += 1
            self._cv.notify_all()
        return True

    def halt_streams(self) -> None:
        """No stream starts another item (the load failed)."""
        if self._stop_streams is not None:
            self._stop_streams(_Stopped())

    def stop(self) -> None:
        """Drain: the items not sent yet go as zeros (call after the peers were told)."""
        self.halt_streams()
        super().stop()
        with self._cv:
            self._cv.notify_all()
            ready, self._ready = self._ready, {}
        for _, release in ready.values():
            release()

    AHEAD = 4  # items whose sends are posted and not yet waited for

    def run(self) -> None:
        posted: collections.deque = collections.deque()  # (key, [(dst, Work)], release), in the global order
        zeros = torch.zeros(0, dtype=torch.uint8)
        try:
            for key in self.order:
                with self._cv:
                    while key not in self._ready and not self._stopped.is_set():
                        self._cv.wait(1.0)
                    got = self._ready.pop(key, None) if not self._stopped.is_set() else None
                if got is None:  # the drain: the peers still get every message they posted a receive for
                    if zeros.numel() < key[2]:
                        zeros = torch.zeros(key[2], dtype=torch.uint8)
                    got = (zeros[:key[2]], _nothing)
                tensor, release = got
                posted.append((key, [], release))
                if key[2]:
                    for dst in self.plan.reads[key]:
                        try:
                            posted[-1][1].append((dst, self.post(self.ex.coord.isend, tensor, dst,
                                                                 _tag(key, self.ex.loads), what="sending to")))
                        except ExchangeFailed as e:  # that peer is gone: the others still get theirs
                            self._failed_with(e)
                while len(posted) > self.AHEAD:
                    self._settle(posted.popleft())
            while posted:
                self._settle(posted.popleft())
        finally:
            for _, _, release in posted:
                release()

    def _settle(self, entry) -> None:
        key, works, release = entry
        try:
            for dst, w in works:
                try:
                    self.wait(w, dst, "sending to")
                except ExchangeFailed as e:
                    self._failed_with(e)
            if not self.draining:
                self.bytes += key[2] * len(self.plan.reads[key])
        finally:
            release()


def _nothing() -> None:
    pass


class _Receiver(_Worker):
    """Receives the items this rank gets from peers, in the global order, a window of
    ``reader.budget`` bytes at a time; checks each against its CRC32C and puts it in place."""

    def __init__(self, exchange: Exchange, reader, planner, plan: Plan, items: dict[Key, list], status: "_Status"):
        super().__init__(exchange, "cloudckpt-exchange-recv")
        self.reader, self.planner, self.plan = reader, planner, plan
        self.items = items
        self.status = status
        self.bytes = 0
        self.direct = 0
        self._placing = threading.Lock()

    def stop(self) -> None:
        """Nothing more is put in place once this returns (the rest is received and dropped)."""
        super().stop()
        with self._placing:
            pass

    def run(self) -> None:
        order = sorted(self.plan.recvs)
        window, _ = self.reader.budget(sum(k[2] for k in order))
        posted: collections.deque = collections.deque()
        held, nxt = 0, 0
        while nxt < len(order) or posted:
            while nxt < len(order) and (not posted or held + order[nxt][2] <= window):
                k = order[nxt]
                buf = torch.empty(k[2], dtype=torch.uint8)
                work = None
                if k[2]:
                    try:
                        work = self.post(self.ex.coord.irecv, buf, self.plan.recvs[k], _tag(k, self.ex.loads),
                                         what="receiving from")
                    except ExchangeFailed as e:  # that peer is gone: the others' messages are still received
                        self._failed_with(e)
                posted.append((k, buf, work))
                held += k[2]
                nxt += 1
            k, buf, work = posted.popleft()
            held -= k[2]
            src = self.plan.recvs[k]
            try:
                if work is not None:
                    self.wait(work, src, "receiving from")
                if self.draining:
                    continue  # received and dropped
                self.status.check()  # a peer that failed told so before its drain's zeros: never placed
                self._place(k, buf, src)
            except BaseException as e:  # noqa: BLE001 - raised on the loading thread; the rest is drained
                self._failed_with(e)
            del buf

    def _place(self, k: Key, buf: torch.Tensor, src: int) -> None:
        rel = self.plan.rels[k[0]]
        url = f"{urls.join(self.reader.remote_dir, rel)} (received from rank {src})"
        data = memoryview(buf.numpy())
        self.reader._check(rel, k[1], k[2], data, url, peer=src)
        with self._placing:  # (stop waits for an item being put in place)
            if self._stopped.is_set():
                return
            for req in self.items[k]:
                self.direct += self.reader._consume(req, self.planner, data, url)
        self.bytes += k[2]


_shared: "weakref.WeakKeyDictionary[dist.Coordinator, Exchange]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def for_coordinator(coord: dist.Coordinator) -> Exchange | None:
    """The exchange of the job ``coord`` coordinates (its own gloo group, made at the
    first load: collective, like every load), or None when the job is one process."""
    if coord.local or coord.world_size < 2:
        return None
    with _lock:
        ex = _shared.get(coord)
    if ex is None:
        ex = Exchange(dist.Coordinator(timeout=coord.timeout))
        with _lock:
            _shared[coord] = ex
    return ex
