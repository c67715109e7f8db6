"""Job-wide request pacing (cloudckpt/transfer/pacing.py): the token bucket, the
division of the budget by the world size, start jitter, which stores are paced, and
the engine waiting for its slots against SeaweedFS."""

from __future__ import annotations

import random

import pytest

from cloudckpt import CheckpointConfig
from cloudckpt.errors import ConfigError
from cloudckpt.storage import StorageOptions, open_store
from cloudckpt.storage.gcs import GCSStore
from cloudckpt.storage.local import LocalStore
from cloudckpt.storage.s3 import S3Store
from cloudckpt.transfer import TransferConfig, TransferEngine, pacing
from cloudckpt.transfer.pacing import READ, WRITE, RequestPacer, Schedule
from cloudckpt.units import MiB


def pacer(clock, rates=(100.0, 200.0), world_size=1, jitter=0.0, seed=0):
    return RequestPacer(rates, world_size, jitter=jitter, clock=clock, sleep=clock.sleep, rng=random.Random(seed))


# ---------------------------------------------------------------- the token bucket
def test_requests_wait_for_consecutive_slots_of_one_over_the_rate(clock):
    p = pacer(clock, rates=(10.0, 20.0))
    t0 = clock()
    starts = []
    for _ in range(5):
        p.wait(WRITE, 1)
        starts.append(clock() - t0)
    assert starts == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert clock.sleeps == pytest.approx([0.1] * 4)


def test_reads_and_writes_have_their_own_schedules(clock):
    p = pacer(clock, rates=(10.0, 20.0))
    assert p.wait(WRITE, 1) == 0 and p.wait(READ, 1) == 0  # the first of each kind goes at once
    assert p.wait(READ, 1) == pytest.approx(0.05)
    assert p.wait(WRITE, 1) == pytest.approx(0.05)  # 0.1 after the first write, 0.05 already spent


def test_a_transfer_of_n_requests_takes_n_slots_and_a_quiet_spell_gives_no_credit(clock):
    p = pacer(clock, rates=(10.0, 10.0))
    assert p.wait(WRITE, 5) == 0  # a multipart upload: create, 3 parts, complete
    assert p.wait(WRITE, 1) == pytest.approx(0.5)  # the next request waits for the 5 slots
    clock.t += 60  # a minute without requests
    waits = [p.wait(WRITE, 1) for _ in range(3)]
    assert waits == pytest.approx([0.0, 0.1, 0.1]), "no burst after a quiet spell"


