"""What a running job's maintenance (prune + gc after every save, ``retention.Maintenance``)
costs, and that it decides as the one-shot ``prune``/``gc`` do.

The request counts are taken at a fault proxy (no faults) in front of real SeaweedFS:
a save and its maintenance make the same requests whether 5 or 40 steps are kept."""

from __future__ import annotations

import collections
import json
import os
import time

import pytest
import torch

from cloudckpt import CheckpointConfig, Checkpointer
from cloudckpt.checkpoint import discovery, layout, retention
from cloudckpt.errors import CheckpointError
from cloudckpt.storage import Location, clear_cache
from cloudckpt.testing.faultproxy import FaultProxy


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


def _requests(events) -> collections.Counter:
    """(method, kind of object) of each request: the step number is left out."""
    out = collections.Counter()
    for e in events:
        path = e.target.split("?", 1)[0]
        kind = "marker" if path.endswith(layout.MARKER) else "lock" if path.endswith(layout.LOCK) else \
            "pointer" if path.endswith("/" + layout.LATEST_POINTER) else "listing" if "?" in e.target and \
            ("list-type" in e.target or "prefix" in e.target or "uploads" in e.target) else "other"
        out[(e.method, kind)] += 1
    return out


def _run_job(proxy: FaultProxy, folder: str, kept: int, work: str) -> dict:
    """``kept`` committed steps written by an earlier job, then a fresh manager keeping
    ``kept`` persistent steps saves twice. Returns the requests of each save (with its
    maintenance) and of one more maintenance alone."""
    with Checkpointer(work_dir=work, distributed=False) as ck:
        for step in range(1, kept + 1):
            ck.save(layout.step_dir(folder, step), _state(step))
    cfg = CheckpointConfig(save_folder=folder, save_interval=1, max_checkpoints=kept, work_dir=work, exact_resume=False)
    out = {}
    with cfg.build() as mgr:
        for name, step in (("first", kept + 1), ("second", kept + 2)):
            proxy.reset_counters()
            mgr.maybe_save(step, _state(step))
            mgr.wait()
            out[name] = list(proxy.events)
        proxy.reset_counters()
        mgr.maintenance.run(keep_above=kept + 2)
        out["alone"] = list(proxy.events)
    out["committed"] = [s for s, _ in discovery.find_checkpoints(folder)]
    return out


def test_maintenance_requests_are_the_same_with_5_and_40_kept_steps(seaweed, s3_bucket, monkeypatch, tmp_path):
    runs = {}
    with FaultProxy(seaweed.endpoint_url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint_url)
        clear_cache()
        for kept in (5, 40):
            runs[kept] = _run_job(proxy, f"{s3_bucket}/kept{kept}", kept, str(tmp_path / f"w{kept}"))
    clear_cache()
    for kept, r in runs.items():
        # the policy held: the newest ``kept`` steps remain
        assert r["committed"] == list(range(3, kept + 3)), (kept, r["committed"])
    # a save and its maintenance (one step pruned): the same requests, whatever is kept
    assert _requests(runs[5]["second"]) == _requests(runs[40]["second"]), (runs[5]["second"], runs[40]["second"])
    # maintenance alone: two LISTs (step folders, multipart uploads), nothing per kept step
    alone = {k: _requests(r["alone"]) for k, r in runs.items()}
    assert alone[5] == alone[40] and sum(alone[5].values()) <= 10, alone
    assert not any(kind == "marker" for _, kind in alone[5]), alone[5]
    # a fresh manager reads each kept step's marker header once (one ranged GET each), then never again
    first = {k: _requests(r["first"])[("GET", "marker")] for k, r in runs.items()}
    second = {k: _requests(r["second"])[("GET", "marker")] for k, r in runs.items()}
    assert first[40] - first[5] == 35 and second[5] == second[40], (first, second)


def _marker_doc(step: int, *, ephemeral: bool, objects: int, objects_first: bool = False) -> bytes:
    objs = [{"path": f"model_and_optim/__{i}_0.distcp", "size": 10, "crc32c": "0badcafe"} for i in range(objects)]
    head = {"format": "cloudckpt", "format_version": 1, "step": step, "ephemeral": ephemeral, "world_size": objects,
            "created": "2026-11-25T00:00:00+00:00", "created_unix": 1.79e9, "library_version": "0", "torch_version": "",
            "save_id": "x", "total_bytes": 10 * objects, "object_count": objects}
    d = {"objects": objs, **head} if objects_first else {**head, "objects": objs}
    return json.dumps(d, separators=(",", ":")).encode()


