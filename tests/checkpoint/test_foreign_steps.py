"""Foreign steps (another tool's marker, OLMo-core's shape) without OLMo-core: made from
our own saves by replacing the marker, so these run fast on every machine. The real
OLMo-core is driven in tests/integrations/test_olmo_core.py.

Found, loaded (sizes from one listing, no checksums), never hidden by the ``latest``
pointer, never pruned or gc'd unless asked, adopted with a sibling manifest; and what
is neither ours nor a foreign marker stays invisible with one warning."""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
import torch

from cloudckpt import CheckpointConfig, Checkpointer
from cloudckpt.checkpoint import discovery, layout, pointer, retention
from cloudckpt.checkpoint.layout import ADOPTED_MANIFEST
from cloudckpt.errors import CorruptCheckpoint, UnsafeCheckpoint
from cloudckpt.ops.adopt import adopt
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

OLMO_MARKER = json.dumps({"ephemeral": False, "version": "3.0.0"}).encode()


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    return str(tmp_path / "run") if request.param == "local" else request.getfixturevalue("s3_bucket") + "/run"


def _sd(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
            "optim": {"state": {"w": {"exp_avg": torch.randn(6, 4, generator=g), "step": torch.tensor(float(step))}}}}


def _zeros(sd):
    return {k: _zeros(v) for k, v in sd.items()} if isinstance(sd, dict) else torch.zeros_like(sd)


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and torch.equal(a, b)


def _save(folder: str, step: int, work: str, *, foreign: bool = False, ephemeral: bool = False) -> str:
    """A real step saved by cloudckpt; ``foreign``: its marker replaced by OLMo-core's, and
    the ``latest`` pointer put back where it was (OLMo-core never moves it)."""
    dir = layout.step_dir(folder, step)
    before = pointer.read(folder)
    with Checkpointer(work_dir=work) as ck:
        ck.save(dir, _sd(step), {"step": step}, ephemeral=ephemeral)
    if foreign:
        store = open_store(dir)
        store.put_bytes(layout.marker_url(dir), json.dumps({"ephemeral": ephemeral, "version": "3.0.0"}).encode())
        if before is None:
            store.delete(pointer.pointer_url(folder))
        else:
            store.put_bytes(pointer.pointer_url(folder), json.dumps({"step": before[0]}).encode())
    return dir


def test_a_foreign_step_is_found_listed_and_loaded_with_sizes_but_no_checksums(root, tmp_path):
    ours = _save(root, 10, str(tmp_path / "w"))
    theirs = _save(root, 20, str(tmp_path / "w"), foreign=True, ephemeral=True)
    found = list(discovery.find_checkpoints(root, with_markers=True))
    assert [(s, m.kind, m.verified, m.ephemeral) for s, _, m in found] == [
        (10, "cloudckpt", True, False), (20, "olmo-core", False, True)]
    assert [s for s, _ in discovery.find_checkpoints(root, ephemeral=True)] == [20]
    assert discovery.dir_is_checkpoint(theirs) and discovery.latest_checkpoint(root) == theirs
    m = discovery.read_marker(theirs)
    assert m.step == 20 and m.world_size == 1 and m.library_version == "3.0.0"
    assert {o.path for o in m.objects} == {o.path for o in discovery.read_marker(ours).objects}
    assert all(o.crc32c is None and o.size > 0 for o in m.objects)
    target = _zeros(_sd(20))
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        assert ck.load(theirs, target) == {"step": 20}
        assert ck.last_load_info.writer == "olmo-core" and ck.last_load_info.verified is False
    assert _equal(target, _sd(20))


def _count_requests(store) -> list[str]:
    calls: list[str] = []
    store.client.meta.events.register("before-send.s3", lambda request, **kw: calls.append(
        f"{request.method} {'LIST' if 'list-type' in request.url else request.url.rsplit('/', 1)[-1]}"))
    return calls


