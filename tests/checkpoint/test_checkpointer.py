"""The Checkpointer against real stores: multi-rank round trips, resharding, failures, races, bad input."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout
from cloudckpt.errors import (
    BucketNotFound,
    CheckpointExists,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    MissingKeys,
    NotACheckpoint,
)
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls
from cloudckpt.testing.multiprocess import run_ranks

from . import workers


def _env() -> dict:
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION",
            "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT", "AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE")
    return {k: os.environ[k] for k in keys if k in os.environ}


def _assert_bitexact(got: dict, seed: int = 0) -> None:
    want = workers.full_tensors(seed)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


# ------------------------------------------------------------------ multi-rank round trips
@pytest.mark.parametrize("backend", ["local", "s3", "gcs"])
def test_two_ranks_save_then_load_is_bitexact_and_leaves_no_temp_dirs(backend, request, tmp_path):
    root = {"local": lambda: str(tmp_path / "ckpt"), "s3": lambda: request.getfixturevalue("s3_bucket") + "/run",
            "gcs": lambda: request.getfixturevalue("gcs_bucket") + "/run"}[backend]()
    step = urls.join(root, "step7")
    work = str(tmp_path / "work")
    saved = run_ranks(2, workers.save_sharded, step, work, env=_env())
    assert os.listdir(work) == [], "every rank removed its temp work dir"
    objs = set(saved[0]["objects"])
    assert {"train/rank0.pt", "train/rank1.pt", "model_and_optim/.metadata"} <= objs
    assert any(o.startswith("model_and_optim/__1_") and o.endswith(".distcp") for o in objs)

    marker = discovery.read_marker(step)
    assert (marker.step, marker.world_size, marker.ephemeral) == (7, 2, False)
    listed = {o.url[len(urls.as_prefix(step)):] for o in open_store(step).walk(urls.as_prefix(step))}
    assert listed == objs | {layout.MARKER}, "every object is in the manifest; the lock is gone"

    loaded = run_ranks(2, workers.load_sharded, step, work, env=_env())
    for r, out in enumerate(loaded):
        _assert_bitexact(out["tensors"])
        assert out["direct_items"] > 0
        assert out["step"] == 7
        assert out["train_state"] == {"rank": r, "step": 7, "lr": 0.1}
    assert os.listdir(work) == []


def test_rank_0_reads_the_dcp_index_once_and_each_rank_only_its_own_part(s3_bucket, tmp_path):
    """DCP has every rank GET ``.metadata`` (its size grows with ranks x tensors). Here
    no rank reads ``.metadata``: rank 0 reads the DCP index's header with the marker and
    hands it to the others, and each rank reads the index part of the rank that wrote
    its shards (a restart with the saved layout: its own)."""
    step = s3_bucket + "/run/step7"
    work = str(tmp_path / "work")
    run_ranks(2, workers.save_sharded, step, work, env=_env())
    outs = run_ranks(2, workers.load_counting_metadata_gets, step, work, env=_env())
    assert [o["metadata_gets"] for o in outs] == [0, 0]
    assert [o["index_header_gets"] for o in outs] == [1, 0]
    assert [o["index_parts"] for o in outs] == [["rank0.json"], ["rank1.json"]]
    for out in outs:
        _assert_bitexact(out["tensors"])


def test_other_ranks_build_their_store_client_while_rank_0_reads_the_marker(s3_bucket, tmp_path):
    """Building boto3's client costs ~0.15-0.3 CPU-s: ranks other than 0 do it while
    they wait for rank 0's marker broadcast, not inside the load."""
    step = s3_bucket + "/run/step7"
    work = str(tmp_path / "work")
    run_ranks(2, workers.save_sharded, step, work, env=_env())
    outs = run_ranks(2, workers.load_waiting_for_connect, step, work, env=_env())
    assert "before_marker" not in outs[0], "rank 0 reads the marker itself: nothing to overlap"
    assert outs[1]["before_marker"] is True, "rank 1's client was not built before the marker arrived"
    assert outs[1]["thread"] == "cloudckpt-connect"
    for out in outs:
        _assert_bitexact(out["tensors"])