def test_waits_under_a_millisecond_are_not_slept_but_the_slot_is_taken(clock):
    p = pacer(clock, rates=(3500.0, 5500.0))  # one rank alone at S3's default rate
    assert [p.wait(WRITE, 1) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert clock.sleeps == []
    assert p.wait(WRITE, 10) == 0.0  # its first slot starts 3/3500 s from now: still not slept
    assert p.wait(WRITE, 1) == pytest.approx(13 / 3500)  # 13 slots taken at the same instant
    assert clock.sleeps == pytest.approx([13 / 3500])


def test_threads_sharing_a_pacer_get_distinct_slots():
    import threading

    s = Schedule(100.0, 0.0, rng=random.Random(0))
    starts = []
    lock = threading.Lock()

    def take():
        for _ in range(50):
            t = s.reserve(1, 0.0)
            with lock:
                starts.append(t)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(starts) == pytest.approx([i / 100 for i in range(200)])


# ---------------------------------------------------------------- division by ranks
@pytest.mark.parametrize("world_size", [1, 8, 1024])
def test_each_rank_gets_the_job_budget_divided_by_the_world_size(clock, world_size):
    p = pacer(clock, rates=(3500.0, 5500.0), world_size=world_size)
    assert p.rank_rate(WRITE) == pytest.approx(3500.0 / world_size)
    assert p.rank_rate(READ) == pytest.approx(5500.0 / world_size)
    # what one rank sends in 10 s of back-to-back requests, and so the job
    t_end = clock() + 10.0
    sent = 0
    while True:
        p.wait(WRITE, 1)
        if clock() >= t_end:
            break
        sent += 1
    assert sent == pytest.approx(3500.0 / world_size * 10, abs=1)
    assert sent * world_size <= 3500 * 10 + world_size


def test_world_size_must_be_a_positive_integer(clock):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            pacer(clock, world_size=bad)
    with pytest.raises(ValueError, match="world_size"):
        TransferEngine(world_size=0)


# ---------------------------------------------------------------- start jitter
def test_start_jitter_delays_the_first_request_by_a_fraction_of_the_window(clock):
    delays = []
    for seed in range(200):
        p = pacer(clock, rates=(100.0, 100.0), world_size=4, jitter=0.5, seed=seed)
        delays.append(p.wait(WRITE, 1))
    assert all(0 <= d <= 0.5 for d in delays)
    assert min(delays) < 0.05 and max(delays) > 0.45, "spread over the window"
    assert len({round(d, 6) for d in delays}) > 150


def test_start_jitter_applies_again_after_a_quiet_spell_and_not_inside_a_burst(clock):
    p = pacer(clock, rates=(100.0, 100.0), world_size=1, jitter=0.5, seed=3)
    first = p.wait(WRITE, 1)
    assert 0 < first <= 0.5
    assert p.wait(WRITE, 1) == pytest.approx(0.01)  # inside the burst: the next slot, no jitter
    clock.t += 0.2  # the schedule was free for less than the window: still the same burst
    assert p.wait(WRITE, 1) == 0.0
    clock.t += 5.0  # a quiet spell longer than the window: the next burst starts jittered
    again = p.wait(WRITE, 1)
    assert 0 <= again <= 0.5 and again != pytest.approx(0.01)


def test_default_jitter_is_one_interval_of_the_rank_and_none_for_one_rank(clock):
    p = pacer(clock, rates=(3500.0, 5500.0), world_size=1024, jitter=None)
    assert p.schedules[WRITE].window == pytest.approx(1024 / 3500)
    assert p.schedules[READ].window == pytest.approx(1024 / 5500)
    assert pacer(clock, rates=(3500.0, 5500.0), world_size=1, jitter=None).schedules[WRITE].window == 0.0
    assert pacer(clock, rates=(3500.0, 5500.0), world_size=8, jitter=0.0).schedules[WRITE].window == 0.0


def test_the_fleets_first_requests_arrive_at_about_the_job_rate(clock):
    """1,024 ranks start together: with the default jitter their first writes spread
    over one interval of a rank, so no second sees more than the job's rate."""
    firsts = sorted(pacer(clock, rates=(3500.0, 5500.0), world_size=1024, jitter=None, seed=s).schedules[WRITE]
                    .reserve(1, 0.0) for s in range(1024))
    assert firsts[-1] <= 1024 / 3500
    per_tenth = [sum(1 for t in firsts if k / 10 <= t < (k + 1) / 10) for k in range(3)]
    assert max(per_tenth) < 3500 / 10 * 1.3, per_tenth
    no_jitter = [pacer(clock, rates=(3500.0, 5500.0), world_size=1024, jitter=0.0, seed=s).schedules[WRITE]
                 .reserve(1, 0.0) for s in range(8)]
    assert no_jitter == [0.0] * 8


# ---------------------------------------------------------------- which stores, which rates
def test_stores_declare_their_default_rates_and_local_folders_are_not_paced(tmp_path, clock):
    assert S3Store.default_request_rates == (3500.0, 5500.0)
    assert GCSStore.default_request_rates == (1000.0, 5000.0)
    assert LocalStore.default_request_rates is None
    local = open_store(str(tmp_path))
    kw = dict(jitter=None, clock=clock, sleep=clock.sleep, rng=random.Random(0))
    assert pacing.make_pacer(None, local, 8, **kw) is None
    assert pacing.make_pacer(500.0, local, 8, **kw) is not None  # set by hand, it applies anywhere
    s3 = S3Store(StorageOptions())
    assert pacing.make_pacer(None, s3, 8, **kw).job_rates == (3500.0, 5500.0)
    assert pacing.make_pacer(200.0, s3, 8, **kw).job_rates == (200.0, 200.0)
    assert pacing.make_pacer(0.0, s3, 8, **kw) is None  # 0: off


def test_an_engine_on_a_local_folder_never_waits(tmp_path, make_files):
    files = make_files(20, 1024)
    with TransferEngine(TransferConfig(start_jitter=5.0), world_size=1024) as engine:
        engine.upload_all([(p, str(tmp_path / "out" / f"f{i}")) for i, (p, _) in enumerate(files)])
        assert engine.pace(str(tmp_path / "out" / "f0")) == 0.0
        s = engine.stats()
    assert s.paced_requests == 0 and s.paced_seconds == 0.0


def test_request_counts_follow_the_stores_parts():
    s3 = S3Store(StorageOptions())  # one PUT up to 512 MiB, then 64 MiB parts; ranges stream
    gcs = GCSStore(StorageOptions())  # 16 MiB chunks above 64 MiB; a range is read in 16 MiB pieces
    assert pacing.upload_requests(100 * MiB, s3) == 1
    assert pacing.upload_requests(640 * MiB, s3) == 10 + 2
    assert pacing.upload_requests(100 * MiB, gcs) == 7 + 2
    assert pacing.range_requests(1000 * MiB, s3) == 1
    assert pacing.range_requests(40 * MiB, gcs) == 3
    assert pacing.download_requests(None, s3) == 2 and pacing.download_requests(1024 * MiB, s3) == 16


# ---------------------------------------------------------------- config
def test_request_rate_is_a_flat_config_field_with_an_env_var_and_start_jitter_a_transfer_option():
    cfg = CheckpointConfig.from_dict({"save_folder": "s3://bucket/run", "transfer": {"start_jitter": "0.25"}},
                                     env={"CLOUDCKPT_REQUEST_RATE": "1200"})
    assert cfg.request_rate == cfg.transfer.request_rate == 1200.0 and cfg.transfer.start_jitter == 0.25
    assert CheckpointConfig("s3://bucket/run", _env={}).transfer.request_rate is None
    assert CheckpointConfig("s3://bucket/run", request_rate=0, _env={}).transfer.request_rate == 0
    for bad in (-1, float("inf"), "fast"):
        with pytest.raises(ConfigError, match="request_rate"):
            CheckpointConfig("s3://bucket/run", request_rate=bad, _env={})
    with pytest.raises(ConfigError, match="start_jitter"):
        TransferConfig(start_jitter=-0.1)


# ---------------------------------------------------------------- the engine, SeaweedFS
def test_the_engine_waits_for_its_share_before_each_request(s3_bucket, make_files, clock):
    """8 uploads and 8 range reads at a job rate of 40 requests/s on 4 ranks: this
    rank sends 10/s, so each kind spans 0.7 s of its clock, one slot per request."""
    files = make_files(8, 4096)
    urls = [f"{s3_bucket}/paced/f{i}" for i in range(len(files))]
    cfg = TransferConfig(request_rate=40.0, start_jitter=0.0, max_concurrency=1)
    with TransferEngine(cfg, world_size=4, clock=clock, sleep=clock.sleep) as engine:
        t0 = clock()
        engine.upload_all([(p, u) for (p, _), u in zip(files, urls, strict=True)])
        t_up = clock() - t0
        got = engine.read_all([(u, 10, 20) for u in urls])
        s = engine.stats()
    assert got == [data[10:20] for _, data in files]
    assert t_up == pytest.approx(0.7)  # 8 PUTs: the first at once, then 7 slots of 0.1 s
    assert clock.sleeps == pytest.approx([0.1] * 7 + [0.1] * 7)
    assert s.paced_requests == 16 and s.paced_seconds == pytest.approx(1.4)


def test_pace_takes_slots_for_requests_sent_outside_the_engine(s3_bucket, clock):
    with TransferEngine(TransferConfig(request_rate=20.0, start_jitter=0.0), world_size=2, clock=clock,
                        sleep=clock.sleep) as engine:
        waits = [engine.pace(f"{s3_bucket}/x", "write") for _ in range(3)]
        with pytest.raises(ValueError, match="kind"):
            engine.pace(f"{s3_bucket}/x", "list")
        assert engine.stats().paced_requests == 3
    assert waits == pytest.approx([0.0, 0.1, 0.1])


def test_the_slots_taken_match_the_requests_the_sdk_sends(seaweed, s3_bucket, tmp_path):
    """A multipart upload, a download in parts, a streamed range and a range read
    through a recording proxy: the engine takes one slot per request that reaches
    the store."""
    from cloudckpt.testing.faultproxy import FaultProxy

    data = random.Random(5).randbytes(12 * MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    url = f"{s3_bucket}/paced/big.bin"
    with FaultProxy(seaweed.endpoint_url) as proxy:
        opts = StorageOptions(endpoint_url=proxy.endpoint_url, multipart_threshold=5 * MiB, part_size=5 * MiB)
        with TransferEngine(TransferConfig(request_rate=1e6), storage_options=opts) as engine:
            counts = []
            for run in (lambda: engine.submit_upload(str(src), url).result(),  # create, 3 parts, complete
                        # its size known: no HEAD, 3 ranged GETs
                        lambda: engine.submit_download(url, str(tmp_path / "back.bin"), size=len(data)).result(),
                        lambda: engine.submit_stream(url, 0, 11 * MiB, lambda open_from, progress: len(
                            open_from(0).read(11 * MiB))).result(),
                        lambda: engine.submit_read(url, 100, 200).result()):
                before, paced = proxy.requests, engine.stats().paced_requests
                run()
                counts.append((proxy.requests - before, engine.stats().paced_requests - paced))
    assert (tmp_path / "back.bin").read_bytes() == data
    assert counts == [(5, 5), (3, 3), (1, 1), (1, 1)], counts


def test_a_saves_and_a_loads_small_requests_outside_the_engine_are_paced_too(s3_bucket, tmp_path):
    """The manifest part each rank publishes at save, and the manifest part and the
    train state each rank reads at the start of a load, go through the engine's pacing
    like its data (every rank of a job reads them at the
    same moment); so do DCP index parts (none here: a tensor stored whole needs none)."""
    import torch

    from cloudckpt import Checkpointer

    step = f"{s3_bucket}/paced-load/step1"
    cfg = TransferConfig(request_rate=1e6, start_jitter=0.0)
    with Checkpointer(work_dir=str(tmp_path / "w"), transfer=cfg) as ck:
        saved: list[tuple] = []
        real = ck.engine.pace
        ck.engine.pace = lambda url, *a, **kw: saved.append((url, *a)) or real(url, *a, **kw)
        ck.save(step, {"model": {"w": torch.arange(6.0)}}, {"epoch": 3})
    assert saved == [(f"{step}/manifest/rank0.json", "write")]  # its part, published by every rank at once
    with Checkpointer(work_dir=str(tmp_path / "w"), transfer=cfg) as ck:
        paced: list[str] = []
        real = ck.engine.pace
        ck.engine.pace = lambda url, *a, **kw: paced.append(url) or real(url, *a, **kw)
        target = {"model": {"w": torch.zeros(6)}}
        assert ck.load(step, target) == {"epoch": 3}
    assert torch.equal(target["model"]["w"], torch.arange(6.0))
    assert sorted(u[len(step) + 1:] for u in paced) == ["manifest/rank0.json", "train/rank0.pt"]
