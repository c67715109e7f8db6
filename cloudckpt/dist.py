"""The only module of cloudckpt that touches ``torch.distributed``.

Collective steps are few and named. Each one carries every rank's exception to
every rank, so no rank is ever left waiting in a barrier while another has
failed (the pattern of DCP's ``_DistWrapper``). With one process (torch.distributed
not initialised) every function is a local no-op.

Call order matters like for any collective: every rank must call the same steps
in the same order. The checkpointer owns a dedicated gloo group (``Coordinator``),
so its coordination never runs on the training process group, and background
(async) saves can coordinate while training issues its own collectives.

A rank that dies or stops answering: every collective of the group fails on the ranks
that wait for it, with gloo's ``RuntimeError`` ("Connection closed by peer", or "Timed
out waiting ...ms" after the group's timeout, ``collective_timeout``). The steps here
(and DCP's collectives on the group, through :meth:`Coordinator.lost_in_dcp`) turn it
into :class:`~cloudckpt.errors.PeerLost`, naming the step; the group is then spent:
every later step on it raises PeerLost at once, so no survivor issues a collective
that could pair with another survivor's different one. ``isend``/``irecv``/``wait``
leave gloo's error as it is: their caller (the read-once exchange) names the peer.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from .errors import CollectiveError, PeerLost

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass
class _Outcome:
    ok: bool
    value: Any = None
    error: Optional[BaseException] = None
    error_text: str = ""


def _run(fn: Callable[[], T]) -> _Outcome:
    try:
        return _Outcome(True, fn())
    except Exception as e:  # noqa: BLE001 - carried to every rank and re-raised there
        return _Outcome(False, error=e, error_text=f"{type(e).__name__}: {e}")


def _portable(o: _Outcome) -> _Outcome:
    """Drop the exception object if it cannot cross processes (keep its text)."""
    if o.error is not None:
        try:
            pickle.loads(pickle.dumps(o.error))
        except Exception:  # noqa: BLE001 - unpicklable error: its text is carried instead
            o.error = None
    return o


def gathered_some(mine: _Outcome, lengths: list[int], recv: Callable[[int, int], bytes]) -> list:
    """The coordinator's side of :meth:`Coordinator.gather_some`, after the gather of
    ``lengths`` (one a rank, 0: nothing to send): every rank's outcome in rank order,
    None where the rank sent nothing; ``recv(rank, n)`` returns the ``n`` bytes that
    rank sends. (bench/scale.py runs this too, with its simulated ranks' lengths.)"""
    outs: list = [None] * len(lengths)
    if not (mine.ok and mine.value is None):
        outs[0] = mine
    for r in [r for r, n in enumerate(lengths) if n and r]:
        outs[r] = pickle.loads(recv(r, lengths[r]))
    return outs


# gloo's texts for a peer that is gone: the time ran out (checked first: "Application
# timeout caused pair closure"), or its connection closed (the process died)
_TIMED_OUT = ("timed out", "timeout")
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
           "socket closed", "pair closure", "no route to host", "network is unreachable")
_DCP_STEPS = {"reduce_scatter": "save plan", "all_reduce": "save finish", "all_gather": "all_gather",
              "broadcast": "broadcast", "barrier": "barrier"}


_SPENT = object()  # a spent Coordinator's group (given up: see Coordinator._give_up)


def peer_gone(e: BaseException) -> str | None:
    """``"timeout"`` or ``"closed"`` when ``e`` is gloo's error for a peer that is gone
    (no answer within the group's timeout, or its connection closed), else None."""
    if not isinstance(e, RuntimeError):
        return None
    text = str(e).lower()
    if any(s in text for s in _TIMED_OUT):
        return "timeout"
    if any(s in text for s in _CLOSED):
        return "closed"
    return None


def _gloo_text(e: BaseException) -> str:
    """gloo's message without its source location and its advice: ``Connection closed by
    peer [10.0.0.7]:41234`` (the peer's address: its node)."""
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", str(e).strip())
    return text.split(". This is typically caused")[0].strip()[:300]


def _caller(depth: int = 2) -> str:
    """The function that called a step without a name (for PeerLost's message)."""
    return sys._getframe(depth).f_code.co_name