@pytest.mark.slow  # 4, then 2, then 1 spawned ranks: about 20 s
def test_resharding_4_to_2_to_1_with_streaming_and_pre_download(s3_bucket, tmp_path, caplog):
    step = s3_bucket + "/run/step7"
    work = str(tmp_path / "work")
    run_ranks(4, workers.save_sharded, step, work, env=_env())
    two = run_ranks(2, workers.load_sharded, step, work, False, env=_env())
    one = run_ranks(1, workers.load_sharded, step, work, True, env=_env())
    for out in two + one:
        _assert_bitexact(out["tensors"])
        assert out["direct_items"] > 0, "row blocks of Shard(0) tensors are copied straight from the fetched bytes"
        # world size changed: every rank falls back to rank 0's train state
        assert out["train_state"] == {"rank": 0, "step": 7, "lr": 0.1}


def test_failure_on_one_rank_mid_upload_leaves_no_marker_and_every_rank_raises(s3_bucket, tmp_path):
    step = s3_bucket + "/run/step3"
    work = str(tmp_path / "work")
    outs = run_ranks(2, workers.save_with_failing_rank, step, work, 1, env=_env())
    for out in outs:
        assert out["error"] == "SaveFailed"
        assert "rank 1" in out["message"] and "injected failure" in out["message"]
        assert "rank 0:" not in out["message"]
    assert os.listdir(work) == [], "temp work dirs are removed on the failure path too"
    store = open_store(step)
    assert not store.exists(layout.marker_url(step))
    assert list(store.walk(urls.as_prefix(step))) == [], "objects of the failed attempt are removed"
    assert not discovery.contains_checkpoint(s3_bucket + "/run")