def test_latest_is_two_requests_and_a_newer_foreign_step_beats_the_pointer(s3_bucket, tmp_path, caplog):
    folder = s3_bucket + "/run"
    for step in (10, 20, 30):
        _save(folder, step, str(tmp_path / "w"))
    calls = _count_requests(open_store(folder))
    assert discovery.latest_checkpoint(folder) == layout.step_dir(folder, 30)
    assert calls == ["GET LIST", "GET .metadata.json"], calls  # the 2-request path: LIST, marker of the newest
    _save(folder, 40, str(tmp_path / "w"), foreign=True)  # OLMo-core continued the run
    assert pointer.read(folder) is None  # saves no longer write one; an earlier cloudckpt left one on step 30:
    open_store(folder).put_bytes(pointer.pointer_url(folder), b'{"step": 30, "pending": false}')
    calls.clear()
    assert discovery.latest_checkpoint(folder) == layout.step_dir(folder, 40)
    assert calls == ["GET LIST", "GET .metadata.json", "GET LIST"], calls  # + the step's listing; no pointer
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert discovery.latest_checkpoint(folder, use_pointer=True) == layout.step_dir(folder, 40)
    assert calls == ["GET LIST", "GET .metadata.json", "GET LIST", "GET latest"], calls  # + why (`latest --pointer`)
    assert any("step40, newer than step30 named by the latest pointer: olmo-core wrote it" in r.getMessage()
               for r in caplog.records)


def test_markers_that_are_neither_ours_nor_foreign_stay_invisible_with_one_warning_each(tmp_path, caplog):
    folder = str(tmp_path / "run")
    bad = {11: b"[1, 2]", 12: json.dumps({"format": "other-tool"}).encode(), 13: b'{"ephemeral": "yes"}',
           14: b"not json"}
    for step in (10, *bad, 15):
        _save(folder, step, str(tmp_path / "w"), foreign=step == 15)
    for step, data in bad.items():
        open_store(folder).put_bytes(layout.marker_url(layout.step_dir(folder, step)), data)
    open_store(folder).delete(urls.join(layout.step_dir(folder, 15), "model_and_optim/.metadata"))  # no DCP metadata
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert [s for s, _ in discovery.find_checkpoints(folder)] == [10]
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert sorted(int(w.split("/step")[1].split(":")[0]) for w in warned) == [11, 12, 13, 14, 15], warned


def test_foreign_steps_are_read_with_the_same_caps_and_name_checks(tmp_path):
    folder = str(tmp_path / "run")
    dir = _save(folder, 5, str(tmp_path / "w"), foreign=True)
    with open(os.path.join(dir, "train", "rank0.pt"), "r+b") as f:  # a sparse 4 GiB + 1 train state
        f.truncate(4 * 1024**3 + 1)
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck, \
            pytest.raises(UnsafeCheckpoint, match="4294967296-byte ceiling"):
        ck.load(dir, _zeros(_sd(5)))
    with open(os.path.join(dir, "model_and_optim", ".metadata"), "r+b") as f:
        f.truncate(1024**3 + 1)
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck, pytest.raises(UnsafeCheckpoint, match="ceiling"):
        ck.load(dir, _zeros(_sd(5)))
    open(os.path.join(dir, "model_and_optim", "notes\x1b[31m.txt"), "wb").close()  # a name no writer makes
    with pytest.raises(UnsafeCheckpoint, match="object name in the step folder"):
        discovery.read_marker(dir)
    assert not discovery.dir_is_checkpoint(dir)


class _Gadget:
    def __reduce__(self):
        return (os.system, ("touch /tmp/cloudckpt-foreign-gadget-ran",))


def test_a_foreign_step_with_a_hostile_global_is_refused(tmp_path):
    folder = str(tmp_path / "run")
    meta_dir = _save(folder, 1, str(tmp_path / "w"), foreign=True)
    with open(os.path.join(meta_dir, "model_and_optim", ".metadata"), "wb") as f:
        pickle.dump(_Gadget(), f, protocol=4)
    train_dir = _save(folder, 2, str(tmp_path / "w"), foreign=True)
    torch.save({"step": 2, "evil": _Gadget()}, os.path.join(train_dir, "train", "rank0.pt"))
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        for dir, what in ((meta_dir, "DCP metadata"), (train_dir, "train state")):
            with pytest.raises(UnsafeCheckpoint, match="system") as e:
                ck.load(dir, _zeros(_sd(int(dir[-1]))))
            assert what in str(e.value), str(e.value)
            with pytest.raises(UnsafeCheckpoint):
                adopt(dir, dry_run=True)
    assert not os.path.exists("/tmp/cloudckpt-foreign-gadget-ran")


