"""The two-level manifest (format 2, and 3: the same with the parts as columns): each
rank's manifest is its own object, ``manifest/rank{R}.json``, uploaded before the
commit; the marker lists the parts with their size and CRC32C. A loading rank reads only the parts of the
files its plan reads,
and trusts a part only once it matches the marker. Steps written in format 1 (every
object in the marker) keep loading and listing unchanged (a step saved by the code
before parts existed is kept in tests/checkpoint/data/format1)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from faults import checks

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout
from cloudckpt.checkpoint.layout import owner_of, part_name
from cloudckpt.checkpoint.marker import FORMAT_VERSION, Marker
from cloudckpt.checkpoint.parts import as_part_list
from cloudckpt.errors import CorruptCheckpoint, UnsafeCheckpoint
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls
from cloudckpt.testing.multiprocess import run_ranks
from cloudckpt.transfer import crc32c_bytes

FORMAT1 = os.path.join(os.path.dirname(__file__), "data", "format1")


def save_two(rank, world_size, dir, work_dir):
    """Rank ``rank`` saves its own tensors (``w{rank}``, ``m{rank}``) and a replicated one."""
    with Checkpointer(work_dir=work_dir) as ck:
        ck.save(dir, checks.step_state(1, rank, numel=1024), {"step": 1, "rank": rank})


@pytest.fixture(scope="module")
def two_rank_step(tmp_path_factory):
    """A step saved by 2 ranks into a local folder, copied fresh for each test."""
    base = tmp_path_factory.mktemp("parts")
    dir = str(base / "run" / "step1")
    assert run_ranks(2, save_two, dir, str(base / "w")) == [None, None]
    return dir


@pytest.fixture
def step(two_rank_step, tmp_path):
    dir = str(tmp_path / "run" / "step1")
    shutil.copytree(two_rank_step, dir)
    return dir


def _raw_marker(dir: str) -> dict:
    with open(os.path.join(dir, layout.MARKER), "rb") as f:
        return json.loads(f.read())


def _marker(dir: str) -> dict:
    """The marker as format 2 (its parts a list of references) to edit by hand."""
    return as_part_list(_raw_marker(dir))


def _write_marker(dir: str, d: dict) -> None:
    with open(os.path.join(dir, layout.MARKER), "w") as f:
        json.dump(d, f)


def _part(dir: str, rank: int) -> dict:
    with open(os.path.join(dir, part_name(rank)), "rb") as f:
        return json.loads(f.read())


def _write_part(dir: str, rank: int, d: dict, *, relist: bool = True) -> None:
    """Write rank ``rank``'s part; ``relist``: make the marker's reference match it."""
    data = json.dumps(d).encode()
    with open(os.path.join(dir, part_name(rank)), "wb") as f:
        f.write(data)
    if relist:
        m = _marker(dir)
        for p in m["parts"]:
            if p["rank"] == rank:
                p.update(size=len(data), crc32c=crc32c_bytes(data))
        _write_marker(dir, m)


def _zeros(ranks=(0, 1)) -> dict:
    return checks.zero_state(2, numel=1024, ranks=ranks)


def test_each_rank_has_a_part_and_the_marker_lists_them_with_size_and_crc(step):
    raw = _raw_marker(step)
    assert raw["format_version"] == FORMAT_VERSION == 3 and raw["parts"]["ranks"] == [[0, 2]], "parts as columns"
    m = _marker(step)
    assert [p["rank"] for p in m["parts"]] == [0, 1]
    own = [o["path"] for o in m["objects"]]
    assert layout.DCP_METADATA in own and all(owner_of(p) is None for p in own), "only the step's own files"
    for p in m["parts"]:
        with open(os.path.join(step, p["path"]), "rb") as f:
            data = f.read()
        assert (p["size"], p["crc32c"]) == (len(data), crc32c_bytes(data))
        part = json.loads(data)
        paths = {o["path"] for o in part["objects"]}
        assert f"train/rank{p['rank']}.pt" in paths
        assert all(x == f"train/rank{p['rank']}.pt" or x.startswith(f"model_and_optim/__{p['rank']}_") for x in paths)
        assert p["objects"] == len(part["objects"]) and p["bytes"] == sum(o["size"] for o in part["objects"])
    full = discovery.read_marker(step)
    header = discovery.read_header(step)
    on_disk = {os.path.relpath(os.path.join(d, n), step) for d, _, ns in os.walk(step) for n in ns} - {layout.MARKER}
    assert {o.path for o in full.objects} == on_disk, "the full manifest lists every object, the parts included"
    assert header.total_bytes == full.total_bytes and header.object_count == full.object_count == len(on_disk)
    assert checks.verify_step(step) == [] and checks.library_verify(step)[0] == 0


def test_a_rank_reads_only_the_parts_of_the_files_its_plan_reads(step, tmp_path):
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        only_w1 = {"model": {"w1": torch.zeros(1024)}}
        ck.load(step, only_w1, load_trainer_state=False, allow_partial=True)
        assert ck.last_load_info.parts_read == 1, "w1 lies in rank 1's file: one part"
        assert torch.equal(only_w1["model"]["w1"], checks.step_state(1, 1, numel=1024)["model"]["w1"])
        sd = _zeros()
        ts = ck.load(step, sd)
        assert ck.last_load_info.parts_read == 2
        assert checks.bitexact(sd, 1, 2, numel=1024)
        assert ts == {"step": 1, "rank": 0}, "the world size changed: rank 0's train state (from part 0)"


def test_discovery_and_listing_read_no_part(step, monkeypatch):
    seen = []
    real = discovery.StepManifest._read_part
    monkeypatch.setattr(discovery.StepManifest, "_read_part", lambda self, ref: seen.append(ref) or real(self, ref))
    folder = os.path.dirname(step)
    assert Checkpointer.latest_checkpoint(folder) == step
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [1]
    assert seen == []


def _refused(step: str, tmp_path, match: str, kind=CorruptCheckpoint) -> None:
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        with pytest.raises(kind, match=match):
            ck.load(step, _zeros())
    with pytest.raises(kind, match=match):
        discovery.read_marker(step)


def test_a_part_that_does_not_match_the_marker_is_refused(step, tmp_path):
    with open(os.path.join(step, part_name(1)), "ab") as f:
        f.write(b" ")
    _refused(step, tmp_path, "manifest part")


def test_a_part_listing_another_ranks_file_is_refused(step, tmp_path):
    p = _part(step, 1)
    p["objects"].append(dict(_part(step, 0)["objects"][0]))
    _write_part(step, 1, p)
    _refused(step, tmp_path, "not a file of that rank|declares", UnsafeCheckpoint)


def test_a_part_of_another_step_is_refused(step, tmp_path):
    p = _part(step, 1)
    p["step"] = 7
    _write_part(step, 1, p)
    _refused(step, tmp_path, "another step", UnsafeCheckpoint)


def test_a_part_naming_a_file_outside_the_step_is_refused(step, tmp_path):
    p = _part(step, 1)
    p["objects"][0]["path"] = "../step2/train/rank1.pt"
    _write_part(step, 1, p)
    _refused(step, tmp_path, r"\.\.", UnsafeCheckpoint)


def test_a_part_whose_sizes_disagree_with_the_marker_is_refused(step, tmp_path):
    p = _part(step, 1)
    p["objects"][0]["size"] += 1
    _write_part(step, 1, p)
    _refused(step, tmp_path, "declares", UnsafeCheckpoint)


def test_a_shard_item_past_its_files_size_in_the_part_is_refused_before_reading(step, tmp_path):
    p = _part(step, 1)
    shard = next(o for o in p["objects"] if o["path"].endswith(".distcp"))
    shard["size"] = 1
    shard.pop("chunks")
    m = _marker(step)
    _write_part(step, 1, p)
    m = _marker(step)
    m["parts"][1]["bytes"] = sum(o["size"] for o in p["objects"])
    _write_marker(step, m)
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        with pytest.raises(CorruptCheckpoint, match="past the file"):
            ck.load(step, _zeros())


def test_the_marker_refuses_a_part_at_another_name_or_a_ranks_file_beside_the_parts(step):
    m = _marker(step)
    m["parts"][1]["path"] = "manifest/rank0.json"
    with pytest.raises(CorruptCheckpoint, match="rank 1"):
        Marker.from_bytes(json.dumps(m).encode(), url="x")
    m = _marker(step)
    m["objects"].append({"path": "train/rank1.pt", "size": 1, "crc32c": "00000000"})
    with pytest.raises(UnsafeCheckpoint, match="beside"):
        Marker.from_bytes(json.dumps(m).encode(), url="x")


# ------------------------------------------------------------------ format 1
def _format1(tmp_path) -> str:
    folder = str(tmp_path / "old")
    shutil.copytree(FORMAT1, folder)
    return os.path.join(folder, "step3")


def _format1_state() -> dict:
    """What the format-1 fixture holds (the generator it was made with)."""
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(4, 8, generator=g), "b": torch.arange(8, dtype=torch.float32)},
            "optim": {"step": torch.tensor(3.0), "m": torch.rand(32, generator=g)}}


def test_a_step_written_in_format_1_lists_verifies_and_loads_unchanged(tmp_path):
    step = _format1(tmp_path)
    folder = os.path.dirname(step)
    assert json.loads(open(os.path.join(step, layout.MARKER)).read())["format_version"] == 1
    assert list(Checkpointer.find_checkpoints(folder)) == [(3, step)]
    assert Checkpointer.latest_checkpoint(folder) == step
    m = discovery.read_marker(step)
    assert m.format_version == 1 and m.parts == () and m.object_count == 4 and m.total_bytes == 9184
    assert checks.library_verify(step)[0] == 0
    want = _format1_state()
    sd = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
          "optim": {k: torch.zeros_like(v) for k, v in want["optim"].items()}}
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ts = ck.load(step, sd)
        assert ck.last_load_info.parts_read == 0
    assert ts == {"step": 3, "note": "format 1"}
    for k in ("model", "optim"):
        for name, t in want[k].items():
            assert torch.equal(sd[k][name], t), name


def test_a_format_1_marker_is_still_refused_when_damaged(tmp_path):
    step = _format1(tmp_path)
    path = os.path.join(step, "model_and_optim", "__0_0.distcp")
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x5A]))
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        with pytest.raises(CorruptCheckpoint, match="CRC32C"):
            ck.load(step, {"model": {"w": torch.zeros(4, 8), "b": torch.zeros(8)},
                           "optim": {"step": torch.tensor(0.0), "m": torch.zeros(32)}})


def test_s3_a_step_in_parts_round_trips_and_its_parts_are_objects_of_the_step(s3_bucket, tmp_path):
    dir = urls.join(s3_bucket, "run", "step2")
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        marker = ck.save(dir, checks.step_state(2, 0, numel=1024), {"step": 2})
        assert [p.rank for p in marker.parts] == [0]
        sd = checks.zero_state(1, numel=1024)
        assert ck.load(dir, sd) == {"step": 2}
        assert ck.last_load_info.parts_read == 1 and checks.bitexact(sd, 2, 1, numel=1024)
    store = open_store(dir)
    assert store.exists(urls.join(dir, part_name(0)))
    assert checks.verify_step(dir) == []


# ------------------------------------------------------------------ no silent skip
def test_a_newest_marker_over_the_readers_cap_is_a_loud_error_never_an_older_step(tmp_path, monkeypatch):
    from cloudckpt import CheckpointConfig
    from cloudckpt.errors import CheckpointError

    folder = str(tmp_path / "run")
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(layout.step_dir(folder, 1), checks.step_state(1, 0, numel=64), {"step": 1})
        ck.save(layout.step_dir(folder, 10), checks.step_state(2, 0, numel=64), {"step": 10})
    marker10 = os.path.join(layout.step_dir(folder, 10), layout.MARKER)
    with open(marker10, "ab") as f:
        f.write(b" " * 64)  # the same JSON, 64 bytes longer (the two markers' sizes differ by a digit or two at most)
    size1 = os.path.getsize(os.path.join(layout.step_dir(folder, 1), layout.MARKER))
    monkeypatch.setattr(discovery, "MAX_MARKER_BYTES", size1 + 32)  # step 1's fits, step 10's is over the cap
    assert os.path.getsize(marker10) > size1 + 32
    with pytest.raises(UnsafeCheckpoint, match="load_step") as ei:
        Checkpointer.latest_checkpoint(folder)
    assert layout.step_dir(folder, 10) in str(ei.value)
    # our own save refuses to commit a marker its readers would refuse, so one over the cap was
    # not written by a legitimate save: resume passes over it loudly (logged, recorded) or,
    # with strict_resume, stops naming it
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w2"), save_interval=1).build()
    try:
        assert mgr.resume(checks.zero_state(1, numel=64)) == {"step": 1}
        assert [s.step for s in mgr.skipped_steps] == [10] and "cannot be read" in mgr.skipped_steps[0].reason
    finally:
        mgr.close()
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w2"), save_interval=1,
                           strict_resume=True).build()
    try:
        with pytest.raises(CheckpointError, match="step10"):
            mgr.resume(checks.zero_state(1, numel=64))
    finally:
        mgr.close()
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [1], "listing shows what it can read"


# ------------------------------------------------------------------ agree: a gather of small references
def gather_values(rank, world_size, fail_rank):
    from cloudckpt import dist
    from cloudckpt.errors import SaveFailed

    coord = dist.Coordinator(timeout=60)
    got = coord.to_coordinator("values", lambda: {"rank": rank})
    try:
        coord.to_coordinator("failing", lambda: 1 // (rank != fail_rank), error=SaveFailed.from_failures)
        failed = None
    except SaveFailed as e:
        failed = str(e)
    return {"got": got, "failed": failed}


def test_to_coordinator_gives_values_to_rank_0_only_and_a_failure_to_every_rank():
    outs = run_ranks(3, gather_values, 2)
    assert outs[0]["got"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert outs[1]["got"] is None and outs[2]["got"] is None, "no other rank receives the values"
    assert all(o["failed"] and "rank 2" in o["failed"] and "ZeroDivisionError" in o["failed"] for o in outs)


def gather_some_values(rank, world_size, fail_rank):
    """gather_some with values on some ranks only (None elsewhere), then a failure on
    ``fail_rank``, which has no value to send, and one on a rank that has."""
    from cloudckpt import dist
    from cloudckpt.errors import SaveFailed

    coord = dist.Coordinator(timeout=60)
    got = coord.gather_some("values", lambda: {"rank": rank, "big": b"x" * (rank * 100_000)} if rank % 2 else None)
    first = coord.gather_some("rank 0 only", lambda: "zero" if rank == 0 else None)
    nothing = coord.gather_some("nothing", lambda: None)
    failed = []
    for bad in (fail_rank, 1):
        try:
            coord.gather_some("failing", lambda bad=bad: (1 // (rank != bad)) and None, error=SaveFailed.from_failures)
            failed.append(None)
        except SaveFailed as e:
            failed.append(str(e))
    return {"got": got, "first": first, "nothing": nothing, "failed": failed}


def test_gather_some_gives_the_values_sent_to_rank_0_and_none_for_the_others():
    outs = run_ranks(4, gather_some_values, 2)
    assert outs[0]["got"] == [None, {"rank": 1, "big": b"x" * 100_000}, None, {"rank": 3, "big": b"x" * 300_000}]
    assert outs[0]["first"] == ["zero", None, None, None] and outs[0]["nothing"] == [None] * 4
    for o in outs[1:]:
        assert o["got"] is None and o["first"] is None and o["nothing"] is None, "no other rank receives the values"
    for o in outs:
        for text, bad in zip(o["failed"], (2, 1), strict=True):
            assert text and f"rank {bad}" in text and "ZeroDivisionError" in text, o["failed"]


def test_gather_some_alone_returns_its_value_or_raises():
    from cloudckpt import dist
    from cloudckpt.errors import SaveFailed

    coord = dist.Coordinator(local=True)
    assert coord.gather_some("one", lambda: 5) == [5] and coord.gather_some("none", lambda: None) == [None]
    with pytest.raises(SaveFailed, match="ZeroDivisionError"):
        coord.gather_some("failing", lambda: 1 // 0, error=SaveFailed.from_failures)


def gather_some_with_a_dead_rank(rank, world_size, out):
    """Rank 2 dies inside gather_some (before it sends anything); the others write down
    what they raised and when."""
    import json
    import time

    from cloudckpt import dist
    from cloudckpt.errors import PeerLost

    coord = dist.Coordinator(timeout=60)
    t = time.monotonic()
    try:
        coord.gather_some("values", lambda: os._exit(3) if rank == 2 else ({"rank": rank} if rank == 1 else None))
        got = {"raised": None}
    except PeerLost as e:
        got = {"raised": "PeerLost", "step": e.step, "seconds": time.monotonic() - t}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def test_a_rank_that_dies_in_gather_some_gives_every_survivor_peer_lost_at_once(tmp_path):
    """Nothing hangs: rank 0 waits in the gather of the lengths, rank 1 (which sent its
    value) in the broadcast of the failures; both raise PeerLost naming the step, long
    before the group's timeout (60 s)."""
    from cloudckpt.testing.multiprocess import RankFailed

    with pytest.raises(RankFailed) as ei:
        run_ranks(3, gather_some_with_a_dead_rank, str(tmp_path), timeout=120)
    assert sorted(ei.value.failures) == [2] and "exit code 3" in str(ei.value.failures[2]), ei.value.failures
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["raised"] == "PeerLost" and got["step"] == "values" and got["seconds"] < 30, (r, got)


