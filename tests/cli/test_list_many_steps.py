"""Issue 5 acceptance: ``cloudckpt list`` on a save folder of 1,200 committed steps
(more than one LIST page) returns every one, correctly flagged, against SeaweedFS.

The wall time of the command is measured and printed (run with ``-s`` to see it),
not asserted: the project does not time unit tests. The figure is recorded in docs/cli.md.
"""

from __future__ import annotations

import time

import pytest

from .helpers import cli, new_root, save_steps, write_fake_steps, write_incomplete_step

N_FAKE = 1200
REAL = (1300, 1400)  # real checkpoints made with the Checkpointer, ephemeral and persistent
INCOMPLETE = tuple(range(1205, 1255, 5))  # 10 uncommitted folders between the committed ones


def _ephemeral(step: int) -> bool:
    return step % 3 != 0


@pytest.mark.slow  # writes 1,200 markers: about 11 s
def test_list_returns_every_one_of_1200_committed_steps_flagged(stores, tmp_path_factory):
    folder = new_root("s3", stores, tmp_path_factory) + "/run-big"
    t0 = time.perf_counter()
    write_fake_steps(folder, {s: _ephemeral(s) for s in range(1, N_FAKE + 1)}, threads=32)
    for s in INCOMPLETE:
        write_incomplete_step(folder, s)
    save_steps(folder, [(REAL[0], True), (REAL[1], False)], str(tmp_path_factory.mktemp("work")))
    setup = time.perf_counter() - t0

    r = cli("list", folder, "--json")
    assert r.code == 0, r.err
    steps = r.lines()
    expected = {**{s: _ephemeral(s) for s in range(1, N_FAKE + 1)}, REAL[0]: True, REAL[1]: False}
    assert [s["step"] for s in steps] == sorted(expected)
    assert all(s["status"] == "committed" for s in steps)
    assert {s["step"]: s["ephemeral"] for s in steps} == expected
    assert {s["step"]: s["object_count"] for s in steps if s["step"] in REAL} == {REAL[0]: 6, REAL[1]: 6}

    r_all = cli("list", folder, "--all", "--json")
    incomplete = [s["step"] for s in r_all.lines() if s["status"] == "incomplete"]
    assert incomplete == list(INCOMPLETE) and len(r_all.lines()) == len(expected) + len(INCOMPLETE)

    r_table = cli("list", folder)
    assert r_table.code == 0 and len(r_table.out.splitlines()) == 1 + len(expected) + 1
    assert r_table.out.splitlines()[-1].startswith(f"{len(expected)} committed (401 persistent, 801 ephemeral)")

    print(f"\n[cli list] {len(expected)} committed + {len(INCOMPLETE)} incomplete step folders on SeaweedFS "
          f"(setup {setup:.1f}s): `cloudckpt list --json` {r.seconds:.2f}s, `--all --json` {r_all.seconds:.2f}s, "
          f"table {r_table.seconds:.2f}s (wall time of the subprocess, interpreter start included)")
