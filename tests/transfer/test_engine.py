"""The transfer engine against an in-memory store with scripted faults and the
local backend: ordering, cancellation, retries, stalls, AIMD, byte budget,
bandwidth cap, CRC32C and progress."""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import random
import threading
import time

import google_crc32c
import pytest

from cloudckpt.errors import (
    AccessDenied,
    AlreadyExists,
    ConfigError,
    InvalidURL,
    NotFound,
    PreconditionFailed,
    Throttled,
    TransferStalled,
    Transient,
)
from cloudckpt.storage.registry import clear_cache, open_store
from cloudckpt.transfer import (
    Crc32cReader,
    ProgressSubscriber,
    SerialExecutor,
    TokenBucket,
    TqdmProgress,
    TransferConfig,
    TransferEngine,
    batch,
    crc32c_bytes,
    crc32c_file,
)

KiB = 1024
MiB = 1024 * 1024


def g_crc(data: bytes) -> str:
    return google_crc32c.Checksum(data).hexdigest().decode()


class Recorder(ProgressSubscriber):
    def __init__(self):
        self.lock = threading.Lock()
        self.queued, self.progress, self.done = {}, {}, {}

    def on_queued(self, url, size):
        self.queued.setdefault(url, []).append(size)

    def on_progress(self, url, nbytes):
        with self.lock:
            self.progress[url] = self.progress.get(url, 0) + nbytes

    def on_done(self, url, result_or_exception):
        self.done[url] = result_or_exception


# ---------------------------------------------------------------- order and cancellation
class _Finished(ProgressSubscriber):
    """Records the order in which transfers finished and sets each one's event."""

    def __init__(self, urls):
        self.order: list[str] = []
        self.events = {u: threading.Event() for u in urls}

    def on_done(self, url, result_or_exception):
        self.order.append(url)
        if url in self.events:
            self.events[url].set()


def test_results_are_in_input_order_when_transfers_finish_in_reverse(faulty, make_files):
    files = make_files(6, 10 * KiB)
    pairs = [(p, f"faulty://bucket/o{i}") for i, (p, _) in enumerate(files)]
    finished = _Finished([u for _, u in pairs])
    # each transfer goes on only once the next one finished
    for (_, url), (_, later) in zip(pairs, pairs[1:], strict=False):
        faulty.script(url, ("wait", finished.events[later]))
    with TransferEngine(TransferConfig(max_concurrency=6), progress=finished) as engine:
        results = engine.upload_all(pairs)
        assert finished.order == [u for _, u in reversed(pairs)], "they finished in reverse"
        reads = engine.read_all([(u, 0, 100) for _, u in reversed(pairs)])
    assert [r.url for r in results] == [u for _, u in pairs]
    assert [r.local_path for r in results] == [p for p, _ in pairs]
    assert [r.crc32c for r in results] == [g_crc(d) for _, d in files]
    assert reads == [d[:100] for _, d in reversed(files)]


@pytest.mark.parametrize("executor", [None, SerialExecutor()], ids=["threads", "serial"])
def test_first_fatal_error_cancels_not_started_transfers_and_is_raised(faulty, make_files, executor):
    files = make_files(6, 4 * KiB)
    pairs = [(p, f"faulty://bucket/c{i}") for i, (p, _) in enumerate(files)]
    faulty.script(pairs[0][1], ("sleep", 0.05))
    faulty.script(pairs[1][1], AccessDenied("put faulty://bucket/c1: access denied", url=pairs[1][1]))
    with TransferEngine(TransferConfig(max_concurrency=1), executor=executor) as engine:
        with pytest.raises(AccessDenied, match="c1"):
            engine.upload_all(pairs)
    started = [u for op, u in faulty.calls]
    assert started == [pairs[0][1], pairs[1][1]], "transfers after the failure must not start"
    assert set(faulty.objects) == {pairs[0][1]}


