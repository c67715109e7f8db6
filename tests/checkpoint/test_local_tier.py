"""The node-local tier with real gloo ranks: 4 ranks as 2 "nodes" x 2 ranks, each node
with its own folder, the bucket on SeaweedFS behind a request-recording proxy.

A first run trains to step 30: local steps 10, 20, 30 (copied to the peer node),
bucket step 20 (persisted from the local files). Then the recovery cases.
"""

from __future__ import annotations

import os
import shutil
import uuid

import google_crc32c
import pytest
import torch

from cloudckpt.checkpoint import discovery, layout
from cloudckpt.checkpoint.local import parts
from cloudckpt.checkpoint.local.groups import Replication
from cloudckpt.errors import ConfigError
from cloudckpt.storage import open_store
from cloudckpt.testing.faultproxy import FaultProxy
from cloudckpt.testing.multiprocess import RankFailed, run_ranks

from . import local_workers
from .test_checkpointer import _env

WORLD = 4


@pytest.fixture
def proxy(seaweed):
    with FaultProxy(seaweed.endpoint_url, seed=0) as p:
        yield p


def _run(proxy, s3_bucket, tmp_path, upto, **kw):
    env = dict(_env(), AWS_ENDPOINT_URL=proxy.endpoint_url, LOCAL_WORLD_SIZE=kw.get("local_world_size", "2"))
    return run_ranks(WORLD, local_workers.run, s3_bucket + "/run", str(tmp_path / "local"), str(tmp_path / "work"),
                     upto, kw.get("cfg_kw"), kw.get("kill"), env=env, timeout=kw.get("timeout", 240))


@pytest.fixture(scope="module")
def reference(seaweed, tmp_path_factory) -> dict:
    """The snapshots (steps 10, 20, 30) of an uninterrupted run with the default settings:
    the training is deterministic, so one run serves every test that compares with it."""
    tmp = tmp_path_factory.mktemp("reference")
    bucket = seaweed.create_bucket("ref-" + uuid.uuid4().hex[:16])
    env = dict(_env(), **seaweed.env(), LOCAL_WORLD_SIZE="2")
    outs = run_ranks(WORLD, local_workers.run, bucket + "/run", str(tmp / "local"), str(tmp / "work"), 30, None, None,
                     env=env, timeout=240)
    return outs[0]["snapshots"]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _requests_since(proxy, n: int) -> list[str]:
    return [f"{c.method} {c.target}" for c in proxy.completed[n:]]


