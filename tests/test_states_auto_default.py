"""The model states' placement chosen by default: ``memfit plan``, ``fit`` and ``train`` without
``--states`` take ``auto`` (``--states device`` is the opt-out), and the Python verbs ``memfit.autofit`` and
``memfit.plan_for_budget`` make the same choice with ``states="auto"`` (memfit.estimation.placed)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny_models import token_workload

import memfit
from memfit.capture.step import StepSpec
from memfit.cli.main import main
from memfit.errors import BudgetInfeasibleError, SpecError
from memfit.estimation import placed
from memfit.estimation.placed import workload_state_sizes
from memfit.estimation.states import place
from memfit.estimation.states_choice import choose_states
from memfit.fitting.search import WindowOverBudgetError
from memfit.optim.states import ModelStates
from memfit.training import TrainConfig, train

TINY = "demo?n_layer=2&n_embd=16&seq_len=16"
# TINY at batch 1 with AdamW: the least plan needs 279,207 B with every model state on the device and
# 244,095 B with the step inside the backward (its gradients are freed as the backward goes).
BETWEEN = "260000"
# The tiny token model at batch 1: 61,666 B on the device, 54,717 B with the step inside the backward.
TOKEN_BETWEEN = 58_000


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow  # about 10 s on 2 cores: the fast tier keeps to about 4 minutes
def test_the_default_plans_what_states_device_plans_where_the_states_fit(tmp_path, capsys) -> None:
    """Estimated stats (nothing timed, so both runs see the same numbers) at a budget the device fits: the
    default's plan file is ``--states device``'s (blocks, segments, head, fingerprint, peaks), byte for byte."""
    argv = ["plan", "--model", TINY, "--batch-size", "4", "--estimate", "--target", "h100-sxm", "--budget", "2GiB"]
    files = {}
    for name, extra in (("default", []), ("device", ["--states", "device"])):
        files[name] = tmp_path / f"{name}.json"
        code, d = _json(capsys, *argv, *extra, "--out", str(files[name]))
        assert code == 0 and d["states"] == "device"
    plans = {k: json.loads(v.read_text()) for k, v in files.items()}
    assert "states" not in plans["default"]  # a device plan, as files without the key are
    for key in plans["device"].keys() - {"extra"}:  # the planner's details may hold timings
        assert json.dumps(plans["default"][key]) == json.dumps(plans["device"][key]), key
    assert plans["default"].keys() == plans["device"].keys()


@pytest.mark.slow  # about 6 s on 2 cores: the fast tier keeps to about 4 minutes
def test_the_default_takes_the_step_in_backward_where_the_device_floor_does_not_fit(capsys) -> None:
    code, d = _json(capsys, "plan", "--model", TINY, "--batch-size", "1", "--repeats", "1", "--budget", BETWEEN)
    assert code == 0 and d["states"] == "step-in-backward"
    assert d["states_reason"].startswith("step-in-backward: the fastest placement that fits (device: no plan fits")
    assert d["predicted_peak_bytes"] <= int(BETWEEN)
    code, d = _json(
        capsys, "plan", "--model", TINY, "--batch-size", "1", "--repeats", "1", "--budget", BETWEEN,
        "--states", "device",
    )  # fmt: skip
    assert code == 2 and "Raise the budget" in d["error"]  # the opt-out keeps the old answer


def test_the_default_says_no_at_once_when_no_placements_states_fit(capsys) -> None:
    """Below every placement's model states nothing is profiled: the refusal names each placement."""
    code, d = _json(capsys, "fit", "--model", TINY, "--global-batch", "2", "--budget", "20KiB", "--host-budget", "1GiB")
    assert code == 2 and d["error_type"] == "BudgetInfeasibleError"
    err = d["error"]
    assert err.startswith("memfit fit: no placement of the model states fits 20.00 KiB")
    for part in ("device: model states alone need", "step-in-backward: model states alone need",
                 "host-optimizer: model states alone need"):  # fmt: skip
        assert part in err