def test_no_queued_transfer_starts_after_a_fatal_error_in_a_tight_race(make_files):
    # without a delay the failing worker would start the next queued transfer before
    # the caller's thread wakes up to cancel it (seen in ~40% of rounds without the fix)
    files = make_files(6, 1 * KiB)
    for round_ in range(30):
        clear_cache()
        store = open_store("faulty://bucket/x")
        pairs = [(p, f"faulty://bucket/r{i}") for i, (p, _) in enumerate(files)]
        store.script(pairs[1][1], AccessDenied("denied", url=pairs[1][1]))
        with TransferEngine(TransferConfig(max_concurrency=1)) as engine:
            with pytest.raises(AccessDenied):
                engine.upload_all(pairs)
        assert len(store.calls) == 2, f"round {round_}: {store.calls}"
    clear_cache()


def test_no_transfer_starts_while_a_failure_is_being_handled(faulty, make_files):
    # the interleaving the test above hits by chance, forced: the running transfer
    # fails while the batch is queueing another one in the engine. Neither the
    # queued transfer (q1) may take the failed one's slot while the failure's
    # callback waits to cancel it, nor the one being queued (q2) start before the
    # batch has listed it for cancelling
    files = make_files(3, 1 * KiB)
    pairs = [(p, f"faulty://bucket/q{i}") for i, (p, _) in enumerate(files)]
    go = threading.Event()
    faulty.script(pairs[0][1], ("wait", go, AccessDenied("denied", url=pairs[0][1])))
    with TransferEngine(TransferConfig(max_concurrency=1)) as engine:
        submitted = []

        def submit(pair):
            if len(submitted) == 2:  # q1 is queued behind q0: let q0 fail now
                go.set()
                cf.wait([submitted[0]], timeout=5)
                assert submitted[0].done()
            f = engine.submit_upload(*pair)
            submitted.append(f)
            if len(submitted) == 3:
                time.sleep(0.3)  # time for a worker to start q1 or q2, were either admitted
            return f

        with pytest.raises(AccessDenied):
            batch.run_all(submit, pairs)
        assert [f.cancelled() for f in submitted] == [False, True, True]
    assert faulty.calls == [("upload", pairs[0][1])]


def test_wait_all_raises_the_error_that_happened_first_and_cancels_pending():
    a, b, c = cf.Future(), cf.Future(), cf.Future()
    a.set_running_or_notify_cancel()  # a started: it cannot be cancelled, it fails later
    b.set_exception(NotFound("b is missing"))  # fails first, though second in order
    threading.Timer(0.2, lambda: a.set_exception(AccessDenied("a denied"))).start()
    with pytest.raises(NotFound, match="b is missing"):
        TransferEngine.wait_all([a, b, c])
    assert c.cancelled() and not a.cancelled()
    assert isinstance(a.exception(timeout=2), AccessDenied)


def test_wait_all_returns_results_in_input_order():
    futs = [cf.Future() for _ in range(4)]
    for i in reversed(range(4)):
        futs[i].set_result(i)
    assert TransferEngine.wait_all(futs) == [0, 1, 2, 3]


# ---------------------------------------------------------------- retries
def test_transient_errors_are_retried_with_seeded_full_jitter_backoff(faulty, make_files, clock):
    (path, data), = make_files(1, 100 * KiB)
    url = "faulty://bucket/retry"
    faulty.script(url, Transient("503 server error", url=url), Throttled("SlowDown", url=url))
    cfg = TransferConfig(max_attempts=4, backoff_base=0.5, backoff_max=20.0, stall_timeout=0)
    with TransferEngine(cfg, executor=SerialExecutor(), clock=clock, sleep=clock.sleep, rng=random.Random(7)) as engine:
        result = engine.submit_upload(path, url).result()
        stats = engine.stats()
    expected_rng = random.Random(7)
    assert clock.sleeps == [expected_rng.uniform(0, 0.5), expected_rng.uniform(0, 1.0)]
    assert result.attempts == 3 and result.crc32c == g_crc(data)
    assert faulty.objects[url] == data
    assert (stats.retries, stats.throttled, stats.transfers) == (2, 1, 1)


def test_retries_stop_after_max_attempts_and_raise_the_last_error(faulty, make_files, clock):
    (path, _), = make_files(1, 1 * KiB)
    url = "faulty://bucket/always-503"
    faulty.script(url, *[Transient(f"503 #{i}", url=url) for i in range(10)])
    with TransferEngine(TransferConfig(max_attempts=3, stall_timeout=0), executor=SerialExecutor(),
                        clock=clock, sleep=clock.sleep) as engine:
        with pytest.raises(Transient, match="503 #2"):
            engine.submit_upload(path, url).result()
        assert engine.stats().retries == 2
    assert faulty.calls.count(("upload", url)) == 3


