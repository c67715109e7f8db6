"""dist.Coordinator.ask_coordinator: each rank sends the coordinator a few integers and
gets its own reply back (a gather and a scatter of fixed-size rows): the load's way of
handing each rank only the manifest part references its plan reads."""

from __future__ import annotations

from cloudckpt.testing.multiprocess import run_ranks


def ask(rank, world_size, fail):
    from cloudckpt import dist

    coord = dist.Coordinator(timeout=60)
    seen = []

    def answer(requests):
        seen.append(requests)
        if fail:
            raise ValueError("no answer for rank 2")
        return [[r * 100 + x for x in req] for r, req in enumerate(requests)]

    request = list(range(rank))  # rank 0 asks nothing, rank 2 asks two integers
    try:
        got, error = coord.ask_coordinator("test", request, answer), None
    except Exception as e:  # noqa: BLE001 - reported to the test
        got, error = None, f"{type(e).__name__}: {e}"
    after = coord.agree("after", lambda: rank)  # the group is usable afterwards
    return {"got": got, "error": error, "seen": seen, "after": after}


def test_each_rank_gets_its_own_reply_and_only_the_coordinator_sees_the_requests():
    outs = run_ranks(3, ask, False)
    assert [o["got"] for o in outs] == [[], [100], [200, 201]]
    assert outs[0]["seen"] == [[[], [0], [0, 1]]] and outs[1]["seen"] == outs[2]["seen"] == []
    assert [o["after"] for o in outs] == [0, 1, 2]


def test_a_failing_answer_is_raised_on_every_rank():
    outs = run_ranks(3, ask, True)
    assert all(o["got"] is None and o["error"] == "ValueError: no answer for rank 2" for o in outs), outs
    assert [o["after"] for o in outs] == [0, 1, 2]


def test_without_a_process_group_the_answer_is_called_directly():
    from cloudckpt import dist

    coord = dist.Coordinator(local=True)
    assert coord.ask_coordinator("t", [1, 2], lambda reqs: [[sum(reqs[0])]]) == [3]
