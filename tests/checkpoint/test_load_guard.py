"""A load says what it did not load: model or optimizer state the target does not ask
for is an error (the quickstart pattern with a fresh AdamW), other leftovers a warning;
shape and dtype mismatches are typed errors naming the key and the step."""

from __future__ import annotations

import logging

import pytest
import torch

from cloudckpt import AppState, Checkpointer
from cloudckpt.errors import KeysNotLoaded, ShapeMismatch


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2)
    for _ in range(3):
        model(torch.randn(2, 8)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return model, optim, sched


@pytest.fixture
def step(tmp_path):
    model, optim, sched = _trained()
    path = str(tmp_path / "run" / "step3")
    with Checkpointer(work_dir=str(tmp_path / "w")) as ck:
        ck.save(path, AppState(model, optim, sched, extra={"ema": _Counter(7)}), {"step": 3})
    return path, (model, optim, sched)


class _Counter:
    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def test_a_fresh_adamws_state_dict_as_target_is_refused_naming_the_optimizer_keys_and_the_way_out(step):
    path, _ = step
    model, optim = torch.nn.Linear(8, 4), None
    optim = torch.optim.AdamW(model.parameters())
    with pytest.raises(KeysNotLoaded) as ei:
        Checkpointer().load(path, {"model": model.state_dict(), "optim": optim.state_dict()})
    text = str(ei.value)
    assert path in text and "optim.state.weight.exp_avg" in text and "AppState" in text and "allow_partial=True" in text


def test_allow_partial_loads_what_is_asked_and_reports_the_rest(step):
    path, (saved, _, _) = step
    model = torch.nn.Linear(8, 4)
    ck = Checkpointer()
    ck.load(path, {"model": model.state_dict()}, allow_partial=True)
    assert "optim.state.weight.exp_avg" in ck.last_load_info.not_loaded


def test_model_only_leaves_the_optimizer_on_purpose_but_not_model_keys(step):
    path, _ = step
    model = torch.nn.Linear(8, 4)
    sd = {"model": model.state_dict()}
    assert Checkpointer().load(path, sd, model_only=True) is None
    partial = {"model": {"weight": torch.zeros(4, 8)}}  # a model that lacks the saved bias
    with pytest.raises(KeysNotLoaded, match="model.bias"):
        Checkpointer().load(path, partial, model_only=True)


def test_other_leftovers_are_one_warning(step, caplog):
    path, _ = step
    model, optim, sched = _trained(seed=1)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        Checkpointer().load(path, AppState(model, optim, sched))  # no "ema" asked for
    warnings = [r for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(warnings) == 1 and "ema.n" in warnings[0].getMessage()


def test_appstate_restores_weights_adamw_state_scheduler_and_extras_bit_exactly(step):
    path, (model, optim, sched) = step
    m2, o2, s2 = _trained(seed=5)
    ema = _Counter()
    assert Checkpointer().load(path, AppState(m2, o2, s2, extra={"ema": ema})) == {"step": 3}
    assert torch.equal(m2.weight, model.weight) and torch.equal(m2.bias, model.bias)
    for p, p2 in zip(model.parameters(), m2.parameters(), strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o2.state[p2][k], optim.state[p][k]), k
    assert s2.state_dict() == sched.state_dict() and o2.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
    assert ema.n == 7


@pytest.mark.parametrize("target,saved_as", [
    (torch.nn.Linear(9, 4), "float32 [4, 8]"),
    (torch.nn.Linear(8, 4).to(torch.float64), "float32 [4, 8]"),
])
def test_shape_and_dtype_mismatches_name_the_key_both_shapes_and_the_step(step, target, saved_as):
    path, _ = step
    with pytest.raises(ShapeMismatch) as ei:
        Checkpointer().load(path, {"model": target.state_dict()}, model_only=True)
    text = str(ei.value)
    assert path in text and "'model.weight'" in text and saved_as in text and str(list(target.weight.shape)) in text


def test_appstate_refuses_optimizers_for_models_not_given():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not given"):
        AppState({"g": a}, {"d": torch.optim.SGD(b.parameters(), lr=0.1)})


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_load_that_casts_reads_as_saved_casts_into_the_target_and_says_which_keys(step, dtype, caplog):
    """Megatron's load casts a tensor saved with another dtype (as Megatron's own and
    stock DCP's do): ``LoadRequest(cast_dtypes=True)``. Each key cast is logged and
    listed in ``last_load_info.cast``; a shape mismatch is still refused."""
    from cloudckpt.checkpoint import loading
    from cloudckpt.checkpoint.loading import LoadRequest

    path, (saved, _, _) = step
    target = torch.nn.Linear(8, 4).to(dtype)
    with Checkpointer() as ck, caplog.at_level(logging.WARNING, logger="cloudckpt"):
        ck._load(loading.open_step(ck.coord, ck.engine, ck.options, ck._step(path)), {"model": target.state_dict()},
                 LoadRequest(only="model", cast_dtypes=True))
        info = ck.last_load_info
    assert torch.equal(target.weight, saved.weight.to(dtype)) and torch.equal(target.bias, saved.bias.to(dtype))
    name = str(dtype).replace("torch.", "")
    assert info.cast == (f"model.weight (float32 -> {name})", f"model.bias (float32 -> {name})")  # target order
    assert "2 tensor(s) saved with another dtype are cast" in caplog.text and path in caplog.text
    with Checkpointer() as ck, pytest.raises(ShapeMismatch, match="model.weight"):
        ck._load(loading.open_step(ck.coord, ck.engine, ck.options, ck._step(path)),
                 {"model": torch.nn.Linear(9, 4).to(dtype).state_dict()}, LoadRequest(only="model", cast_dtypes=True))
    with Checkpointer() as ck:  # the plain load still refuses a dtype change
        with pytest.raises(ShapeMismatch, match="float32"):
            ck.load(path, {"model": torch.nn.Linear(8, 4).to(dtype).state_dict()}, model_only=True)
        assert ck.last_load_info is None or ck.last_load_info.cast == ()


def test_before_read_is_called_with_the_ranges_before_any_byte_is_read_and_casts_nothing(step):
    """``Checkpointer.load(before_read=...)`` (the node-local tier's hook) is handed this
    rank's ranges once the load is planned, before the read; the load request keeps it
    apart from the cast of dtypes (a keyword-only request)."""
    path, (saved, _, _) = step

    class Stop(Exception):
        pass

    seen = []

    def before_read(ranges):
        seen.append(ranges)
        raise Stop

    target = torch.nn.Linear(8, 4)
    with torch.no_grad():
        target.weight.zero_()
    with Checkpointer() as ck, pytest.raises(Stop):
        ck.load(path, {"model": target.state_dict()}, model_only=True, before_read=before_read)
    assert len(seen) == 1 and seen[0] and all(isinstance(r, list) for r in seen[0].values()), seen
    assert not target.weight.any(), "a byte was read before before_read"
    with pytest.raises(ShapeMismatch):  # before_read is not taken for cast_dtypes
        Checkpointer().load(path, {"model": torch.nn.Linear(8, 4).to(torch.float64).state_dict()}, model_only=True,
                            before_read=lambda ranges: None)