class Coordinator:
    """Named collective steps on a dedicated gloo group.

    Create it on every rank at the same point (it creates a process group when
    torch.distributed is initialised). ``timeout`` bounds how long a step waits
    for a dead or stuck rank (the group's gloo timeout: every collective on the group,
    DCP's included); a rank that is gone raises PeerLost (the module docstring).
    """

    lost: PeerLost | None = None  # the first step that lost a peer: the group is spent
    exchanged: tuple[int, int] = (0, 0)  # bytes sent and received by the last all_to_all_objects

    def __init__(self, *, timeout: float = 600.0, group=None, local: bool = False):
        """``local=True``: this process acts alone even in a distributed job (e.g. a
        trainer that saves from rank 0 only)."""
        self.timeout = timeout
        if group is not None:
            self.group = group
        elif is_distributed() and not local:
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        else:
            self.group = None
        self.local = self.group is None
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------ a peer that is gone
    def _peer_lost(self, step: str, e: BaseException, *, own: BaseException | None = None,
                   peer: int | None = None) -> PeerLost | None:
        """The PeerLost for gloo's error ``e`` at ``step`` (None: ``e`` is not about a peer
        that is gone); the group is spent from now on."""
        kind = peer_gone(e)
        if kind is None:
            return None
        also = None if own is None else f"{type(own).__name__}: {own}"[:500]
        lost = PeerLost(step, {self.rank: _gloo_text(e)}, gone=() if peer is None else (peer,), timeout=self.timeout,
                        timed_out=kind == "timeout", also=also)
        if self.lost is None:
            self.lost = lost
            self._give_up()
        log.error("rank %d: %s", self.rank, lost)
        return lost

    def _give_up(self) -> None:
        """Destroy the spent group, so that this rank's connections of it close once the
        last reference to it goes (the error's frames: PeerLost does not keep gloo's): a
        survivor still waiting on this rank (in a collective that does not touch the dead
        rank's connection, such as its part of a ring) fails then, not at the group's
        timeout, and gives up its own in turn; the news crosses the job in moments.
        ``group`` becomes a placeholder: every step raises PeerLost before using it."""
        group, self.group = self.group, _SPENT
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - best effort: the survivors still time out
            log.debug("rank %d: could not destroy the spent group: %s", self.rank, e)

    def _step(self, step: str, *, own: BaseException | None = None, peer: int | None = None) -> "_Step":
        """``with self._step(name): <collectives>``: gloo's error for a peer that is gone
        becomes PeerLost (or this rank's own CollectiveError, ``own``, which says more:
        the read-once exchange's names the rank); a spent group raises PeerLost at once."""
        return _Step(self, step, own, peer)

    def _spent(self, step: str) -> None:
        """:meth:`on_coordinator` on a spent group raises PeerLost before the coordinator
        runs anything (no lock taken, nothing written for a save that cannot agree). The
        steps every rank runs run first: their ``fn`` raises the rank's own PeerLost where
        it holds one (a save's AGREE, after DCP's collectives lost the peer)."""
        if self.lost is not None and self.group is not None:
            with self._step(step):
                pass

    def _usable(self) -> None:
        """For ``isend``/``irecv``, whose caller handles gloo's RuntimeError: the same
        error type once the group is spent."""
        if self.lost is not None:
            raise RuntimeError(f"rank {self.rank} gave up this group after {self.lost.step}: a peer rank is gone")

    def lost_in_dcp(self, e: BaseException, *, where: str | None = None) -> PeerLost | None:
        """The PeerLost for ``e``, raised out of ``dcp.save`` on this group, when it is
        gloo's error for a peer that is gone (named by DCP's collective: ``DCP's save
        plan``, ``DCP's save finish``, or ``DCP's barrier`` where DCP runs with no
        collective but its closing barrier); else None. The group is spent from now on."""
        if self.group is None or peer_gone(e) is None:
            return None
        names = [f.f_code.co_name for f, _ in traceback.walk_tb(e.__traceback__)
                 if "distributed/checkpoint" in f.f_code.co_filename.replace("\\", "/")]
        inner = next((_DCP_STEPS[n] for n in reversed(names) if n in _DCP_STEPS), "save")
        e.__traceback__ = None  # DCP's frames hold the group: let it go (the text is in PeerLost)
        lost = self._peer_lost(f"DCP's {inner}", e)
        return lost.at(where) if lost is not None and where else lost

    def _all_gather(self, obj: Any, step: str, own: BaseException | None = None) -> list:
        if self.group is None:
            return [obj]
        out: list = [None] * self.world_size
        with self._step(step, own=own):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj: Any, step: str, own: BaseException | None = None) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        with self._step(step, own=own):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_gather(self, value: Any, step: str | None = None) -> list:
        """Every rank's ``value`` (picklable, small), in rank order. ``step``: its name in
        a PeerLost (default: the caller's function)."""
        return self._all_gather(value, step or f"all_gather in {_caller()}")

    # ------------------------------------------------------------ point to point
    # Bulk bytes (files of the node-local tier) between two ranks of this group, in
    # pieces of CHUNK bytes, pipelined: memory above the file's own pages is two pieces
    # per side (one on the wire, one being read, or checked and written).
    CHUNK = 8 * 1024 * 1024

    def send_bytes(self, data: bytes, dst: int) -> None:
        """Send ``data`` (its length first) to rank ``dst`` of this group."""
        with self._step(f"send to rank {dst}", peer=dst):
            peer = dist.get_global_rank(self.group, dst)
            dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=peer, group=self.group)
            if data:
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=peer, group=self.group)

    def recv_bytes(self, src: int, *, limit: int) -> bytes:
        """What ``send_bytes`` sent from rank ``src``; a length above ``limit`` is refused
        (CollectiveError) before anything is allocated for it."""
        n = torch.zeros(1, dtype=torch.int64)
        with self._step(f"receive from rank {src}", peer=src):
            peer = dist.get_global_rank(self.group, src)
            dist.recv(n, src=peer, group=self.group)
        size = int(n.item())
        if not 0 <= size <= limit:
            raise CollectiveError("receive", {src: f"announced {size} bytes, more than the {limit} allowed"})
        if not size:
            return b""
        with self._step(f"receive from rank {src}", peer=src):
            return self._recv_exact(src, size)

    def send_file(self, path: str, size: int, dst: int, *, offset: int = 0) -> None:
        """Send ``size`` bytes of the file ``path`` from ``offset`` to rank ``dst`` of this group.
        Pipelined: the next piece is read while the one before it is on the wire."""
        sizes, bufs = self._pieces(size)
        # (on an error the buffers are not freed under a transfer: its Work holds them)
        sending = None
        with self._step(f"send to rank {dst}", peer=dst), open(path, "rb") as f:
            peer = dist.get_global_rank(self.group, dst)
            f.seek(offset)
            for k, n in enumerate(sizes):
                view = bufs[k % len(bufs)][:n]  # the send that used this buffer is done (waited below)
                got = f.readinto(memoryview(view.numpy()))
                if got != n:
                    raise OSError(f"{path}: read {got} bytes where {n} were expected (the file changed)")
                if sending is not None:
                    sending.wait()
                sending = dist.isend(view, dst=peer, group=self.group)
            if sending is not None:
                sending.wait()

    def recv_file(self, path: str, size: int, src: int, on_chunk: Callable[[memoryview], None] | None = None, *,
                  offset: int | None = None) -> None:
        """Receive ``size`` bytes from rank ``src`` of this group into a new file ``path``
        (``offset``: into the existing file ``path`` at that offset). Pipelined: the next
        piece arrives while the one before it is checked (``on_chunk``) and written."""
        sizes, bufs = self._pieces(size)
        with self._step(f"receive from rank {src}", peer=src), open(path, "xb" if offset is None else "r+b") as f:
            peer = dist.get_global_rank(self.group, src)
            f.seek(offset or 0)
            receiving = dist.irecv(bufs[0][:sizes[0]], src=peer, group=self.group) if sizes else None
            for k, n in enumerate(sizes):
                receiving.wait()
                view = bufs[k % len(bufs)][:n]
                # the next piece's buffer held piece k - 1, checked and written already
                # (on an error the buffers are not freed under a transfer: its Work holds them)
                if k + 1 < len(sizes):
                    receiving = dist.irecv(bufs[(k + 1) % len(bufs)][:sizes[k + 1]], src=peer, group=self.group)
                data = memoryview(view.numpy())
                if on_chunk is not None:
                    on_chunk(data)
                f.write(data)

    def _pieces(self, size: int) -> tuple[list[int], list]:
        """The sizes of the pieces ``size`` bytes move in, and their buffers (two, one
        for a single piece)."""
        sizes = [min(self.CHUNK, size - at) for at in range(0, size, self.CHUNK)]
        return sizes, [torch.empty(min(self.CHUNK, max(size, 1)), dtype=torch.uint8) for _ in range(min(2, len(sizes)))]

    def on_coordinator(self, step: str, fn: Callable[[], T]) -> T:
        """Rank 0 runs ``fn``; every rank gets its value, or raises its error
        (the same exception type where it can be carried, else CollectiveError)."""
        self._spent(step)
        o = _portable(_run(fn)) if self.is_coordinator else None
        o = self._broadcast(o, step, o.error if o is not None else None)
        if o.ok:
            return o.value
        if o.error is not None:
            raise o.error
        raise CollectiveError(step, {0: o.error_text})

    def all_ranks(self, step: str, fn: Callable[[], T], *,
                  error: Callable[[str, dict], BaseException] | None = None) -> list[T]:
        """Every rank runs ``fn``; returns the values of all ranks in rank order.
        If any rank failed, every rank raises one error naming each failing rank
        (``error(step, {rank: text})`` builds it; default CollectiveError). A local
        exception is chained as the cause on its own rank."""
        mine = _run(fn)
        outs = self._all_gather(_Outcome(mine.ok, mine.value, None, mine.error_text), step, mine.error)
        failures = {r: o.error_text for r, o in enumerate(outs) if not o.ok}
        if failures:
            exc = (error or CollectiveError)(step, failures)
            raise exc from mine.error
        return [o.value for o in outs]

    def to_coordinator(self, step: str, fn: Callable[[], T], *,
                       error: Callable[[str, dict], BaseException] | None = None) -> list[T] | None:
        """Every rank runs ``fn``; the coordinator receives every rank's value (a gather,
        not an all-gather: no other rank receives the others' values) and returns them
        in rank order; other ranks return None. If any rank failed, every rank raises
        one error naming each failing rank (the failures are broadcast, values are not),
        as :meth:`all_ranks` does."""
        mine = _run(fn)
        o = _Outcome(mine.ok, mine.value, None, mine.error_text)
        if self.group is None:
            outs: list | None = [o]
        else:
            outs = [None] * self.world_size if self.is_coordinator else None
            with self._step(step, own=mine.error):
                dist.gather_object(o, outs, dst=dist.get_global_rank(self.group, 0), group=self.group)
        failures = {r: x.error_text for r, x in enumerate(outs) if not x.ok} if outs is not None else None
        failures = self._broadcast(failures, step, mine.error)
        if failures:
            exc = (error or CollectiveError)(step, failures)
            raise exc from mine.error
        return [x.value for x in outs] if outs is not None else None

    def gather_some(self, step: str, fn: Callable[[], T], *,
                    error: Callable[[str, dict], BaseException] | None = None) -> list[T | None] | None:
        """:meth:`to_coordinator` for a step where most ranks have nothing to send (``fn``
        returns None there): the coordinator receives one int64 length a rank (one
        gather) and the pickled values of the ranks that have one, point to point; it
        returns every rank's value in rank order (None for the ranks that sent none),
        other ranks return None. A rank sends and receives its own value and a few
        integers; the coordinator, ``world_size`` integers and the values sent. Not
        ``gather_object``, which all-gathers every rank's size on every rank and pads
        every rank's value to the largest. Failures as :meth:`to_coordinator`."""
        mine = _run(fn)
        if self.group is None:
            if not mine.ok:
                raise (error or CollectiveError)(step, {0: mine.error_text}) from mine.error
            return [mine.value]
        o = _Outcome(mine.ok, mine.value, None, mine.error_text)
        blob = b"" if mine.ok and mine.value is None else pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)
        sizes, views = self._lengths() if self.is_coordinator else (None, None)
        outs: list | None = None
        with self._step(step, own=mine.error):
            root = dist.get_global_rank(self.group, 0)
            dist.gather(torch.tensor([len(blob)], dtype=torch.int64), views, dst=root, group=self.group)
            if sizes is not None:
                outs = gathered_some(o, sizes.tolist(), lambda r, n: self._recv_exact(r, n))
            elif blob:
                dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=root, group=self.group)
        failures = {r: x.error_text for r, x in enumerate(outs) if x is not None and not x.ok} \
            if outs is not None else None
        failures = self._broadcast(failures, step, mine.error)
        if failures:
            exc = (error or CollectiveError)(step, failures)
            raise exc from mine.error
        return [None if x is None else x.value for x in outs] if outs is not None else None

    _gather_out: tuple | None = None

    def _lengths(self) -> tuple:
        """The coordinator's outputs of gather_some's gather: one int64 tensor of
        ``world_size`` and a view of it a rank (made once: R views cost ~8 ms at 16,384)."""
        if self._gather_out is None:
            sizes = torch.empty(self.world_size, dtype=torch.int64)
            self._gather_out = (sizes, list(sizes.view(-1, 1).unbind(0)))
        return self._gather_out

    def _recv_exact(self, src: int, size: int) -> bytes:
        """The ``size`` bytes rank ``src`` of this group sends (its length known here);
        the caller names the step."""
        buf = torch.empty(size, dtype=torch.uint8)
        dist.recv(buf, src=dist.get_global_rank(self.group, src), group=self.group)
        return buf.numpy().tobytes()

    # ------------------------------------------------------------ read-once exchange
    # (dcp/exchange.py: a census of the ranges each rank needs, then the bytes between
    # the ranks that share them). Tensors are CPU int64 / uint8; a Work is waited with
    # ``wait`` (bounded by this group's timeout; gloo's is_completed never reports a
    # dead peer, a timed wait does).

    def all_to_all_int64(self, rows, send_counts: list[int], recv_counts: list[int], step: str | None = None):
        """all_to_all_single of an int64 tensor: ``send_counts[r]`` elements of ``rows``
        (in rank order) go to rank ``r``; returns what every rank sent here, in rank
        order (``recv_counts[r]`` from rank ``r``). Per-rank cost: this rank's own
        elements and two lists of ``world_size`` counts, nothing that grows with what
        other ranks send each other. ``step``: its name in a PeerLost (default: the
        caller's function)."""
        out = torch.empty(sum(recv_counts), dtype=torch.int64)
        if self.group is None:
            out.copy_(rows)
            return out
        with self._step(step or f"all_to_all in {_caller()}"):
            dist.all_to_all_single(out, rows, output_split_sizes=list(recv_counts),
                                   input_split_sizes=list(send_counts), group=self.group)
        return out

    def all_gather_ints(self, values: "list[int]", step: str | None = None) -> "list[list[int]]":
        """Every rank's ``values`` (the same count on every rank), in rank order: one
        all_gather of ``len(values)`` int64 per rank (no pickling). ``step``: its name in a
        PeerLost (default: the caller's function)."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        if self.group is None:
            return [mine.tolist()]
        out = torch.empty(self.world_size * len(mine), dtype=torch.int64)  # one tensor, not one a rank
        with self._step(step or f"all_gather in {_caller()}"):
            dist.all_gather_single(out, mine, group=self.group)
        return out.view(self.world_size, len(mine)).tolist()

    def all_to_all_objects(self, objs: list, step: str, *, limit: int) -> list:
        """``objs[r]`` (picklable) goes to rank ``r``; returns what each rank sent here, in
        rank order. Pickled here, then two all_to_all_single: one int64 length per pair of
        ranks, then the bytes, so a rank handles its own payloads and ``world_size``
        lengths, nothing other ranks send each other. A payload of more than ``limit``
        bytes is refused on the rank that would send it, and a length above ``limit`` on
        the rank that would receive it, before anything is allocated for it: every rank
        raises CollectiveError naming the ranks (the exchange of lengths is itself the
        agreement). Bounded in time by the group's timeout (PeerLost), as every step.
        :attr:`exchanged` is then ``(bytes sent, bytes received)``, this rank's own included.
        An empty list travels as no bytes at all (neither pickled nor unpickled): at
        large R most pairs of ranks have nothing for each other."""
        if len(objs) != self.world_size:
            raise ValueError(f"{step}: {len(objs)} payloads for {self.world_size} ranks")
        blobs = [b"" if type(o) is list and not o else pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)
                 for o in objs]
        if self.group is None:
            self.exchanged = (len(blobs[0]), len(blobs[0]))
            return [pickle.loads(blobs[0]) if blobs[0] else []]
        too_big = [r for r, b in enumerate(blobs) if len(b) > limit]
        # a rank with a payload over the limit announces -1 to every rank: all refuse together
        lengths = torch.tensor([-1 if too_big else len(b) for b in blobs], dtype=torch.int64)
        got = torch.empty(self.world_size, dtype=torch.int64)
        with self._step(step):
            dist.all_to_all_single(got, lengths, group=self.group)
        bad = {r: (f"a payload of more than {limit} bytes" if n < 0 else f"announced {n} bytes, more than the "
                   f"{limit} allowed") for r, n in enumerate(got.tolist()) if n < 0 or n > limit}
        flag = torch.tensor([1 if bad else 0], dtype=torch.int64)
        with self._step(step):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()):
            raise CollectiveError(step, bad or {self.rank: "another rank refused a payload over the limit"})
        counts = got.tolist()
        send = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8) if any(blobs) else \
            torch.empty(0, dtype=torch.uint8)
        recv = torch.empty(sum(counts), dtype=torch.uint8)
        with self._step(step):
            dist.all_to_all_single(recv, send, output_split_sizes=counts, input_split_sizes=[len(b) for b in blobs],
                                   group=self.group)
        self.exchanged = (len(send), len(recv))
        data, out, at = recv.numpy().tobytes(), [], 0
        for n in counts:
            out.append(pickle.loads(data[at:at + n]) if n else [])
            at += n
        return out

    def isend(self, tensor, dst: int, tag: int = 0):
        """Start sending ``tensor`` to rank ``dst`` of this group (a Work, for ``wait``)."""
        self._usable()
        return dist.isend(tensor, dst=dist.get_global_rank(self.group, dst), group=self.group, tag=tag)

    def irecv(self, tensor, src: int, tag: int = 0):
        """Start receiving into ``tensor`` from rank ``src`` of this group (a Work, for ``wait``)."""
        self._usable()
        return dist.irecv(tensor, src=dist.get_global_rank(self.group, src), group=self.group, tag=tag)

    def wait(self, work, seconds: float | None = None) -> None:
        """Wait for a Work of ``isend``/``irecv``: at most ``seconds`` (default this
        group's timeout); a closed connection (the peer died) or the time running out
        raises RuntimeError."""
        work.wait(timeout=datetime.timedelta(seconds=self.timeout if seconds is None else max(seconds, 0.001)))

    # ------------------------------------------------------------ flat in the world size
    # What these send does not grow with the number of ranks: one all_reduce of a few
    # integers (and, only when some rank failed, one broadcast from the lowest such rank).
    def agree(self, step: str, fn: Callable[[], T]) -> T:
        """Every rank runs ``fn`` and returns its own value; if any rank failed, every
        rank raises the error of the lowest failing rank (its own type where it can be
        carried, else CollectiveError naming that rank; the failing rank raises its own).
        Unlike :meth:`all_ranks`, no rank receives the others' values or outcomes."""
        mine = _run(fn)
        if self.group is None:
            if not mine.ok:
                raise mine.error
            return mine.value
        flag = torch.tensor([0 if mine.ok else self.world_size - self.rank], dtype=torch.int64)
        with self._step(step, own=mine.error):  # a rank is gone: PeerLost (or this rank's CollectiveError)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()) == 0:
            return mine.value
        src = self.world_size - int(flag.item())
        box = [_portable(_Outcome(False, None, mine.error, mine.error_text)) if self.rank == src else None]
        with self._step(step, own=mine.error):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        if not mine.ok:
            raise mine.error
        o = box[0]
        if o.error is not None:
            raise o.error
        raise CollectiveError(step, {src: o.error_text})

    def ask_coordinator(self, step: str, request: list[int],
                        answer: Callable[[list[list[int]]], list[list[int]]]) -> list[int]:
        """Every rank sends ``request`` (integers) to the coordinator, which calls
        ``answer(every rank's request, in rank order)`` for one reply (integers) per rank;
        each rank returns its own reply. A gather and a scatter of fixed-size int64 rows
        (the longest request and the longest reply, agreed by an all_reduce and a
        broadcast of one integer each): a rank sends and receives its own, the
        coordinator every rank's; nothing any rank handles grows with the world size
        but the coordinator's. Every rank calls it after an :meth:`agree` (so none is
        missing); if ``answer`` fails, every rank raises its error."""
        if self.group is None:
            o = _run(lambda: answer([list(request)]))
            if not o.ok:
                raise o.error
            return list(o.value[0])
        width = torch.tensor([len(request)], dtype=torch.int64)
        with self._step(step):
            root = dist.get_global_rank(self.group, 0)
            dist.all_reduce(width, op=dist.ReduceOp.MAX, group=self.group)
        row = _padded_row(request, int(width.item()))
        rows = [torch.empty_like(row) for _ in range(self.world_size)] if self.is_coordinator else None
        with self._step(step):
            dist.gather(row, rows, dst=root, group=self.group)
        o = None
        if self.is_coordinator:
            o = _run(lambda: answer([r[1:1 + int(r[0])].tolist() for r in rows]))
            if o.ok and (len(o.value) != self.world_size):
                o = _Outcome(False, error=RuntimeError(f"{step}: {len(o.value)} replies for {self.world_size} ranks"))
        # the reply's width, or -1 and the coordinator's error
        head = torch.tensor([max((len(v) for v in o.value), default=0) if o.ok else -1] if o else [0],
                            dtype=torch.int64)
        with self._step(step, own=o.error if o is not None else None):
            dist.broadcast(head, src=root, group=self.group)
        if int(head.item()) < 0:
            box = [_portable(_Outcome(False, None, o.error, f"{type(o.error).__name__}: {o.error}")) if o else None]
            with self._step(step, own=o.error if o is not None else None):
                dist.broadcast_object_list(box, src=root, group=self.group)
            if o is not None:
                raise o.error
            if box[0].error is not None:
                raise box[0].error
            raise CollectiveError(step, {0: box[0].error_text})
        n = int(head.item())
        out = torch.empty(n + 1, dtype=torch.int64)
        replies = [_padded_row(v, n) for v in o.value] if o is not None else None
        with self._step(step):
            dist.scatter(out, replies, src=root, group=self.group)
        return out[1:1 + int(out[0])].tolist()

    def any_rank(self, flags: "list[bool] | Any", step: str | None = None) -> list[bool]:
        """Element-wise OR of every rank's ``flags`` (same length on every rank): one
        all_reduce of ``len(flags)`` bytes. ``step``: its name in a PeerLost (default: the
        caller's function)."""
        t = torch.tensor([bool(x) for x in flags], dtype=torch.uint8)
        if self.group is not None and len(t):
            with self._step(step or f"any_rank in {_caller()}"):
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(x) for x in t.tolist()]