def _first_run(proxy, s3_bucket, tmp_path, **kw):
    outs = _run(proxy, s3_bucket, tmp_path, 30, **kw)
    assert all(o["resumed_step"] is None for o in outs)
    assert [s for s, _ in discovery.find_checkpoints(s3_bucket + "/run")] == [20]  # persisted: save_interval 20
    copies = (kw.get("cfg_kw") or {}).get("replication_factor", 2) > 1
    for node in (0, 1):  # every node holds steps 10..30: its ranks' parts (and their peers' copies)
        want = ["rank0", "rank1", "rank2", "rank3"] if copies else [f"rank{2 * node}", f"rank{2 * node + 1}"]
        for step in (10, 20, 30):
            held = sorted(os.listdir(tmp_path / "local" / f"node{node}" / f"step{step}"))
            assert [h for h in held if h.startswith("rank")] == want, (node, step, held)
            assert not [h for h in held if h.startswith(".tmp-")], held
    return outs[0]["snapshots"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_replaced_node_recovers_from_its_peers_without_reading_the_bucket_step(proxy, s3_bucket, tmp_path,
                                                                                 async_save):
    snaps = _first_run(proxy, s3_bucket, tmp_path, cfg_kw={"async_save": async_save})
    shutil.rmtree(tmp_path / "local" / "node1")  # node 1 replaced: its disk is empty
    before = len(proxy.completed)
    outs = _run(proxy, s3_bucket, tmp_path, 30, cfg_kw={"async_save": async_save})
    for r, o in enumerate(outs):
        assert (o["resumed_from"], o["resumed_step"]) == ("local", 30), r
        assert _equal(o["at_resume"], snaps[30]), r  # bit-exact: model and optimizer state
        assert o["train_state"] == {"step": 30, "rank": r}
    # node 1's ranks got their parts (train state, shards) from node 0; node 0 needed nothing
    assert outs[2]["recovery"]["fetched_bytes"] > 0 and outs[3]["recovery"]["fetched_bytes"] > 0
    assert outs[0]["recovery"]["fetched_bytes"] == 0 and outs[1]["recovery"]["fetched_bytes"] == 0
    reqs = _requests_since(proxy, before)
    # what docs/local-tier.md says rank 0 sends (the other ranks send nothing): two LISTs of the save folder
    # (the newest committed step; uncommitted leftovers above it), one LIST of its unfinished multipart
    # uploads, one GET and one HEAD of the newest bucket step's marker; no step data, nothing of step 30
    kinds = sorted("LIST" if "list-type=2" in r and "prefix=run%2F&delimiter" in r else
                   "UPLOADS" if "?uploads&prefix=run%2F" in r else
                   r.split()[0] + " marker" if r.split()[1].endswith("/run/step20/.metadata.json") else r for r in reqs)
    assert kinds == ["GET marker", "HEAD marker", "LIST", "LIST", "UPLOADS"], reqs


def test_both_nodes_wiped_resumes_from_the_bucket_step(proxy, s3_bucket, tmp_path):
    snaps = _first_run(proxy, s3_bucket, tmp_path)
    shutil.rmtree(tmp_path / "local")
    outs = _run(proxy, s3_bucket, tmp_path, 30)
    for r, o in enumerate(outs):
        assert (o["resumed_from"], o["resumed_step"]) == ("bucket", 20), r
        assert _equal(o["at_resume"], snaps[20]), r
        assert o["train_state"] == {"step": 20, "rank": r}


def test_without_copies_a_lost_node_falls_back_to_the_bucket(proxy, s3_bucket, tmp_path):
    snaps = _first_run(proxy, s3_bucket, tmp_path, cfg_kw={"replication_factor": 1})
    shutil.rmtree(tmp_path / "local" / "node1")
    outs = _run(proxy, s3_bucket, tmp_path, 30, cfg_kw={"replication_factor": 1})
    for r, o in enumerate(outs):
        assert (o["resumed_from"], o["resumed_step"]) == ("bucket", 20), r
        assert _equal(o["at_resume"], snaps[20]), r


def _leftovers(local) -> list[str]:
    return sorted(f"{n.name}/{s.name}/{e}" for n in local.iterdir() for s in n.iterdir() if s.is_dir()
                  for e in os.listdir(s) if e.startswith(".tmp-"))


@pytest.mark.parametrize("where", ["save", "copy"])
def test_a_rank_killed_in_a_local_step_leaves_it_incomplete(proxy, s3_bucket, tmp_path, where, reference):
    """Rank 2 is SIGKILLed while writing (or while receiving the copies of) local step
    30; the others fail on their collectives. The restart resumes from local step 20,
    the newest complete one, never from 30; when it writes step 30 again, the killed
    attempt's temporary folder in it is removed."""
    with pytest.raises(RankFailed):
        _run(proxy, s3_bucket, tmp_path, 30, kill=(30, 2, where), timeout=120)
    # rank 2's part being written, or its copy of rank 0's part being received
    left = _leftovers(tmp_path / "local")
    want = ".tmp-write2-" if where == "save" else ".tmp-recv0-"
    assert any(x.startswith(f"node1/step30/{want}") for x in left), left  # (other ranks clean up their own)
    outs = _run(proxy, s3_bucket, tmp_path, 30)
    for r, o in enumerate(outs):
        assert (o["resumed_from"], o["resumed_step"]) == ("local", 20), r
        assert _equal(o["at_resume"], reference[20]), r  # an uninterrupted run's
    assert outs[0]["snapshots"][30].keys() and _equal(outs[0]["snapshots"][30], reference[30])
    assert _leftovers(tmp_path / "local") == []
    for node in (0, 1):  # step 30 written again, complete on both nodes
        held = sorted(os.listdir(tmp_path / "local" / f"node{node}" / "step30"))
        assert held == [f".replicated-rank{2 * node}", f".replicated-rank{2 * node + 1}",
                        "rank0", "rank1", "rank2", "rank3"], held


def test_a_rank_killed_while_persisting_leaves_no_bucket_step(proxy, s3_bucket, tmp_path, reference):
    """Rank 2 dies in the upload of step 20 to the bucket: the bucket shows no step
    (the usual marker-last guarantee); the restart resumes from a complete local step
    and clears the upload's leftovers."""
    with pytest.raises(RankFailed):
        _run(proxy, s3_bucket, tmp_path, 25, kill=(20, 2, "persist"), timeout=120)
    assert list(discovery.find_checkpoints(s3_bucket + "/run")) == []
    outs = _run(proxy, s3_bucket, tmp_path, 20)
    step = outs[0]["resumed_step"]
    assert step in (10, 20)  # 20 if its copies finished before the kill, else 10
    for r, o in enumerate(outs):
        assert (o["resumed_from"], o["resumed_step"]) == ("local", step), r
        assert _equal(o["at_resume"], reference[step]), r  # an uninterrupted run's
    # the partial upload was removed by resume: every object left belongs to a committed step
    committed = [d + "/" for _, d in discovery.find_checkpoints(s3_bucket + "/run")]
    left = [o.url for o in open_store(s3_bucket).walk(s3_bucket + "/run/")]
    assert all(any(u.startswith(c) for c in committed) for u in left), \
        [u for u in left if not any(u.startswith(c) for c in committed)]


def test_bad_settings_are_typed_errors_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="replication_factor=3 is larger than the number of failure domains"):
        Replication(4, 3, 2)
    with pytest.raises(ConfigError, match=r"not divisible by replication_jump x replication_factor \(2 x 2\)"):
        Replication(6, 2, 2)
    with pytest.raises(ConfigError, match="replication_jump=4 does not divide the world size 6"):
        Replication(6, 1, 4)
    assert Replication(4, 2, 2).groups() == [(0, 2), (1, 3)]
    assert Replication(8, 2, 2).groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert Replication(6, 3, 2).group_of(5) == (1, 3, 5)
    from cloudckpt import CheckpointConfig

    with pytest.raises(ConfigError, match="local_save_interval=5 needs local_dir"):
        CheckpointConfig(save_folder=str(tmp_path / "r"), local_save_interval=5)
    with pytest.raises(ConfigError, match="keep_last_local=0"):
        CheckpointConfig(save_folder=str(tmp_path / "r"), local_dir=str(tmp_path / "l"), keep_last_local=0)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"local_dir=.*file.* is not usable on rank 0"):
        CheckpointConfig(save_folder=str(tmp_path / "r"), local_dir=str(blocked / "ckpt")).build()