def test_resume_takes_a_newer_foreign_step_and_maintenance_never_deletes_it(root, tmp_path):
    cfg = CheckpointConfig(save_folder=root, save_interval=10, max_checkpoints=1, work_dir=str(tmp_path / "w"),
                           async_save=False, gc_grace_seconds=0)
    with cfg.build() as mgr:
        assert mgr.resume(_zeros(_sd(0))) is None
        for step in (10, 20):
            mgr.save(step, _sd(step), {"step": step})
        mgr.wait()
    _save(root, 30, str(tmp_path / "w2"), foreign=True)
    assert pointer.read(root) is None  # saves no longer write one; an earlier cloudckpt left one on step 20:
    open_store(root).put_bytes(pointer.pointer_url(root), b'{"step": 20, "pending": false}')
    with cfg.build() as mgr:
        target = _zeros(_sd(0))
        assert mgr.resume(target) == {"step": 30} and mgr.resumed_step == 30
        assert _equal(target, _sd(30))
        mgr.save(40, _sd(40), {"step": 40})  # no CheckpointExists: the run goes on past the foreign step
        mgr.wait()
    assert [s for s, _ in discovery.find_checkpoints(root)] == [30, 40]  # 20 pruned by policy, 30 kept
    assert retention.gc(root, older_than=0).step_dirs == []


def test_prune_counts_foreign_steps_only_when_asked(root, tmp_path):
    for step, foreign in ((10, True), (20, False), (30, True), (40, False)):
        _save(root, step, str(tmp_path / "w"), foreign=foreign)
    assert retention.prune(root, retention.Policy(max_checkpoints=1), dry_run=True) == [layout.step_dir(root, 20)]
    doomed = retention.prune(root, retention.Policy(max_checkpoints=1, include_foreign=True))
    assert doomed == [layout.step_dir(root, s) for s in (10, 20, 30)]
    assert [s for s, _ in discovery.find_checkpoints(root)] == [40]


def test_adopt_writes_a_sibling_manifest_that_loads_and_verify_then_check(root, tmp_path):
    dir = _save(root, 7, str(tmp_path / "w"), foreign=True)
    store = open_store(dir)
    rep = adopt(dir)  # dry run
    assert not rep.written and not rep.already and not store.exists(urls.join(dir, ADOPTED_MANIFEST))
    rep = adopt(dir, dry_run=False)
    assert rep.written and rep.manifest_url == urls.join(dir, ADOPTED_MANIFEST)
    assert store.get_bytes(layout.marker_url(dir)) == json.dumps({"ephemeral": False, "version": "3.0.0"}).encode()
    m = discovery.read_marker(dir)
    assert m.kind == "olmo-core+manifest" and m.verified and all(o.crc32c for o in m.objects)
    shard = next(o for o in m.objects if o.path.endswith(".distcp"))
    assert shard.chunks and sum(c[1] for c in shard.chunks) <= shard.size  # item CRC32Cs, as our saves record
    assert adopt(dir, dry_run=False).already
    target = _zeros(_sd(7))
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.load(dir, target)
        assert _equal(target, _sd(7)) and ck.last_load_info.verified is True
        url = urls.join(dir, shard.path)
        data = bytearray(store.get_bytes(url))
        data[shard.chunks[0][0]] ^= 1
        store.put_bytes(url, bytes(data))
        with pytest.raises(CorruptCheckpoint, match="CRC32C"):
            ck.load(dir, _zeros(_sd(7)))
    # the other tool rewrites the step: the manifest no longer vouches for it
    store.put_bytes(layout.marker_url(dir), json.dumps({"ephemeral": True, "version": "3.0.1"}).encode())
    m = discovery.read_marker(dir)
    assert m.kind == "olmo-core" and not m.verified and m.ephemeral


def test_adopt_refuses_a_step_with_anything_missing_and_leaves_ours_alone(tmp_path):
    folder = str(tmp_path / "run")
    assert adopt(_save(folder, 1, str(tmp_path / "w")), dry_run=False).already  # ours has a manifest
    dir = _save(folder, 2, str(tmp_path / "w"), foreign=True)
    store = open_store(dir)
    shard = next(o.path for o in discovery.read_marker(dir).objects if o.path.endswith(".distcp"))
    store.delete(urls.join(dir, shard))
    with pytest.raises(CorruptCheckpoint, match=f"missing.*{shard}"):
        adopt(dir, dry_run=False)
    assert not store.exists(urls.join(dir, ADOPTED_MANIFEST))
