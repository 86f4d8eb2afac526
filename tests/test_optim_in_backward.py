"""The optimizer step inside the backward (memfit.optim.in_backward) against plain torch optimizers.

References: plain ``torch.optim`` steps after the backward (parameters and state bitwise on the CPU,
where both run torch's single-tensor kernels), torch's own LR schedulers and state dicts, and the
live-tensor tracker's measured peak for the predictions.
"""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch
from tiny_models import token_batch, token_loss, token_workload
from torch import nn

import memfit
from memfit.accumulate import Accumulator
from memfit.capture.step import StepSpec, make_optimizer, measure_step, warm_up
from memfit.cli.main import main
from memfit.errors import PlanFileError, SpecError
from memfit.optim import InBackwardError, ModelStates, StepInBackward, release_optimizer
from memfit.plan.types import Plan
from memfit.training import train
from memfit.training.config import TrainConfig

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}
DEMO = "demo?n_layer=2&n_embd=32&seq_len=16"


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = token_workload().model
    return model, copy.deepcopy(model)


def _run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, first: int = 0, sched: object = None) -> None:
    for k in range(first, first + steps):
        torch.manual_seed(100 + k)
        loss, _count = token_loss(model, token_batch(4))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()


def _hooks(model: nn.Module) -> int:
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parameters_after_steps_equal_plain_training_bitwise(name: str) -> None:
    # On the CPU torch's optimizers run their single-tensor kernels by default: the same arithmetic.
    cls, kwargs = OPTIMIZERS[name]
    model, ref = _models()
    with StepInBackward(model.parameters(), cls, **kwargs) as opt:
        plain = cls(ref.parameters(), **kwargs)
        _run(model, opt, 4)
        _run(ref, plain, 4)
        _assert_same(model, ref)
        state, plain_state = opt.state_dict(), plain.state_dict()
        assert state["param_groups"] == plain_state["param_groups"]
        for i, s in plain_state["state"].items():
            for key, value in s.items():
                assert torch.equal(state["state"][i][key], value), (i, key)


def test_gradients_are_freed_in_the_backward_and_step_does_not_step_again() -> None:
    model, ref = _models()
    opt = StepInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1)
    batch = token_batch(4)
    token_loss(model, batch)[0].backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # the plain loop's step after the backward: nothing left to step
    opt.step()
    token_loss(ref, batch)[0].backward()
    plain.step()
    _assert_same(model, ref)
    # A gradient set by hand (no backward) is stepped by step(), as plain training would.
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    opt.step()
    plain.step()
    _assert_same(model, ref)
    opt.remove()


def test_state_dict_round_trip_and_resume_equal_uninterrupted() -> None:
    cls, kwargs = OPTIMIZERS["adamw"]
    model, ref = _models()
    resumed = copy.deepcopy(model)
    plain = cls(ref.parameters(), **kwargs)
    _run(ref, plain, 5)  # uninterrupted, plain
    first = StepInBackward(model.parameters(), cls, **kwargs)
    _run(model, first, 2)
    saved, weights = copy.deepcopy(first.state_dict()), copy.deepcopy(model.state_dict())
    first.remove()
    resumed.load_state_dict(weights)
    again = StepInBackward(resumed.parameters(), cls, **kwargs)
    again.load_state_dict(saved)
    _run(resumed, again, 3, first=2)
    _assert_same(resumed, ref)
    # The format is plain torch's: the plain optimizer's state dict loads into it, and back.
    other = StepInBackward(copy.deepcopy(ref).parameters(), cls, **kwargs)
    other.load_state_dict(plain.state_dict())
    assert json.dumps(str(other.state_dict())) == json.dumps(str(plain.state_dict()))
    again.remove()
    other.remove()


def test_an_lr_scheduler_drives_every_parameter() -> None:
    cls, kwargs = OPTIMIZERS["adamw"]
    model, ref = _models()
    opt = StepInBackward(model.parameters(), cls, **kwargs)
    plain = cls(ref.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    _run(model, opt, 4, sched=sched)
    _run(ref, plain, 4, sched=plain_sched)
    assert opt.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == kwargs["lr"] / 16
    _assert_same(model, ref)
    opt.remove()


def test_a_second_backward_in_a_window_is_refused() -> None:
    model, _ = _models()
    opt = StepInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    batch = token_batch(4)
    token_loss(model, batch)[0].backward()
    with pytest.raises(InBackwardError, match="second backward.*--states device"):
        token_loss(model, batch)[0].backward()
    opt.zero_grad()  # a new window
    token_loss(model, batch)[0].backward()
    opt.remove()


def test_accumulator_refuses_clipping_and_several_micro_steps_before_any_step() -> None:
    wl = token_workload()
    opt = make_optimizer(wl.model, "sgd", states="step-in-backward")
    with pytest.raises(InBackwardError, match="Clipping by the global norm.*--states device"):
        Accumulator(wl.model, opt, micro_batch=2, max_grad_norm=1.0)
    before = [p.detach().clone() for p in wl.model.parameters()]
    acc = Accumulator(wl.model, opt, micro_batch=2)
    with pytest.raises(InBackwardError, match="2 micro-steps.*--states device"):
        acc.step(token_batch(4), wl.loss_fn, count_fn=wl.count_fn)
    assert all(torch.equal(p, q) for p, q in zip(wl.model.parameters(), before, strict=True))
    # One micro-step per window: the Accumulator's step is plain training's.
    ref = copy.deepcopy(wl.model)
    plain = make_optimizer(ref, "sgd")
    one, acc_ref = Accumulator(wl.model, opt, micro_batch=4), Accumulator(ref, plain, micro_batch=4)
    for k in range(2):
        torch.manual_seed(k)
        batch = token_batch(4)
        one.step(batch, wl.loss_fn, count_fn=wl.count_fn)
        acc_ref.step(batch, wl.loss_fn, count_fn=wl.count_fn)
    _assert_same(wl.model, ref)
    release_optimizer(opt)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"micro_batch": 2}, "--micro-batch 2 makes windows of several micro-steps"),
        ({"max_grad_norm": 1.0}, "--max-grad-norm needs every gradient"),
        ({"autocast_dtype": torch.float16}, "--amp fp16"),
    ],
)
def test_train_config_refuses_what_the_step_in_backward_cannot_do(changes: dict, fragment: str) -> None:
    config = TrainConfig(global_batch=4, steps=1, states="step-in-backward", **changes)
    with pytest.raises(SpecError, match=fragment):
        config.check(1)


