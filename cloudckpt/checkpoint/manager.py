"""CheckpointManager: what a trainer calls. Built by ``CheckpointConfig.build()``.

    mgr = CheckpointConfig(save_folder="s3://my-bucket/run", save_interval=1000, ephemeral_save_interval=100).build()
    train_state = mgr.resume(state_dict)        # newest committed step, or None
    for step in ...:
        mgr.maybe_save(step, state_dict, train_state)
    mgr.close()

- ``resume`` discovers on rank 0 and broadcasts; before loading it removes
  uncommitted step folders *above* the resumed step: they are leftovers of this
  run's crashed attempt, and the run is about to write those steps again. The
  resumed step is the newest committed one, whoever wrote it: a step another tool
  (OLMo-core) committed after ours is resumed from, never deleted or overwritten
  (a folder with a marker is never a leftover).
- ``maybe_save`` applies the intervals (a step due for both is persistent).
- After a save commits, rank 0 prunes by policy and garbage-collects (old
  uncommitted folders, orphaned multipart uploads) on a background thread: marker
  first, never the newest committed step, never a step being written, never a
  step another tool wrote (``retention.Policy.include_foreign`` is off). Its cost
  per save does not grow with the kept steps (``retention.Maintenance``: two LISTs
  and the deletes; a committed step's header is read once, or known from the save).
- On SIGTERM (main thread only): ``sigterm="finish"`` waits up to
  ``sigterm_timeout`` for in-flight saves to commit, ``"abandon"`` does not wait;
  either way the process then exits with the signal. An abandoned save has no
  marker, so readers never see it; gc removes its objects later.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import errors, exact_resume
from ..errors import CloudCkptError, ConfigError, CorruptCheckpoint, NotACheckpoint
from ..options import ManagerOptions
from ..storage import Location
from . import discovery, layout, loaders, refusals, retention
from .checkpointer import Checkpointer
from .local.groups import Replication
from .local.tier import LocalTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SkippedStep:
    """A committed bucket step that ``resume()`` did not use because it failed its checks."""

    step: int
    dir: str
    reason: str  # the first failing ranks' errors


class CheckpointManager:
    """The trainer's checkpoint loop: resume, save intervals, retention and gc, SIGTERM,
    exact resume of data loaders and RNGs, the node-local tier. Build it with
    ``CheckpointConfig(...).build()`` on every rank at the same point (it creates its
    ``Checkpointer``, whose gloo group is collective).

    Args:
        config: the validated settings: a ``CheckpointConfig`` (a
            :class:`~cloudckpt.options.ManagerOptions`, which is the type named here:
            ``cloudckpt.options`` sits below the checkpoint package, ``cloudckpt.config`` above it).

    Attributes:
        checkpointer: the ``Checkpointer`` it saves and loads with.
        resumed_step: the step ``resume()`` loaded (None before it, or with nothing to load).
        resumed_from: where that step came from: ``"local"`` (node-local tier) or ``"bucket"``.
        skipped_steps: ``SkippedStep(step, dir, reason)`` for each newer bucket step
            ``resume()`` passed over because it failed its checks.
        steps_above_resumed: committed steps above the resumed one (``load_step`` resumed
            an older step, or newer steps failed their checks); ``maybe_save`` does not save
            over them unless ``save_overwrite``, except those in ``refused_above``.
        refused_above: the steps above the resumed one that failed their checks (this
            resume's ``skipped_steps``, or a refusal note of an earlier one: see
            ``cloudckpt.checkpoint.refusals``); ``maybe_save`` deletes such a step, with a
            warning, and saves that step number afresh.
        last_saved_step: the newest step this manager saved.
    """

    def __init__(self, config: ManagerOptions) -> None:
        if not isinstance(config, ManagerOptions):
            raise TypeError(f"CheckpointManager takes a CheckpointConfig, got {type(config).__name__}")
        self.config = config
        self.checkpointer = Checkpointer(config.checkpointer)  # collective: its own group
        self.coord = self.checkpointer.coord
        self.save_location = Location.of(config.save_folder, self.checkpointer.storage_options)
        self.local = self._local_tier(config) if config.local.local_dir else None
        self.resumed_from: str | None = None  # "local" or "bucket"
        kept = config.retention
        self.policy = retention.Policy(kept.keep_last_ephemeral, kept.max_checkpoints, kept.keep_every)
        self.maintenance = retention.Maintenance(self.save_location, self.policy, older_than=kept.gc_grace_seconds)
        self._maint = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloudckpt-maint")
        self._maint_futures: list[Future] = []
        self._writing: set[int] = set()
        self._lock = threading.Lock()
        self.resumed_step: int | None = None
        self.skipped_steps: tuple[SkippedStep, ...] = ()  # bucket steps resume() found failing their checks
        self.steps_above_resumed: frozenset[int] = frozenset()  # committed steps above the resumed one
        self.refused_above: frozenset[int] = frozenset()  # those of them that failed their checks: replaced
        self.last_saved_step: int | None = None
        self._closed = False
        self._loaders: dict[str, Any] = {}
        self._install_sigterm()

    def _local_tier(self, config: ManagerOptions) -> LocalTier:
        ws, tier = self.coord.world_size, config.local
        jump = tier.replication_jump or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        factor = tier.replication_factor or (2 if ws // max(jump, 1) >= 2 else 1)
        rep = Replication(ws, factor, jump)
        # uploads local steps from their own thread and group: a Checkpointer of its own
        return LocalTier(self.checkpointer, Checkpointer(self.checkpointer.options), local_dir=tier.local_dir,
                         replication=rep, keep_last=tier.keep_last_local,
                         collective_timeout=config.checkpointer.collective_timeout, save_folder=config.save_folder)

    def register_data_loader(self, loader: Any, name: str = "train") -> None:
        """Save and restore this loader's state (``state_dict``/``load_state_dict``) with
        every checkpoint of this rank (exact resume). Register before ``resume()``.
        A ``StatefulDataLoader`` with workers keeps their RNG states too (map-style
        datasets); a case that cannot resume exactly is logged as a warning here.

        Raises:
            ConfigError: the loader is not stateful (a plain ``torch.utils.data.DataLoader``:
                use torchdata's ``StatefulDataLoader``), or ``name`` is taken.
        """
        loaders.check_stateful(loader, name)
        if name in self._loaders and self._loaders[name] is not loader:
            raise ConfigError(f"register_data_loader: a loader named {name!r} is already registered; "
                              "pass another name= for a second loader")
        self._loaders[name] = loader
        if self.config.exact_resume:
            loaders.watch_workers(loader, name)

    # ------------------------------------------------------------ resume
    def resume(self, state_dict: dict, *, load_step: int | None = None, **load_kwargs: Any) -> Any:
        """Load the newest committed step into ``state_dict``; return the train state
        (or None when the folder has no committed step). Collective.

        A newer step that fails its checks is logged, recorded in ``skipped_steps`` and
        passed over for the previous committed one, unless ``strict_resume``.

        Args:
            state_dict: the model/optimizer state to load into, in place (resharded as needed).
            load_step: load this committed step instead of the newest (default: the
                config's ``load_step``).
            **load_kwargs: passed to ``Checkpointer.load`` (``strict``,
                ``exclude_from_loading``, ``allow_partial``...).

        Returns:
            This rank's train state, or None when there is no committed step.

        Raises:
            NotACheckpoint: ``load_step`` is not a committed step (the message names the
                nearest committed ones).
            CorruptCheckpoint: the step fails its checks and ``load_step`` was asked for,
                ``strict_resume`` is set, or no older committed step exists.
            CheckpointError: any other error of ``Checkpointer.load`` (``MissingKeys``,
                ``KeysNotLoaded``, ``ShapeMismatch``...); storage errors.
        """
        folder = self.config.save_folder
        load_step = self.config.load_step if load_step is None else load_step
        found = None
        if self.local is not None and load_step is not None:
            self.local.drain()
            found = self.local.find(step=load_step)
        latest = None if found is not None else self.step_to_resume(load_step=load_step)
        if self.local is not None and found is None and load_step is None:
            self.local.drain()
            found = self.local.find(newer_than=layout.parse_step_dir(latest) - 1 if latest else -1)
        if found is not None:
            ts = self.local.load(found, state_dict, **load_kwargs)
            self.resumed_step, self.resumed_from = found.step, "local"
            log.info("resumed from local step %d (%s)", found.step, self.local.last_recovery)
        elif latest is None:
            log.info("no committed checkpoint in %s: starting from scratch", folder)
            return None
        else:
            latest, ts = self._load_with_fallback(latest, state_dict, explicit=load_step is not None, **load_kwargs)
            self.resumed_step, self.resumed_from = layout.parse_step_dir(latest), "bucket"
            info = self.checkpointer.last_load_info
            if info.writer != "cloudckpt":
                log.warning("resumed from %s, the newest committed step, written by %s%s", latest, info.writer,
                            "" if info.verified else " (no manifest: unverified)")
            else:
                log.info("resumed from %s", latest)
        if isinstance(ts, dict) and exact_resume.KEY in ts:
            ts = dict(ts)
            saved = ts.pop(exact_resume.KEY)
            if self.config.exact_resume:
                same = self.checkpointer.last_load_info.saved_world_size == self.coord.world_size
                where = latest if self.resumed_from == "bucket" else f"local step {self.resumed_step}"
                done, missing = exact_resume.restore(saved, self._loaders, same_world_size=same, where=where)
                if "rng:torch" in done:
                    for name, loader in self._loaders.items():
                        loaders.keep_rng_across_first_iter(loader, name)
                if missing:
                    log.warning("exact resume: not restored on rank %d: %s (%s)", self.coord.rank, ", ".join(missing),
                                "the world size changed" if not same else "not in the checkpoint")
        return ts

    def _load_with_fallback(self, dir: str, state_dict: dict, *, explicit: bool, **load_kwargs: Any) -> tuple[str, Any]:
        """Load the bucket step ``dir``; if it fails its checks (CorruptCheckpoint, on any
        rank) and neither ``explicit`` (``load_step``) nor ``strict_resume`` is set, log
        it, record it in ``skipped_steps`` and load the next older committed step. Every
        rank takes the same decision (one collective per attempt). Returns (dir, train state)."""
        while True:
            got: dict = {}

            def attempt(dir=dir, got=got):
                try:
                    got["ts"] = self.checkpointer.load(dir, state_dict, **load_kwargs)
                    return None
                except CorruptCheckpoint as e:
                    return type(e).__name__, " ".join(str(e).split())[:500]

            failed = {r: o for r, o in enumerate(self.coord.all_ranks(f"load {dir}", attempt)) if o}
            if not failed:
                self._decide_steps_above(dir, explicit=explicit)
                return dir, got["ts"]
            step = layout.parse_step_dir(dir)
            reason = "; ".join(f"rank {r}: {t}" for r, (_, t) in sorted(failed.items())[:3]) + \
                (f" (and {len(failed) - 3} more ranks)" if len(failed) > 3 else "")
            kind = _corrupt_class(failed[min(failed)][0])  # the first failing rank's class, on every rank
            older = self.coord.on_coordinator("find older step", functools.partial(self._refuse, step, reason))
            if explicit or self.config.strict_resume:
                why = f"load_step={step} was asked for" if explicit else "strict_resume=True"
                raise kind(f"{dir} fails its checks ({reason}); not falling back to an older step "
                           f"because {why}. {_advice(step, older, self.config.save_folder)}")
            self.skipped_steps += (SkippedStep(step, dir, reason),)
            if older is None:
                raise kind(f"{dir} fails its checks ({reason}) and no older committed step exists to "
                           "fall back to: restore the step, or start the run afresh in a new save_folder")
            if self.coord.is_coordinator:
                log.error("resume: %s fails its checks (%s); falling back to the previous committed step %s. "
                          "Set strict_resume=True to stop instead; `cloudckpt verify %s` shows what is wrong",
                          dir, reason, older, dir)
            dir = older

    def _refuse(self, step: int, reason: str) -> str | None:
        """Coordinator: record that ``step`` failed its checks (a refusal note beside the
        run, ``refusals``) and return the newest committed step folder below it (None: none)."""
        refusals.record(self.save_location, step, reason)
        return _newest_committed_below(self.save_location, step)

    def _decide_steps_above(self, dir: str, *, explicit: bool) -> None:
        """Committed steps above the resumed one (skipped as corrupt, or newer than an
        explicit ``load_step``) are decided now, not at the save that would meet them.
        Steps that failed their checks (this resume's ``skipped_steps``, or a refusal note
        that still describes the step) are replaced as the run reaches them; others block
        an explicit ``load_step`` unless ``save_overwrite``."""
        step = layout.parse_step_dir(dir)
        above, noted = self.coord.on_coordinator("steps above", lambda: self._steps_above(step))
        refused = {s.step for s in self.skipped_steps if s.step > step} | set(noted)
        above = sorted(set(above) | refused)
        if not above:
            return
        healthy = sorted(set(above) - refused)
        if explicit and not self.config.checkpointer.save_overwrite and healthy:
            raise ConfigError(
                f"resume: load_step={step}, but {self.config.save_folder} has committed steps above it "
                f"({_steps_text(healthy)}); training on would mix two histories in one folder and meet those steps. "
                "Branch into a new save_folder, remove them (cloudckpt rm), or set save_overwrite=True to replace "
                "them as the run reaches them")
        self.steps_above_resumed = frozenset(above)
        self.refused_above = frozenset(refused)
        self.maintenance.refused(refused)
        if not self.coord.is_coordinator:
            return
        if refused:
            mine = {s.step for s in self.skipped_steps}
            why = "; ".join(f"step{s}: {noted[s]}" for s in sorted(set(noted) - mine)[:3])
            log.warning("resume: step(s) above the resumed step %d failed their checks: %s%s; they are replaced "
                        "as the run reaches them (the refused step is deleted first)", step,
                        _steps_text(sorted(refused)), f" (recorded earlier: {why})" if why else "")
        if healthy:
            overwrite = self.config.checkpointer.save_overwrite
            what = ("replaced as the run reaches them (save_overwrite=True)" if overwrite else
                    "kept: the saves of these step numbers are skipped (set save_overwrite=True to replace them)")
            log.warning("resume: committed steps above the resumed step %d: %s; they will be %s", step,
                        _steps_text(healthy), what)

    def _steps_above(self, step: int) -> tuple[list[int], dict[int, str]]:
        """Coordinator: the committed steps above ``step``, and the steps above it with a
        refusal note that still describes them (``{step: "reason (refused at T)"}``). A
        note for ``step`` itself is removed: the step just passed its checks."""
        loc = self.save_location
        notes = refusals.read_all(loc)
        if step in notes:
            log.warning("resume: %s passed its checks; it was recorded as refused at %s (%s): removing that note",
                        layout.step_dir(loc.url, step), notes[step].when, notes[step].reason[:200])
            refusals.remove(loc, step)
        live = refusals.live(loc, notes, [s for s in notes if s > step])
        return (_committed_above(loc, step),
                {s: f"{n.reason[:200]} (refused at {n.when})" for s, n in live.items()})

    def step_to_resume(self, *, load_step: int | None = None) -> str | None:
        """The bucket step folder ``resume`` loads (``load_step``, default the config's,
        else the newest committed; None if there is none), after removing uncommitted
        leftovers of a crashed attempt above it. Collective: rank 0 decides, every rank
        gets the answer. Integrations that load by themselves (Hugging Face) use it."""
        loc = self.save_location
        load_step = self.config.load_step if load_step is None else load_step

        def discover():
            skipped: list = []
            if load_step is not None:
                latest = _committed_step(loc, load_step)
            else:
                latest, skipped = discovery.newest_usable(loc, skip_refused=True)
                for s, _dir, reason in skipped:
                    refusals.record(loc, s, reason)
                if skipped and self.config.strict_resume:
                    s, dir, reason = skipped[0]
                    raise CorruptCheckpoint(f"{dir} is committed but its marker is refused ({reason}); not falling "
                                            "back to an older step because strict_resume=True. "
                                            + _advice(s, latest, self.config.save_folder))
                for _step, dir, reason in skipped:
                    log.error("resume: %s is committed but its marker is refused (%s); passing over it to an older "
                              "step. Set strict_resume=True to stop instead", dir, reason)
            step = layout.parse_step_dir(latest) if latest else -1
            rep = retention.gc(loc, only_steps_above=step)  # uncommitted folders only: a refused marker stays
            if rep.step_dirs:
                log.warning("removed uncommitted leftovers of a crashed attempt above step %d: %s", step, rep.step_dirs)
            return latest, skipped

        latest, skipped = self.coord.on_coordinator("discover", discover)
        self.skipped_steps += tuple(SkippedStep(step, dir, reason) for step, dir, reason in skipped)
        if latest is None and skipped:
            raise CorruptCheckpoint(f"no usable committed step in {self.config.save_folder}: "
                                    f"{', '.join(d for _, d, _ in skipped[:3])} cannot be read (see the log); restore "
                                    "one, or start the run afresh in a new save_folder")
        return latest

    # ------------------------------------------------------------ save
    def due(self, step: int) -> str | None:
        """``"persistent"``, ``"ephemeral"`` or None for this step."""
        c = self.config
        if c.save_interval and step % c.save_interval == 0:
            return "persistent"
        if c.ephemeral_save_interval and step % c.ephemeral_save_interval == 0:
            return "ephemeral"
        return None

    def maybe_save(self, step: int, state_dict: dict, train_state: Any = None, *, force: bool = False) -> Any:
        """Save if ``step`` is due (or ``force``). Collective.

        A step above the resumed one that is already committed is not saved over
        (a warning) unless ``save_overwrite``; one that failed its checks at resume
        (``refused_above``) is deleted first (a warning) and saved afresh. After the save
        commits, rank 0 prunes and garbage-collects in the background.

        Args:
            step: the training step; the config's intervals decide whether it is due
                (persistent, ephemeral, local).
            state_dict: the model/optimizer state (DCP).
            train_state: this rank's picklable extras (plain data), with the RNG states
                and data loaders added when ``exact_resume``.
            force: save a persistent step even when it is not due.

        Returns:
            The ``Marker`` (sync), a ``Future`` of it (``async_save``), or None when not due.

        Raises:
            SaveFailed: a rank failed (nothing was committed); with ``async_save``, an
                earlier save's failure is raised by a later call, ``wait`` or ``close``.
            CheckpointExists: the step is committed and ``save_overwrite`` is off.
            SaveInProgress: another save holds the step's lock.
        """
        for loader in self._loaders.values():
            loaders.release(loader)  # the first step after a resume has run
        kind = self.due(step) or ("persistent" if force else None)
        if kind is not None and step in self.refused_above:
            self.coord.on_coordinator("replace refused step", functools.partial(self._drop_refused, step))
            self.refused_above -= {step}
            self.steps_above_resumed -= {step}
        if kind is not None and step in self.steps_above_resumed and not self.config.checkpointer.save_overwrite:
            if self.coord.is_coordinator:
                log.warning("step %d is already committed in %s (it was above the resumed step): not saving over it",
                            step, self.config.save_folder)
            kind = None
        every = self.config.local.local_save_interval
        local = self.local is not None and bool(every) and step % every == 0
        if kind is None and not local:
            return None
        if self.local is not None:
            return self.save_local(step, state_dict, train_state, persist=kind is not None,
                                   ephemeral=kind == "ephemeral")
        return self.save(step, state_dict, train_state, ephemeral=kind == "ephemeral")

    def _drop_refused(self, step: int) -> None:
        """Coordinator: delete the committed step ``step`` that failed its checks at resume
        (marker first, then its objects and its refusal note), so the run can save it."""
        dir = layout.step_dir(self.save_location.url, step)
        log.warning("replacing %s, which failed its checks at resume: deleting it (marker first) to save step %d "
                    "afresh", dir, step)
        retention.delete_step(self.save_location.at(dir))

    def _with_rng(self, train_state: Any) -> Any:
        if not self.config.exact_resume:
            return train_state
        train_state = dict(train_state or {})
        train_state[exact_resume.KEY] = exact_resume.capture(self._loaders)
        return train_state

    def save_local(self, step: int, state_dict: dict, train_state: Any = None, *, persist: bool = False,
                   ephemeral: bool = False) -> Any:
        """Write a local step (node-local tier), copy it to peer nodes in the background
        and, with ``persist``, upload it to the bucket from the same files. Returns the
        local part's Marker (sync) or a Future of it (``async_save``). Collective."""
        train_state = self._with_rng(train_state)
        dest = layout.step_dir(self.config.save_folder, step) if persist else None
        if persist:
            with self._lock:
                self._writing.add(step)

        def write(sd: dict, ts: Any):
            return self.local.save(step, sd, ts, persist_to=dest, ephemeral=ephemeral,
                                   on_persisted=(lambda ok: self._after_save(step, ok, ephemeral)) if persist else None)

        if self.config.async_save:
            return self.checkpointer._run_async(write, state_dict, train_state)
        try:
            return write(state_dict, train_state)
        except BaseException:
            if persist:
                self._after_save(step, False, ephemeral)
            raise

    def save(self, step: int, state_dict: dict, train_state: Any = None, *, ephemeral: bool = False) -> Any:
        dir = layout.step_dir(self.config.save_folder, step)
        train_state = self._with_rng(train_state)
        with self._lock:
            self._writing.add(step)
        if self.config.async_save:
            fut = self.checkpointer.save_async(dir, state_dict, train_state, ephemeral=ephemeral)
            fut.add_done_callback(lambda f: self._after_save(step, f.exception() is None, ephemeral))
            return fut
        try:
            marker = self.checkpointer.save(dir, state_dict, train_state, ephemeral=ephemeral)
        except BaseException:
            self._after_save(step, False, ephemeral)
            raise
        self._after_save(step, True, ephemeral)
        return marker

    def _after_save(self, step: int, ok: bool, ephemeral: bool) -> None:
        with self._lock:
            self._writing.discard(step)
            if ok:
                self.last_saved_step = step
        if ok:
            self.maintenance.committed(step, ephemeral=ephemeral)
        if ok and self.coord.is_coordinator and not self._closed:
            self._maint_futures = [f for f in self._maint_futures if not f.done()]
            self._maint_futures.append(self._maint.submit(self._maintain))

    def _maintain(self) -> None:
        with self._lock:
            protect = frozenset(self._writing)
            newest = self.last_saved_step
        try:
            # a save that starts after ``protect`` was taken is above the newest committed step
            self.maintenance.run(protect=protect, keep_above=newest)
        except CloudCkptError as e:
            log.warning("background prune/gc of %s failed (will retry after the next save): %s",
                        self.config.save_folder, e)

    # ------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Wait for in-flight saves, local copies and persists, and background maintenance."""
        self.checkpointer.wait()
        if self.local is not None:
            self.local.wait()
        for f in list(self._maint_futures):
            f.result()

    def close(self) -> None:
        """Wait for in-flight work, then release resources. Raises an unreported async failure."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._maint.shutdown(wait=True)
            if self.local is not None:
                self.local.close()
            self.checkpointer.close()
            self._restore_sigterm()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ SIGTERM
    def _install_sigterm(self) -> None:
        self._prev_handler = None
        if threading.current_thread() is not threading.main_thread():
            return
        self._prev_handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._prev_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_handler)
            self._prev_handler = None

    def _on_sigterm(self, signum, frame) -> None:
        pending = self.checkpointer.in_flight() + (self.local.in_flight() if self.local is not None else [])
        shutdown = self.config.shutdown
        if shutdown.sigterm == "finish" and pending:
            log.warning("SIGTERM: finishing %d in-flight save(s) (up to %.0fs)", len(pending), shutdown.sigterm_timeout)
            for f in pending:
                try:
                    f.result(timeout=shutdown.sigterm_timeout)
                except Exception as e:  # noqa: BLE001 - exiting anyway; the save is not committed
                    log.warning("SIGTERM: in-flight save did not commit (%s); it stays invisible", e)
        elif pending:
            log.warning("SIGTERM: abandoning %d in-flight save(s); they are not committed and stay invisible",
                        len(pending))
        prev = self._prev_handler
        self._restore_sigterm()
        if callable(prev):
            prev(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def _committed_step(folder: Location, step: int) -> str:
    """The folder of committed step ``step`` under ``folder``; NotACheckpoint naming the
    nearest committed steps if it is not committed."""
    dir = layout.step_dir(folder.url, step)
    if discovery.dir_is_checkpoint(folder.at(dir)):
        return dir
    committed = [s for s, _ in discovery.find_checkpoints(folder)]
    nearest = sorted(sorted(committed, key=lambda s: (abs(s - step), s))[:3])
    raise NotACheckpoint(
        f"load_step={step}: {dir} is not a committed checkpoint; "
        + (f"the nearest committed steps are {nearest} (of {len(committed)}): pass one of them, or leave load_step "
           "unset to resume from the newest" if committed else f"{folder.url} holds no committed checkpoint"))


def _advice(step: int, older: str | None, folder: str) -> str:
    """What to do about a committed step that failed its checks, with the setting that
    works the first time."""
    if older is None:
        return (f"No older committed step exists: restore step{step}, or start the run afresh in a new save_folder "
                f"(`cloudckpt list {folder}` marks it REFUSED)")
    return (f"The refusal is recorded (`cloudckpt list {folder}` marks step{step} REFUSED). Restore the step, or "
            f"resume from the previous committed step with load_step={layout.parse_step_dir(older)}: the run then "
            f"replaces step{step} when it reaches it")


def _steps_text(steps: list[int]) -> str:
    return ", ".join(f"step{s}" for s in steps[:10]) + (f" and {len(steps) - 10} more" if len(steps) > 10 else "")


def _committed_above(folder: Location, step: int) -> list[int]:
    """Committed steps above ``step`` (one LIST, one marker check per step above)."""
    return [s for s, d in discovery.list_step_dirs(folder) if s > step and discovery.dir_is_checkpoint(folder.at(d))]


def _newest_committed_below(folder: Location, step: int) -> str | None:
    """The newest committed step folder below ``step`` (one LIST, marker checks from the top down)."""
    for s, d in sorted(discovery.list_step_dirs(folder), reverse=True):
        if s < step and discovery.dir_is_checkpoint(folder.at(d)):
            return d
    return None


def _corrupt_class(name: str) -> type[CorruptCheckpoint]:
    """The CorruptCheckpoint subclass of cloudckpt.errors called ``name`` (else CorruptCheckpoint)."""
    cls = getattr(errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, CorruptCheckpoint) else CorruptCheckpoint