def test_two_jobs_saving_the_same_step_concurrently_exactly_one_commits(s3_bucket, tmp_path):
    step = s3_bucket + "/run/step9"
    results: dict = {}

    def job(i):
        results[i] = run_ranks(1, workers.save_plain, step, str(tmp_path / f"work{i}"), i, env=_env())[0]

    threads = [threading.Thread(target=job, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [results[1], results[2]]
    assert errors.count(None) == 1, errors
    loser = next(e for e in errors if e is not None)
    assert loser.startswith(("SaveInProgress", "CheckpointExists")), loser
    winner = 1 if results[1] is None else 2
    sd = {"model": {"x": torch.zeros(1024, 256)}}
    assert Checkpointer().load(step, sd) == {"who": winner}
    assert torch.equal(sd["model"]["x"], torch.full((1024, 256), float(winner)))


# ------------------------------------------------------------------ single-process behaviour
def _plain_state(v: float = 1.0) -> dict:
    return {"model": {"w": torch.arange(4096, dtype=torch.float32) * v, "b": torch.ones(3)},
            "optim": {"m": torch.full((10,), float(v))}, "epoch": 2}


def test_step_folder_without_marker_is_invisible_to_discovery(any_root, tmp_path):
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    ck.save(urls.join(any_root, "step3"), _plain_state(), {"s": 3})
    ck.save(urls.join(any_root, "step4"), _plain_state(), {"s": 4}, ephemeral=True)
    open_store(any_root).put_bytes(urls.join(any_root, "step5", "model_and_optim", "__0_0.distcp"), b"partial")
    open_store(any_root).put_bytes(urls.join(any_root, "notastep", layout.MARKER), b"{}")
    assert discovery.latest_checkpoint(any_root) == urls.join(any_root, "step4")
    assert [s for s, _ in discovery.find_checkpoints(any_root)] == [3, 4]
    assert [s for s, _ in discovery.find_checkpoints(any_root, ephemeral=False)] == [3]
    assert [s for s, _ in discovery.find_checkpoints(any_root, ephemeral=True)] == [4]
    assert not discovery.dir_is_checkpoint(urls.join(any_root, "step5"))
    assert discovery.dir_is_checkpoint(urls.join(any_root, "step3"))
    with pytest.raises(NotACheckpoint):
        ck.load(urls.join(any_root, "step5"), _plain_state(0))


def test_overwrite_refused_unless_save_overwrite_then_replaced(any_root, tmp_path):
    step = urls.join(any_root, "step1")
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, _plain_state(1.0), {"v": 1})
    with pytest.raises(CheckpointExists) as ei:
        Checkpointer(work_dir=str(tmp_path / "w")).save(step, _plain_state(2.0), {"v": 2})
    assert isinstance(ei.value, FileExistsError) and step in str(ei.value)
    sd = _plain_state(0)
    assert Checkpointer().load(step, sd) == {"v": 1}, "the committed step is untouched"
    Checkpointer(work_dir=str(tmp_path / "w"), save_overwrite=True).save(step, _plain_state(2.0), {"v": 2})
    assert Checkpointer().load(step, sd) == {"v": 2}
    assert torch.equal(sd["model"]["w"], torch.arange(4096, dtype=torch.float32) * 2.0)


def test_a_replaced_step_is_swapped_in_one_request_and_reads_everywhere(any_root, tmp_path):
    """save_overwrite of a committed step on a store that replaces conditionally: the new
    objects go under .replace/{save id}, the marker (format 4) replaces the old one in one
    request, then the old objects go; every reader finds the new step (load, verify,
    inspect, download + stock DCP), and replacing it again leaves one root."""
    import torch.distributed.checkpoint as dcp

    from cloudckpt.ops import download, inspect_step, verify_step

    step = urls.join(any_root, "step1")
    store = open_store(step)
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(step, _plain_state(1.0), {"v": 1})
    roots = []
    for v in (2.0, 3.0):
        with Checkpointer(work_dir=str(tmp_path / "w"), save_overwrite=True) as ck:
            ck.save(step, _plain_state(v), {"v": v})
        raw = json.loads(store.get_bytes(urls.join(step, layout.MARKER)))
        assert raw["format_version"] == 4 and raw["root"].startswith(".replace/"), raw.get("root")
        roots.append(raw["root"])
        rels = {urls.relative(o.url, step) for o in store.walk(urls.as_prefix(step))}
        assert rels - {layout.MARKER} and all(r.startswith(raw["root"] + "/") for r in rels - {layout.MARKER}), \
            f"only the marker and the new step's objects are left: {sorted(rels)}"
        sd = _plain_state(0)
        assert Checkpointer().load(step, sd) == {"v": v}
        assert torch.equal(sd["model"]["w"], torch.arange(4096, dtype=torch.float32) * v)
        assert verify_step(step).ok and inspect_step(step).tensors
    assert roots[0] != roots[1]
    local = str(tmp_path / "copy" / "step1")
    download(step, local)
    got = {"model": {"w": torch.zeros(4096), "b": torch.zeros(3)}, "optim": {"m": torch.zeros(10)}}
    dcp.load(got, storage_reader=dcp.FileSystemReader(os.path.join(local, layout.MODEL_DIR)), no_dist=True)
    assert torch.equal(got["model"]["w"], torch.arange(4096, dtype=torch.float32) * 3.0), "stock DCP reads the copy"
    assert json.loads(open(os.path.join(local, layout.MARKER), "rb").read())["format_version"] == 3
    assert Checkpointer().load(local, _plain_state(0)) == {"v": 3.0}, "the copy is a step of its own"


def test_a_marker_root_outside_replace_is_refused(tmp_path):
    """A format 4 marker's root names where every object is read from: only
    ``.replace/{32 hex digits}`` is accepted (a crafted ``../``, absolute or other name
    is a typed refusal naming the marker)."""
    step = str(tmp_path / "run" / "step1")
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, _plain_state(1.0), None)
    path = os.path.join(step, layout.MARKER)
    honest = json.loads(open(path, "rb").read())
    for root in ("../../outside", "/etc", ".replace/../../x", ".replace/" + "0" * 31, "", 7, None):
        doc = dict(honest, format_version=4, root=root)
        with open(path, "w") as f:
            json.dump(doc, f)
        with pytest.raises(CorruptCheckpoint, match="root"):
            discovery.read_header(step)


def test_missing_keys_are_listed_and_strict_false_loads_what_exists(tmp_path):
    step = str(tmp_path / "c" / "step1")
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, _plain_state(), None)
    sd = {"model": {"w": torch.zeros(4096), "nope": torch.zeros(2)}, "extra": torch.zeros(1)}
    with pytest.raises(MissingKeys) as ei:
        Checkpointer().load(step, sd)
    assert "model.nope" in str(ei.value) and "extra" in str(ei.value)
    ck = Checkpointer()
    ck.load(step, sd, strict=False, allow_partial=True)  # the target also lacks model.b and optim.m
    assert torch.equal(sd["model"]["w"], torch.arange(4096, dtype=torch.float32))
    assert ck.last_load_info.not_loaded == ["epoch", "model.b", "optim.m"]


