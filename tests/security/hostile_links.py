"""Class 1: links planted in the local folders cloudckpt works in.

The node-local tier's folder (``local_dir``; a pre-created ``/dev/shm/ckpt`` or a shared
scratch disk) may hold links someone else planted, at every level: in place of a step
folder, a rank's part, a folder or a file of a part, the ``.replicated-rank{R}`` marker,
a ``.tmp-*`` folder, the node folder's run file. None is ever followed: a save into one
is refused (typed), a read through one does not happen (the part does not count),
retention removes the link itself and never an entry of its target. Pre-download and
the per-rank work dirs: a work folder that is a link, or a folder, made by another user
is refused.

Each try builds a one-process manager with the tier (``local_dir = tmp/local``, the
bucket folder is ``root``), plants, and runs one entry point inside
``outside_untouched``; what the try asserts itself (the link removed, not its target;
the planted part not resumed from) is checked in the child, an AssertionError being a
finding.
"""

from __future__ import annotations

import os
import shutil
import stat

from .tries import OK, REFUSED, Try, outside_untouched

N = 3  # the step the tries save or read


def _cfg(tmp: str, root: str, **kw):
    from cloudckpt import CheckpointConfig

    opts = dict(save_folder=root, local_dir=os.path.join(tmp, "local"), local_save_interval=1, save_interval=1000,
                keep_last_local=2, work_dir=os.path.join(tmp, "work"), exact_resume=False, collective_timeout=20)
    opts.update(kw)
    return CheckpointConfig(**opts)


def _state(v: float = 0.0) -> dict:
    import torch

    return {"w": torch.full((64,), v), "b": torch.full((4,), v)}


def _save(mgr, steps) -> None:
    for s in steps:
        mgr.maybe_save(s, _state(float(s)), {"step": s})
    mgr.wait()


def _local(tmp: str, *rel: str) -> str:
    return os.path.join(tmp, "local", *rel)


def _link(target: str, at: str) -> None:
    os.makedirs(os.path.dirname(at), exist_ok=True)
    os.symlink(target, at)


def _plant(tmp: str, where: str, step: int) -> str:
    """Plant a link at the level ``where`` of step ``step``'s local folder, to a folder
    or a file under ``outside/``; returns the link's path."""
    outside = os.path.join(tmp, "outside")
    step_dir = _local(tmp, f"step{step}")
    target_dir = os.path.join(outside, "X")
    os.makedirs(target_dir, exist_ok=True)
    for n in ("rank0", "keep.bin"):  # what a followed link would write over or delete
        if n == "rank0":
            os.makedirs(os.path.join(target_dir, n), exist_ok=True)
        else:
            with open(os.path.join(target_dir, n), "wb") as f:
                f.write(b"x" * 10)
    victim = os.path.join(outside, "victim")
    at, target = {
        "step": (step_dir, target_dir),
        "step_file": (step_dir, victim),
        "rank": (os.path.join(step_dir, "rank0"), target_dir),
        "rank_file": (os.path.join(step_dir, "rank0"), victim),
        "tmp": (os.path.join(step_dir, ".tmp-write0-dead"), target_dir),
        "replicated": (os.path.join(step_dir, ".replicated-rank0"), victim),
        "run_file": (_local(tmp, ".cloudckpt-run.json"), victim),
        "model_dir": (os.path.join(step_dir, "rank0", "model_and_optim"), target_dir),
        "shard_file": (os.path.join(step_dir, "rank0", "model_and_optim", "__0_0.distcp"), victim),
        "train_file": (os.path.join(step_dir, "rank0", "train", "rank0.pt"), victim),
        "manifest": (os.path.join(step_dir, "rank0", "part.json"), victim),
    }[where]
    if os.path.lexists(at):  # a real one of an earlier save: moved out of the way, kept outside
        shutil.move(at, os.path.join(outside, "moved-" + os.path.basename(at)))
    _link(target, at)
    return at


# ----------------------------------------------------------------- entry points
def local_tier_save(tmp: str, root: str, where: str) -> None:
    """Plant at ``where`` before the local save of step N (a fresh run; the bucket empty)."""
    if where == "run_file":
        _plant(tmp, where, N)
    else:
        with _cfg(tmp, root).build():
            pass  # the run file: the folder is this run's
        if where not in ("step", "step_file"):
            os.makedirs(_local(tmp, f"step{N}"))  # a real step folder holding the link
        _plant(tmp, where, N)
    with outside_untouched(tmp):
        with _cfg(tmp, root).build() as mgr:
            _save(mgr, [N])
    run_file = os.lstat(_local(tmp, ".cloudckpt-run.json"))
    assert stat.S_ISREG(run_file.st_mode), "the run file is this run's own file (a planted link replaced, not followed)"
    st = os.lstat(_local(tmp, f"step{N}", "rank0"))
    assert stat.S_ISDIR(st.st_mode), "the part is a real folder"


def local_tier_retention(tmp: str, root: str, where: str) -> None:
    """Steps 1..N saved; a link planted at ``where`` of step 1 (which retention removes
    with keep_last_local=2 at the next save); the save of N+1 prunes."""
    with _cfg(tmp, root).build() as mgr:
        _save(mgr, [1])
    at = _plant(tmp, where, 1)
    with outside_untouched(tmp):
        with _cfg(tmp, root).build() as mgr:
            _save(mgr, [2, N])
    assert not os.path.lexists(at), f"{at}: the planted link is still there"
    assert sorted(os.listdir(_local(tmp))) == [".cloudckpt-run.json", "step2", f"step{N}"], os.listdir(_local(tmp))


