"""Throttle storms and stuck transfers through the fault proxy, multi-rank, S3 and GCS."""

from __future__ import annotations

import pytest

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery, layout
from cloudckpt.storage import StorageOptions, open_store
from cloudckpt.storage import url as urls
from cloudckpt.testing.faultproxy import Rule
from cloudckpt.testing.multiprocess import run_ranks
from cloudckpt.transfer import TransferConfig

from . import checks, workers

# Small parts so one save is many requests (more chances for faults); quick SDK backoff
# is not configurable in botocore standard mode, so keep the request count moderate.
STORAGE = {"multipart_threshold": 5 * 1024 * 1024, "part_size": 5 * 1024 * 1024}
TRANSFER = {"backoff_base": 0.05, "backoff_max": 0.5}


@pytest.mark.slow  # 2 ranks through a storm of faults: 12-16 s per backend
def test_throttle_storm_10pct_503_and_2pct_resets_save_commits_and_loads_bitexact(proxy, tmp_path, secret_scan):
    """10% of requests answered 503 SlowDown (S3) / 503 (GCS), 1% reset before reaching
    the store and 1% reset after it (answer lost), during two saves and their loads."""
    # which requests draw a fault depends on how many requests there are (retries, threads), so one reset of
    # each kind, and one throttle on the first request for a shard file (its upload, which the save stats
    # count), are forced on top of the rates: every run sees all three
    proxy.add(Rule("reset", nth=5), Rule("reset", nth=9, when="response"), Rule("slowdown", key=r"\.distcp", times=1),
              Rule("slowdown", rate=0.10), Rule("reset", rate=0.01), Rule("reset", rate=0.01, when="response"))
    folder = proxy.bucket + "/run"
    outs = run_ranks(2, workers.save_and_load, folder, str(tmp_path / "work"), [1, 2], STORAGE, TRANSFER,
                     env=checks.rank_env())
    secret_scan.add(*(o["logs"] for o in outs))
    injected = proxy.injected()
    assert injected["slowdown"] >= 2 and injected["reset"] >= 2, f"the storm must actually happen: {injected}"
    for o in outs:
        assert all(o["exact"]), "every load is bit-exact"
    # retries and throttle back-off are reported in the save stats (summed over ranks and saves)
    stats = [s for o in outs for s in o["stats"]]
    assert sum(s["sdk_retries"] for s in stats) + sum(s["retries"] for s in stats) >= 1
    assert max(s["throttled"] for s in stats) >= 1, stats
    assert checks.committed_steps(folder) == [1, 2]
    for s in (1, 2):
        assert checks.verify_step(checks.step_dir(folder, s)) == []
        assert not open_store(folder).exists(urls.join(checks.step_dir(folder, s), layout.LOCK))


def test_truncated_and_stalled_downloads_are_retried_and_the_load_is_bitexact(proxy, tmp_path, secret_scan):
    folder = proxy.bucket + "/run"
    Checkpointer(work_dir=str(tmp_path / "w0")).save(checks.step_dir(folder, 1), checks.step_state(1, 0),
                                                     {"step": 1, "rank": 0})
    proxy.add(Rule("truncate", method="GET", key=r"\.distcp", after_bytes=1000, times=2),
              Rule("stall", method="GET", key=r"\.distcp", after_bytes=100, times=1, hold=3))
    # SDK retries off (max_attempts=1): the engine's own retries must cover truncation and stalls, and an
    # abandoned attempt's thread ends at once instead of retrying in the background
    ck = Checkpointer(work_dir=str(tmp_path / "w"),
                      storage_options=StorageOptions(read_timeout=5, max_attempts=1, **STORAGE),
                      transfer=TransferConfig(stall_timeout=2, **TRANSFER))
    sd = checks.zero_state(1)
    ts = ck.load(checks.step_dir(folder, 1), sd)
    ck.close()
    assert checks.bitexact(sd, 1, 1) and ts == {"step": 1, "rank": 0}
    assert proxy.injected()["truncate"] == 2 and proxy.injected()["stall"] == 1
    assert ck.engine.stats().retries >= 3 and ck.engine.stats().stalls == 1


STALL_TIMEOUT = 2.0
MARGIN = 2.5  # one watchdog tick (0.5 s), the AGREE exchange and rank 0's clean-up, on a busy 2-core CI machine


@pytest.mark.slow  # 2 ranks, a stalled upload, then a second save: 9-10 s per backend
def test_stalled_upload_fails_the_save_on_every_rank_within_the_stall_timeout_and_the_next_save_commits(
        proxy, tmp_path, secret_scan):
    """Rank 1's shard upload stops being read after 4 KiB: every rank raises SaveFailed
    within stall_timeout + margin, no marker is written, the training loop goes on and
    the next save commits."""
    folder = proxy.bucket + "/run"
    proxy.add(Rule("stall", method=("PUT", "POST"), key=r"__1_\d+\.distcp", times=1, after_bytes=4096, hold=4))
    storage = {"read_timeout": 4, "connect_timeout": 4}
    transfer = {"stall_timeout": STALL_TIMEOUT, "max_attempts": 1}
    outs = run_ranks(2, workers.stalled_save_then_recover, folder, str(tmp_path / "work"), storage, transfer,
                     env=checks.rank_env())
    secret_scan.add(*(o["logs"] for o in outs), *(o["error"] or "" for o in outs))
    stalled_at = next(e.t for e in proxy.events if e.fault == "stall")
    for r, o in enumerate(outs):
        assert o["error"] is not None and o["error"].startswith("SaveFailed"), o["error"]
        assert "rank 1" in o["error"] and "stall_timeout" in o["error"], o["error"]
        took = o["failed_at"] - stalled_at
        print(f"stalled upload ({proxy.flavor}): rank {r} raised {took:.2f}s after the stall began")
        assert 0 < took < STALL_TIMEOUT + MARGIN, f"rank {r} raised {took:.1f}s after the upload stalled"
        assert o["exact"], "the next save committed and loads bit-exactly"
    assert not discovery.dir_is_checkpoint(checks.step_dir(folder, 1))
    assert not open_store(folder).exists(layout.marker_url(checks.step_dir(folder, 1)))
    assert checks.committed_steps(folder) == [2]
    assert checks.verify_step(checks.step_dir(folder, 2)) == []