def test_load_optim_state_false_skips_optimizer_and_none_tolerates_its_absence(tmp_path):
    step = str(tmp_path / "c" / "step1")
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, {"model": {"w": torch.ones(5)}}, {"t": 1})
    sd = {"model": {"w": torch.zeros(5)}, "optim": {"m": torch.zeros(2)}}
    assert Checkpointer().load(step, sd) == {"t": 1}  # optim absent, load_optim_state=None: fine
    assert torch.equal(sd["model"]["w"], torch.ones(5))
    with pytest.raises(MissingKeys):
        Checkpointer().load(step, sd, load_optim_state=True)
    assert Checkpointer().load(step, sd, load_optim_state=False, load_trainer_state=False) is None


@pytest.mark.parametrize("pre_download", [False, True], ids=["streaming", "pre_download"])
def test_checksum_mismatch_names_the_object_and_can_be_turned_off(any_root, tmp_path, pre_download):
    step = urls.join(any_root, "step1")
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, _plain_state(), {"t": 1})
    m = discovery.read_marker(step)
    shard = next(o for o in m.objects if o.path.endswith(".distcp"))
    url = urls.join(step, shard.path)
    store = open_store(url)
    data = bytearray(store.get_bytes(url))
    big = max(shard.chunks, key=lambda c: c[1])  # model.w's item: 16 KiB of raw floats in its middle
    off = big[0] + big[1] // 2  # inside the tensor's raw bytes (an item's last bytes are its zip directory)
    data[off] ^= 0xFF
    store.put_bytes(url, bytes(data))
    with pytest.raises(CorruptCheckpoint) as ei:
        Checkpointer(work_dir=str(tmp_path / "w"), pre_download=pre_download).load(step, _plain_state(0))
    assert url in str(ei.value) and "CRC32C" in str(ei.value)
    # flipped payload byte loads unchecked
    Checkpointer(work_dir=str(tmp_path / "w"), verify_checksums=False,
                 pre_download=pre_download).load(step, _plain_state(0))


