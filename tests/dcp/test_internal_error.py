"""A read of the load's own plan that goes wrong is a cloudckpt bug (InternalError),
never a verdict on the checkpoint (issue 44, item 7): CorruptCheckpoint only where the
object is shorter than the range the plan checked against the manifest, or an item
fails its CRC32C; and resume() never falls back to an older step for an InternalError."""

from __future__ import annotations

import io
import os
import pickle
import threading

import pytest
import torch

from cloudckpt import CheckpointConfig
from cloudckpt.dcp.resumable import Body, ResumableStream, coalesce, spans
from cloudckpt.errors import CollectiveError, CorruptCheckpoint, InternalError
from tests.checkpoint import fallback_workers as fw


class _Reader:
    def __init__(self, data: bytes):
        self.f = io.BytesIO(data)

    def read(self, n):
        return self.f.read(n)

    def close(self):
        pass

    def __enter__(self):  # the stores' range readers are context managers
        return self

    def __exit__(self, *exc):
        self.close()


class _Stream(ResumableStream):
    def __init__(self, start, end, reads):
        super().__init__("mem://obj", start, end, threading.Lock())
        self.reads = reads

    def resume_at(self):
        return self.start

    def attempt(self, attempt, at, open_from, progress):
        with open_from(at) as body:
            for pos, n in self.reads:
                self.read(body, pos, n, progress)
        return 0


def _run(obj: bytes, start, end, reads):
    st = _Stream(start, end, reads)
    return st(lambda pos: _Reader(obj[pos:end]), lambda n: None)


def test_the_old_false_verdict_is_now_an_internal_error_and_a_short_object_stays_corrupt():
    obj = bytes(range(256)) * 8  # 2,048 bytes
    # the same item read twice from one body (what coalesce's merged stream used to do)
    with pytest.raises(InternalError, match="cloudckpt bug") as e:
        _run(obj, 0, 100, [(0, 100), (0, 100)])
    assert not isinstance(e.value, CorruptCheckpoint)
    with pytest.raises(InternalError):  # past the range the stream opened
        _run(obj, 0, 100, [(0, 50), (50, 60)])
    # the object ends inside the range the plan checked: truly truncated
    with pytest.raises(CorruptCheckpoint, match=r"expected bytes \[0, 3000\) but the object ends at 2048"):
        _run(obj, 0, 3000, [(0, 1000), (1000, 2000)])
    _run(obj, 0, 300, [(0, 100), (100, 200)])  # a plain read passes


def test_internal_error_crosses_processes_as_itself():
    e = pickle.loads(pickle.dumps(InternalError("x")))
    assert type(e) is InternalError and str(e) == str(InternalError("x")) and str(e).count("cloudckpt bug") == 1


def test_identical_and_overlapping_ranges_are_one_span_read_once():
    items = [(0, 10, "a"), (0, 10, "b"), (20, 10, "c"), (25, 10, "d"), (40, 0, "e"), (40, 0, "f"), (50, 5, "g")]
    (s, e, parts), = coalesce(items, max_gap=100, max_range=1 << 62)
    assert (s, e) == (0, 55)
    assert [(a, b, [p for *_, p in ps]) for a, b, ps in spans(parts)] == [
        (0, 10, ["a", "b"]), (20, 35, ["c", "d"]), (40, 40, ["e", "f"]), (50, 55, ["g"])]
    # an identical or overlapping item stays in its range even when the range is full
    got = coalesce([(0, 100, "a"), (0, 100, "b"), (50, 100, "c")], max_gap=0, max_range=10)
    assert [(a, b, [p for *_, p in ps]) for a, b, ps in got] == [(0, 150, ["a", "b", "c"])]


def test_body_knows_where_it_is():
    b = Body(_Reader(b"abcdef"), 10, 16)
    assert bytes(b.read(4)) == b"abcd" and b.pos == 14


def test_resume_does_not_fall_back_on_an_internal_error(tmp_path, monkeypatch):
    """A load that hits an InternalError stops resume() with it named (no older step is
    loaded, nothing is recorded as skipped), where a CorruptCheckpoint would fall back."""
    from cloudckpt.dcp import reader as reader_mod

    folder = str(tmp_path / "run")
    fw.save_steps(0, 1, folder, str(tmp_path / "w"), [5, 10])
    real = reader_mod.StreamingReader.read_data

    def read_data(self, plan, planner):
        if "step10" in self.remote_dir:
            raise InternalError(f"{self.remote_dir}: a planted bug")
        return real(self, plan, planner)

    monkeypatch.setattr(reader_mod.StreamingReader, "read_data", read_data)
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w"), save_interval=5).build()
    sd = fw.state(1)
    with pytest.raises((InternalError, CollectiveError), match="a planted bug.*cloudckpt bug") as e:
        mgr.resume(sd)
    assert not isinstance(e.value, CorruptCheckpoint)
    assert mgr.skipped_steps == () and mgr.resumed_step is None
    assert not torch.equal(sd["model"]["w"], fw.state(5)["model"]["w"])  # step5 was not loaded either
    mgr.close()
    # the control: the same run with a damaged step10 falls back to step5
    model = os.path.join(folder, "step10", "model_and_optim")
    shard = sorted(n for n in os.listdir(model) if n.endswith(".distcp"))[0]
    with open(os.path.join(model, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(model, shard)) - 7)
    monkeypatch.setattr(reader_mod.StreamingReader, "read_data", real)
    mgr = CheckpointConfig(save_folder=folder, work_dir=str(tmp_path / "w2"), save_interval=5).build()
    sd = fw.state(1)
    assert mgr.resume(sd)["step"] == 5 and [s.step for s in mgr.skipped_steps] == [10]
    assert "truncated" in mgr.skipped_steps[0].reason
    mgr.close()
