"""The one reader of a committed step, for every caller: a load, ``load_with``, the
CLI's inspect, verify and export, the Hugging Face integrations' train state.

A :class:`CommittedStep` is a step (``StepRef``) and its marker. Everything else is
read from it on demand, each object checked against the marker or the manifest part
that lists it (size, CRC32C) through ``cloudckpt.untrusted`` before it is parsed,
and each with one set of checks whoever reads it:

- the ranks' manifest parts (``discovery.StepManifest``), only those a caller needs;
- the DCP index header (:meth:`CommittedStep.header`): parsed (names, dtypes, layouts inside their
  tensors, chunk writers among the ranks the marker describes), then checked against
  the step: its tensors hold no more bytes than the step stores, its owners are ranks
  of the saved world and, where the marker lists the shard files itself (a step read
  whole, a step of the local tier), its own items lie inside them. A load reads the
  parts lazily and checks each item it reads against its file instead (``check_plan``);
- a rank's DCP index part (:meth:`CommittedStep.index_part`), checked against the header;
- DCP's ``.metadata`` (:meth:`CommittedStep.metadata`), unpickled with the allowlist;
- a rank's train state (:meth:`CommittedStep.train_state`), ``weights_only``.

A load's coordinator reads what every rank plans against once (:func:`read_shared`)
and hands it to the other ranks with the marker's part references withheld; each rank
then asks the coordinator for the references its plan reads (:meth:`CommittedStep.with_part_refs`).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .._torch_compat import flatten_for_load
from ..dcp import index
from ..dcp.reader import Checksums
from ..errors import CorruptCheckpoint
from ..untrusted import MAX_TRAIN_STATE_BYTES, load_plain, loads_metadata, read_checked
from ..untrusted.limits import read_metadata
from . import discovery, layout
from .entries import ObjectEntry
from .marker import Marker
from .parts import WithheldParts, decode_refs, encode_refs
from .step import StepRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shared:
    """What a load's coordinator reads once for every rank: the marker, and either the
    DCP index header's bytes (a step with the index) or DCP's ``.metadata`` bytes (a step
    without it; None when the marker lists none). Both are checked against the marker
    before they travel."""

    marker: Marker
    header: bytes | None
    metadata: bytes | None

    def for_peers(self) -> "Shared":
        """What the other ranks receive: the marker's part references withheld when the
        step has the index (each rank asks for those its plan reads), so what a rank
        receives does not grow with the saved job's ranks."""
        if self.header is None or not self.marker.parts:
            return self
        return dataclasses.replace(self, marker=self.marker.withholding_parts())


def read_shared(step: StepRef, *, verify: bool = True) -> Shared:
    """The coordinator's read for a load (:class:`Shared`). Raises NotACheckpoint,
    CorruptCheckpoint, IncompatibleCheckpoint, UnsafeCheckpoint, storage errors."""
    c = CommittedStep(step, discovery.read_header(step.loc), verify=verify)
    if not c.marker.verified:
        # a foreign step: sizes from one listing bound every read; no CRC32C to check
        log.warning("loading %s, written by %s without a manifest: sizes are checked, checksums cannot be "
                    "(run `cloudckpt adopt %s --yes` to record them)", step, c.marker.writer, step)
    data = c.header_bytes()
    if data is not None:
        return Shared(c.marker, data, None)
    return Shared(c.marker, None, c.metadata_bytes())


@dataclass
class Selection:
    """What one rank's load plan reads of a step with the DCP index (:meth:`CommittedStep.select`)."""

    wanted: dict  # {key: boxes of this rank's shards, or None for a value}
    needs: dict  # {key: the chunks of the key's layout this rank's shards overlap}
    owners: set  # the ranks whose index parts hold the chunks selected
    writers: set  # the ranks whose manifest parts this rank's load reads