def test_hooks_leave_the_model() -> None:
    model, _ = _models()
    with StepInBackward(model.parameters(), torch.optim.SGD, lr=0.1):
        assert _hooks(model) == sum(1 for _ in model.parameters())
    assert _hooks(model) == 0
    opt = make_optimizer(model, "adamw", states="step-in-backward")
    release_optimizer(opt)
    assert _hooks(model) == 0 and not opt.hooked
    StepInBackward(model.parameters(), torch.optim.SGD, lr=0.1)  # collected at once: its hooks go with it
    assert _hooks(model) == 0


def test_unknown_or_unimplemented_placement_is_refused() -> None:
    with pytest.raises(SpecError, match="unknown model-states placement 'gpu'"):
        StepSpec(states="gpu")
    assert StepSpec(states="step-in-backward").states is ModelStates.STEP_IN_BACKWARD
    made = memfit.policy_plan(token_workload().model, "all")
    data = made.with_(states="step-in-backward").to_dict()
    assert data["states"] == "step-in-backward" and Plan.from_dict(data).states == "step-in-backward"
    assert "states" not in made.to_dict() and Plan.from_dict(made.to_dict()).states == "device"  # older files
    with pytest.raises(PlanFileError, match="\"states\" is 'gpu'; valid: .*step-in-backward"):
        Plan.from_dict({**data, "states": "gpu"})


def _measured_peak(wl: memfit.Workload, plan: Plan, states: str) -> int:
    torch.manual_seed(0)
    batch = wl.make_batch(1)
    memfit.apply_plan(wl.model, plan)
    opt = make_optimizer(wl.model, "adamw", states=states)
    try:
        warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
        return measure_step(wl.model, batch, wl.loss_fn, opt, seed=2).peak_bytes
    finally:
        release_optimizer(opt)
        memfit.remove_plan(wl.model)


def test_profiled_plan_predicts_the_measured_peak_and_saves_about_the_gradients() -> None:
    wl = memfit.load_workload(DEMO)
    peaks, grads = {}, {}
    for states in ("device", "step-in-backward"):
        res = memfit.plan_for_policy(wl, "all", step=StepSpec(batch_size=1, states=states, repeats=1))
        assert res.plan.states == states and res.stats.states == states
        assert _hooks(wl.model) == 0  # profiling leaves the model without the optimizer's hooks
        measured = _measured_peak(wl, res.plan, states)
        assert res.plan.predicted_peak_bytes == measured, states
        peaks[states], grads[states] = measured, res.stats.grads_bytes
    params_bytes = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    assert grads["device"] == params_bytes and grads["step-in-backward"] == 0
    saved = peaks["device"] - peaks["step-in-backward"]
    assert 0.5 * params_bytes < saved <= params_bytes  # most of the gradients no longer coexist
    with pytest.raises(SpecError, match="--states step-in-backward"):  # stats of one placement, plan of another
        memfit.plan_for_policy(wl, "all", step=StepSpec(batch_size=1), stats=res.stats)


@pytest.mark.slow
def test_cli_plan_and_verify_with_states(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out = tmp_path / "plan.json"
    argv = ["--model", DEMO, "--batch-size", "1", "--repeats", "1", "--policy", "all"]
    code = main(["plan", *argv, "--states", "step-in-backward", "--out", str(out), "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["states"] == "step-in-backward"
    assert json.loads(out.read_text())["states"] == "step-in-backward"
    code = main(["verify", "--model", DEMO, "--batch-size", "1", "--repeats", "1", "--plan", str(out), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["ok"] and res["states"] == "step-in-backward", res.get("reason")
    after = res["after_steps"]
    assert after["optimizer_steps"] >= 3 and after["params_after_steps_max_rel_err"] == 0.0
    assert after["states_compared"] == ["exp_avg", "exp_avg_sq"] and after["params_tolerance_kind"] == "relative"
    assert res["measured_peak_bytes"] == res["predicted_peak_bytes"] < res["baseline_peak_bytes"]
    code = main(["verify", "--model", DEMO, "--batch-size", "1", "--plan", str(out), "--states", "device", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["states"] == "step-in-backward"


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_train_steps_inside_the_backward_as_plain_training_does() -> None:
    trained = {}
    for states in ("device", "step-in-backward"):
        wl = token_workload()
        res = train(wl, TrainConfig(global_batch=4, steps=3, states=states, device="cpu", lr=1e-2))
        assert res.optimizer_steps == 3 and res.accumulation_steps == 1
        trained[states] = wl.model
        gc.collect()
        assert _hooks(wl.model) == 0  # the run's optimizer is gone, its hooks with it
    _assert_same(trained["step-in-backward"], trained["device"])


def test_fit_with_the_step_in_backward_keeps_one_micro_step_or_refuses() -> None:
    wl = token_workload()
    with pytest.raises(SpecError, match="window is one micro-step of the whole batch \\(4\\).*--states device"):
        memfit.autofit(wl, 10**9, 4, step=StepSpec(states="step-in-backward"), max_micro_batch=2)