def test_the_node_of_a_rank_is_its_machine_whatever_the_jump():
    """``{node}`` and same-node links follow the machine (LOCAL_WORLD_SIZE ranks each),
    not the failure domain: a jump of a rack (2 machines of 2 ranks) keeps 4 folders."""
    from cloudckpt.checkpoint.local.groups import on_machines

    rack = on_machines(Replication(8, 2, 4), {"LOCAL_WORLD_SIZE": "2"})
    assert [rack.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert rack.groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]  # every copy on the other rack
    assert [on_machines(Replication(8, 2, 4), {}).node_of(r) for r in range(8)] == [0] * 4 + [1] * 4  # no launcher info
    assert on_machines(Replication(4, 2, 2), {"LOCAL_WORLD_SIZE": "2"}).node_of(3) == 1
    with pytest.raises(ConfigError, match=r"replication_jump=2 is not a multiple of the ranks per node \(4, "):
        on_machines(Replication(8, 2, 2), {"LOCAL_WORLD_SIZE": "4"})  # copies would share a machine
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE='x' is not a number of ranks per node"):
        on_machines(Replication(4, 2, 2), {"LOCAL_WORLD_SIZE": "x"})
    with pytest.raises(ConfigError, match="3 ranks per node .* does not divide the world size 4"):
        on_machines(Replication(4, 1, 4), {"LOCAL_WORLD_SIZE": "3"})