class CommittedStep:
    """One committed step, read as it is needed (see the module docstring).

    Args:
        step: the step folder.
        marker: its marker (``discovery.read_header``: parts unread; or
            ``discovery.read_marker``: every object inline).
        header, metadata: the DCP index header's or ``.metadata``'s bytes, read and
            checked already (a load's coordinator handed them over), or None to read
            them here when asked.
        verify: check CRC32Cs (sizes are always checked).
        pace: called with a URL before each read of a part or train state (the
            transfer engine's request pacing: every rank of a load reads at once).
    """

    def __init__(self, step: StepRef, marker: Marker, *, header: bytes | None = None, metadata: bytes | None = None,
                 verify: bool = True, pace: Callable[[str], Any] | None = None):
        self.step = step
        self.verify = verify
        self.pace = pace
        self._header_bytes = header
        self._metadata_bytes = metadata
        self._header: index.Header | None = None
        self._parts: dict[int, dict | None] = {}  # index parts read whole (a load's: the ranks it reads from)
        self._set_marker(marker)

    @classmethod
    def of_shared(cls, step: StepRef, shared: Shared, *, verify: bool = True,
                  pace: Callable[[str], Any] | None = None) -> "CommittedStep":
        """The step as a load's coordinator handed it over (:func:`read_shared`)."""
        return cls(step, shared.marker, header=shared.header, metadata=shared.metadata, verify=verify, pace=pace)

    @classmethod
    def open(cls, step: StepRef, *, whole: bool = False, verify: bool = True) -> "CommittedStep":
        """Read the step's marker (``whole``: with every part read and inline, as the
        CLI's verify, inspect and export read it). Raises as ``discovery.read_marker``."""
        return cls(step, (discovery.read_marker if whole else discovery.read_header)(step.loc), verify=verify)

    def _set_marker(self, marker: Marker) -> None:
        self.marker = marker
        self.step = self.step.with_root(marker.root)  # a replaced step's objects are under its root
        self.manifest = discovery.StepManifest(self.step.loc, marker, pace=self.pace)

    # ------------------------------------------------------------ the manifest
    def entry(self, rel: str) -> ObjectEntry | None:
        """The manifest entry of ``rel`` (reading the part that lists it), or None."""
        return self.manifest.entry(rel)

    def with_part_refs(self, coord: Any, ranks: Iterable[int]) -> None:
        """Collective: a rank whose marker's part references are withheld gets those of
        ``ranks`` from the coordinator (one gather and one scatter of a few integers per
        reference); every rank calls it, the coordinator answers from its own marker."""
        m = self.marker
        withheld = isinstance(m.parts, WithheldParts)
        got = coord.ask_coordinator("part refs", sorted(ranks) if withheld else [],
                                    lambda asked: [encode_refs(m, rs) for rs in asked])
        if withheld:
            held = WithheldParts(len(m.parts), {**m.parts.held, **decode_refs(got)}, m.parts.total_bytes)
            self._set_marker(dataclasses.replace(m, parts=held))

    def shard_manifest(self, rels: Iterable[str]) -> tuple[Checksums, dict[str, int]]:
        """``(checksums, sizes)`` of the files ``rels`` under ``model_and_optim/`` a
        rank's load plan reads, from the parts that list them."""
        prefix = layout.MODEL_DIR + "/"
        entries = self.manifest.entries(prefix + r for r in rels)
        return _checksums({p[len(prefix):]: o for p, o in entries.items()}), \
            {p[len(prefix):]: o.size for p, o in entries.items()}

    def item_checksums(self) -> Checksums:
        """``{file under model_and_optim/: {(offset, length): crc32c}}`` of the files the
        marker lists itself: one entry per DCP item, and the whole file as ``(0, size)``."""
        return _checksums(self.marker.files_under(layout.MODEL_DIR))

    def model_files(self) -> dict[str, int]:
        """``{shard file under model_and_optim/: size}`` the marker lists itself."""
        return {rel: o.size for rel, o in self.marker.files_under(layout.MODEL_DIR).items()}

    # ------------------------------------------------------------ the DCP index
    def header_bytes(self) -> bytes | None:
        """The index header's bytes, checked against the marker (size, CRC32C); None for
        a step without the index (another tool's, or older than the index)."""
        if self._header_bytes is None:
            entry = self.marker.object(layout.INDEX_HEADER) if self.marker.verified else None
            if entry is None:
                return None
            self._header_bytes = read_checked(self.step.store, self.step.index_header_url, entry,
                                              limit=index.MAX_INDEX_BYTES, what="DCP index", verify=self.verify)
        return self._header_bytes

    def header(self) -> "index.Header | None":
        """The DCP index header, parsed and checked once (the module docstring lists the
        checks); None for a step without the index. Raises CorruptCheckpoint,
        UnsafeCheckpoint."""
        if self._header is None:
            data = self.header_bytes()
            if data is None:
                return None
            m = self.marker
            header = index.parse_header(data, url=self.step.index_header_url, writers=len(m.parts) + len(m.objects))
            index.check_tensor_bytes(header, m.total_bytes)  # a caller may allocate what the header says
            index.check_owners(header, m.world_size)
            if not m.parts:  # the shard files are in the marker itself
                index.check_items(header, self.model_files())
            self._header = header
        return self._header

    def select(self, flat_state_dict: dict, *, train_state_rank: int) -> Selection:
        """This rank's selection from the index: the chunks its shards overlap and the
        ranks whose manifest parts its load reads. Not collective."""
        header = self.header()
        wanted = index.wanted_boxes(flatten_for_load(flat_state_dict))
        needs, owners = index.select(header, wanted)
        writers = owners | index.writers_read(header, needs, wanted) | {train_state_rank}
        return Selection(wanted, needs, owners, writers)

    def rank_objects(self, rank: int) -> dict[str, ObjectEntry]:
        """``{path: entry}`` of every object rank ``rank`` wrote (its shard files, its
        index part, its train state), from its manifest part read and checked now and not
        kept (a caller visiting the ranks one at a time holds one part: ``export``); for a
        step whose marker lists its objects itself, the marker's of that rank."""
        m = self.marker
        ref = m.part_of(layout.index_part_name(rank))
        if ref is None:
            return {o.path: o for o in m.objects if layout.owner_of(o.path) == rank}
        part = discovery.StepManifest(self.step.loc, m, pace=self.pace).parts([rank])[rank]
        return {o.path: o for o in part.objects}

    def index_part(self, rank: int, files: dict[str, int] | None = None, *,
                   objects: dict[str, ObjectEntry] | None = None) -> dict | None:
        """Rank ``rank``'s index part, read (checked against its manifest entry) and
        parsed, with every chunk the header gives that rank found in it inside ``files``
        (``{shard file: size}``; None: the files the marker lists); None when the step has
        none and the rank wrote no chunk. ``objects``: the rank's manifest entries
        (``rank_objects``) instead of the parts this step keeps. A part read with neither
        (a load's: the few ranks it reads from) is kept, for the first save after the
        load to plan from (checkpoint/structure.py). Raises CorruptCheckpoint,
        UnsafeCheckpoint."""
        plain = files is None and objects is None
        if plain and rank in self._parts:  # read by the load; the first save after it plans from it again
            return self._parts[rank]
        rel, url = layout.index_part_name(rank), self.step.index_part_url(rank)
        entry = self.entry(rel) if objects is None else objects.get(rel)
        part = None
        if entry is not None:
            if self.pace is not None:
                self.pace(url)
            data = read_checked(self.step.store, url, entry, limit=index.MAX_INDEX_BYTES, what="DCP index part",
                                verify=self.verify)
            part = index.parse_part(data, url=url, rank=rank)
        if files is not None:
            index.check_part(self.header(), rank, part, files)
        if plain:  # a load reads the parts of the few ranks it overlaps: kept for its next save
            self._parts[rank] = part
        return part

    def plan_metadata(self, sel: Selection) -> Any:
        """The DCP ``Metadata`` one rank plans its load against: only the chunks its
        shards overlap (``sel``), from the index parts of the ranks that wrote them (read
        concurrently)."""
        header = self.header()

        def read(rank: int) -> dict:
            if self.entry(layout.index_part_name(rank)) is None:
                raise CorruptCheckpoint(f"{self.step.index_part_url(rank)}: the DCP index places chunks on rank "
                                        f"{rank}, whose manifest lists no index part; the step is damaged: load an "
                                        "older step")
            return self.index_part(rank)

        ranks = sorted(sel.owners)
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(ranks)))) as pool:
            parts = dict(zip(ranks, pool.map(read, ranks), strict=True))
        return index.build_metadata(header, sel.needs, parts, sel.wanted)

    def index_metadata(self, keys: set[str]) -> Any:
        """DCP ``Metadata`` holding every key and, for storage, the chunks and items of
        ``keys`` only, each rank's part that holds a chunk of ``keys`` read and checked
        against the header (``export``; the marker read whole)."""
        header, files = self.header(), self.model_files()
        wanted = {k: [((0,) * len(t.size), tuple(t.size))] for k, t in header.tensors.items() if k in keys}
        wanted.update((k, None) for k in header.values if k in keys)
        needs, owners = index.select(header, wanted)
        parts = {rank: {k: v for k, v in (self.index_part(rank, files) or {}).items() if k[0] in keys}
                 for rank in sorted(owners)}
        return index.build_metadata(header, needs, parts, wanted)

    def shapes(self) -> Any:
        """DCP ``Metadata`` with every key, dtype and size of the step, for a caller that
        builds its targets from them (``load_with``): from the index header (no chunks,
        no storage), or for a step without the index its whole ``.metadata``."""
        header = self.header()
        if header is not None:
            return index.build_metadata(header, {}, {}, {})
        return self.metadata()

    # ------------------------------------------------------------ DCP's .metadata
    def metadata_bytes(self) -> bytes | None:
        """DCP's ``.metadata`` bytes, checked against the marker; None when the marker lists
        none. Its ceiling follows the step (``untrusted.limits.metadata_limit``)."""
        if self._metadata_bytes is not None:
            return self._metadata_bytes
        entry = self.marker.object(layout.DCP_METADATA)
        if entry is None:
            return None
        return read_metadata(self.step.store, self.step.metadata_url, size=entry.size, crc32c=entry.crc32c,
                             described=self.marker.total_bytes - entry.size, verify=self.verify)

    def metadata(self) -> Any:
        """DCP ``Metadata`` from ``.metadata``, unpickled with the allowlist, every item
        inside the manifest's files. Raises CorruptCheckpoint (the marker lists none),
        UnsafeCheckpoint."""
        data = self.metadata_bytes()
        if data is None:
            raise CorruptCheckpoint(f"{self.step.metadata_url}: the checkpoint's marker lists no DCP metadata; "
                                    "it holds no model or optimizer state")
        return loads_metadata(data, url=self.step.metadata_url, files=self.marker.sizes_under(layout.MODEL_DIR))

    # ------------------------------------------------------------ train state
    def train_state(self, rank: int, *, world_size: int | None = None, required: bool = False) -> Any:
        """Rank ``rank``'s train state (``torch.load(weights_only=True)``), or None when the
        step has none. ``world_size``: the loading job's; when it differs from the saved
        one, rank 0's train state is loaded (with a warning). Raises CorruptCheckpoint
        (``required`` and missing, or a bad size or CRC32C), UnsafeCheckpoint."""
        saved = self.marker.world_size
        if world_size is not None and world_size != saved:
            log.warning("world size changed (%d saved, %d now): rank %d loads the train state of rank 0 (%s)",
                        saved, world_size, rank, self.step.train_state_url(0))
            rank = 0
        return self.train_state_file(layout.train_state_name(rank), required=required)

    def train_state_file(self, rel: str, *, required: bool = False) -> Any:
        """The train state file ``rel`` of the step (``torch.load(weights_only=True)``), or
        None when the manifest does not list it (CorruptCheckpoint with ``required``)."""
        url = self.step.url_of(rel)
        entry = self.entry(rel)
        if entry is None:
            if required:
                raise CorruptCheckpoint(f"{url}: the train state file is not in this checkpoint; save a train state "
                                        "or pass load_trainer_state=None")
            return None
        if self.pace is not None:
            self.pace(url)
        data = read_checked(self.step.store, url, entry, limit=MAX_TRAIN_STATE_BYTES, what="train state",
                            verify=self.verify)
        return load_plain(data, url=url, what="train state")


def _checksums(entries: dict[str, ObjectEntry]) -> Checksums:
    out: Checksums = {}
    for rel, o in entries.items():
        d = out[rel] = {(c[0], c[1]): c[2] for c in o.chunks}
        if o.crc32c:
            d[(0, o.size)] = o.crc32c
    return out


__all__ = ["CommittedStep", "Selection", "Shared", "read_shared"]
