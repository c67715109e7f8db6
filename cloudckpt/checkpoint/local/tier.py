"""The node-local tier: frequent local steps, copies on peer nodes, persisted to the
bucket from the same files, recovery from peers (docs/local-tier.md).

Threads and groups (every collective runs on every rank in the same order):

- the training thread (or the async saver's thread) writes a local step with the
  checkpointer's own group (DCP's plan exchange, AGREE);
- one background thread per rank copies each step to the peers of its replication
  group and then prunes, on the tier's own gloo group;
- one more background thread persists steps to the bucket with a second
  Checkpointer (its own group and transfer engine), from the files on disk.

A slow or failed copy or persist never blocks the next local step: it only keeps the
step from being complete (a copy) or committed (a persist). Persist failures are
logged and raised by ``wait()``/``close()``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ... import dist
from ...errors import CloudCkptError, ConfigError, CorruptCheckpoint, LocalCapacityError, SaveFailed
from ...storage.nofollow import resolve
from ...untrusted import loads_json
from .. import layout
from ..marker import Marker
from . import exchange, parts
from .groups import Replication, on_machines

log = logging.getLogger(__name__)
RUN_FILE = ".cloudckpt-run.json"  # the run (save_folder) whose local steps the folder holds
_MAX_RUN_FILE = 64 * 1024  # ours holds one path


@dataclass(frozen=True)
class Found:
    """A complete local step: which ranks hold each part, and each part's manifest."""

    step: int
    holders: dict[int, list[int]]
    markers: dict[int, Marker]


def node_folder(local_dir: str, node: int) -> str:
    """``local_dir`` with ``{node}`` replaced by the node index (several simulated nodes
    on one machine each get a folder of their own), with its links resolved: the
    user's own (``~/x -> /nfs/x``) are followed here, once; nothing inside it ever is."""
    return resolve(local_dir.replace("{node}", str(node)))