def test_with_a_jump_of_a_rack_each_machine_keeps_its_own_folder_and_a_replaced_one_recovers(proxy, s3_bucket,
                                                                                             tmp_path):
    """4 machines of 1 rank (LOCAL_WORLD_SIZE=1) in 2 racks (replication_jump=2): each
    machine writes ``node{0..3}``, with its part and a copy of the other rack's group
    member's; machine 3 replaced (its folder empty) recovers local step 10 from machine 1."""
    kw = {"cfg_kw": {"replication_jump": 2}, "local_world_size": "1"}
    snaps = _run(proxy, s3_bucket, tmp_path, 10, **kw)[0]["snapshots"]
    local = tmp_path / "local"
    assert sorted(os.listdir(local)) == ["node0", "node1", "node2", "node3"]
    for node, want in enumerate([["rank0", "rank2"], ["rank1", "rank3"], ["rank0", "rank2"], ["rank1", "rank3"]]):
        held = sorted(os.listdir(local / f"node{node}" / "step10"))
        assert held == [f".replicated-rank{node}"] + want, (node, held)
    shutil.rmtree(local / "node3")
    outs = _run(proxy, s3_bucket, tmp_path, 10, **kw)
    for r, o in enumerate(outs):
        assert (o["resumed_from"], o["resumed_step"]) == ("local", 10), r
        assert _equal(o["at_resume"], snaps[10]), r
    # machines 0-2 link the parts in their own folders; machine 3 has none and fetches what it reads
    assert [o["recovery"]["local_files"] > 0 for o in outs] == [True, True, True, False]
    assert outs[3]["recovery"]["fetched_bytes"] > 0


def test_temporary_folders_a_killed_save_left_are_removed_by_a_rewrite_and_by_retention(tmp_path):
    """One process: the leftovers of a killed attempt (its part being written, a copy
    being received) in a step written again, and in a step kept by retention, are
    removed; another rank's are not this rank's to remove."""
    from cloudckpt import CheckpointConfig

    local = tmp_path / "local"
    cfg = CheckpointConfig(save_folder=str(tmp_path / "run"), local_dir=str(local), local_save_interval=1,
                           keep_last_local=2, work_dir=str(tmp_path / "w"), exact_resume=False)
    with cfg.build() as mgr:
        for step in (1, 2):
            mgr.maybe_save(step, {"w": torch.full((4,), float(step))})
        mgr.wait()
        for name in (".tmp-write0-a1", ".tmp-write0-a2/model_and_optim", ".tmp-write10-x", ".tmp-recv3-y"):
            (local / "step2" / name).mkdir(parents=True)  # kept step 2
        (local / "step3" / ".tmp-write0-b1").mkdir(parents=True)  # a killed write of step 3
        (local / "step3" / ".replicated-rank0").touch()  # left from an older, complete step 3
        mgr.maybe_save(3, {"w": torch.full((4,), 3.0)})
        mgr.wait()
        assert sorted(os.listdir(local / "step3")) == [".replicated-rank0", "rank0"]
        # rank 0 has no peers (one process): another rank's leftovers are left for that rank
        assert sorted(os.listdir(local / "step2")) == [".replicated-rank0", ".tmp-recv3-y", ".tmp-write10-x", "rank0"]
    assert parts.own_leftover(".tmp-write1-ab", 1, ()) and not parts.own_leftover(".tmp-write10-ab", 1, ())
    assert parts.own_leftover(".tmp-recv3-y", 1, (3,)) and not parts.own_leftover(".tmp-recv3-y", 1, (2,))