def save_recording_agree(rank, world_size, dir, work_dir, tensors):
    """Save ``tensors`` tensors per rank, recording the pickled size of what this rank sends
    to the coordinator at AGREE and of what it receives back from COMMIT."""
    import pickle

    from cloudckpt import dist

    sizes = {}
    real_gather, real_on = dist.Coordinator.to_coordinator, dist.Coordinator.on_coordinator

    def to_coordinator(self, step, fn, **kw):
        def wrapped():
            v = fn()
            sizes.setdefault(step, len(pickle.dumps(v)))
            return v
        return real_gather(self, step, wrapped, **kw)

    def on_coordinator(self, step, fn):
        v = real_on(self, step, fn)
        if step == "commit":
            sizes["commit"] = len(pickle.dumps(v))
        return v

    dist.Coordinator.to_coordinator, dist.Coordinator.on_coordinator = to_coordinator, on_coordinator
    try:
        state = {"model": {f"r{rank}.t{i}": torch.full((16,), float(i)) for i in range(tensors)}}
        with Checkpointer(work_dir=work_dir) as ck:
            ck.save(dir, state, {"rank": rank})
    finally:
        dist.Coordinator.to_coordinator, dist.Coordinator.on_coordinator = real_gather, real_on
    return sizes


def test_agree_sends_each_rank_a_part_reference_whatever_the_number_of_tensors(tmp_path):
    few = run_ranks(2, save_recording_agree, str(tmp_path / "a" / "step1"), str(tmp_path / "w"), 4)
    many = run_ranks(2, save_recording_agree, str(tmp_path / "b" / "step1"), str(tmp_path / "w"), 400)
    for r in (0, 1):
        print(f"rank {r}: agree {few[r]['agree']} -> {many[r]['agree']} bytes, commit {few[r]['commit']} -> "
              f"{many[r]['commit']} bytes (4 -> 400 tensors per rank)")
    # rank 1 sends its part's reference only; rank 0 also the .metadata entry: the same size at 100x the items
    # (a few more digits in the sizes)
    assert many[1]["agree"] < 600 and abs(many[1]["agree"] - few[1]["agree"]) < 16
    assert abs(many[0]["agree"] - few[0]["agree"]) < 16
    assert abs(many[1]["commit"] - few[1]["commit"]) < 32, "the marker every rank gets back does not grow either"
    full = discovery.read_marker(str(tmp_path / "b" / "step1"))
    assert sum(len(o.chunks) for o in full.objects) >= 800, "the items are in the parts"