@pytest.mark.parametrize("objects_first", [False, True])
def test_read_header_of_a_large_marker_reads_its_leading_fields_or_falls_back_to_the_whole(tmp_path, objects_first):
    folder = tmp_path / "run"
    step = folder / "step7"
    step.mkdir(parents=True)
    data = _marker_doc(7, ephemeral=True, objects=5000, objects_first=objects_first)
    assert len(data) > retention.HEADER_BYTES
    (step / layout.MARKER).write_bytes(data)
    assert retention.read_header(Location.of(str(step))) == retention.StepHeader(7, True, False)


def test_read_header_refuses_what_discovery_skips_and_reads_other_tools_markers(tmp_path):
    folder = tmp_path / "run"
    for n, body in ((1, b"{not json"), (2, _marker_doc(99, ephemeral=False, objects=1)),
                    (3, json.dumps({"ephemeral": True, "version": "2.1"}).encode())):
        (folder / f"step{n}").mkdir(parents=True)
        (folder / f"step{n}" / layout.MARKER).write_bytes(body)
    (folder / "step3" / "model_and_optim").mkdir()
    (folder / "step3" / layout.DCP_METADATA).write_bytes(b"x")
    (folder / "step4").mkdir()
    with pytest.raises(CheckpointError):
        retention.read_header(Location.of(str(folder / "step1")))
    # a small marker is parsed whole, as discovery parses it; the step is the folder's
    assert retention.read_header(Location.of(str(folder / "step2"))) == retention.StepHeader(2, False, False)
    assert retention.read_header(Location.of(str(folder / "step3"))) == retention.StepHeader(3, True, True)
    assert retention.read_header(Location.of(str(folder / "step4"))) is None


def test_leading_fields_stop_at_the_first_container_a_cut_or_a_repeated_key():
    lf = retention._leading_fields
    assert lf(b'{"a":1,"b":"x","c":[1,2],"d":3}') == {"a": 1, "b": "x"}
    assert lf(b' { "a" : true , "b" : nu') == {"a": True}
    assert lf(b'{"a":1,"a":2}') == {}
    assert lf(b'[1,2]') == {} and lf(b'') == {} and lf(b'\xff\xfe{"a":1}') == {}


def test_maintenance_decides_like_prune_and_gc_and_keeps_foreign_and_marked_folders(tmp_path):
    """Steps of both kinds, another tool's step, a folder with a corrupt marker, an old
    uncommitted folder, a young one, a step being written above the newest: Maintenance
    deletes exactly what prune + gc delete, and a second run deletes nothing more."""
    def build(root):
        with Checkpointer(work_dir=str(tmp_path / "w"), distributed=False) as ck:
            for step, eph in ((10, False), (20, True), (30, False), (40, True), (50, False), (60, True)):
                ck.save(layout.step_dir(root, step), _state(step), ephemeral=eph)
        (root / "step35").mkdir()
        (root / "step35" / layout.MARKER).write_bytes(json.dumps({"ephemeral": False, "version": "2.1"}).encode())
        (root / "step35" / "model_and_optim").mkdir()
        (root / "step35" / layout.DCP_METADATA).write_bytes(b"x")
        (root / "step45").mkdir()
        (root / "step45" / layout.MARKER).write_bytes(b"{broken")
        for n in (15, 25, 70):
            (root / f"step{n}").mkdir()
            (root / f"step{n}" / "junk").write_bytes(b"x")
        return root

    policy = retention.Policy(keep_last_ephemeral=1, max_checkpoints=2)
    now = time.time() + 7200
    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    for root in (a, b):
        old = time.time() - 7200
        os.utime(root / "step15" / "junk", (old, old))  # step15 is old; step25 is young, step70 in progress
    pruned = retention.prune(str(a), policy)
    rep = retention.gc(str(a), older_than=3600, keep_above=60, now=time.time() + 1800)
    m = retention.Maintenance(str(b), policy, older_than=3600)
    m_pruned, m_rep = m.run(keep_above=60, now=time.time() + 1800)
    rel = lambda urls_, root: sorted(u[len(str(root)):] for u in urls_)  # noqa: E731
    assert rel(m_pruned, b) == rel(pruned, a) == ["/step10", "/step20", "/step40"]
    assert rel(m_rep.step_dirs, b) == rel(rep.step_dirs, a)
    assert sorted(p.name for p in b.iterdir()) == sorted(p.name for p in a.iterdir())
    assert {"step35", "step45", "step70"} <= {p.name for p in b.iterdir()}
    assert rel(m_rep.step_dirs, b) == ["/step15"]
    again, rep2 = m.run(keep_above=60, now=now)  # two hours on, step25 is old too
    assert again == [] and rel(rep2.step_dirs, b) == ["/step25"]