@pytest.mark.parametrize("pre_download", [False, True], ids=["streaming", "pre_download"])
def test_truncated_distcp_is_reported_as_corrupt_naming_the_object(s3_bucket, tmp_path, pre_download):
    step = s3_bucket + "/run/step1"
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, _plain_state(), {"t": 1})
    shard = next(o for o in discovery.read_marker(step).objects if o.path.endswith(".distcp"))
    url = urls.join(step, shard.path)
    store = open_store(url)
    store.put_bytes(url, store.get_bytes(url)[: shard.size // 2])
    with pytest.raises(CorruptCheckpoint) as ei:
        Checkpointer(work_dir=str(tmp_path / "w"), pre_download=pre_download).load(step, _plain_state(0))
    assert url in str(ei.value) and "truncated" in str(ei.value)
    if pre_download:  # the downloaded copy is removed on failure too
        assert not [p for p in (tmp_path / "w").rglob("*.distcp")]


def test_missing_train_state_file_is_a_typed_error(gcs_bucket, tmp_path):
    step = gcs_bucket + "/run/step1"
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, _plain_state(), {"t": 1})
    open_store(step).delete(urls.join(step, "train/rank0.pt"))
    with pytest.raises(CorruptCheckpoint) as ei:
        Checkpointer().load(step, _plain_state(0))
    assert "train/rank0.pt" in str(ei.value)


def test_corrupt_and_future_version_markers_are_skipped_by_listing_loud_at_latest_and_refused_by_load(
        any_root, tmp_path, caplog):
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    for s in (1, 2, 3):
        ck.save(urls.join(any_root, f"step{s}"), _plain_state(), {"s": s})
    store = open_store(any_root)
    store.put_bytes(layout.marker_url(urls.join(any_root, "step3")), b"{not json")  # not cloudckpt's: junk
    m2 = json.loads(store.get_bytes(layout.marker_url(urls.join(any_root, "step2"))))
    m2["format_version"] = 99
    store.put_bytes(layout.marker_url(urls.join(any_root, "step2")), json.dumps(m2, separators=(",", ":")).encode())
    with caplog.at_level(logging.WARNING):
        assert [s for s, _ in discovery.find_checkpoints(any_root)] == [1]
    assert "not valid JSON" in caplog.text and "format_version 99" in caplog.text
    # a committed step of ours the reader refuses is never passed over silently for an older one
    with pytest.raises(IncompatibleCheckpoint, match="load_step") as ei:
        discovery.latest_checkpoint(any_root)
    assert urls.join(any_root, "step2") in str(ei.value) and "upgrade cloudckpt" in str(ei.value)
    with pytest.raises(CorruptCheckpoint):
        ck.load(urls.join(any_root, "step3"), _plain_state(0))
    with pytest.raises(IncompatibleCheckpoint) as ei:
        ck.load(urls.join(any_root, "step2"), _plain_state(0))
    assert "upgrade cloudckpt" in str(ei.value)
    store.delete(layout.marker_url(urls.join(any_root, "step2")))  # removed: the older step is the newest again
    with caplog.at_level(logging.WARNING):
        assert discovery.latest_checkpoint(any_root) == urls.join(any_root, "step1")


def test_not_a_step_folder_and_missing_bucket_are_typed_errors(s3_bucket, tmp_path):
    ck = Checkpointer(work_dir=str(tmp_path / "w"))
    with pytest.raises(NotACheckpoint) as ei:
        ck.save(s3_bucket + "/run/checkpoint-7", _plain_state(), None)
    assert "step{N}" in str(ei.value)
    with pytest.raises(BucketNotFound) as ei:
        ck.save("s3://no-such-bucket-cloudckpt/run/step1", _plain_state(), None)
    assert "no-such-bucket-cloudckpt" in str(ei.value)
    assert not (tmp_path / "w").exists() or os.listdir(tmp_path / "w") == [], "no temp dir left behind"


def test_stock_dcp_reads_a_downloaded_checkpoint_and_converts_it(s3_bucket, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = s3_bucket + "/run/step1"
    state = _plain_state(3.0)
    Checkpointer(work_dir=str(tmp_path / "w")).save(step, state, {"t": 1})
    local = tmp_path / "dl"
    store = open_store(step)
    prefix = urls.as_prefix(urls.join(step, layout.MODEL_DIR))
    for o in store.walk(prefix):
        store.download_file(o.url, str(local / o.url[len(prefix):]))
    sd = _plain_state(0)
    dcp_load(sd, storage_reader=FileSystemReader(str(local)))
    assert torch.equal(sd["model"]["w"], state["model"]["w"]) and torch.equal(sd["optim"]["m"], state["optim"]["m"])
    dcp_to_torch_save(str(local), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert torch.equal(full["model"]["w"], state["model"]["w"]) and full["epoch"] == 2


class _Evil:
    """Unpickling this would create a file (stands for arbitrary code)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _manifest_matches_files(step) -> None:
    """Rewrite the marker's manifest from the files now in the (local) step folder."""
    import json

    from cloudckpt.checkpoint.parts import as_part_list
    from cloudckpt.transfer import crc32c_bytes

    def rewrite(objects: list) -> None:
        for o in objects:
            data = (step / o["path"]).read_bytes()
            o.update(size=len(data), crc32c=crc32c_bytes(data), chunks=[])

    marker = step / ".metadata.json"
    d = as_part_list(json.loads(marker.read_bytes()))  # format 3's part columns, edited as format 2's list
    rewrite(d["objects"])
    for ref in d.get("parts", []):  # format 2: the ranks' files are listed in their parts
        part = json.loads((step / ref["path"]).read_bytes())
        rewrite(part["objects"])
        body = json.dumps(part).encode()
        (step / ref["path"]).write_bytes(body)
        ref.update(size=len(body), crc32c=crc32c_bytes(body), bytes=sum(o["size"] for o in part["objects"]))
    marker.write_text(json.dumps(d))


def test_dcp_values_that_would_run_code_on_load_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    step = tmp_path / "run" / "step1"
    Checkpointer(work_dir=str(tmp_path / "w")).save(str(step), {"model": {"w": torch.ones(2)}, "extra": 1}, None)
    # rewrite the DCP part with a value whose pickle runs code, keeping a valid marker around it
    pwned = tmp_path / "pwned"
    dcp.save({"model": {"w": torch.ones(2)}, "extra": _Evil(str(pwned))}, checkpoint_id=str(step / "model_and_optim"))
    _manifest_matches_files(step)  # sizes and CRC32Cs consistent: only the unpickling decides
    with pytest.raises(CorruptCheckpoint) as ei:
        Checkpointer(verify_checksums=False).load(str(step), {"model": {"w": torch.zeros(2)}, "extra": 0})
    assert "extra" in str(ei.value) and "weights_only" in str(ei.value)
    assert not pwned.exists(), "the pickle's code must not have run"