class LocalTier:
    def __init__(self, checkpointer, persister, *, local_dir: str, replication: Replication, keep_last: int,
                 collective_timeout: float, save_folder: str):
        self.ck = checkpointer
        self.persister = persister
        self.rep = on_machines(replication)  # the machine of a rank: LOCAL_WORLD_SIZE, not the jump
        self.keep_last = keep_last
        self.rank = checkpointer.coord.rank
        self.root = node_folder(local_dir, self.rep.node_of(self.rank))
        self._peers = tuple(r for r in self.rep.group_of(self.rank) if r != self.rank)
        self._check_writable(local_dir)
        self._claim(local_dir, save_folder)
        parts.remove_leftovers(self.root, f".tmp-view{self.rank}-")  # of a recovery killed on this rank
        self.coord = dist.Coordinator(timeout=collective_timeout)
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloudckpt-replicate")
        self._persist = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloudckpt-persist")
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self._persisting: set[int] = set()
        self._errors: list[BaseException] = []
        self.last_replication: dict = {}
        self.last_recovery: dict = {}

    # ------------------------------------------------------------ checks
    def _check_writable(self, local_dir: str) -> None:
        probe = f".probe-{uuid.uuid4().hex[:8]}"
        try:
            with parts.open_folder(self.root, create=True) as root:
                os.close(root.new_file(probe))
                os.unlink(probe, dir_fd=root.fd)
        except OSError as e:
            raise ConfigError(f"local_dir={local_dir!r} is not usable on rank {self.rank} "
                              f"({self.root}: {e.strerror or e}): use a writable node-local folder such as "
                              "/dev/shm/ckpt or a local NVMe path") from None

    def _claim(self, local_dir: str, save_folder: str) -> None:
        """Record the run (its ``save_folder``) the node's folder serves; refuse a folder
        holding local steps of another run, which resume would otherwise load."""
        path = os.path.join(self.root, RUN_FILE)
        with parts.open_folder(self.root) as root:
            try:  # a link as the run file: UnsafeCheckpoint (never read through)
                doc = loads_json(root.read(RUN_FILE, limit=_MAX_RUN_FILE), url=path, what="local tier's run file",
                                 limit=_MAX_RUN_FILE)
                owner = doc.get("save_folder") if isinstance(doc, dict) else None
                if not isinstance(owner, str):
                    raise CorruptCheckpoint(f"{path}: the local tier's run file names no save_folder")
            except FileNotFoundError:
                owner = None
            except CorruptCheckpoint as e:
                if parts.steps_on_disk(self.root):
                    raise ConfigError(
                        f"local_dir={local_dir!r} ({self.root}) holds local steps, and its run file, which says "
                        f"which run they belong to, cannot be used ({e}): remove the folder (or use another "
                        "local_dir) unless you know they are this run's steps; then remove only the run file") from None
                owner = None
            if owner not in (None, save_folder) and parts.steps_on_disk(self.root):
                raise ConfigError(
                    f"local_dir={local_dir!r} ({self.root}) holds local steps of another run "
                    f"(save_folder {ascii(owner)[1:-1][:500]}); "
                    f"resuming {save_folder} from them would load the wrong state: use another local_dir for this run, "
                    "or remove the folder if that run is over")
            if owner != save_folder:
                root.write(RUN_FILE, json.dumps({"save_folder": save_folder}).encode())

    def _check_room(self, state_dict: dict) -> None:
        need = _state_bytes(state_dict) * self.rep.factor
        free = shutil.disk_usage(self.root).free
        if need > free:
            raise LocalCapacityError(
                f"local_dir {self.root} has {free} bytes free; the next local step needs about {need} on this node "
                f"(this rank's state x replication_factor {self.rep.factor}): free space, lower keep_last_local, or "
                "point local_dir at a larger folder")

    # ------------------------------------------------------------ save
    def save(self, step: int, state_dict: dict, train_state: Any, *, persist_to: str | None = None,
             ephemeral: bool = False, on_persisted=None) -> Marker:
        """Write this rank's part of ``step`` locally (collective), then queue its copies
        to peers and, with ``persist_to`` (the bucket step folder), its upload."""
        self._check_room(state_dict)
        tmp = None

        def make_folder() -> str:
            nonlocal tmp  # a link planted as the step's folder: UnsafeCheckpoint, and every rank stops here
            # the step written again (a restart from an older step): a killed attempt's temporary
            # folders of this rank go, and so does its record of having copied the step
            gone = parts.remove_own_leftovers(self.root, step, self.rank, self._peers, replicated=True)
            if gone:
                log.info("local step %d: removed what an earlier attempt left on rank %d: %s", step, self.rank, gone)
            tmp = parts.new_tmp(self.root, step, f"write{self.rank}")
            return uuid.uuid4().hex

        try:
            save_id = self.ck.coord.all_ranks(f"local step {step}: make its folder", make_folder,
                                              error=SaveFailed.from_failures)[0]  # rank 0's id for all
            entries = self.ck._write_local(tmp, state_dict, train_state)
            marker = Marker(step=step, ephemeral=ephemeral, world_size=self.rep.world_size,
                            objects=tuple(sorted(entries, key=lambda o: o.path)), torch_version=torch.__version__,
                            save_id=save_id)
            parts.publish(tmp, marker, self.root, self.rank)
        except BaseException:
            if tmp is not None:
                parts.remove(tmp)
            raise
        if persist_to is not None:
            with self._lock:
                self._persisting.add(step)
            self._track(self._persist.submit(self._persist_step, step, persist_to, ephemeral, on_persisted))
        self._track(self._bg.submit(self._replicate_and_prune, step))
        return marker

    def _track(self, fut: Future) -> None:
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]

    def _replicate_and_prune(self, step: int) -> None:
        try:
            stats = self.coord.all_ranks("copy local step",
                                         lambda: exchange.replicate(self.coord, self.rep, self.root, step))
            parts.mark_replicated(self.root, step, self.rank)
            self.last_replication = dict(stats[self.rank], step=step)
        except Exception as e:  # noqa: BLE001 - the step stays incomplete; the next one tries again
            log.warning("local step %d: copying to peer nodes failed (%s); it is not complete", step, e)
            return
        self._prune(step)

    def _persist_step(self, step: int, url: str, ephemeral: bool, on_persisted) -> None:
        ok = False
        try:
            own = parts.read_part(self.root, step, self.rank)
            files = [] if own is None else [(own.file(o.path), o) for o in own.marker.objects]
            self.persister._persist_files(url, files, ephemeral=ephemeral, step=step)
            ok = True
            log.info("persisted local step %d to %s", step, url)
        except BaseException as e:
            log.error("persisting local step %d to %s failed (nothing was committed there): %s", step, url, e)
            with self._lock:
                self._errors.append(e)
            raise
        finally:
            with self._lock:
                self._persisting.discard(step)
            if on_persisted is not None:
                on_persisted(ok)

    # ------------------------------------------------------------ completeness
    def _held(self, step: int) -> dict[int, parts.Part]:
        """The parts of ``step`` this rank is meant to hold (its own and its group's),
        once the step's copying finished on every rank."""
        out: dict[int, parts.Part] = {}
        if not parts.is_replicated(self.root, step, self.rank):
            return out
        for r in self.rep.group_of(self.rank):
            p = parts.read_part(self.root, step, r)
            if p is not None and p.marker.world_size == self.rep.world_size:
                out[r] = p
        return out

    def _summary(self) -> dict[int, list[int]]:
        return {s: sorted(self._held(s)) for s in parts.steps_on_disk(self.root)}

    def _complete(self, every: list[dict[int, list[int]]]) -> list[int]:
        covered: dict[int, set[int]] = {}
        for summary in every:
            for s, rs in summary.items():
                covered.setdefault(s, set()).update(rs)
        return sorted(s for s, rs in covered.items() if rs == set(range(self.rep.world_size)))

    def find(self, *, newer_than: int = -1, step: int | None = None) -> Found | None:
        """The newest local step above ``newer_than`` (or exactly ``step``) whose every
        part has a verified copy on some rank; None if there is none. Collective: one
        all-gather of what each rank holds, then each candidate's copies are verified
        (CRC32C) by their holders and gathered again."""
        summary = {s: rs for s, rs in self._summary().items() if s > newer_than and (step is None or s == step)}
        candidates = self._complete(self.coord.all_gather(summary))
        for s in reversed(candidates):
            held = self._held(s)
            ok = {r: p for r, p in held.items() if parts.verify(p)}
            mine = {r: (p.marker.to_bytes(), p.marker.save_id) for r, p in ok.items()}
            every = self.coord.all_gather(mine)
            holders: dict[int, list[int]] = {}
            markers: dict[int, Marker] = {}
            save_ids = set()
            for rank, got in enumerate(every):
                for r, (body, save_id) in got.items():
                    holders.setdefault(r, []).append(rank)
                    markers.setdefault(r, Marker.from_bytes(body, url=f"rank {rank}'s copy of part {r}"))
                    save_ids.add(save_id)
            if set(holders) == set(range(self.rep.world_size)) and len(save_ids) == 1:
                return Found(s, holders, markers)
            log.warning("local step %d is not usable: %s", s, "parts of different saves" if len(save_ids) > 1
                        else "some parts failed their checksums and have no other copy")
        return None

    # ------------------------------------------------------------ recovery
    def load(self, found: Found, state_dict: dict, **load_kwargs: Any) -> Any:
        """Load the complete local step ``found`` into ``state_dict``: the files this rank
        reads come from its own disk, or from a peer that holds them. Collective.
        Returns the train state, as ``Checkpointer.load`` does."""
        t0 = time.monotonic()
        # parts with a verified copy on this node's disk (this rank's or a neighbour's): linked, not fetched
        node = self.rep.node_of(self.rank)
        held = {}
        for r, hs in found.holders.items():
            if any(self.rep.node_of(h) == node for h in hs):
                p = parts.read_part(self.root, found.step, r)
                if p is not None and p.marker == found.markers[r]:
                    held[r] = p
        owner = {o.path: r for r, m in found.markers.items() for o in m.objects}
        any_marker = next(iter(found.markers.values()))
        objects = sorted((o for m in found.markers.values() for o in m.objects), key=lambda o: o.path)
        combined = Marker(step=found.step, ephemeral=any_marker.ephemeral, world_size=self.rep.world_size,
                          objects=tuple(objects),
                          torch_version=any_marker.torch_version, save_id=any_marker.save_id)
        # private, in the node folder (a link planted as the step's folder on this node changes nothing)
        view = parts.new_view(self.root, f"view{self.rank}")
        stats = {"fetched_bytes": 0, "local_files": 0}
        try:
            with parts.open_folder(view) as v:
                v.write(layout.MARKER, combined.to_bytes())
            for p in held.values():
                for o in p.marker.objects:
                    parts.link_into(p, o.path, view)
                    stats["local_files"] += 1

            linked = {o.path for p in held.values() for o in p.marker.objects}

            def fetch(ranges: dict[str, list[tuple[int, int]]]) -> None:
                needs = [(owner[r], r, off, n) for r, rs in ranges.items() if r in owner and r not in linked
                         for off, n in rs]
                stats["fetched_bytes"] += exchange.fetch(self.coord, needs, found.holders, held, found.markers, view)

            # read whole before planning: the train state, the rank's part of the DCP index
            # (its chunks: a restart keeps the layout), and on rank 0 what it reads for all
            whole = [layout.train_state_name(self.rank), layout.index_part_name(self.rank)] + (
                [layout.DCP_METADATA, layout.INDEX_HEADER] if self.rank == 0 else [])
            fetch({r: [(0, found.markers[owner[r]].object(r).size)] for r in whole if r in owner})
            ts = self.ck.load(view, state_dict, before_read=lambda ranges: fetch(
                {f"{layout.MODEL_DIR}/{r}": rs for r, rs in ranges.items()}), **load_kwargs)
        finally:
            parts.remove(view)
        self.last_recovery = dict(stats, step=found.step, seconds=time.monotonic() - t0)
        return ts

    # ------------------------------------------------------------ retention
    def _prune(self, copied: int) -> None:
        """Keep the ``keep_last`` newest complete steps (and steps being persisted, and
        any newer step still being written); remove the rest: older complete steps,
        partial steps below the newest complete one, and leftovers of failed writes
        (in the steps kept up to ``copied``, the step just copied: this rank's own
        temporary folders; a newer step may be being written). Collective on the tier's
        group (runs on the background thread)."""
        try:
            every = self.coord.all_gather(self._summary())
        except CloudCkptError as e:
            log.warning("local retention skipped: %s", e)
            return
        complete = self._complete(every)
        keep = set(complete[-self.keep_last:])
        with self._lock:
            keep |= self._persisting
        newest = complete[-1] if complete else -1
        for s in parts.steps_on_disk(self.root):
            if s in keep and s <= copied:
                try:
                    parts.remove_own_leftovers(self.root, s, self.rank, self._peers)
                except (OSError, CloudCkptError) as e:
                    log.warning("local retention could not clean step %d: %s", s, e)
            if s in keep or s > newest:
                continue
            try:  # a link in the node folder is removed itself, never followed
                parts.remove_step(self.root, s, self.rep.group_of(self.rank))
            except (OSError, CloudCkptError) as e:
                log.warning("local retention could not remove step %d: %s", s, e)

    # ------------------------------------------------------------ lifecycle
    def drain(self) -> None:
        """Wait for the copies and persists under way (errors stay for ``wait``)."""
        for f in self.in_flight():
            with contextlib.suppress(Exception):
                f.result()

    def in_flight(self) -> list[Future]:
        with self._lock:
            return [f for f in self._pending if not f.done()]

    def wait(self) -> None:
        """Wait for copies and persists; raise the first persist failure not reported yet."""
        for f in self.in_flight():
            try:
                f.result()
            except Exception:  # noqa: BLE001 - persist errors are collected; copy errors were logged
                pass
        with self._lock:
            errs, self._errors = self._errors, []
        if errs:
            raise errs[0]

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._bg.shutdown(wait=True)
            self._persist.shutdown(wait=True)
            self.persister.close()


def _state_bytes(state_dict: Any) -> int:
    """Bytes of the tensors of a state dict (this rank's shards), Statefuls expanded."""
    from ..._torch_compat import stateful_to_state_dict

    total = 0

    def walk(v: Any) -> None:
        nonlocal total
        if isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.numel() * local.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(stateful_to_state_dict(state_dict))
    return total
