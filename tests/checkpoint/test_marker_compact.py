"""The marker of format 3 (issue 32): the ranks' part references as columns, about 30
bytes per rank instead of ~115, and ceilings that follow the job.

- Our writer's marker at 16,384 ranks is under 1 MB; at ``MAX_WORLD_SIZE`` ranks, every
  field at its largest, it is under the reader's ``MAX_MARKER_BYTES``.
- Steps written as format 2 (a list of part references) keep listing, verifying and
  loading unchanged.
- The columns are hostile input: lengths, counts, CRC32C strings and rank runs are
  checked before anything is built from them.
- DCP's ``.metadata`` is read up to a ceiling that follows the step (1 GiB, or the
  bytes of the step's other files), with no more bytes allocated than the store holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tracemalloc

import pytest
import torch
from faults import checks

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout, retention
from cloudckpt.checkpoint.committed import CommittedStep
from cloudckpt.checkpoint.entries import ObjectEntry
from cloudckpt.checkpoint.layout import part_name
from cloudckpt.checkpoint.marker import FORMAT_VERSION, INLINE_FORMAT_VERSION, MAX_WORLD_SIZE, Marker
from cloudckpt.checkpoint.parts import MAX_PART_BYTES, MAX_PART_DATA, MAX_PART_OBJECTS, PartRef, as_part_list
from cloudckpt.checkpoint.step import StepRef
from cloudckpt.errors import CorruptCheckpoint, IncompatibleCheckpoint, SaveFailed, UnsafeCheckpoint
from cloudckpt.ops.export import read_dcp_metadata
from cloudckpt.storage import Location, open_store
from cloudckpt.storage import url as urls
from cloudckpt.untrusted import limits
from cloudckpt.untrusted.limits import MAX_MARKER_BYTES

META = layout.DCP_METADATA


def _marker(world: int, ranks=None, *, size=999_999, objects=99, nbytes=99_999_999_999, step=1000) -> Marker:
    """A marker of ``world`` ranks with a part for each of ``ranks`` (default all)."""
    ranks = range(world) if ranks is None else ranks
    parts = tuple(PartRef(r, part_name(r), size, f"{(r * 2654435761) & 0xffffffff:08x}", objects, nbytes)
                  for r in ranks)
    return Marker(step=step, ephemeral=False, world_size=world, parts=parts, format_version=FORMAT_VERSION,
                  objects=(ObjectEntry("index/header.json", 4096, "0123abcd"), ObjectEntry(META, 10**9, "89abcdef")),
                  torch_version="2.13.0+cu128", save_id="f" * 32,
                  created_unix=1_790_000_000.123456)  # fixed: time.time()'s repr varies in length


# ------------------------------------------------------------------ size
def test_the_marker_of_16384_ranks_is_under_1_mb_about_30_bytes_a_rank():
    """Realistic values for the 70B + AdamW shape (a part of ~1 MB, up to 100 GB and 99 files per rank)."""
    for world in (64, 1024, 16_384):
        m = _marker(world)
        new, old = len(m.to_bytes()), len(dataclasses.replace(m, format_version=2).to_bytes())
        print(f"R={world}: format 3 {new:,} bytes ({new / world:.1f}/rank), format 2 {old:,} ({old / world:.1f}/rank)")
        assert new / world <= 40 and old / world > 100
    assert len(_marker(16_384).to_bytes()) <= 1_000_000


LARGEST = dict(size=MAX_PART_BYTES, objects=MAX_PART_OBJECTS, nbytes=(10**20 - 1) // MAX_WORLD_SIZE, step=10**20 - 1)


def _top(k: int, stride: int) -> range:
    """``k`` ranks, ``stride`` apart, ending at the world's last rank: every rank number
    has as many digits as the largest one."""
    return range(MAX_WORLD_SIZE - stride * k + stride - 1, MAX_WORLD_SIZE, stride)


@pytest.mark.parametrize("stride", [1, 2], ids=["every-rank", "every-other"])
def test_the_largest_marker_our_writer_can_write_fits_the_readers_cap(stride):
    """Every field at the largest the reader accepts, the bytes per part as large as the
    step's total (20 digits) allows at MAX_WORLD_SIZE ranks, rank numbers of 7 digits. A
    part then costs a fixed number of bytes, so the marker is linear in the parts:
    measured at two sizes, checked at a third, extrapolated to the most parts a world of
    MAX_WORLD_SIZE ranks holds (every rank, or every other rank: one run per part)."""
    size = {k: len(_marker(MAX_WORLD_SIZE, _top(k, stride), **LARGEST).to_bytes()) for k in (4096, 8192, 12288)}
    per_part = (size[8192] - size[4096] + 4095) // 4096
    assert abs(size[12288] - 2 * size[8192] + size[4096]) <= 4, "linear (the header's totals gain a digit now and then)"
    parts = MAX_WORLD_SIZE // stride
    at_max = size[8192] + (parts - 8192) * per_part + 64
    print(f"largest marker, {parts:,} parts in {MAX_WORLD_SIZE:,} ranks: {at_max / 2**20:.1f} MiB "
          f"({per_part} bytes/part)")
    assert at_max < MAX_MARKER_BYTES
    # and the reader takes such a marker back (a few thousand parts of it)
    m = _marker(MAX_WORLD_SIZE, _top(8192, stride), **LARGEST)
    assert Marker.from_bytes(m.to_bytes()).parts == m.parts
    # MAX_PART_DATA per part would overflow the step's total (more than 20 digits): refused at save time
    with pytest.raises(CorruptCheckpoint, match="digits"):
        Marker.from_bytes(_marker(20, nbytes=MAX_PART_DATA).to_bytes())


def test_a_marker_round_trips_with_sparse_ranks_and_as_format_2():
    m = _marker(10, [0, 1, 2, 5, 7, 8, 9])
    d = json.loads(m.to_bytes())
    assert d["format_version"] == 3 and d["parts"]["ranks"] == [[0, 3], [5, 1], [7, 3]]
    assert len(d["parts"]["crc32c"]) == 7 * 8
    back = Marker.from_bytes(m.to_bytes())
    assert back.parts == m.parts and back.format_version == 3 and back.total_bytes == m.total_bytes
    v2 = as_part_list(d)
    assert v2["format_version"] == 2 and [p["rank"] for p in v2["parts"]] == [0, 1, 2, 5, 7, 8, 9]
    assert Marker.from_bytes(json.dumps(v2).encode()).parts == m.parts
    assert dataclasses.replace(back, format_version=2).to_bytes() == json.dumps(v2, separators=(",", ":")).encode()


def test_a_marker_without_parts_is_written_as_format_2():
    """Adopted manifests and the local tier's per-rank manifests: no parts, readable by
    cloudckpt versions that read format 2."""
    m = Marker(step=1, ephemeral=False, world_size=1, objects=(ObjectEntry(META, 10, "00000000"),))
    d = json.loads(m.to_bytes())
    assert m.format_version == INLINE_FORMAT_VERSION == 2 and (d["format_version"], d["parts"]) == (2, [])


# ------------------------------------------------------------------ hostile columns
def _crafted(**change) -> bytes:
    d = json.loads(_marker(4).to_bytes())
    for k, v in change.items():
        if k == "world_size":
            d[k] = v
        elif v is None:
            del d["parts"][k]
        else:
            d["parts"][k] = v
    return json.dumps(d).encode()


CRAFTED = {
    "a size too many": dict(size=[1, 2, 3, 4, 5]),
    "an object count missing": dict(objects=[1, 2, 3]),
    "a byte count too many": dict(bytes=[1, 2, 3, 4, 5]),
    "a CRC32C digit short": dict(crc32c="0" * 31),
    "upper-case CRC32C": dict(crc32c="ABCDEF01" * 4),
    "CRC32C not hex": dict(crc32c="0000000g" * 4),
    "CRC32C a list": dict(crc32c=["00000000"] * 4),
    "ranks overlap": dict(ranks=[[0, 2], [1, 2]]),
    "ranks out of order": dict(ranks=[[2, 2], [0, 2]]),
    "a run of no rank": dict(ranks=[[0, 0], [0, 4]]),
    "ranks past the world": dict(ranks=[[1, 4]]),
    "ranks cover fewer parts": dict(ranks=[[0, 3]]),
    "ranks cover a million parts": dict(ranks=[[0, 1 << 20]], world_size=1 << 20),
    "a run of three numbers": dict(ranks=[[0, 4, 1]]),
    "a negative rank": dict(ranks=[[-1, 4]]),
    "a rank as a string": dict(ranks=[["0", 4]]),
    "a size as a string": dict(size=["1", 2, 3, 4]),
    "a size true": dict(size=[True, 2, 3, 4]),
    "a part over MAX_PART_BYTES": dict(size=[MAX_PART_BYTES + 1, 2, 3, 4]),
    "objects over MAX_PART_OBJECTS": dict(objects=[MAX_PART_OBJECTS + 1, 2, 3, 4]),
    "bytes of 20 digits": dict(bytes=[10**19, 2, 3, 4]),
    "a column missing": dict(bytes=None),
    "a column added": dict(path=["manifest/rank0.json"] * 4),
    "more parts than ranks": dict(world_size=3),
    "world over MAX_WORLD_SIZE": dict(world_size=MAX_WORLD_SIZE + 1, ranks=[[0, 4]]),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_columns_are_refused_before_anything_is_built_from_them(case):
    data = _crafted(**CRAFTED[case])
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpoint, match="commit marker u"):
            Marker.from_bytes(data, url="u")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(data) + (1 << 16), f"{peak} bytes held to refuse {len(data)} bytes"


def test_format_3_takes_columns_only_and_format_2_a_list_only():
    d = json.loads(_marker(4).to_bytes())
    with pytest.raises(CorruptCheckpoint, match="columns"):
        Marker.from_bytes(json.dumps({**d, "parts": as_part_list(d)["parts"]}).encode())
    with pytest.raises(CorruptCheckpoint, match="not a list"):
        Marker.from_bytes(json.dumps({**d, "format_version": 2}).encode())
    with pytest.raises(CorruptCheckpoint, match="parts"):
        Marker.from_bytes(json.dumps({k: v for k, v in d.items() if k != "parts"}).encode())
    with pytest.raises(CorruptCheckpoint, match="root"):  # format 4: format 3 and the root of a replaced step
        Marker.from_bytes(json.dumps({**d, "format_version": 4}).encode())
    root = ".replace/" + "ab" * 16
    assert Marker.from_bytes(json.dumps({**d, "format_version": 4, "root": root}).encode()).root == root
    with pytest.raises(IncompatibleCheckpoint, match="reads version 1 to 4: upgrade"):
        Marker.from_bytes(json.dumps({**d, "format_version": 5}).encode())


# ------------------------------------------------------------------ steps written in format 2
FORMAT2_MARKER = (b'{"format":"cloudckpt","format_version":2,"step":7,"ephemeral":false,"world_size":3,'
                  b'"created":"2026-11-21T23:00:00+00:00","created_unix":1795302000.0,"library_version":"0.1.0",'
                  b'"torch_version":"2.13.0","save_id":"abc","total_bytes":4600,"object_count":7,'
                  b'"objects":[{"path":"model_and_optim/.metadata","size":100,"crc32c":"1a2b3c4d"}],'
                  b'"parts":[{"rank":0,"path":"manifest/rank0.json","size":900,"crc32c":"0badc0de",'
                  b'"objects":2,"bytes":1000},{"rank":2,"path":"manifest/rank2.json","size":600,'
                  b'"crc32c":"deadbeef","objects":2,"bytes":2000}]}')


def test_a_format_2_marker_written_by_hand_parses_as_before():
    m = Marker.from_bytes(FORMAT2_MARKER, url="u")
    assert m.format_version == 2 and m.step == 7 and m.world_size == 3
    assert m.parts == (PartRef(0, "manifest/rank0.json", 900, "0badc0de", 2, 1000),
                       PartRef(2, "manifest/rank2.json", 600, "deadbeef", 2, 2000))
    assert (m.total_bytes, m.object_count) == (4600, 7)
    assert m.to_bytes() == FORMAT2_MARKER, "a format 2 marker is written back as it was"
    assert m.part_of("train/rank2.pt") == m.parts[1] and m.part_of("train/rank1.pt") is None


def _as_format_2(step: str) -> None:
    """Rewrite the step's marker the way the previous writer wrote it: PartRef.to_json's list."""
    path = os.path.join(step, layout.MARKER)
    d = json.loads(open(path, "rb").read())
    header = discovery.read_header(step)
    d.update(format_version=2, parts=[p.to_json() for p in header.parts])
    with open(path, "w") as f:
        json.dump(d, f, separators=(",", ":"))


def test_a_step_written_in_format_2_lists_verifies_and_loads_unchanged(tmp_path):
    folder = str(tmp_path / "run")
    step = layout.step_dir(folder, 4)
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(step, checks.step_state(4, 0, numel=1024), {"step": 4})
    header3 = discovery.read_header(step)
    assert header3.format_version == 3
    _as_format_2(step)
    assert json.loads(open(os.path.join(step, layout.MARKER)).read())["format_version"] == 2
    header = discovery.read_header(step)
    assert header.format_version == 2 and header.parts == header3.parts
    assert list(Checkpointer.find_checkpoints(folder)) == [(4, step)]
    assert Checkpointer.latest_checkpoint(folder) == step
    assert retention.read_header(Location.of(step)).step == 4
    assert checks.library_verify(step)[0] == 0 and checks.verify_step(step) == []
    sd = checks.zero_state(1, numel=1024)
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        assert ck.load(step, sd) == {"step": 4}
        assert ck.last_load_info.parts_read == 1
    assert checks.bitexact(sd, 4, 1, numel=1024)


# ------------------------------------------------------------------ DCP metadata: a ceiling that follows the step
def test_the_metadata_ceiling_is_1_gib_or_the_steps_other_bytes():
    assert limits.metadata_limit(0) == limits.metadata_limit(10**6) == 1 << 30
    assert limits.metadata_limit(840 * 10**9) == 840 * 10**9
    # the honest 4,096-rank 70B step of the issue: 1.6 GB of .metadata for ~840 GB of shards
    assert 1_600_000_000 <= limits.metadata_limit(840 * 10**9)


class _Counting:
    """A store that records what was asked of it."""

    def __init__(self, store):
        self.store, self.asked = store, []

    def get_bytes(self, url, *, start=None, end=None):
        self.asked.append((start, end))
        return self.store.get_bytes(url, start=start, end=end)


def _saved(root: str, tmp_path, step=1) -> tuple[str, Marker]:
    dir = urls.join(root, f"step{step}")
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(dir, checks.step_state(step, 0, numel=1024), {"step": step})
    return dir, discovery.read_header(dir)


def _declare(dir: str, **meta) -> Marker:
    """Rewrite the marker with its .metadata entry changed (``meta``) and, with ``bytes``, the
    bytes its part declares; the marker as the reader now parses it."""
    store = open_store(dir)
    d = json.loads(store.get_bytes(urls.join(dir, layout.MARKER)))
    nbytes = meta.pop("part_bytes", None)
    if nbytes is not None:
        d["parts"]["bytes"] = [nbytes]
    next(o for o in d["objects"] if o["path"] == META).update(meta)
    store.put_bytes(urls.join(dir, layout.MARKER), json.dumps(d).encode())
    return discovery.read_header(dir)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_metadata_declared_over_the_ceiling_is_refused_before_any_request(backend, tmp_path, request):
    root = str(tmp_path / "run") if backend == "local" else urls.join(request.getfixturevalue("s3_bucket"), "run")
    dir, _ = _saved(root, tmp_path)
    marker = _declare(dir, size=1 << 40)  # 1 TiB of metadata for a step of a few KB
    loc = Location.of(dir)
    counting = _Counting(loc.store)
    url = loc.join(META).url
    with pytest.raises(UnsafeCheckpoint) as ei:
        limits.read_metadata(counting, url, size=1 << 40, described=marker.total_bytes - (1 << 40))
    assert counting.asked == [], "refused before any request"
    text = str(ei.value)
    assert url in text and "1099511627776 bytes" in text and "load_step" in text and "restore" in text
    with pytest.raises(UnsafeCheckpoint, match="ceiling"):
        read_dcp_metadata(loc)  # what inspect, verify and export read


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_huge_declared_metadata_allocates_only_what_the_store_holds(backend, tmp_path, request):
    """The part declares 2**62 bytes, so 64 GiB of .metadata is under the ceiling: the read
    asks for windows, gets the few KB the object holds, and refuses the step for its size;
    nothing near 64 GiB is allocated (a local file's read(n) would allocate n up front)."""
    root = str(tmp_path / "run") if backend == "local" else urls.join(request.getfixturevalue("s3_bucket"), "run")
    dir, _ = _saved(root, tmp_path)
    marker = _declare(dir, size=64 << 30, part_bytes=1 << 62)
    assert limits.metadata_limit(marker.total_bytes - (64 << 30)) > 64 << 30
    loc = Location.of(dir)
    counting = _Counting(loc.store)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpoint, match="the marker says 68719476736") as ei:
            limits.read_metadata(counting, loc.join(META).url, size=64 << 30, described=1 << 62)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert loc.join(META).url in str(ei.value)
    assert counting.asked == [(0, limits.READ_WINDOW)], "one window: the object ended inside it"
    assert peak < 2 * limits.READ_WINDOW, peak
    with pytest.raises(CorruptCheckpoint, match="the marker says 68719476736"):
        CommittedStep(StepRef.of(loc), marker).metadata_bytes()


