"""A rank that dies (SIGKILL) or hangs (SIGSTOP) in the middle of a save or a load, on
real gloo ranks (2 and 8) and a local folder: every surviving rank raises PeerLost
naming the collective step it was in and the step folder, within
``collective_timeout`` of the victim's end; nothing partial is committed, and a restart
resumes from the previous step, bit-exact.

Where the victim stops, and the step every survivor names:

- in DCP's write of step 2 (its data not written): ``DCP's barrier`` (step 2 is planned
  from step 1's structure: DCP runs with no collective but its closing barrier);
- in AGREE of step 2 (its part not reported): ``agree``;
- in the load's read of step 1 (after the read-once exchange's census): ``load read``.

The time from the victim's end to each survivor's error is printed (``-s``); at 2 and
8 ranks it is well under a second for a dead rank (its connections close, and each
survivor that sees it closes its own: dist.Coordinator._give_up) and
``collective_timeout`` for a hung one. The 8-rank cases take about 25 s each (slow).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from cloudckpt import CheckpointConfig
from cloudckpt.checkpoint import layout

from . import checks, dead_rank_workers, workers

TIMEOUT = 10.0  # collective_timeout of the ranks: the bound a survivor waits for a silent peer
STEP = {"write": "DCP's barrier", "agree": "agree", "read": "load read"}


def _run(tmp_path, world_size: int, phase: str, victim: int, sig: str = "SIGKILL", timeout: float = TIMEOUT):
    """Run the job; return (the step folder, {survivor: outcome}, the victim's end time)."""
    folder = str(tmp_path / "ckpt" / "run")
    out = tmp_path / "out"
    out.mkdir()
    job = workers.Job(world_size, dead_rank_workers.run, folder, str(tmp_path / "work"), phase, victim, sig,
                      timeout, str(out), env=checks.rank_env(), tmp=str(tmp_path))
    try:
        survivors = [r for r in range(world_size) if r != victim]
        deadline = time.monotonic() + 120 + 2 * timeout
        while time.monotonic() < deadline and not all((out / f"rank{r}.json").exists() for r in survivors):
            time.sleep(0.1)
        job.join(10)
    finally:
        if (out / "victim.json").exists() and sig == "SIGSTOP":
            os.kill(json.loads((out / "victim.json").read_text())["pid"], signal.SIGCONT)
        job.kill_all()
    stderr = {r: (tmp_path / f"rank{r}.stderr").read_text(errors="replace") for r in range(world_size)
              if (tmp_path / f"rank{r}.stderr").exists()}
    assert (out / "victim.json").exists(), f"the victim never reached {phase}: {stderr}"
    outcomes = {r: json.loads((out / f"rank{r}.json").read_text()) for r in survivors
                if (out / f"rank{r}.json").exists()}
    assert sorted(outcomes) == survivors, f"survivors that did not report: {stderr}"
    return folder, outcomes, json.loads((out / "victim.json").read_text())["at"]


def _check_survivors(outcomes: dict, ended: float, *, step: str, where: str, timed_out: bool, bound: float,
                     label: str) -> None:
    delays = {r: o["at"] - ended for r, o in outcomes.items()}
    print(f"\n{label}: time from the victim's end to each survivor's PeerLost: "
          + ", ".join(f"rank {r} {d:.2f} s" for r, d in sorted(delays.items()))
          + f"\n{label}: rank {min(outcomes)} raised: {outcomes[min(outcomes)].get('raised')}: "
          + f"{outcomes[min(outcomes)].get('message')}")
    for r, o in outcomes.items():
        assert o["raised"] == "PeerLost", (r, o)
        assert o["step"] == step and f"collective step '{step}' of {where} failed" in o["message"], (r, o)
        assert o["where"] == where, (r, o)
        assert bool(o["timed_out"]) == timed_out, (r, o)
        assert "Restart the job: a step is committed only once every rank agreed, so nothing partial was " \
               "committed" in o["message"], (r, o)
        assert f"collective_timeout ({TIMEOUT:g} s)" in o["message"] or timed_out, (r, o)
        assert 0 <= delays[r] < bound, (r, delays[r], o)
        # the next save on the spent group: PeerLost at once, naming where the peer was lost; nothing written
        nxt = o["next"]
        assert nxt["raised"] == "PeerLost" and nxt["seconds"] < 2, (r, nxt)
        assert f"collective step 'prepare' of {os.path.dirname(where)}/step3 failed: the group lost a peer rank " \
               f"earlier, at {step} of {where}" in nxt["message"], (r, nxt)
    assert not os.path.exists(os.path.join(os.path.dirname(where), "step3")), "a save on a spent group wrote"


def _restart_resumes_step_1(folder: str, tmp_path, world_size: int) -> None:
    """No marker of step 2 (and step 1 complete); a restart (one rank here) resumes step 1
    bit-exact and can save step 2."""
    assert checks.committed_steps(folder) == [1]
    assert checks.verify_step(checks.step_dir(folder, 1)) == []
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "restart"), exact_resume=False).build()
    try:
        sd = {"model": {}, "optim": {}}
        for r in range(world_size):
            part = dead_rank_workers.state(1, r, zero=True)
            sd["model"].update(part["model"])
            sd["optim"].update(part["optim"])
        ts = mgr.resume(sd)
        assert mgr.resumed_step == 1 and ts == {"step": 1, "rank": 0}
        for r in range(world_size):
            want = dead_rank_workers.state(1, r)
            assert sd["model"][f"w{r}"].equal(want["model"][f"w{r}"]) and sd["optim"][f"m{r}"].equal(
                want["optim"][f"m{r}"]), f"rank {r}'s tensors of step 1 do not load bit-exact"
        mgr.save(2, sd, {"step": 2, "rank": 0})
    finally:
        mgr.close()
    assert checks.committed_steps(folder) == [1, 2]


