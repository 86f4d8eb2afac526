"""``--states auto`` (memfit.estimation.states_choice, memfit.cli.states): the fastest placement of the
model states that fits, device whenever it fits, never one the context refuses; where every part lives."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from torch import nn

from memfit.capture.step import measure_step, step_optimizer, tensor_bytes, warm_up
from memfit.cli.main import main
from memfit.errors import BudgetInfeasibleError, PlanFileError, SpecError
from memfit.estimation.states import place, state_sizes
from memfit.estimation.states_choice import StatesContext, choose_states, model_states_parts
from memfit.models.registry import load_workload
from memfit.optim.in_backward import InBackwardError, placement_refusal, refuse_in_accumulator, refuse_window
from memfit.optim.states import ModelStates
from memfit.plan.types import Plan
from memfit.training import TrainConfig

TINY = "demo?n_layer=2&n_embd=16&seq_len=16"
MEASURED = (ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD, ModelStates.HOST_OPTIMIZER)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def _sizes() -> object:
    model = _mlp()
    return state_sizes(model, optimizer="adamw", blocks=[model[0], model[2]])


def _attempt(fits: set[ModelStates], tried: list[ModelStates]):
    def attempt(m: ModelStates) -> str:
        tried.append(m)
        if m not in fits:
            raise BudgetInfeasibleError(f"no plan with {m.value}", min_budget_bytes=10_000 + len(tried))
        return f"plan with {m.value}"

    return attempt


def test_device_is_chosen_whenever_it_fits_and_nothing_else_is_tried() -> None:
    tried: list[ModelStates] = []
    res, choice = choose_states(
        _attempt(set(ModelStates), tried), _sizes(), budget_bytes=1 << 30, host_budget_bytes=None
    )
    assert (res, choice.states, tried) == ("plan with device", ModelStates.DEVICE, [ModelStates.DEVICE])
    assert choice.reason == "device: every model state fits on the device"


def test_next_fastest_is_tried_when_device_does_not_fit_and_the_reason_says_why() -> None:
    tried: list[ModelStates] = []
    fits = {ModelStates.HOST_OPTIMIZER}
    res, choice = choose_states(
        _attempt(fits, tried), _sizes(), budget_bytes=1 << 30, host_budget_bytes=None,
        context=StatesContext(buildable=MEASURED),
    )  # fmt: skip
    assert tried == [ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD, ModelStates.HOST_OPTIMIZER]
    assert res == "plan with host-optimizer"
    assert choice.reason.startswith("host-optimizer: the fastest placement that fits (device: no plan fits 1.00 GiB")
    outcomes = {c.states: c.outcome for c in choice.considered}
    assert outcomes[ModelStates.HOST_PARAMS] == "unusable"  # not buildable here: never tried


def test_placements_the_context_refuses_are_never_tried() -> None:
    """Accumulation, clipping, a GradScaler rule out the step inside the backward; data parallelism also
    the host optimizer: the same refusals the optimizers raise."""
    for ctx, left in (
        (StatesContext(micro_steps=2), ModelStates.STEP_IN_BACKWARD),
        (StatesContext(max_grad_norm=1.0), ModelStates.STEP_IN_BACKWARD),
    ):
        tried: list[ModelStates] = []
        _, choice = choose_states(
            _attempt({ModelStates.HOST_OPTIMIZER}, tried), _sizes(), budget_bytes=1 << 30, host_budget_bytes=None,
            context=ctx,
        )  # fmt: skip
        assert left not in tried and choice.states is ModelStates.HOST_OPTIMIZER
        assert {c.states: c.outcome for c in choice.considered}[left] == "unusable"
    for ctx, why in (
        (StatesContext(parallel="ddp", buildable=MEASURED), "host-optimizer: under data parallelism"),
        (StatesContext(scaler=True, buildable=MEASURED), "host-optimizer: a GradScaler"),
    ):
        tried = []
        with pytest.raises(BudgetInfeasibleError, match=why):
            choose_states(
                _attempt({ModelStates.HOST_OPTIMIZER}, tried), _sizes(), budget_bytes=1 << 30, host_budget_bytes=None,
                context=ctx,
            )  # fmt: skip
        assert tried == [ModelStates.DEVICE]


def test_refusal_texts_are_the_optimizers_own() -> None:
    model = _mlp()
    with step_optimizer(model, "sgd", 0.1, states="step-in-backward") as opt:
        for call, kw in (
            (lambda: refuse_window(opt, 3, True), {"micro_steps": 3}),
            (lambda: refuse_in_accumulator(opt, 0.5, None, "local"), {"max_grad_norm": 0.5}),
            (lambda: refuse_in_accumulator(opt, None, object(), "local"), {"scaler": True}),
            (lambda: refuse_in_accumulator(opt, None, None, "ddp"), {"parallel": "ddp"}),
        ):
            with pytest.raises(InBackwardError) as err:
                call()
            assert str(err.value) == placement_refusal("step-in-backward", **kw)
    with step_optimizer(model, "sgd", 0.1, states="host-optimizer") as opt:
        with pytest.raises(InBackwardError) as err:
            refuse_in_accumulator(opt, None, None, "fsdp2")
        assert str(err.value) == placement_refusal("host-optimizer", parallel="fsdp2")
        with pytest.raises(InBackwardError) as err:
            refuse_in_accumulator(opt, None, object(), "local")  # before any step: its step() would refuse it
        assert str(err.value) == placement_refusal("host-optimizer", scaler=True)
    assert placement_refusal("host-optimizer", micro_steps=4, max_grad_norm=1.0) is None
    assert placement_refusal("device", parallel="ddp") is None


def test_model_states_alone_over_the_budget_or_the_host_budget_run_nothing() -> None:
    sizes = _sizes()
    device = place(sizes, "device")
    host_opt = place(sizes, "host-optimizer")
    tried: list[ModelStates] = []
    budget = device.device_states_bytes - 1  # below the device placement's states: it is not tried
    with pytest.raises(BudgetInfeasibleError) as err:
        choose_states(
            _attempt(set(), tried), sizes, budget_bytes=budget, host_budget_bytes=host_opt.host_bytes - 1,
            context=StatesContext(buildable=MEASURED), subsystem="memfit plan",
        )  # fmt: skip
    assert ModelStates.DEVICE not in tried
    assert ModelStates.HOST_OPTIMIZER not in tried  # over the host budget
    text = str(err.value)
    assert text.startswith("memfit plan: no placement of the model states fits")
    assert "device: model states alone need" in text and "host-optimizer: its host part" in text
    assert "--host-budget" in text


def test_model_states_parts_are_the_host_optimizers_own_bytes() -> None:
    """The JSON's ``model_states`` for host-optimizer: its host tensors are the bytes the arithmetic says,
    and the tracker's host peak (counted apart from the device's) holds at least them."""
    model = _mlp()
    sizes = state_sizes(model, optimizer="adamw")
    parts = model_states_parts(sizes, "host-optimizer")
    batch = torch.randn(6, 8)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    with step_optimizer(model, "adamw", 1e-2, states="host-optimizer") as opt:
        warm_up(model, batch, loss_fn, opt, seed=0)
        mem = measure_step(model, batch, loss_fn, opt, seed=0)
        host = tensor_bytes(opt.host_tensors())
    assert sum(p["host_bytes"] for p in parts.values()) == host
    assert mem.host_peak_bytes >= host
    assert parts["optimizer_state"] == {
        "device_bytes": 0,
        "host_bytes": 2 * sizes.params_bytes + 4 * 4,
    }  # moments, steps
    assert (mem.grads_bytes, mem.optimizer_bytes) == (0, 0)


def test_host_params_on_plan_is_refused_with_an_estimate_that_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", TINY, "--budget", "10MiB", "--states", "host-params", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["ok"] is False
    call = out["error"].split("`")[1]
    assert call.startswith("memfit estimate") and "--states host-params" in call
    code = main([*shlex.split(call)[1:], "--json"])
    est = json.loads(capsys.readouterr().out)
    assert code == 0 and est["states"] == "host-params"


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_plan_auto_keeps_device_and_says_where_every_part_lives(tmp_path, capsys) -> None:
    """``--states auto`` where the device fits: the plan ``--states device`` makes, with ``states_reason``
    and ``model_states``; the plan file says it too and loads."""
    path = tmp_path / "p.json"
    argv = ["plan", "--model", TINY, "--budget", "64MiB", "--batch-size", "2", "--repeats", "1", "--json"]
    assert main([*argv, "--states", "auto", "--out", str(path)]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert (auto["states"], auto["states_reason"]) == ("device", "device: every model state fits on the device")
    parts = auto["model_states"]
    assert parts["optimizer_state"]["device_bytes"] == 2 * parts["parameters"]["device_bytes"] > 0
    assert all(p["host_bytes"] == 0 for p in parts.values())
    assert json.loads(path.read_text())["model_states"] == parts
    assert Plan.load(path).states == "device"
    assert main([*argv, "--states", "device"]) == 0
    device = json.loads(capsys.readouterr().out)
    assert device["blocks"] == auto["blocks"] and device["predicted_peak_bytes"] == auto["predicted_peak_bytes"]
    assert device["states_reason"] == "device: as --states asked"


@pytest.mark.slow
def test_fit_auto_takes_the_host_optimizer_below_the_device_floor(capsys) -> None:
    """Below the least budget of micro-batch 1 with every state on the device, and with micro-batches
    capped below the global batch (no step inside the backward), the fit holds the optimizer on the host."""
    assert main(["plan", "--model", TINY, "--budget", "64MiB", "--batch-size", "1", "--repeats", "1", "--json"]) == 0
    least = json.loads(capsys.readouterr().out)["min_budget_bytes"]
    argv = ["fit", "--model", TINY, "--global-batch", "4", "--max-micro-batch", "2", "--no-measure", "--repeats", "1"]
    argv += ["--budget", str(least - 1), "--json"]
    code = main([*argv, "--states", "device"])
    assert code == 2 and json.loads(capsys.readouterr().out)["ok"] is False
    assert main([*argv, "--states", "auto"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["states"] == "host-optimizer" and auto["predicted_peak_bytes"] < least
    parts = auto["model_states"]
    assert parts["optimizer_state"]["device_bytes"] == 0
    tensors = len(list(load_workload(TINY).model.parameters()))  # AdamW: two moments, one 4-byte step counter each
    assert parts["optimizer_state"]["host_bytes"] == 2 * parts["parameters"]["host_bytes"] + 4 * tensors
    assert "on the CPU the host is this machine" in auto["states_reason"]
    seen = {c["states"]: c["outcome"] for c in auto["states_considered"]}
    assert seen == {
        "device": "over",
        "step-in-backward": "unusable",
        "host-optimizer": "chosen",
        "host-params": "unusable",
    }


def test_train_auto_without_a_budget_keeps_device_and_says_so(capsys) -> None:
    argv = ["train", "--model", TINY, "--global-batch", "2", "--micro-batch", "1", "--steps", "1", "--device", "cpu"]
    assert main([*argv, "--states", "auto", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["states"], r["states_reason"]) == ("device", "device: no --budget to fit")
    assert r["model_states"]["gradients"]["device_bytes"] == r["model_states"]["parameters"]["device_bytes"] > 0


@pytest.mark.slow
def test_train_auto_trains_with_the_placement_that_fits(capsys) -> None:
    """Below every budget micro-batch 1 meets with the states on the device, and with micro-batches of 1
    (no step inside the backward), train runs its steps with the optimizer on the host."""
    assert main(["plan", "--model", TINY, "--budget", "64MiB", "--batch-size", "1", "--repeats", "1", "--json"]) == 0
    least = json.loads(capsys.readouterr().out)["min_budget_bytes"]
    argv = ["train", "--model", TINY, "--global-batch", "2", "--steps", "2", "--device", "cpu", "--max-grad-norm", "1"]
    argv += ["--budget", str(least - 1), "--json"]
    assert main([*argv, "--states", "device"]) == 2
    capsys.readouterr()
    assert main([*argv, "--states", "auto"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["states"] == "host-optimizer" and r["optimizer_steps"] == 2
    assert r["states_considered"][1] == {
        **r["states_considered"][1],
        "states": "step-in-backward",
        "outcome": "unusable",
    }


def test_train_config_takes_the_host_optimizer_with_accumulation_and_clipping() -> None:
    """The step inside the backward's refusals are its own: the host optimizer sums a window on the host and
    clips there."""
    host = TrainConfig(global_batch=4, micro_batch=2, steps=1, states="host-optimizer", max_grad_norm=1.0)
    host.check(1)
    with pytest.raises(SpecError, match="--max-grad-norm"):
        TrainConfig(global_batch=4, steps=1, states="step-in-backward", max_grad_norm=1.0).check(1)


@pytest.mark.slow  # about 17 s on 2 cores: the fast tier keeps to about 4 minutes
def test_plan_estimate_auto_plans_what_fake_steps_can(capsys) -> None:
    """``--estimate``: device where it fits; the host placements are priced by ``memfit estimate`` only, and
    a budget below every plan names each placement and why."""
    argv = ["plan", "--model", TINY, "--batch-size", "1", "--estimate", "--target", "h100-sxm", "--states", "auto"]
    assert main([*argv, "--budget", "2GiB", "--json"]) == 0  # on CUDA: reserved memory, cuBLAS's workspaces too
    d = json.loads(capsys.readouterr().out)
    assert d["states"] == "device" and d["model_states"]["parameters"]["host_bytes"] == 0
    assert main([*argv, "--budget", "32MiB", "--json"]) == 2  # the states fit, no plan with the workspaces does
    err = json.loads(capsys.readouterr().out)["error"]
    assert "host-optimizer: not planned here in this version (`memfit estimate --states host-optimizer`" in err


def test_a_plan_files_model_states_are_checked(tmp_path) -> None:
    """``"model_states"`` in a plan file loads; a misspelt part or a negative size is refused with one line."""
    good = {"parameters": {"device_bytes": 8, "host_bytes": 0}, "gradients": {"device_bytes": 8, "host_bytes": 0}}
    base = {"format": "memfit.plan", "version": 1, "policy": "none", "chain_path": "blocks", "blocks": []}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(base | {"model_states": good}))
    assert Plan.load(path).policy == "none"
    for bad, why in (
        ({"gradient": {"device_bytes": 8, "host_bytes": 0}}, "unknown key"),
        ({"gradients": {"device_bytes": -1, "host_bytes": 0}}, "whole number of bytes"),
    ):
        path.write_text(json.dumps(base | {"model_states": bad}))
        with pytest.raises(PlanFileError, match=why):
            Plan.load(path)