def test_a_metadata_over_the_floor_is_read_in_windows_when_the_step_is_larger(tmp_path, monkeypatch):
    """With the floor and the window shrunk to a few hundred bytes, an honest step whose
    .metadata is over the floor but under its other files' bytes saves, and its .metadata
    is read in several windows, stitched and checked (what inspect, verify, export read)."""
    monkeypatch.setattr(limits, "MAX_METADATA_BYTES", 256)
    monkeypatch.setattr(limits, "READ_WINDOW", 200)
    dir, marker = _saved(str(tmp_path / "run"), tmp_path)
    meta = marker.object(META)
    assert 256 < meta.size < marker.total_bytes - meta.size, (meta.size, marker.total_bytes)
    counting = _Counting(Location.of(dir).store)
    data = limits.read_metadata(counting, Location.of(dir).join(META).url, size=meta.size, crc32c=meta.crc32c,
                                described=marker.total_bytes - meta.size)
    assert len(data) == meta.size and len(counting.asked) == meta.size // 200 + 1
    assert counting.asked[:2] == [(0, 200), (200, 400)]
    _, md = read_dcp_metadata(Location.of(dir))
    assert "model.w0" in md.state_dict_metadata


def test_a_save_whose_metadata_outweighs_the_step_fails_before_the_marker(tmp_path):
    """The save-time check follows the same ceiling: a .metadata over 1 GiB is committed
    only when the step's other files hold more (the commit protocol alone, on a folder)."""
    from cloudckpt.checkpoint.commit import StepCommit

    def commit(step: int, part_bytes: int):
        loc = Location.of(layout.step_dir(str(tmp_path / "run"), step))
        c = StepCommit(StepRef.of(loc, step=step), save_id=f"s{step}", world_size=1)
        c.prepare()
        m = c.marker([PartRef(0, part_name(0), 100, "00000000", 1, part_bytes)],
                     [ObjectEntry(META, 2 << 30, "00000000")], ephemeral=False)
        try:
            return c.commit(m)
        except SaveFailed:
            c.abort()
            raise

    with pytest.raises(SaveFailed, match=r"model_and_optim/\.metadata is 2147483648 bytes, over the 1073741824-byte"):
        commit(1, 10**9)
    assert not os.path.exists(os.path.join(layout.step_dir(str(tmp_path / "run"), 1), layout.MARKER))
    assert commit(2, 3 << 30).step == 2, "2 GiB of metadata for 3 GiB of shards: committed"
    assert discovery.read_header(layout.step_dir(str(tmp_path / "run"), 2)).object(META).size == 2 << 30


