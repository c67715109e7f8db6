"""Hugging Face Trainer and Accelerate through cloudckpt, against real stores: the examples
train a tiny model built from a config (no download) in a child process checkpointing to
SeaweedFS or fake-gcs-server, are SIGKILLed after a committed save, and resume in a new
process. The state right after the resume equals the state at the save (weights, AdamW
moments and step counts, LR scheduler, RNG, global step), and the final state equals an
uninterrupted run's, bit for bit (the models use dropout, so the RNG matters)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # the hf extra is installed by scripts/setup.sh: missing means a broken install
    raise ImportError("transformers/accelerate are not installed; pip install -e '.[test,hf]'") from e

from checkpoint.test_resume_after_kill import _same as _assert_same

from cloudckpt import Checkpointer

WORKER = Path(__file__).parent / "hf_workers.py"
ROOT = Path(__file__).resolve().parents[2]


def _worker(kind: str, folder: str, dump_dir: Path, *extra: str) -> subprocess.Popen:
    dump_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(WORKER), kind, folder, "8", str(dump_dir), *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _wait_stalled(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait for the STALLED line; fail with the child's output if it exits or hangs first."""
    lines: list[str] = []
    seen = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("STALLED"):
                seen.set()
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    if not seen.wait(timeout):
        proc.kill()
        pytest.fail("the child did not reach its stall point:\n" + "".join(lines)[-4000:])


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``start(kind)``: the uninterrupted run of that kind (local folder) and its dump
    folder; started by the first test that asks, shared by the others (it is deterministic)."""
    runs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(kind: str) -> tuple[subprocess.Popen, Path]:
        if kind not in runs:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{kind}")
            runs[kind] = _worker(kind, str(tmp / "ref-folder"), tmp / "ref"), tmp / "ref"
        return runs[kind]

    yield start
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _kill_and_resume(kind: str, folder: str, tmp_path: Path, uninterrupted) -> None:
    ref, ref_dir = uninterrupted(kind)  # runs beside this test's runs when this test started it
    victim = _worker(kind, folder, tmp_path / "victim", "--stall-at", "4")
    try:
        _wait_stalled(victim)
        # step 4 is committed (the stall comes after its save returned); nothing later was started
        assert Checkpointer.dir_is_checkpoint(f"{folder}/step4")
        assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [2, 4]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        assert victim.returncode == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
    _finish(_worker(kind, folder, tmp_path / "resumed"))
    if ref.returncode is None:  # (a later test finds it finished)
        _finish(ref)
    assert ref.returncode == 0

    stalled = _load(tmp_path / "victim" / "stalled.pt")
    resumed = _load(tmp_path / "resumed" / "resumed.pt")
    assert stalled["step"] == resumed["step"] == 4
    _assert_same(stalled["model"], resumed["model"], "weights at resume")
    assert stalled["optim"]["state"], "AdamW has per-parameter state at step 4"
    _assert_same(stalled["optim"], resumed["optim"], "optimizer state at resume")
    _assert_same(stalled["sched"], resumed["sched"], "LR scheduler at resume")
    _assert_same(stalled["rng"], _load(tmp_path / "resumed" / "first_step_rng.pt"), "RNG at the first resumed step")

    final, want = _load(tmp_path / "resumed" / "final.pt"), _load(ref_dir / "final.pt")
    assert final["step"] == want["step"] == 8
    for key in ("model", "optim", "sched"):
        _assert_same(want[key], final[key], f"final {key} vs an uninterrupted run")
    # the resumed run went on committing; max_checkpoints=3 pruned the oldest
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [4, 6, 8]


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_trainer_killed_after_a_commit_resumes_from_the_bucket_like_an_uninterrupted_run(backend, request, tmp_path,
                                                                                        uninterrupted):
    folder = request.getfixturevalue({"s3": "s3_bucket", "gcs": "gcs_bucket"}[backend]) + "/hf-run"
    _kill_and_resume("trainer", folder, tmp_path, uninterrupted)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_accelerate_killed_after_a_commit_resumes_from_the_bucket_like_an_uninterrupted_run(backend, request, tmp_path,
                                                                                           uninterrupted):
    folder = request.getfixturevalue({"s3": "s3_bucket", "gcs": "gcs_bucket"}[backend]) + "/acc-run"
    _kill_and_resume("accelerate", folder, tmp_path, uninterrupted)


def _example_trainer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_trainer_example", ROOT / "examples" / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_resume_guards_against_a_silent_fresh_optimizer_and_foreign_steps(tmp_path):
    from cloudckpt import AppState
    from cloudckpt.errors import CheckpointError, IncompatibleCheckpoint

    example = _example_trainer()
    folder = str(tmp_path / "run")
    trainer, cloud = example.make_trainer(folder, max_steps=2, output_dir=str(tmp_path / "out1"))
    assert cloud.prepare_resume() is None, "nothing committed yet: start from scratch"
    trainer.train(resume_from_checkpoint=None)
    cloud.close()
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [2]

    # prepared a resume, then trained without passing the folder: refused, not a fresh optimizer
    trainer, cloud = example.make_trainer(folder, max_steps=4, output_dir=str(tmp_path / "out2"))
    path = cloud.prepare_resume()
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "rng_state.pth", "trainer_state.json"]
    with pytest.raises(CheckpointError, match="resume_from_checkpoint"):
        trainer.train()
    cloud.close()

    # a step written by something else (no hf section in its train state) is refused by name
    with Checkpointer(distributed=False, work_dir=str(tmp_path / "w")) as c:
        c.save(f"{folder}/step10", AppState(torch.nn.Linear(2, 2)), {"step": 10})
    trainer, cloud = example.make_trainer(folder, max_steps=12, output_dir=str(tmp_path / "out3"))
    with pytest.raises(IncompatibleCheckpoint, match="step10 was not saved by cloudckpt's Hugging Face integration"):
        cloud.prepare_resume()
    cloud.close()


def _prepare_in_a_child(folder: str, work_dir: Path, *, killed: bool) -> str:
    """prepare_resume() in a new process that then exits normally (or is SIGKILLed);
    returns the folder it prepared."""
    code = ("import os, signal, sys\n"
            "from cloudckpt.integrations.hf import CloudCheckpointCallback\n"
            "path = CloudCheckpointCallback(sys.argv[1], work_dir=sys.argv[2]).prepare_resume()\n"
            "print('PREPARED', path, os.listdir(path), flush=True)\n"
            "if sys.argv[3] == 'kill':\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, folder, str(work_dir), "kill" if killed else "exit"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == (-signal.SIGKILL if killed else 0), proc.stdout + proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PREPARED "))
    assert "model.safetensors" in line, line
    return line.split()[1]


def test_the_resume_folder_is_removed_once_read_at_exit_and_after_a_kill(tmp_path):
    """prepare_resume's folder is a full copy of the weights: removed when the first
    resumed step begins, at process exit when training never ran, and, after a
    SIGKILL, by the next prepare_resume on the machine (a live process's is kept)."""
    from transformers import TrainerCallback

    example = _example_trainer()
    folder = str(tmp_path / "run")
    trainer, cloud = example.make_trainer(folder, max_steps=2, output_dir=str(tmp_path / "out1"))
    trainer.train(resume_from_checkpoint=cloud.prepare_resume())
    cloud.close()

    seen = []

    class Probe(TrainerCallback):  # after the cloud callback: sees the folder as the step begins
        def on_step_begin(self, args, state, control, **kw):
            seen.append((state.global_step, os.path.exists(path)))

    trainer, cloud = example.make_trainer(folder, max_steps=4, output_dir=str(tmp_path / "out2"), callbacks=[Probe()])
    path = cloud.prepare_resume()
    base = os.path.dirname(path)
    assert os.path.basename(base).startswith(f"hf-resume-{os.getpid()}-") \
        and os.path.isfile(f"{path}/model.safetensors")
    trainer.train(resume_from_checkpoint=path)
    cloud.close()
    assert trainer.state.global_step == 4 and seen == [(2, False), (3, False)], seen
    assert not os.path.exists(base)
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [2, 4]
    # the finished job run again resumes at max_steps, trains one more step and commits it (docs say so)
    trainer, cloud = example.make_trainer(folder, max_steps=4, output_dir=str(tmp_path / "out3"))
    path = cloud.prepare_resume()
    trainer.train(resume_from_checkpoint=path)
    cloud.close()
    assert trainer.state.global_step == 5 and not os.path.exists(os.path.dirname(path))
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [2, 4, 5]

    work = tmp_path / "work"
    exited = _prepare_in_a_child(folder, work, killed=False)
    assert not os.path.exists(os.path.dirname(exited)), "removed at process exit"
    killed = _prepare_in_a_child(folder, work, killed=True)
    assert os.path.isfile(f"{killed}/model.safetensors"), "a SIGKILL leaves it"
    live = work / f"hf-resume-{os.getppid()}-live"  # a process that is still running (pytest's parent)
    live.mkdir()
    cloud = example.CloudCheckpointCallback(folder, work_dir=str(work))
    mine = cloud.prepare_resume()
    assert not os.path.exists(os.path.dirname(killed)) and live.is_dir() and os.path.isdir(mine)
    cloud.close()
    assert [n for n in os.listdir(work) if n.startswith("hf-resume-")] == [live.name]