def test_a_local_dir_without_room_for_the_step_is_a_typed_error_naming_it(tmp_path, monkeypatch):
    """One process: the free space is what shutil.disk_usage reports (here: 1 KiB)."""
    import collections

    from cloudckpt import CheckpointConfig
    from cloudckpt.errors import LocalCapacityError

    mgr = CheckpointConfig(save_folder=str(tmp_path / "run"), local_dir=str(tmp_path / "local"), local_save_interval=1,
                           work_dir=str(tmp_path / "w")).build()
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("cloudckpt.checkpoint.local.tier.shutil.disk_usage", lambda p: usage(2048, 1024, 1024))
    try:
        with pytest.raises(LocalCapacityError, match=r"local_dir .*local has 1024 bytes free; "
                                                     r"the next local step needs "
                                                     r"about 40000 .*replication_factor 1"):
            mgr.maybe_save(1, {"w": torch.zeros(100, 100)})
        assert parts.steps_on_disk(str(tmp_path / "local")) == []  # nothing written
    finally:
        mgr.close()


def test_one_process_resumes_from_its_newest_local_step_and_keeps_the_last_k(tmp_path):
    from cloudckpt import CheckpointConfig

    cfg = CheckpointConfig(save_folder=str(tmp_path / "run"), local_dir=str(tmp_path / "local"), local_save_interval=2,
                           save_interval=4, keep_last_local=2, work_dir=str(tmp_path / "w"), exact_resume=False)
    with cfg.build() as mgr:
        for step in range(1, 8):
            mgr.maybe_save(step, {"w": torch.full((4,), float(step))}, {"step": step})
        mgr.wait()
    assert parts.steps_on_disk(str(tmp_path / "local")) == [4, 6]  # 2 and older pruned
    assert [s for s, _ in discovery.find_checkpoints(str(tmp_path / "run"))] == [4]
    with cfg.build() as mgr:
        sd = {"w": torch.zeros(4)}
        assert mgr.resume(sd) == {"step": 6} and (mgr.resumed_from, mgr.resumed_step) == ("local", 6)
        assert torch.equal(sd["w"], torch.full((4,), 6.0))
    shutil.rmtree(tmp_path / "local")
    with cfg.build() as mgr:
        sd = {"w": torch.zeros(4)}
        assert mgr.resume(sd) == {"step": 4} and mgr.resumed_from == "bucket"


def test_a_local_dir_holding_another_runs_steps_is_refused_not_resumed_from(tmp_path):
    from cloudckpt import CheckpointConfig

    local = str(tmp_path / "local")
    first = CheckpointConfig(save_folder=str(tmp_path / "run-a"), local_dir=local, local_save_interval=1,
                             work_dir=str(tmp_path / "w"), exact_resume=False)
    with first.build() as mgr:
        mgr.maybe_save(1, {"w": torch.ones(2)})
    with pytest.raises(ConfigError, match=r"holds local steps of another run \(save_folder .*run-a\)"):
        first.replace(save_folder=str(tmp_path / "run-b")).build()
    shutil.rmtree(os.path.join(local, "step1"))  # that run's steps are gone: the folder is taken over
    with first.replace(save_folder=str(tmp_path / "run-b")).build() as mgr:
        assert mgr.resume({"w": torch.zeros(2)}) is None


