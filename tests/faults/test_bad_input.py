"""Bad input, table-driven: each case is a typed error with an actionable message, and
the committed step that was there before still loads bit-exactly afterwards.

docs/reliability.md lists the same table (test ids are the case names; a test checks
that the two agree). Every case gets its own buckets and run folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest
import torch

from cloudckpt import CheckpointConfig, Checkpointer
from cloudckpt.checkpoint import discovery, layout
from cloudckpt.errors import (
    AccessDenied,
    BucketNotFound,
    CheckpointExists,
    ConfigError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    InvalidURL,
    MissingKeys,
    NotACheckpoint,
    SaveFailed,
    SaveInProgress,
    StorageError,
    UnsafeDelete,
)
from cloudckpt.storage import StorageOptions, clear_cache, open_store
from cloudckpt.storage import url as urls
from cloudckpt.transfer import TransferConfig

from . import checks
from .conftest import FAKE_SECRETS

WRONG_KEY, WRONG_SECRET, MISSING_ADC = FAKE_SECRETS


@dataclass
class Ctx:
    bucket: str  # s3://...
    gcs: str  # gs://...
    run: str  # s3://bucket/run: has a committed step1
    step: str  # s3://bucket/run/step1
    local_run: str  # a local run folder with a committed step1
    tmp: str
    seaweed: object

    def ck(self, **kw) -> Checkpointer:
        return Checkpointer(work_dir=os.path.join(self.tmp, "work"), **kw)

    def save(self, dir: str, **kw) -> None:
        ck = self.ck(**kw)
        try:
            ck.save(dir, checks.step_state(2, 0), {"step": 2, "rank": 0})
        finally:
            ck.close()


@contextlib.contextmanager
def _env(**kv):
    """Change the storage env for one call (a fresh store is built with it)."""
    with mock.patch.dict(os.environ):
        for k, v in kv.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        clear_cache()
        try:
            yield
        finally:
            clear_cache()


def _rewrite(url: str, fn: Callable[[bytes], bytes]) -> None:
    store = open_store(url)
    store.put_bytes(url, fn(store.get_bytes(url)))


def _marker_json(c: Ctx, **changes) -> None:
    def edit(b: bytes) -> bytes:
        d = json.loads(b)
        d.update(changes)
        return json.dumps(d).encode()

    _rewrite(layout.marker_url(c.step), edit)


def _load(dir: str, **kw):
    return Checkpointer().load(dir, checks.zero_state(1), **kw)


@contextlib.contextmanager
def small_disk(path: str, size: str = "1m"):
    """A size-limited folder: tmpfs, else a loop-mounted ext4 image; skip with the reason if neither mounts."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        img = path + ".img"
        r2 = subprocess.run(f"truncate -s 2M {img} && mkfs.ext4 -q {img} && mount -o loop {img} {path}", shell=True,
                            capture_output=True, text=True)
        if r2.returncode != 0:
            pytest.skip(f"cannot mount a size-limited folder: tmpfs: {r.stderr.strip()}; "
                        f"loop ext4: {r2.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def _full_disk(c: Ctx) -> None:
    with small_disk(os.path.join(c.tmp, "small")) as work:
        ck = Checkpointer(work_dir=work)
        try:
            big = {"model": {"w": torch.randn(1024 * 1024)}}  # 4 MiB into a 1 MiB work dir
            ck.save(urls.join(c.run, "step3"), big, {"step": 3})
        finally:
            ck.close()
            left = os.listdir(work)
        assert left == [], f"the work dir is cleaned on the failure path: {left}"


def _full_disk_pre_download(c: Ctx) -> None:
    """A load with pre_download=True into a work dir too small for the shard: typed, names
    the way out, leaves the work dir empty (the committed step is untouched)."""
    step = urls.join(c.run, "step4")
    ck = c.ck()
    ck.save(step, {"model": {"w": torch.randn(1024 * 1024)}}, {"step": 4})  # a 4 MiB shard
    ck.close()
    with small_disk(os.path.join(c.tmp, "small-load")) as work:
        try:
            Checkpointer(work_dir=work, pre_download=True).load(step, {"model": {"w": torch.zeros(1024 * 1024)}})
        finally:
            left = os.listdir(work)
            assert left == [], f"the work dir is cleaned on the failure path: {left}"


def _plant_fresh_lock(c: Ctx) -> None:
    step = urls.join(c.run, "step5")
    open_store(step).put_bytes(urls.join(step, layout.LOCK),
                               json.dumps({"save_id": "other", "created_unix": __import__("time").time()}).encode())
    c.save(step)


CASES: dict[str, tuple[Callable[[Ctx], object], type, str]] = {
    # ---- URLs and schemes
    "malformed_url_single_slash": (lambda c: c.save("s3:/bucket/run/step2"), InvalidURL, "scheme://bucket/prefix"),
    "unknown_scheme": (lambda c: c.save("ftp://bucket/run/step2"), InvalidURL, "s3:// and gs://"),
    "url_without_bucket": (lambda c: c.save("s3:///run/step2"), InvalidURL, "has no bucket"),
    "invalid_bucket_name": (lambda c: c.save("s3://Bad_Bucket!/run/step2"), InvalidURL, "bucket names are"),
    "empty_path_segment": (lambda c: c.save(c.bucket + "/run//step2"), InvalidURL, "remove it"),
    "empty_url": (lambda c: c.save(""), NotACheckpoint, "step{N}"),
    "not_a_step_folder_name": (lambda c: c.save(c.run + "/checkpoint-2"), NotACheckpoint, "step{N}"),
    "config_unknown_scheme": (lambda c: CheckpointConfig(save_folder="hdfs://namenode/run"), ConfigError,
                              "unknown scheme"),
    # ---- buckets and credentials
    "missing_bucket_s3": (lambda c: c.save("s3://no-such-bucket-cloudckpt/run/step2"), BucketNotFound,
                          "create it or fix the URL"),
    "missing_bucket_gcs": (lambda c: c.save("gs://no-such-bucket-cloudckpt/run/step2"), BucketNotFound,
                           "create it or fix the URL"),
    "missing_bucket_discovery": (lambda c: Checkpointer.latest_checkpoint("s3://no-such-bucket-cloudckpt/run"),
                                 BucketNotFound, "no-such-bucket-cloudckpt"),
    "wrong_secret_key": (lambda c: _with_keys(c, c.seaweed.access_key, WRONG_SECRET), AccessDenied,
                         "check the credentials"),
    "unknown_access_key": (lambda c: _with_keys(c, WRONG_KEY, WRONG_SECRET), AccessDenied, "check the credentials"),
    "missing_credentials": (lambda c: _with_keys(c, None, None), AccessDenied, "AWS_ACCESS_KEY_ID"),
    "read_only_credentials_save": (lambda c: _with_keys(c, c.seaweed.ro_access_key, c.seaweed.ro_secret_key),
                                   AccessDenied, "may use this bucket"),
    "gcs_missing_adc": (lambda c: _no_adc(c), AccessDenied, "application-default login"),
    # ---- where checkpoints go
    "bucket_root_as_save_folder": (lambda c: CheckpointConfig(save_folder=c.bucket), ConfigError, "bucket root"),
    "save_folder_inside_a_checkpoint": (lambda c: CheckpointConfig(save_folder=c.step + "/nested"), ConfigError,
                                        "inside a checkpoint step folder"),
    "prune_the_bucket_root": (lambda c: open_store(c.bucket).delete_prefix(c.bucket), UnsafeDelete, "force=True"),
    "overwrite_committed_step": (lambda c: c.save(c.step), CheckpointExists, "save_overwrite=True"),
    "step_locked_by_a_live_save": (_plant_fresh_lock, SaveInProgress, "delete"),
    # ---- damaged checkpoints (the damage is to a copy: step7, not the committed step1)
    "marker_not_json": (lambda c: _damaged(c, lambda s: _rewrite(layout.marker_url(s), lambda b: b"{not json")),
                        CorruptCheckpoint, "not valid JSON"),
    "marker_wrong_shape": (lambda c: _damaged(c, lambda s: _rewrite(layout.marker_url(s), lambda b: b"[1, 2]")),
                           CorruptCheckpoint, "not a cloudckpt marker"),
    "marker_future_version": (lambda c: _damaged(c, lambda s: _rewrite(layout.marker_url(s), _future)),
                              IncompatibleCheckpoint, "upgrade cloudckpt"),
    "marker_missing_field": (lambda c: _damaged(c, lambda s: _rewrite(layout.marker_url(s), _no_objects)),
                             CorruptCheckpoint, "bad field"),
    "truncated_distcp": (lambda c: _damaged(c, lambda s: _rewrite(_shard(s), lambda b: b[: len(b) // 3])),
                         CorruptCheckpoint, "truncated"),
    "missing_distcp": (lambda c: _damaged(c, lambda s: open_store(s).delete(_shard(s))), CorruptCheckpoint,
                       "listed in the"),
    "missing_distcp_pre_download": (lambda c: _damaged(c, lambda s: open_store(s).delete(_shard(s)), pre_download=True),
                                    CorruptCheckpoint, "listed in the"),
    "missing_train_state": (lambda c: _damaged(c, lambda s: open_store(s).delete(urls.join(s, "train/rank0.pt"))),
                            CorruptCheckpoint, "train/rank0.pt"),
    "load_a_folder_without_marker": (lambda c: _load(c.run + "/step9"), NotACheckpoint, "cloudckpt list"),
    "load_the_run_folder": (lambda c: _load(c.run), NotACheckpoint, "cloudckpt list"),
    "load_keys_not_in_checkpoint": (lambda c: Checkpointer().load(c.step, {"model": {"nope": torch.zeros(2)}}),
                                    MissingKeys, "strict=False"),
    # ---- configuration
    "config_interval_not_an_int": (lambda c: CheckpointConfig(save_folder=c.run, save_interval="ten"), ConfigError,
                                   "save_interval"),
    "config_bool_not_a_bool": (lambda c: CheckpointConfig(save_folder=c.run, async_save="maybe"), ConfigError,
                               "async_save"),
    "config_bad_size": (lambda c: CheckpointConfig(save_folder=c.run, part_size="12XB"), ConfigError, "part_size"),
    "config_unknown_field": (lambda c: CheckpointConfig.from_dict({"save_folder": c.run, "save_intervall": 10}),
                             ConfigError, "unknown checkpoint config field"),
    "config_not_a_mapping": (lambda c: CheckpointConfig.from_dict(["save_folder"]), ConfigError, "mapping"),
    "config_env_override_bad": (lambda c: CheckpointConfig.from_dict({"save_folder": c.run},
                                                                     env={"CLOUDCKPT_MAX_CONCURRENCY": "lots"}),
                                ConfigError, "max_concurrency"),
    "negative_save_interval": (lambda c: CheckpointConfig(save_folder=c.run, save_interval=-5), ConfigError,
                               "positive integer"),
    "zero_ephemeral_interval": (lambda c: CheckpointConfig(save_folder=c.run, ephemeral_save_interval=0), ConfigError,
                                "positive integer"),
    "negative_stall_timeout": (lambda c: CheckpointConfig(save_folder=c.run, stall_timeout=-1), ConfigError,
                               "stall_timeout"),
    "retention_deletes_newest_persistent": (lambda c: CheckpointConfig(save_folder=c.run, max_checkpoints=0),
                                            ConfigError, "max_checkpoints"),
    "retention_deletes_newest_ephemeral": (lambda c: CheckpointConfig(save_folder=c.run, keep_last_ephemeral=0),
                                           ConfigError, "newest"),
    "storage_part_size_too_small": (lambda c: StorageOptions(part_size=1024 * 1024), ConfigError, "5 MiB"),
    "storage_addressing_style": (lambda c: StorageOptions(addressing_style="sideways"), ConfigError, "'path'"),
    "transfer_zero_concurrency": (lambda c: TransferConfig(max_concurrency=0), ConfigError, "max_concurrency"),
    # ---- the machine
    "full_disk_in_work_dir": (_full_disk, SaveFailed, "No space left"),
    "full_disk_in_pre_download_work_dir": (lambda c: _full_disk_pre_download(c), StorageError, "pre_download=False"),
}


def _with_keys(c: Ctx, key, secret) -> None:
    with _env(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret):
        c.save(urls.join(c.run, "step2"))


def _no_adc(c: Ctx) -> None:
    with _env(STORAGE_EMULATOR_HOST=None, NO_GCE_CHECK="True", GCE_METADATA_HOST="127.0.0.1:9",
              GOOGLE_APPLICATION_CREDENTIALS=MISSING_ADC):
        c.save(urls.join(c.gcs, "run/step2"))


def _future(b: bytes) -> bytes:
    d = json.loads(b)
    d["format_version"] = 99
    return json.dumps(d).encode()


def _no_objects(b: bytes) -> bytes:
    d = json.loads(b)
    del d["objects"]
    return json.dumps(d).encode()


def _shard(step: str) -> str:
    m = discovery.read_marker(step)
    return urls.join(step, next(o.path for o in m.objects if o.path.endswith(".distcp")))


def _damaged(c: Ctx, damage: Callable[[str], None], **load_kw):
    """Commit another step (the committed step1 is never touched), damage it, and load it."""
    step = urls.join(c.run, "step7")
    ck = c.ck()
    ck.save(step, checks.step_state(7, 0), {"step": 7, "rank": 0})
    ck.close()
    damage(step)
    return Checkpointer(work_dir=os.path.join(c.tmp, "load")).load(step, checks.zero_state(1), **load_kw)


@pytest.fixture
def ctx(s3_bucket, gcs_bucket, seaweed, tmp_path):
    """This case's own S3 bucket, GCS bucket and local run, each run with a committed step1
    (the env points at SeaweedFS and fake-gcs-server; the fixtures restore it afterwards)."""
    c = Ctx(bucket=s3_bucket, gcs=gcs_bucket, run=s3_bucket + "/run", step=s3_bucket + "/run/step1",
            local_run=str(tmp_path / "local" / "run"), tmp=str(tmp_path), seaweed=seaweed)
    for run in (c.run, c.local_run):
        ck = c.ck()
        ck.save(urls.join(run, "step1"), checks.step_state(1, 0), {"step": 1, "rank": 0})
        ck.close()
    yield c
    clear_cache()


def _assert_committed_step_intact(c: Ctx) -> None:
    clear_cache()
    for run in (c.run, c.local_run):
        step = urls.join(run, "step1")
        assert checks.verify_step(step) == [], f"{step} was damaged by the bad call"
        sd = checks.zero_state(1)
        assert Checkpointer().load(step, sd) == {"step": 1, "rank": 0}
        assert checks.bitexact(sd, 1, 1)
        assert 1 in checks.committed_steps(run)


# torch's FileSystemWriter thread that hits ENOSPC dies with an unhandled exception (the save itself raises
# SaveFailed all the same): that thread's warning is expected for the full-disk case only
_PARAMS = [pytest.param(c, marks=pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"))
           if c == "full_disk_in_work_dir" else c for c in CASES]


@pytest.mark.parametrize("case", _PARAMS)
def test_bad_input_is_a_typed_actionable_error_and_loses_nothing_committed(case, ctx, secret_scan):
    action, expected, hint = CASES[case]
    with pytest.raises(expected) as ei:
        action(ctx)
    msg = str(ei.value)
    secret_scan.add(msg, repr(ei.value))
    assert hint in msg, f"{case}: the message should say {hint!r}: {msg}"
    assert len(msg) > 30, f"{case}: the message is too short to act on: {msg!r}"
    _assert_committed_step_intact(ctx)


DOCS = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def _documented_cases() -> dict[str, str]:
    """{case: error type} from the "Bad input" table of docs/reliability.md: a row names one
    or more cases in backticks (what is in parentheses is an example, not a case)."""
    section = DOCS.read_text().split("## Bad input", 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        (error,) = re.findall(r"`(\w+)`", cells[1])
        for case in re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", cells[0])):
            assert case not in out, f"{case} has two rows in {DOCS.name}"
            out[case] = error
    return out


def test_every_case_is_a_documented_row_with_the_same_error_and_every_row_is_a_case():
    documented = _documented_cases()
    assert sorted(set(CASES) - set(documented)) == [], f"cases missing from the table in {DOCS}"
    assert sorted(set(documented) - set(CASES)) == [], f"rows of the table in {DOCS} with no case here"
    wrong = {c: (documented[c], CASES[c][1].__name__) for c in CASES if documented[c] != CASES[c][1].__name__}
    assert wrong == {}, f"documented error != the error the case expects: {wrong}"