def test_a_foreign_dcp_folder_is_read_up_to_its_listed_metadata_size(tmp_path, monkeypatch):
    """A folder without our manifest (a stock DCP folder: torchtitan's read_dcp_folder makes
    this call): the size is the listing's, the ceiling follows the listed shard bytes."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "titan"
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(src), no_dist=True)
    folder = Location.of(str(src))
    prefix = folder.url.rstrip("/") + "/"
    listing = {e.url[len(prefix):]: e.size for e in folder.store.list(prefix) if not e.is_prefix}
    meta, shards = listing.pop(".metadata"), sum(listing.values())
    monkeypatch.setattr(limits, "MAX_METADATA_BYTES", meta - 1)
    assert meta < shards
    data = limits.read_metadata(folder.store, prefix + ".metadata", size=meta, described=shards)
    assert data == (src / ".metadata").read_bytes(), "under the shards' bytes: read"
    with pytest.raises(UnsafeCheckpoint, match="ceiling") as ei:
        limits.read_metadata(folder.store, prefix + ".metadata", size=shards + 1, described=shards)
    assert prefix + ".metadata" in str(ei.value)
    with pytest.raises(CorruptCheckpoint, match="holds"):  # the listing went stale: no more than listed is read
        limits.read_metadata(folder.store, prefix + ".metadata", size=meta - 10, described=shards)