def test_a_crafted_local_part_is_ignored_and_nothing_outside_its_folder_is_read_or_linked(tmp_path):
    """A part manifest naming a path outside its folder (or an absolute one) is refused by
    the marker parser: the part does not count, resume falls back, no file outside is used."""
    import json

    from cloudckpt import CheckpointConfig

    secret = tmp_path / "secret.pt"
    torch.save({"w": torch.full((2,), 7.0)}, secret)
    local = tmp_path / "local"
    cfg = CheckpointConfig(save_folder=str(tmp_path / "run"), local_dir=str(local), local_save_interval=1,
                           work_dir=str(tmp_path / "w"), exact_resume=False)
    with cfg.build():
        pass  # the folder now belongs to this run
    for i, path in enumerate(["../../../secret.pt", str(secret), "model_and_optim/../../x"]):
        part = local / f"step{i + 1}" / "rank0"
        part.mkdir(parents=True)
        (local / f"step{i + 1}" / ".replicated-rank0").touch()
        (part / "part.json").write_text(json.dumps({
            "format": "cloudckpt", "format_version": 1, "step": i + 1, "ephemeral": False, "world_size": 1,
            "created_unix": 0, "objects": [{"path": path, "size": secret.stat().st_size, "crc32c": None}]}))
        assert parts.read_part(str(local), i + 1, 0) is None
    with cfg.build() as mgr:
        sd = {"w": torch.zeros(2)}
        assert mgr.resume(sd) is None and torch.equal(sd["w"], torch.zeros(2))
    assert torch.load(secret, weights_only=True)["w"].tolist() == [7.0, 7.0]


def test_files_move_between_ranks_in_pipelined_pieces_byte_for_byte(tmp_path):
    data = os.urandom(12_000)
    (tmp_path / "src.bin").write_bytes(data)
    got = run_ranks(2, local_workers.file_pieces, str(tmp_path), timeout=120)[1]
    whole, crc = got["whole"]
    assert whole == data[:10_500] and crc == google_crc32c.value(data[:10_500])
    ranged, crc = got["range"]
    assert ranged == b"\0" * 777 + data[777:777 + 4_321] + b"\0" * 5 and crc == google_crc32c.value(data[777:5_098])
    assert got["one"] == (data[:1000], google_crc32c.value(data[:1000]))
    assert got["small"] == (data[3:20], google_crc32c.value(data[3:20]))


def test_a_persisted_local_steps_reused_metadata_is_copied_in_the_bucket_not_uploaded_again(any_root, tmp_path,
                                                                                         monkeypatch):
    # the local tier persists from the local step's files; a .metadata the writer reused is a link
    # to the one persisted last: the persister copies that object in the store instead of sending it
    from cloudckpt import CheckpointConfig
    from cloudckpt.dcp import writer as dcp_writer
    from cloudckpt.storage import open_store

    monkeypatch.setattr(dcp_writer, "KEEP_METADATA_BYTES", 0)  # kept at every size, as a large job's
    root = any_root.rstrip("/")
    cfg = CheckpointConfig(save_folder=root, local_dir=str(tmp_path / "local"), local_save_interval=1,
                           save_interval=2, keep_last_local=2, work_dir=str(tmp_path / "w"), exact_resume=False)
    sd = {"w": torch.arange(8.0), "b": torch.ones(3)}
    with cfg.build() as mgr:
        for step in range(1, 7):
            mgr.maybe_save(step, sd, {"step": step})
            mgr.wait()
        stats = mgr.local.persister.engine.stats()
    store = open_store(root)
    metas = [store.get_bytes(f"{root}/step{s}/{layout.DCP_METADATA}") for s in (2, 4, 6)]
    assert metas[0] == metas[1] == metas[2]
    assert stats.bytes_copied == 2 * len(metas[0])  # steps 4 and 6: copied from the step persisted before
    with cfg.build() as mgr:
        shutil.rmtree(tmp_path / "local")
        got = {"w": torch.zeros(8), "b": torch.zeros(3)}
        assert mgr.resume(got) == {"step": 6} and mgr.resumed_from == "bucket"
    assert all(torch.equal(got[k], sd[k]) for k in sd)