class _Step:
    """:meth:`Coordinator._step`. A plain context manager, not ``contextlib``'s: the error
    raised must not keep gloo's traceback (its frames hold the group, which closes its
    connections only once nothing refers to it)."""

    def __init__(self, coord: Coordinator, step: str, own: BaseException | None, peer: int | None):
        self.coord, self.step, self.own, self.peer = coord, step, own, peer

    def __enter__(self) -> None:
        first = self.coord.lost
        if first is None:
            return
        if isinstance(self.own, CollectiveError):
            raise self.own
        raise PeerLost(self.step, first.failures, gone=first.gone, timeout=self.coord.timeout,
                       timed_out=first.timed_out,
                       earlier=first.step if first.where is None else f"{first.step} of {first.where}")

    def __exit__(self, typ, e, tb) -> bool:
        if not isinstance(e, RuntimeError):
            return False
        lost = self.coord._peer_lost(self.step, e, own=self.own, peer=self.peer)
        if lost is None:
            return False
        e.__traceback__ = None  # gloo's frames hold the group: let them go (its text is in PeerLost)
        del tb
        own, self.own = self.own, None
        if isinstance(own, CollectiveError):
            raise own from None
        raise lost from own


def _padded_row(values, width: int):
    """``[len(values), *values]`` as int64, padded with -1 to ``width + 1`` elements (the
    fixed-size rows of :meth:`Coordinator.ask_coordinator`)."""
    values = list(values)
    row = torch.full((width + 1,), -1, dtype=torch.int64)
    row[0] = len(values)
    row[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return row


def init_process_group(rank: int, world_size: int, *, init_method: str, timeout: float = 120.0) -> None:
    """Initialise a gloo world (used by the test/bench launcher and the examples)."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=init_method,
                            timeout=datetime.timedelta(seconds=timeout))


def destroy_process_group() -> None:
    if is_distributed():
        dist.destroy_process_group()