CASES = [pytest.param(ws, phase, victim, id=f"{ws}ranks-{phase}-kill{victim}",
                      marks=() if ws == 2 else (pytest.mark.slow,))
         for ws, victim in ((2, 1), (8, 3)) for phase in ("write", "agree", "read")]


@pytest.mark.parametrize("world_size,phase,victim", CASES)
def test_a_rank_killed_mid_save_or_load_gives_every_survivor_peer_lost_and_commits_nothing(
        world_size, phase, victim, tmp_path, secret_scan):
    folder, outcomes, ended = _run(tmp_path, world_size, phase, victim)
    where = layout.step_dir(folder, 1 if phase == "read" else 2)
    # a dead rank's connections close, and each survivor that sees it gives the group up (closing
    # its own): every survivor knows in moments, none waits for collective_timeout
    _check_survivors(outcomes, ended, step=STEP[phase], where=where, timed_out=False, bound=TIMEOUT / 2,
                     label=f"{world_size} ranks, rank {victim} killed in {phase}")
    secret_scan.add(*(o["message"] for o in outcomes.values()))
    _restart_resumes_step_1(folder, tmp_path, world_size)


def test_the_coordinator_killed_at_agree_gives_the_survivor_peer_lost(tmp_path, secret_scan):
    folder, outcomes, ended = _run(tmp_path, 2, "agree", 0)
    _check_survivors(outcomes, ended, step="agree", where=layout.step_dir(folder, 2), timed_out=False,
                     bound=TIMEOUT / 2, label="2 ranks, rank 0 killed in agree")
    _restart_resumes_step_1(folder, tmp_path, 2)


def test_a_hung_rank_is_given_up_on_after_collective_timeout(tmp_path, secret_scan):
    """SIGSTOP: the victim's connections stay open; the survivor waits collective_timeout,
    no less and not much more, then raises PeerLost (timed out)."""
    timeout = 4.0
    folder, outcomes, ended = _run(tmp_path, 2, "agree", 1, sig="SIGSTOP", timeout=timeout)
    (o,) = outcomes.values()
    assert o["at"] - ended >= timeout - 0.5, o
    assert f"did not answer within collective_timeout ({timeout:g} s)" in o["message"], o
    assert o["raised"] == "PeerLost" and o["timed_out"] and o["step"] == "agree", o
    assert o["at"] - ended < timeout + 5, o
    print(f"\n2 ranks, rank 1 stopped in agree: PeerLost after {o['at'] - ended:.2f} s: {o['message']}")
    assert checks.committed_steps(folder) == [1]
