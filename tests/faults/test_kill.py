"""kill -9 at random moments: of one rank during a save (sync and async), and of a
prune or a gc. Whatever the moment, a reader never sees a partial step.

Trials are seeded and every backend is killed by default: CI runs
``CLOUDCKPT_KILL_TRIALS`` (default 6: S3, GCS and local, sync and async, once each)
save trials and, per backend, one prune and one gc trial per 6 save trials (at least
one each); the full campaign is

    CLOUDCKPT_KILL_TRIALS=24 .venv/bin/python -m pytest tests/faults/test_kill.py

(24 save trials, 4 per backend and mode; 4 prune and 4 gc trials per backend).
``CLOUDCKPT_KILL_SEED`` picks another family of seeds.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from cloudckpt import CheckpointConfig, Checkpointer
from cloudckpt.checkpoint import discovery, layout, retention
from cloudckpt.errors import NotACheckpoint
from cloudckpt.storage import clear_cache, open_store
from cloudckpt.storage import url as urls
from cloudckpt.testing.faultproxy import Rule

from . import checks, workers

COMBOS = [("s3", "sync"), ("s3", "async"), ("gcs", "sync"), ("gcs", "async"), ("local", "sync"), ("local", "async")]
KILL_TRIALS = int(os.environ.get("CLOUDCKPT_KILL_TRIALS", str(len(COMBOS))))  # default: every backend and mode once
SEED = int(os.environ.get("CLOUDCKPT_KILL_SEED", "0"))
BACKENDS = ["s3", "gcs", "local"]


def _marks(fast: bool):
    """``make test-fast`` keeps one trial of each kind (local: the quickest); the rest are slow."""
    return () if fast else (pytest.mark.slow,)


SAVE_TRIALS = [pytest.param(t, id=f"{t}-{'-'.join(COMBOS[t % len(COMBOS)])}",
                            marks=_marks(COMBOS[t % len(COMBOS)] == ("local", "sync") and t < len(COMBOS)))
               for t in range(KILL_TRIALS)]
NUMEL = 256 * 1024  # 1 MiB + 0.5 MiB per rank per step
KILL_WINDOW = 4.0  # seconds after both ranks are ready: a few saves long


def _root(backend: str, request, tmp_path) -> str:
    if backend == "local":
        return str(tmp_path / "ckpt" / "run")
    proxy = request.getfixturevalue(f"{backend}_proxy")
    proxy.add(Rule("latency", delay=0.01))  # every request 10 ms slower: wider windows between the steps of a save
    return proxy.bucket + "/run"


def _wait_for(paths: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks not ready after {timeout}s: {paths}")
        time.sleep(0.05)


def _done_steps(progress: str, world_size: int) -> set[int]:
    out: set[int] = set()
    for r in range(world_size):
        try:
            with open(os.path.join(progress, f"done{r}")) as f:
                out |= {int(x) for x in f.read().split()}
        except FileNotFoundError:
            pass  # this rank never finished a save
    return out


def assert_no_partial_step_is_visible(folder: str, work_dir: str, *, world_size: int, numel: int) -> list[int]:
    """The reader's guarantees: every committed step verifies (each manifest object
    with its size and CRC32C), latest_checkpoint is the newest committed step, and
    loading it is bit-exact. Returns the committed steps."""
    clear_cache()
    committed = checks.committed_steps(folder)
    for s in committed:
        problems = checks.verify_step(checks.step_dir(folder, s))
        assert problems == [], f"committed step{s} is partial: {problems}"
    for s in committed[-2:]:  # and the library's own `cloudckpt verify` agrees on the newest ones
        rc, out = checks.library_verify(checks.step_dir(folder, s))
        assert rc == 0, out
    if not committed:
        with pytest.raises(NotACheckpoint):
            Checkpointer.latest_checkpoint(folder)
        return committed
    latest = Checkpointer.latest_checkpoint(folder)
    assert latest == checks.step_dir(folder, max(committed))
    sd = checks.zero_state(world_size, numel=numel)
    ts = Checkpointer(work_dir=work_dir).load(latest, sd)
    assert checks.bitexact(sd, max(committed), world_size, numel=numel), f"{latest} does not load bit-exactly"
    assert ts == {"step": max(committed), "rank": 0}
    return committed


@pytest.mark.parametrize("trial", SAVE_TRIALS)
def test_kill9_of_one_rank_at_a_random_moment_of_a_save_never_exposes_a_partial_step(trial, request, tmp_path,
                                                                                      secret_scan):
    backend, mode = COMBOS[trial % len(COMBOS)]
    rng = random.Random(f"{SEED}-save-{trial}")
    folder = _root(backend, request, tmp_path)
    progress = tmp_path / "progress"
    progress.mkdir()
    job = workers.Job(2, workers.save_loop, folder, str(tmp_path / "work"), mode, list(range(1, 200)), NUMEL,
                      str(progress),
                      trial % 4 != 3, env=checks.rank_env(), tmp=str(tmp_path))
    try:
        # "ready" comes when step 1 committed on this rank (every 4th trial: when the job starts, so
        # that the kill may hit the very first save, with nothing committed to fall back on)
        _wait_for([str(progress / f"ready{r}") for r in range(2)], timeout=120)
        delay, victim = rng.uniform(0, KILL_WINDOW), rng.randrange(2)
        time.sleep(delay)
        job.kill(victim)
        time.sleep(rng.uniform(0, 0.3))  # the scheduler notices and kills the rest of the job
    finally:
        job.kill_all()
    done = _done_steps(str(progress), 2)
    for f in tmp_path.glob("rank*.stderr"):  # what the ranks printed (the survivors' errors included)
        secret_scan.add(f.read_text(errors="replace"))
    committed = assert_no_partial_step_is_visible(folder, str(tmp_path / "check"), world_size=2, numel=NUMEL)
    print(f"kill trial {trial}: {backend}/{mode} killed rank {victim} after {delay:.2f}s; "
          f"saves returned: {sorted(done)[-3:]}, committed: {committed[-3:]}")
    assert done <= set(committed), f"a save that returned was lost: {sorted(done - set(committed))}"

    # the job restarts (on one rank here): resume from the newest committed step, then keep saving
    cfg = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "restart"), exact_resume=False)
    mgr = cfg.build()
    sd = checks.zero_state(2, numel=NUMEL)
    ts = mgr.resume(sd)
    newest = max(committed, default=0)
    assert ts == ({"step": newest, "rank": 0} if committed else None)
    nxt = newest + 1
    mgr.save(nxt, checks.step_state(nxt, 0, numel=NUMEL), {"step": nxt, "rank": 0})
    mgr.close()
    assert checks.committed_steps(folder)[-1] == nxt
    assert checks.verify_step(checks.step_dir(folder, nxt)) == []
    assert [s for s in checks.committed_steps(folder) if s <= newest] == committed, "resume lost no committed step"


# ------------------------------------------------------------------ prune and gc
MAINT_ROUNDS = max(1, KILL_TRIALS // len(COMBOS))  # prune and gc trials per backend
MAINT = [pytest.param(b, r, id=f"{r}-{b}", marks=_marks(b == "local" and r == 0))
         for r in range(MAINT_ROUNDS) for b in BACKENDS]
# round 0 kills right after the first delete (part-way, whatever the machine's speed: a
# proxied prune or gc goes on for about a second more); later rounds at a random moment
# how long after the worker is ready the kill may come: a proxied prune or gc (+40 ms per
# request) takes about a second; a local one a few milliseconds
KILL_WINDOWS = {"s3": 1.5, "gcs": 1.5, "local": 0.05}


def _maint_root(backend: str, request, tmp_path):
    """A run folder on ``backend`` and, for S3 and GCS, the fault proxy in front of it."""
    if backend == "local":
        return str(tmp_path / "ckpt" / "run"), None
    proxy = request.getfixturevalue(f"{backend}_proxy")
    return proxy.bucket + "/run", proxy


def _slowed(proxy):
    """Every request 40 ms slower: the kill lands part-way through the deletes."""
    if proxy is not None:
        proxy.add(Rule("latency", delay=0.04))


def _unslowed(proxy):
    if proxy is not None:
        proxy.clear()


def _committed_run(folder: str, work_dir: str, steps: range, *, ephemeral_every: int = 2) -> None:
    ck = Checkpointer(work_dir=work_dir)
    for s in steps:
        ck.save(checks.step_dir(folder, s), checks.step_state(s, 0), {"step": s, "rank": 0},
                ephemeral=s % ephemeral_every == 1)
    ck.close()


def _kill_during(fn, args, rng, window: float, tmp_path, *, after=None) -> float:
    """Run ``fn`` in a spawned process and kill -9 it: as soon as ``after()`` is true (polled),
    else at a random moment of ``window`` seconds after it is ready. Returns when, after ready."""
    progress = tmp_path / "maint"
    progress.mkdir(exist_ok=True)
    job = workers.Job(1, fn, *args, str(progress), env=checks.rank_env(), tmp=str(tmp_path))
    try:
        _wait_for([str(progress / "ready0")], timeout=120)
        t0 = time.monotonic()
        if after is None:
            time.sleep(rng.uniform(0, window))
        else:
            while not after() and job.procs[0].is_alive():
                assert time.monotonic() - t0 < 60, "the worker deleted nothing within 60 s"
        delay = time.monotonic() - t0
    finally:
        job.kill_all()
    return delay


PRUNE_STEPS = range(1, 9)  # odd steps ephemeral (``_committed_run``)
# workers.prune_all applies Policy(keep_last_ephemeral=1, max_checkpoints=1): it keeps the
# newest ephemeral step (7) and the newest persistent one (8) and drops the other six
PRUNE_KEEPS = {7, 8}


@pytest.mark.parametrize("backend,trial", MAINT)
def test_kill9_during_prune_keeps_every_step_the_policy_keeps_and_leaves_no_dropped_step_partial(
        backend, trial, request, tmp_path, secret_scan):
    rng = random.Random(f"{SEED}-prune-{backend}-{trial}")
    folder, proxy = _maint_root(backend, request, tmp_path)
    _committed_run(folder, str(tmp_path / "w"), PRUNE_STEPS)
    before = checks.committed_steps(folder)
    assert before == list(PRUNE_STEPS)
    policy = retention.Policy(keep_last_ephemeral=1, max_checkpoints=1)
    assert set(before) - set(retention.steps_to_prune([(s, s % 2 == 1) for s in before], policy)) == PRUNE_KEEPS
    store = open_store(folder)
    first_gone = (lambda: not store.exists(layout.marker_url(checks.step_dir(folder, 1)))) if trial == 0 else None
    _slowed(proxy)
    delay = _kill_during(workers.prune_all, (folder,), rng, KILL_WINDOWS[backend], tmp_path, after=first_gone)
    _unslowed(proxy)
    after = assert_no_partial_step_is_visible(folder, str(tmp_path / "check"), world_size=1, numel=64 * 1024)
    print(f"prune trial {backend}/{trial}: killed after {delay:.2f}s; committed {before} -> {after}")
    # kept steps: still committed, and (like every committed step above) complete
    assert PRUNE_KEEPS <= set(after), f"prune deleted a step the policy keeps: {sorted(PRUNE_KEEPS - set(after))}"
    assert set(after) <= set(before)
    # a dropped step is still complete (committed: verified above) or gone: its marker went
    # first, so no reader sees it, and what the kill left of its objects is gc's to remove
    gone = sorted(set(before) - set(after))
    for s in gone:
        with pytest.raises(NotACheckpoint):
            Checkpointer(work_dir=str(tmp_path / "check")).load(checks.step_dir(folder, s), checks.zero_state(1))
    retention.gc(folder, older_than=0)
    for s in gone:
        assert checks.objects_under(checks.step_dir(folder, s)) == [], f"objects of pruned step{s} are left after gc"
    assert checks.committed_steps(folder) == after, "gc touched no committed step"


@pytest.mark.parametrize("backend,trial", MAINT)
def test_kill9_during_gc_never_touches_a_committed_step(backend, trial, request, tmp_path, secret_scan):
    rng = random.Random(f"{SEED}-gc-{backend}-{trial}")
    folder, proxy = _maint_root(backend, request, tmp_path)
    _committed_run(folder, str(tmp_path / "w"), range(1, 5))
    store = open_store(folder)
    for s in range(5, 10):  # crashed saves: objects without a marker (and a lock)
        d = checks.step_dir(folder, s)
        for name in ("model_and_optim/__0_0.distcp", "model_and_optim/.metadata", "train/rank0.pt", ".lock"):
            store.put_bytes(urls.join(d, name), os.urandom(1000))
    before = checks.committed_steps(folder)
    crashed5 = urls.as_prefix(checks.step_dir(folder, 5))
    first_gone = (lambda: len(list(store.walk(crashed5))) < 4) if trial == 0 else None
    _slowed(proxy)
    delay = _kill_during(workers.gc_all, (folder,), rng, KILL_WINDOWS[backend] * 2 / 3, tmp_path, after=first_gone)
    _unslowed(proxy)
    after = assert_no_partial_step_is_visible(folder, str(tmp_path / "check"), world_size=1, numel=64 * 1024)
    print(f"gc trial {backend}/{trial}: killed after {delay:.2f}s; committed {before} -> {after}")
    assert after == before, "gc never deletes a committed step"
    rep = retention.gc(folder, older_than=0)  # a later gc finishes the job
    assert [discovery.dir_is_checkpoint(d) for d in rep.step_dirs] == [False] * len(rep.step_dirs)
    for s, d in discovery.list_step_dirs(folder):
        # SeaweedFS's filer (and a local folder) keeps emptied folders, so a gc'ed step can still be listed
        # as a prefix: with no object
        assert s in before or checks.objects_under(d) == [], f"gc left objects of uncommitted {d}"