@pytest.mark.parametrize("exc", [AccessDenied("denied"), NotFound("missing"), PreconditionFailed("precondition"),
                                 AlreadyExists("exists"), InvalidURL("bad url")],
                         ids=lambda e: type(e).__name__)
def test_fatal_errors_are_not_retried(faulty, make_files, clock, exc):
    (path, _), = make_files(1, 1 * KiB)
    url = "faulty://bucket/fatal"
    faulty.script(url, exc, exc, exc)
    with TransferEngine(TransferConfig(max_attempts=4), executor=SerialExecutor(), clock=clock,
                        sleep=clock.sleep) as engine:
        with pytest.raises(type(exc)):
            engine.submit_upload(path, url).result()
        assert engine.stats().retries == 0
    assert faulty.calls == [("upload", url)] and clock.sleeps == []


def test_missing_local_file_fails_without_retry(faulty, tmp_path):
    with TransferEngine(executor=SerialExecutor()) as engine:
        with pytest.raises(FileNotFoundError, match="nope.bin"):
            engine.submit_upload(str(tmp_path / "nope.bin"), "faulty://bucket/x").result()
        assert engine.stats().retries == 0


# ---------------------------------------------------------------- stall watchdog
def _wait_idle(store, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while store.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.active == 0, "the released worker did not finish"


def test_stall_watchdog_fails_a_blocked_upload_within_stall_timeout(faulty, make_files):
    (path, _), = make_files(1, 256 * KiB)
    url = "faulty://bucket/stuck"
    faulty.script(url, ("block",))
    with TransferEngine(TransferConfig(stall_timeout=0.3, max_attempts=1)) as engine:
        t0 = time.monotonic()
        fut = engine.submit_upload(path, url)
        with pytest.raises(TransferStalled) as ei:
            fut.result(timeout=5)
        elapsed = time.monotonic() - t0
        # not before stall_timeout; and well before the block ends (30 s): only the watchdog ended it
        # (one tick is 0.075 s; the rest is room for a loaded machine)
        assert 0.3 <= elapsed < 10, elapsed
        assert url in str(ei.value) and "0.3s" in str(ei.value)
        faulty.release()  # the stuck worker wakes up: its late outcome must be ignored
        _wait_idle(faulty)
        stats = engine.stats()
    assert (stats.stalls, stats.transfers) == (1, 0)
    assert isinstance(fut.exception(), TransferStalled)
    assert url not in faulty.objects, "the abandoned attempt must stop at its next progress callback"


def test_stalled_attempt_is_retried_and_the_stuck_attempt_is_ignored(faulty, make_files):
    (path, data), = make_files(1, 256 * KiB)
    url = "faulty://bucket/stuck-once"
    faulty.script(url, ("block",))
    cfg = TransferConfig(stall_timeout=0.3, max_attempts=2, backoff_base=0.01)
    with TransferEngine(cfg) as engine:
        result = engine.submit_upload(path, url).result(timeout=5)
        faulty.release()
        _wait_idle(faulty)
        stats = engine.stats()
    assert result.attempts == 2 and result.crc32c == g_crc(data)
    assert faulty.objects[url] == data
    assert (stats.stalls, stats.retries, stats.transfers) == (1, 1, 1)


class _MaxDelay(random.Random):
    """Backoff delays at their upper bound (full jitter drawn at its maximum)."""

    def uniform(self, a, b):
        return b


@pytest.mark.parametrize("backoff,attempts", [(100, 2), (10, 4)])
def test_re_attempts_stop_once_no_new_bytes_moved_for_operation_timeout(make_files, clock, backoff, attempts):
    """Every attempt sends the same first half of the file and fails (only the first
    one's bytes are new); operation_timeout is 50 s. A 100 s backoff: attempt 2 ends 100 s
    after the last new bytes, so there is no third attempt although max_attempts allows 4.
    10 s backoffs: each retry starts within 50 s of the last new bytes, so all 4
    attempts run, and the last (the script is spent) succeeds."""
    from cloudckpt.storage import StorageOptions

    (path, data), = make_files(1, 256 * KiB)
    url = f"faulty://bucket/no-new-bytes-{backoff}"
    so = StorageOptions(operation_timeout=50)
    store = open_store(url, so)
    store.script(url, *[("midway", Transient(f"reset #{i}", url=url)) for i in range(3)])
    cfg = TransferConfig(max_attempts=4, backoff_base=backoff, backoff_max=backoff, stall_timeout=0)
    with TransferEngine(cfg, storage_options=so, executor=SerialExecutor(), clock=clock, sleep=clock.sleep,
                        rng=_MaxDelay()) as engine:
        fut = engine.submit_upload(path, url)
        if attempts < 4:
            with pytest.raises(Transient, match=f"reset #{attempts - 1}"):
                fut.result()
        else:
            assert fut.result().attempts == 4 and store.objects[url] == data
    assert store.calls.count(("upload", url)) == attempts and clock.sleeps == [backoff] * (attempts - 1)


def test_a_stall_that_moved_no_bytes_is_not_retried_after_operation_timeout(make_files):
    from cloudckpt.storage import StorageOptions

    (path, _), = make_files(1, 256 * KiB)
    url = "faulty://bucket/stuck-silent"
    so = StorageOptions(operation_timeout=0.1)
    store = open_store(url, so)
    store.script(url, ("block",), ("block",))
    try:
        with TransferEngine(TransferConfig(stall_timeout=0.3, max_attempts=3, backoff_base=0.01),
                            storage_options=so) as engine:
            with pytest.raises(TransferStalled):
                engine.submit_upload(path, url).result(timeout=5)
            assert engine.stats().retries == 0
    finally:
        store.release()
        _wait_idle(store)


def test_a_stream_job_gets_an_opener_of_its_range_and_is_retried_whole_on_a_transient_error(faulty):
    url = "faulty://bucket/stream"
    data = os.urandom(10_000)
    faulty.objects[url] = data
    calls = []

    def job(open_from, progress):
        calls.append(len(calls))
        with open_from(1000 + 500 * (len(calls) - 1)) as r:  # a retry resumes further on
            got = bytes(r.read(100_000))
            progress(len(got))
        if len(calls) == 1:
            raise Transient(f"get {url}: connection problem (reset)", url=url)
        return len(got)

    rec = Recorder()
    with TransferEngine(TransferConfig(max_attempts=3, backoff_base=0.01), progress=rec) as engine:
        assert engine.submit_stream(url, 1000, 9000, job).result(timeout=5) == 7500
        stats = engine.stats()
    assert calls == [0, 1]
    assert (stats.retries, stats.transfers, stats.bytes_downloaded) == (1, 1, 7500)
    assert rec.progress[url] == 7500, "the failed attempt's bytes were taken back"


def test_a_stream_that_says_it_is_alive_is_not_stalled_and_one_that_is_silent_is(faulty, clock):
    """On the injected clock: a job that reports progress(0) every 0.1 s for 0.8 s is never
    stalled (stall_timeout 0.3 s); one silent for 0.8 s is, and its next progress call stops it."""
    url = "faulty://bucket/stream-alive"
    faulty.objects[url] = b"x" * 100
    engine = TransferEngine(TransferConfig(stall_timeout=0.3, max_attempts=1), clock=clock)

    def alive(open_from, progress):
        for _ in range(8):
            clock.t += 0.1
            progress(0)
            assert engine.check_stalls() == 0
        return 0

    abandoned, given_up = [], threading.Event()

    def silent(open_from, progress):
        clock.t += 0.8  # the watchdog (or the check below) fails this attempt
        assert given_up.wait(10)
        try:
            progress(0)
        except Exception as e:
            abandoned.append(type(e).__name__)
            raise
        return 0

    with engine:
        assert engine.submit_stream(url, 0, 100, alive).result(timeout=10) == 0
        fut = engine.submit_stream(url, 0, 100, silent)
        with pytest.raises(TransferStalled, match="stream-alive"):
            fut.result(timeout=10)
        given_up.set()
        deadline = time.monotonic() + 10
        while not abandoned and time.monotonic() < deadline:
            time.sleep(0.01)
    assert abandoned == ["_Abandoned"], "the stalled attempt's next progress call stops it"


def test_stall_watchdog_counts_a_whole_range_read_as_one_request(faulty):
    url = "faulty://bucket/slow-read"
    faulty.objects[url] = b"x" * 1000
    faulty.script(url, ("block",))  # the request hangs until released (30 s): only the watchdog can end it
    with TransferEngine(TransferConfig(stall_timeout=0.3, max_attempts=1)) as engine:
        with pytest.raises(TransferStalled, match="slow-read"):
            engine.submit_read(url, 0, 10).result(timeout=10)
        faulty.release()


def test_stall_check_uses_the_injected_clock(faulty, make_files, clock):
    (path, _), = make_files(1, 1 * KiB)
    url = "faulty://bucket/fake-clock-stall"
    faulty.script(url, ("block",))
    engine = TransferEngine(TransferConfig(stall_timeout=60, max_attempts=1), clock=clock)
    fut = engine.submit_upload(path, url)
    deadline = time.monotonic() + 5
    while not faulty.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    clock.t += 59
    assert engine.check_stalls() == 0 and not fut.done()
    clock.t += 2
    assert engine.check_stalls() == 1
    assert isinstance(fut.exception(timeout=1), TransferStalled)
    faulty.release()
    engine.close()


# ---------------------------------------------------------------- AIMD and budgets
def test_aimd_halves_on_throttle_once_per_window_and_recovers_additively(faulty, make_files, clock):
    files = make_files(1, 1 * KiB)
    path = files[0][0]
    cfg = TransferConfig(max_concurrency=8, min_concurrency=2, stall_timeout=0)
    with TransferEngine(cfg, executor=SerialExecutor(), clock=clock, sleep=clock.sleep) as engine:
        def upload(name, *actions):
            faulty.script(f"faulty://bucket/{name}", *actions)
            engine.submit_upload(path, f"faulty://bucket/{name}").result()

        upload("t1", ("signal", "throttled"))
        assert engine.stats().concurrency == 4
        upload("t2", ("signal", "throttled"))  # same 1 s window: no second cut
        assert engine.stats().concurrency == 4
        clock.t += 1.5
        upload("t3", ("signal", "throttled"))
        clock.t += 1.5
        upload("t4", ("signal", "throttled"))  # floor: min_concurrency
        assert engine.stats().concurrency == 2
        upload("t5", ("signal", "transient"))  # a plain retry is no throttle signal
        s = engine.stats()
        assert (s.concurrency, s.throttled, s.sdk_retries, s.min_concurrency_seen) == (2, 4, 5, 2)
        for i in range(7):  # t5 was the first clean success: 8 in all
            upload(f"ok{i}")
        assert engine.stats().concurrency == 3
        for i in range(8 * 5):
            upload(f"more{i}")
        assert engine.stats().concurrency == 8, "recovery stops at max_concurrency"


def _upload_all_held(engine, store, pairs, *, running: int) -> None:
    """``upload_all(pairs)`` with every transfer held in the store until ``running`` of them
    are in it at once (polled, 10 s at most): whatever the engine admits beyond its limit
    is held there too, and shows in ``store.peak_active``."""
    go = threading.Event()
    for _, u in pairs:
        store.script(u, ("wait", go))
    with cf.ThreadPoolExecutor(1) as pool:
        done = pool.submit(engine.upload_all, pairs)
        deadline = time.monotonic() + 10
        while store.active < running and not done.done():
            assert time.monotonic() < deadline, f"only {store.active} transfers running after 10 s, expected {running}"
            time.sleep(0.005)
        go.set()
        done.result(timeout=30)


def test_in_flight_transfers_follow_the_lowered_limit(faulty, make_files):
    files = make_files(6, 1 * KiB)  # 1 + 6 clean successes: fewer than the 8 that would raise the limit again
    with TransferEngine(TransferConfig(max_concurrency=8)) as engine:
        faulty.script("faulty://bucket/first", ("signal", "throttled"))
        engine.submit_upload(files[0][0], "faulty://bucket/first").result()
        assert engine.stats().concurrency == 4
        faulty.peak_active = 0
        pairs = [(p, f"faulty://bucket/p{i}") for i, (p, _) in enumerate(files)]
        _upload_all_held(engine, faulty, pairs, running=4)
        assert engine.stats().concurrency == 4
    assert faulty.peak_active == 4


def test_bytes_in_flight_are_bounded_and_a_larger_transfer_runs_alone(faulty, make_files):
    small = make_files(6, 100 * KiB, prefix="s")
    (big, _), = make_files(1, 300 * KiB, prefix="b")
    with TransferEngine(TransferConfig(max_concurrency=8, max_bytes_in_flight=250 * KiB)) as engine:
        pairs = [(p, f"faulty://bucket/s{i}") for i, (p, _) in enumerate(small)]
        _upload_all_held(engine, faulty, pairs, running=2)
        assert faulty.peak_active == 2
        faulty.peak_active = 0
        assert engine.submit_upload(big, "faulty://bucket/big").result().size == 300 * KiB
    assert faulty.peak_active == 1


# ---------------------------------------------------------------- bandwidth
def test_token_bucket_schedule_with_fake_clock(clock):
    bucket = TokenBucket(1000.0, clock=clock, sleep=clock.sleep)
    t0 = clock.t
    for _ in range(10):
        bucket.consume(500)
    assert clock.t - t0 == pytest.approx(5.0)
    clock.t += 100  # idle time gives no credit for a later burst
    assert bucket.consume(1000) == pytest.approx(1.0)


def test_bandwidth_cap_holds_within_10_percent_across_concurrent_uploads(faulty, make_files):
    # real clock; an in-memory store, so disk flushes of a busy machine cannot slow it below the cap
    rate = 20e6
    files = make_files(4, 10 * MiB)
    pairs = [(p, f"faulty://bucket/bw{i}") for i, (p, _) in enumerate(files)]
    with TransferEngine(TransferConfig(max_concurrency=4, bandwidth_limit=rate)) as engine:
        t0 = time.monotonic()
        engine.upload_all(pairs)
        elapsed = time.monotonic() - t0
    assert faulty.peak_active == 4, "the cap must hold across concurrent transfers"
    measured = 4 * 10 * MiB / elapsed
    # the cap: never more than 10% above it; below it only by a margin a loaded machine can cause
    assert 0.5 * rate <= measured <= 1.1 * rate, f"{measured / 1e6:.1f} MB/s against a cap of {rate / 1e6:.0f} MB/s"


# ---------------------------------------------------------------- CRC32C
def test_crc32c_helpers_match_google_crc32c(tmp_path):
    data = bytes(range(256)) * 1000
    p = tmp_path / "d"
    p.write_bytes(data)
    assert crc32c_bytes(data) == crc32c_file(p, chunk_size=999) == g_crc(data)
    assert crc32c_bytes(b"123456789") == "e3069283"  # the CRC32C check value


def test_crc32c_reader_restarts_on_seek_zero_and_reports_an_incomplete_prefix():
    data = bytes(range(256)) * 100
    r = Crc32cReader(io.BytesIO(data))
    r.read(1000)
    r.seek(0)
    while r.read(777):
        pass
    assert (r.hexdigest(), r.bytes_covered) == (g_crc(data), len(data))
    r.seek(500)
    r.read(10)  # re-reading covered bytes changes nothing
    assert r.hexdigest() == g_crc(data)
    r2 = Crc32cReader(io.BytesIO(data))
    r2.seek(100)
    r2.read()  # skipped the first 100 bytes: the CRC cannot cover the file
    assert r2.bytes_covered == 0


def test_upload_crc32c_is_right_after_a_backend_restart_and_an_engine_retry(faulty, make_files, clock):
    (path, data), = make_files(1, 1 * MiB)
    a, b = "faulty://bucket/restarted", "faulty://bucket/retried"
    faulty.script(a, ("restart",))
    faulty.script(b, ("midway", Transient("connection reset", url=b)))
    with TransferEngine(executor=SerialExecutor(), clock=clock, sleep=clock.sleep) as engine:
        ra = engine.submit_upload(path, a).result()
        rb = engine.submit_upload(path, b).result()
    assert ra.crc32c == rb.crc32c == g_crc(data)
    assert (ra.attempts, rb.attempts) == (1, 2)
    assert faulty.objects[a] == faulty.objects[b] == data


def test_checksum_off_gives_no_crc(faulty, make_files):
    (path, _), = make_files(1, 1 * KiB)
    with TransferEngine(TransferConfig(checksum=False), executor=SerialExecutor()) as engine:
        assert engine.submit_upload(path, "faulty://bucket/nocrc").result().crc32c is None


def test_local_download_writes_the_file_and_its_crc(make_files, tmp_path):
    (path, data), = make_files(1, 3 * MiB)
    dest = tmp_path / "dl" / "copy.bin"
    with TransferEngine() as engine:
        (r,) = engine.download_all([(path, str(dest))])
    assert dest.read_bytes() == data and r.size == len(data) and r.crc32c == g_crc(data)
    assert [p.name for p in dest.parent.iterdir()] == ["copy.bin"]


# ---------------------------------------------------------------- progress
def test_progress_sums_to_the_size_even_when_an_attempt_is_restarted(faulty, make_files, clock):
    (path, data), = make_files(1, 1 * MiB)
    url = "faulty://bucket/progress"
    faulty.script(url, ("midway", Transient("reset", url=url)))
    rec = Recorder()
    with TransferEngine(progress=rec, executor=SerialExecutor(), clock=clock, sleep=clock.sleep) as engine:
        result = engine.submit_upload(path, url).result()
        engine.submit_download(url, path + ".back").result()
    assert rec.queued == {url: [len(data), None]}  # a download's size is not known up front
    assert rec.progress[url] == 2 * len(data)  # the upload, then the download
    assert rec.done[url].local_path == path + ".back" and result.attempts == 2


def test_tqdm_progress_bar_reaches_the_total(make_files, tmp_path):
    files = make_files(3, 200 * KiB)
    out = io.StringIO()
    with TqdmProgress(file=out, mininterval=0) as bar:
        with TransferEngine(progress=bar) as engine:
            engine.upload_all([(p, str(tmp_path / "o" / f"{i}")) for i, (p, _) in enumerate(files)])
        assert bar.bar.total == bar.bar.n == 3 * 200 * KiB


# ---------------------------------------------------------------- lifecycle and config
def test_close_removes_retry_listeners_and_refuses_new_work(faulty, make_files):
    (path, _), = make_files(1, 1 * KiB)
    engine = TransferEngine()
    engine.submit_upload(path, "faulty://bucket/l").result()
    assert faulty._retry_listeners
    engine.close()
    assert faulty._retry_listeners == []
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_upload(path, "faulty://bucket/l2")


def test_close_without_wait_cancels_queued_transfers(faulty, make_files):
    files = make_files(3, 1 * KiB)
    url0 = "faulty://bucket/q0"
    faulty.script(url0, ("block",))
    engine = TransferEngine(TransferConfig(max_concurrency=1))
    futs = [engine.submit_upload(p, f"faulty://bucket/q{i}") for i, (p, _) in enumerate(files)]
    deadline = time.monotonic() + 10
    while not faulty.calls:  # q0 is in the store (held), q1 and q2 wait in the queue
        assert time.monotonic() < deadline, "q0 did not start within 10 s"
        time.sleep(0.005)
    engine.close(wait=False)
    assert [f.cancelled() for f in futs] == [False, True, True]
    faulty.release()
    assert futs[0].result(timeout=10).url == url0


@pytest.mark.parametrize("field,value", [
    ("max_concurrency", 0), ("min_concurrency", 9), ("max_bytes_in_flight", -1), ("bandwidth_limit", 0),
    ("stall_timeout", -1), ("max_attempts", 0), ("backoff_base", -0.1), ("backoff_max", 0.1), ("checksum", "yes"),
    ("max_concurrency", 2.5),
])
def test_config_rejects_bad_values_naming_field_and_value(field, value):
    with pytest.raises(ConfigError) as ei:
        TransferConfig(**{field: value})
    assert field in str(ei.value) and repr(value) in str(ei.value)