@pytest.mark.slow  # about 5 s on 2 cores: the fast tier keeps to about 4 minutes
def test_train_by_default_steps_inside_the_backward_below_the_device_floor(capsys) -> None:
    argv = ["train", "--model", TINY, "--global-batch", "1", "--steps", "2", "--device", "cpu", "--budget", BETWEEN]
    code, d = _json(capsys, *argv)
    assert code == 0 and d["states"] == "step-in-backward" and d["optimizer_steps"] == 2
    seen = {c["states"]: c["outcome"] for c in d["states_considered"]}
    assert seen["device"] == "over" and seen["step-in-backward"] == "chosen"


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_python_verbs_choose_as_the_cli_and_train_to_plain_trainings_parameters() -> None:
    """``memfit.plan_for_budget`` and ``memfit.autofit`` with ``states="auto"`` take the step inside the backward
    where the device floor does not fit; training the fit's plan with it gives plain training's parameters."""
    res = memfit.plan_for_budget(token_workload(), TOKEN_BETWEEN, step=StepSpec(batch_size=1, repeats=1), states="auto")
    assert res.plan.states == "step-in-backward"
    assert (memfit.autofit, memfit.plan_for_budget) == (placed.autofit, placed.plan_for_budget)
    wl = token_workload()
    fit, choice = placed.autofit_placed(wl, TOKEN_BETWEEN, 1, step=StepSpec(repeats=1), states="auto", measure=False)
    assert fit.plan.states == choice.states == "step-in-backward" and fit.micro_batch == 1
    assert [c.outcome for c in choice.considered][:2] == ["over", "chosen"]
    plain = copy.deepcopy(wl.model)
    config = TrainConfig(global_batch=1, steps=3, device="cpu", lr=1e-2, plan=fit.plan, states=str(fit.plan.states))
    assert train(wl, config).optimizer_steps == 3
    plain_wl = token_workload()
    plain_wl.model.load_state_dict(plain.state_dict())
    train(plain_wl, TrainConfig(global_batch=1, steps=3, device="cpu", lr=1e-2, states="device"))
    assert not all(torch.equal(p, q) for p, q in zip(wl.model.parameters(), plain.parameters(), strict=True))
    for (name, p), q in zip(wl.model.named_parameters(), plain_wl.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_python_verbs_refuse_two_placements_and_name_each_when_none_fits() -> None:
    wl = token_workload()
    with pytest.raises(SpecError, match="name two placements"):
        memfit.plan_for_budget(wl, 10**9, step=StepSpec(states="step-in-backward"), states="host-optimizer")
    sizes = workload_state_sizes(wl)
    least = min(place(sizes, m).device_states_bytes for m in ("device", "step-in-backward", "host-optimizer"))
    with pytest.raises(BudgetInfeasibleError, match="memfit.plan: no placement of the model states fits") as err:
        memfit.plan_for_budget(wl, least - 1, step=StepSpec(batch_size=1, repeats=1), states="auto")
    assert "host-params: not planned here" in str(err.value)


def test_state_sizes_follow_the_steps_dtype() -> None:
    wl = token_workload()
    f32 = workload_state_sizes(wl)
    f64 = workload_state_sizes(wl, StepSpec(dtype=torch.float64))
    assert (f64.params_bytes, f64.grads_bytes, f64.optimizer_bytes) == (
        2 * f32.params_bytes,
        2 * f32.grads_bytes,
        2 * f32.optimizer_bytes,
    )


def test_a_placement_whose_windows_all_measured_over_the_budget_leaves_the_choice_to_the_next() -> None:
    """A fit that predicted a window within the budget but measured every one over it (the CLI's default
    ``fit``, which measures) does not end the choice: the next placement is tried."""
    tried: list[str] = []

    def attempt(m: ModelStates) -> str:
        tried.append(m.value)
        if m is ModelStates.DEVICE:
            raise WindowOverBudgetError("memfit.fit: every window over", measured_peak_bytes=123_456)
        return m.value

    sizes = workload_state_sizes(token_workload())
    res, choice = choose_states(attempt, sizes, budget_bytes=10**9, host_budget_bytes=None)
    assert (res, tried) == ("step-in-backward", ["device", "step-in-backward"])
    assert choice.considered[0].outcome == "over" and "every window measured over" in choice.considered[0].reason