def local_tier_resume(tmp: str, root: str, where: str) -> None:
    """Local steps 1..N saved (nothing in the bucket); step N's part is moved outside and
    a link to it planted at ``where``: resume must not use step N through the link."""
    with _cfg(tmp, root).build() as mgr:
        _save(mgr, range(1, N + 1))
    outside = os.path.join(tmp, "outside")
    step_dir = _local(tmp, f"step{N}")
    real = {  # the genuine thing the link points at (a followed link would resume from it)
        "step": step_dir, "rank": os.path.join(step_dir, "rank0"),
        "model_dir": os.path.join(step_dir, "rank0", "model_and_optim"),
        "shard_file": os.path.join(step_dir, "rank0", "model_and_optim", "__0_0.distcp"),
        "train_file": os.path.join(step_dir, "rank0", "train", "rank0.pt"),
        "manifest": os.path.join(step_dir, "rank0", "part.json"),
        "replicated": os.path.join(step_dir, ".replicated-rank0"),
        "run_file": _local(tmp, ".cloudckpt-run.json"),
    }[where]
    moved = os.path.join(outside, "genuine-" + os.path.basename(real))
    shutil.move(real, moved)
    os.symlink(moved, real)
    with outside_untouched(tmp):
        with _cfg(tmp, root).build() as mgr:
            ts = mgr.resume(_state())
    assert mgr.resumed_step != N, f"resumed from local step {N} through the link at {real}"
    assert ts in (None, {"step": N - 1}), ts


def _foreign(path: str) -> None:
    """Make ``path`` (a link or a folder) another user's: chown when root, else tell
    cloudckpt this process is another user (the same check either way)."""
    if os.geteuid() == 0:
        os.lchown(path, 4242, 4242)
    else:
        from cloudckpt.storage import nofollow

        real = os.geteuid()
        nofollow._euid = lambda: real + 1


def load_pre_download_work_dir(tmp: str, root: str, how: str) -> None:
    """A save in ``root``; then a pre-download load whose work_dir (``tmp/scratch/work``)
    is a link to ``outside/`` made by another user, or a folder another user made first
    (the ``/tmp/cloudckpt-work-<uid>`` of a shared machine)."""
    from cloudckpt import Checkpointer

    step = os.path.join(root, "step1")
    with Checkpointer(work_dir=os.path.join(tmp, "w0")) as ck:
        ck.save(step, _state(1.0), {"step": 1})
    work = os.path.join(tmp, "scratch", "work")
    os.makedirs(os.path.dirname(work))
    if how == "link":
        os.symlink(os.path.join(tmp, "outside"), work)
    else:
        os.makedirs(work, mode=0o777)
    _foreign(work)
    with outside_untouched(tmp):
        with Checkpointer(work_dir=work, pre_download=True) as ck:
            ck.load(step, _state())


_LEVELS = {  # where the link is planted (N: the step saved, pruned or resumed from): what it points at
    "step": "local_dir/stepN -> a folder outside (or, for resume, the genuine step moved there)",
    "step_file": "local_dir/stepN -> a file outside",
    "rank": "local_dir/stepN/rank0 -> a folder outside (or the genuine part)",
    "rank_file": "local_dir/stepN/rank0 -> a file outside",
    "tmp": "local_dir/stepN/.tmp-write0-* -> a folder outside",
    "replicated": "local_dir/stepN/.replicated-rank0 -> a file outside",
    "model_dir": "local_dir/stepN/rank0/model_and_optim -> a folder outside (or its genuine copy)",
    "shard_file": "a shard file of the part -> a file outside (or its genuine copy)",
    "train_file": "the part's train/rank0.pt -> a file outside (or its genuine copy)",
    "manifest": "the part's part.json -> its genuine copy outside",
    "run_file": "local_dir/.cloudckpt-run.json (the node folder's run file) -> a file outside: never read; "
                "replaced itself when the folder holds no steps, refused when it does",
}
_ENTRIES = {  # entry point: {level: expected outcome}
    "local_tier_save": {"step": REFUSED, "step_file": REFUSED, "rank": OK, "rank_file": OK, "tmp": OK,
                        "replicated": OK, "run_file": OK},
    "local_tier_retention": {w: OK for w in ("step", "step_file", "rank", "rank_file", "tmp", "replicated",
                                             "model_dir", "shard_file", "train_file")},
    "local_tier_resume": {"step": OK, "rank": OK, "model_dir": OK, "shard_file": OK, "train_file": OK,
                          "manifest": OK, "replicated": OK, "run_file": REFUSED},
}

TRIES: list[Try] = (
    [Try(1, f"tier-{w}", _LEVELS[w], entry, f"tests.security.hostile_links:{entry}", {"where": w}, expect)
     for entry, levels in _ENTRIES.items() for w, expect in levels.items()]
    + [Try(1, "work-dir-link", "work_dir is a link to a folder outside, made by another user", "load_pre_download",
           "tests.security.hostile_links:load_pre_download_work_dir", {"how": "link"}, REFUSED),
       Try(1, "work-dir-foreign", "work_dir is a folder another user made first (a squatted /tmp name)",
           "load_pre_download", "tests.security.hostile_links:load_pre_download_work_dir", {"how": "folder"}, REFUSED)]
)