def test_a_save_our_reader_would_refuse_fails_before_the_marker(tmp_path, monkeypatch):
    import cloudckpt.untrusted as untrusted
    from cloudckpt.errors import SaveFailed

    folder = str(tmp_path / "run")
    monkeypatch.setattr(untrusted, "MAX_TRAIN_STATE_BYTES", 100)  # a load would refuse any train state over it
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        with pytest.raises(SaveFailed, match="train/rank0.pt .*ceiling"):
            ck.save(layout.step_dir(folder, 1), checks.step_state(1, 0, numel=64), {"step": 1, "pad": "x" * 1000})
    assert not os.path.exists(os.path.join(layout.step_dir(folder, 1), layout.MARKER))
    assert list(Checkpointer.find_checkpoints(folder)) == []
    assert not os.path.exists(layout.step_dir(folder, 1)) or os.listdir(layout.step_dir(folder, 1)) == [], \
        "the attempt's objects are removed"


def test_a_marker_prints_short_whatever_the_step_holds(tmp_path):
    """A sync maybe_save returns the Marker: its repr is one short line, not the manifest."""
    import torch as _torch

    from cloudckpt import CheckpointConfig as _Config

    mgr = _Config(save_folder=str(tmp_path / "run"), work_dir=str(tmp_path / "w"), save_interval=1).build()
    m = mgr.maybe_save(1, {f"w{i}": _torch.randn(8) for i in range(300)}, {"step": 1})
    mgr.close()
    text = repr(m)
    assert text.startswith("Marker(step=1, ephemeral=False, world_size=1, objects=") and len(text) < 200, text
