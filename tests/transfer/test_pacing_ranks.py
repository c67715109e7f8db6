"""Job-wide pacing, 8 real gloo ranks against SeaweedFS behind a fault proxy that
answers 503 SlowDown above a request rate."""

from __future__ import annotations

import time

import pytest
import torch
from botocore.exceptions import ClientError

from cloudckpt import Checkpointer
from cloudckpt.storage import StorageOptions
from cloudckpt.testing.faultproxy import FaultProxy, Rule
from cloudckpt.testing.multiprocess import run_ranks
from cloudckpt.transfer import TransferConfig


def _state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"model": {f"w{rank}": torch.randn(4096, generator=g), f"b{rank}": torch.randn(64, generator=g)},
            "optim": {f"m{rank}": torch.randn(2048, generator=g)}}


def save_and_load(rank, world_size, folder, work_dir, phases):
    """For each ``(step, request_rate)``: save the step and load it back with a fresh
    Checkpointer paced at ``request_rate`` (0: no pacing); returns per phase the
    monotonic start/end, the engine's counters and whether the load was bit-exact."""
    import torch.distributed as tdist

    out = []
    for step, rate in phases:
        tdist.barrier()
        time.sleep(1.2)  # the proxy's one-second window of the previous phase has passed
        tdist.barrier()
        ck = Checkpointer(work_dir=work_dir, storage_options=StorageOptions(),
                          transfer=TransferConfig(request_rate=rate))
        t0 = time.monotonic()
        dir = f"{folder}/step{step}"
        ck.save(dir, _state(step, rank), {"step": step, "rank": rank})
        want = _state(step, rank)
        sd = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in want.items()}
        ts = ck.load(dir, sd)
        t1 = time.monotonic()
        exact = ts == {"step": step, "rank": rank} and all(
            torch.equal(sd[k][n], want[k][n]) for k in want for n in want[k])
        out.append({"t0": t0, "t1": t1, "exact": exact, "stats": vars(ck.engine.stats()),
                    "engine_world_size": ck.engine.world_size})
        ck.close()
    return out


def _phase(outs: list, i: int, events: list) -> dict:
    """Phase ``i`` summed over the ranks, and the proxy's answers within its span."""
    t0, t1 = min(o[i]["t0"] for o in outs), max(o[i]["t1"] for o in outs)
    mine = [e for e in events if t0 <= e.t <= t1]
    stats = [o[i]["stats"] for o in outs]
    return {"requests": len(mine), "slowdowns": sum(e.fault == "slowdown" for e in mine),
            "sdk_retries": sum(s["sdk_retries"] for s in stats), "retries": sum(s["retries"] for s in stats),
            "throttled": sum(s["throttled"] for s in stats), "paced_requests": sum(s["paced_requests"] for s in stats),
            "exact": all(o[i]["exact"] for o in outs),
            "refused": sorted(f"{e.method} {e.target.split('?')[0].split('/step', 1)[-1]}" for e in mine if e.fault)}


WORLD = 8
LIMIT = 20  # the proxy lets 20 requests/s through (any method, sliding second) and answers SlowDown above
PACED = 10  # the job's request_rate when paced: the requests a save or load sends outside the engine
# (a rank's manifest part, rank 0's lock, marker and index) come on top of it


def test_eight_ranks_paced_under_the_stores_rate_finish_with_fewer_slowdowns_than_unpaced(seaweed, s3_bucket, tmp_path):
    """8 gloo ranks save and load a step paced at 10 requests/s for the job, then
    another one unpaced, through a proxy that answers 503 SlowDown above 20 requests/s.
    Both finish bit-exact (the SDK and the engine retry what was refused); the paced
    run meets fewer SlowDowns. The counts are printed (docs/performance.md quotes
    them); no timing is asserted."""
    with FaultProxy(seaweed.endpoint_url, seed=0) as proxy:
        proxy.add(Rule("slowdown", above_rate=LIMIT))
        env = {**seaweed.env(), "AWS_ENDPOINT_URL": proxy.endpoint_url}
        outs = run_ranks(WORLD, save_and_load, f"{s3_bucket}/run", str(tmp_path / "work"), [(1, PACED), (2, 0)],
                         env=env, timeout=240)
        events = list(proxy.events)
    paced, unpaced = _phase(outs, 0, events), _phase(outs, 1, events)
    print(f"\n8 ranks, SlowDown above {LIMIT} requests/s: paced at {PACED}/s {paced}; unpaced {unpaced}")
    assert paced["exact"] and unpaced["exact"], "no failure: every rank loads its state back bit-exactly"
    assert {p["engine_world_size"] for o in outs for p in o} == {WORLD}, "the engine gets the job's world size"
    assert unpaced["slowdowns"] >= 1 and unpaced["sdk_retries"] + unpaced["retries"] >= 1, unpaced
    assert paced["slowdowns"] < unpaced["slowdowns"], (paced, unpaced)
    # bounded: the paced engines keep their requests under the limit; what the proxy refused
    # is at most the requests sent outside the engine, each retried by the SDK
    assert paced["sdk_retries"] + paced["retries"] <= paced["requests"] - paced["paced_requests"], paced
    assert paced["retries"] == 0, "no transfer needed an engine-level re-attempt"
    assert paced["paced_requests"] >= 4 * WORLD and unpaced["paced_requests"] == 0


# ---------------------------------------------------------------- the proxy's rate mode
def test_above_rate_lets_n_requests_through_per_sliding_second():
    r = Rule("slowdown", above_rate=3)
    assert [r.over_rate(t) for t in (0.0, 0.1, 0.2, 0.3, 0.9)] == [False, False, False, True, True]
    assert r.over_rate(1.05) is False  # the request of 0.0 left the window
    assert r.over_rate(1.1) is False  # and the one of 0.1
    assert r.over_rate(1.15) is True  # 0.2, 1.05 and 1.1 are within the last second
    assert r.over_rate(1.25) is False
    for bad in ({"above_rate": 0}, {"above_rate": 5, "per": 0}):
        with pytest.raises(ValueError):
            Rule("slowdown", **bad)


def test_above_rate_answers_slowdown_through_the_proxy(seaweed, s3_bucket):
    import boto3
    from botocore.config import Config

    with FaultProxy(seaweed.endpoint_url) as proxy:
        proxy.add(Rule("slowdown", above_rate=2, per=60))
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url, config=Config(retries={"total_max_attempts": 1}),
                              aws_access_key_id=seaweed.access_key, aws_secret_access_key=seaweed.secret_key,
                              region_name=seaweed.region)
        bucket = s3_bucket[len("s3://"):]
        client.put_object(Bucket=bucket, Key="a", Body=b"1")
        client.get_object(Bucket=bucket, Key="a")
        with pytest.raises(ClientError) as e:
            client.get_object(Bucket=bucket, Key="a")
        assert e.value.response["Error"]["Code"] == "SlowDown"
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert proxy.injected() == {"slowdown": 1}
