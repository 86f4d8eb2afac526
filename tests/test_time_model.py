"""The time model calibrated on timed steps (memfit.fitting.time_model, NOTE [ The time model learns ]).

Synthetic timings, so that the arithmetic is checked exactly: steps measured as a known correction of
their predictions must be fitted back to it, and the calibrated predictions of the timed steps must be
closer to the measured times than the cost model's were. The cost model's own numbers are the reference
for the calibrated costs (a solve on them predicts what the fit says)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_solver import random_costs

from memfit.capture.step import StepSpec
from memfit.errors import SpecError
from memfit.fitting.budget import plan_for_budget
from memfit.fitting.choice import MeasuredCandidate, calibrate_time_model
from memfit.fitting.time_model import TimedStep, calibrated_costs, fit_time_model
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.solve import min_budget, solve
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile

# (base, predicted): the keep-all base and plans that add 0 to 0.8 s of recompute to it
PLANS = [(1.0, 1.0), (1.0, 1.2), (1.0, 1.5), (1.0, 1.8), (1.0, 1.35)]


def _steps(keep: float, change: float, overhead: float = 0.0, noise=None, plans=PLANS) -> list[TimedStep]:
    noise = noise or [1.0] * len(plans)
    return [
        TimedStep(base_s=b, predicted_s=p, measured_s=(overhead + keep * b + change * (p - b)) * n)
        for (b, p), n in zip(plans, noise, strict=True)
    ]


def _off(measured: float, predicted: float) -> float:
    return abs(math.log(measured / predicted))


def test_a_known_correction_is_fitted_back_and_the_predictions_meet_the_measured_times() -> None:
    steps = _steps(keep=1.3, change=2.0)  # recompute costs twice what the model expects, the base 1.3x
    fit = fit_time_model(steps)
    assert fit.keep_scale == pytest.approx(1.3, rel=1e-9) and fit.change_scale == pytest.approx(2.0, rel=1e-9)
    assert fit.fitted == ("keep", "change") and fit.steps == len(steps) and fit.step_overhead_s == 0.0
    for s in steps:
        assert fit.predict_step_s(s.base_s, s.predicted_s) == pytest.approx(s.measured_s, rel=1e-9)
    assert fit.ratio_after == pytest.approx(1.0, rel=1e-9)
    assert fit.ratio_before == pytest.approx(sorted(s.measured_s / s.predicted_s for s in steps)[2])
    assert fit.ratio_before > 1.4  # the cost model was off by that much


def test_with_noise_every_timed_step_is_predicted_closer_than_before() -> None:
    noise = [1.03, 0.97, 1.02, 0.99, 1.01]
    steps = _steps(keep=0.6, change=2.5, noise=noise)
    fit = fit_time_model(steps)
    for s in steps:
        after = fit.predict_step_s(s.base_s, s.predicted_s)
        assert _off(s.measured_s, after) < _off(s.measured_s, s.predicted_s), s
        assert _off(s.measured_s, after) < 0.05
    assert abs(math.log(fit.ratio_after)) < abs(math.log(fit.ratio_before))


def test_a_per_step_overhead_is_fitted_on_cuda_where_the_bases_differ() -> None:
    # the fixed policies' plans are predicted on another profile (the model's own activations): other bases
    plans = [(1.0, 1.0), (1.0, 1.4), (1.2, 1.2), (1.2, 1.7), (1.0, 1.9)]
    steps = _steps(keep=1.1, change=1.5, overhead=0.05, plans=plans)
    fit = fit_time_model(steps, overhead=True)
    assert fit.fitted == ("keep", "change", "overhead")
    assert fit.step_overhead_s == pytest.approx(0.05, rel=1e-6)
    assert fit.keep_scale == pytest.approx(1.1, rel=1e-6) and fit.change_scale == pytest.approx(1.5, rel=1e-6)
    assert fit_time_model(steps).step_overhead_s == 0.0  # on the CPU: no overhead term
    # one base for every plan: an overhead cannot be told from the base's scale and is not fitted
    assert "overhead" not in fit_time_model(_steps(keep=1.1, change=1.5, overhead=0.05), overhead=True).fitted


def test_what_the_steps_cannot_tell_apart_is_left_as_it_was() -> None:
    only_base = [
        TimedStep(base_s=1.0, predicted_s=1.0, measured_s=2.0),
        TimedStep(base_s=1.0, predicted_s=1.0, measured_s=2.2),
    ]
    fit = fit_time_model(only_base)
    # least squares on the relative error: sum((m - k) / m)^2 is least at k = sum(1/m) / sum(1/m^2)
    assert fit.fitted == ("keep",) and fit.change_scale == fit.keep_scale
    assert fit.keep_scale == pytest.approx((1 / 2.0 + 1 / 2.2) / (1 / 2.0**2 + 1 / 2.2**2), rel=1e-9)
    one = fit_time_model([TimedStep(base_s=1.0, predicted_s=1.5, measured_s=3.0)])  # one scale for the step
    assert one.fitted == ("keep",) and one.keep_scale == one.change_scale == pytest.approx(2.0)
    assert one.ratio_after == pytest.approx(1.0)
    with pytest.raises(SpecError, match="at least one timed step"):
        fit_time_model([])


def test_calibrated_costs_predict_what_the_fit_says() -> None:
    steps = _steps(keep=1.2, change=1.7, overhead=0.01, plans=[(1.0, 1.0), (1.0, 1.4), (1.2, 1.2), (1.2, 1.7)])
    fit = fit_time_model(steps, overhead=True)
    for seed in range(3):
        costs = random_costs(5, 40 + seed, segments=True)
        costs = ChainCosts(**{**{f: getattr(costs, f) for f in costs.__slots__}, "base_step_s": 2.0})
        cal = calibrated_costs(costs, fit)
        budget = (min_budget(costs)[0] * 3) // 2
        plan_sol = solve(costs, budget)
        plan = Plan(
            policy="t", chain_path="", blocks=tuple(costs.decision(i, o) for i, o in enumerate(plan_sol.options))
        )
        before, after = predict(costs, plan), predict(cal, plan)
        assert after.step_s == pytest.approx(fit.predict_step_s(costs.base_step_s, before.step_s), rel=1e-9)
        assert after.peak_bytes == before.peak_bytes  # bytes untouched


def test_a_second_plan_for_the_same_stats_is_solved_on_the_calibrated_times() -> None:
    torch.set_num_threads(1)
    wl = load_workload("demo?n_layer=3&n_embd=32&n_head=2", seq_len=16)
    st = profile(
        wl, step=StepSpec(batch_size=2, repeats=1), options=("keep", "recompute"), heads=False, activations=False
    )
    budget = (min_budget(ChainCosts.from_stats(st))[0] + st.peak_bytes) // 2
    first = plan_for_budget(wl, budget, stats=st).plan
    timed = [
        MeasuredCandidate(
            label=str(i),
            kind="solver",
            plan=first.with_(predicted_step_s=p),
            predicted_peak_bytes=1,
            predicted_step_s=p,
            measured_peak_bytes=1,
            measured_step_s=m,
            step_s_samples=(m,),
            vs_solver=1.0,
            time_model_ratio=m / p,
            fits_budget=True,
        )  # fmt: skip
        for i, (p, m) in enumerate(
            (st.step_s + e, 0.8 * st.step_s + 3.0 * e) for e in (0.0, 0.3 * st.step_s, 0.6 * st.step_s)
        )
    ]
    fit = calibrate_time_model(timed)
    assert fit is not None and fit.change_scale == pytest.approx(3.0, rel=1e-6)
    second = plan_for_budget(wl, budget, stats=st, time_model=fit).plan
    again = predict(ChainCosts.from_stats(st), second).step_s  # the same plan, on the profile's times
    assert second.predicted_step_s == pytest.approx(fit.predict_step_s(st.step_s, again), rel=1e-9)
    assert second.predicted_peak_bytes <= budget


def test_each_profile_keeps_its_own_base_scale() -> None:
    """The fixed policies are predicted on another profile, made at another time: its keep-all step
    measures otherwise (here 0.8x where the solver's measures 1.0x), while recompute costs 1.5x for both."""
    solver = [TimedStep(base_s=1.0, predicted_s=p, measured_s=1.0 + 1.5 * (p - 1.0)) for p in (1.0, 1.1, 1.3)]
    policy = [
        TimedStep(base_s=1.2, predicted_s=p, measured_s=0.8 * 1.2 + 1.5 * (p - 1.2), profile="policy")
        for p in (1.2, 1.5, 1.9)
    ]
    fit = fit_time_model(solver + policy)
    assert fit.fitted == ("keep", "keep:policy", "change")
    assert fit.keep_scale == pytest.approx(1.0, rel=1e-9) and fit.keep_scales["policy"] == pytest.approx(0.8, rel=1e-9)
    assert fit.change_scale == pytest.approx(1.5, rel=1e-9)
    for s in solver + policy:
        assert fit.predict_step_s(s.base_s, s.predicted_s, s.profile) == pytest.approx(s.measured_s, rel=1e-9)
    # one keep scale for both cannot meet them all
    shared = fit_time_model([replace(s, profile="solver") for s in solver + policy])
    assert max(_off(s.measured_s, shared.predict_step_s(s.base_s, s.predicted_s)) for s in solver + policy) > 0.01


def test_the_choice_says_how_far_the_time_model_was_off_before_and_after(capsys) -> None:
    from memfit.cli.choice import show_choice
    from memfit.cli.common import Output
    from memfit.fitting.choice import MeasuredChoice

    steps = _steps(keep=1.3, change=2.0)
    timed = tuple(
        MeasuredCandidate(
            label=f"c{i}",
            kind="solver",
            plan=Plan(policy="t", chain_path="", blocks=(), baseline_step_s=s.base_s),
            predicted_peak_bytes=1,
            predicted_step_s=s.predicted_s,
            measured_peak_bytes=1,
            measured_step_s=s.measured_s,
            step_s_samples=(s.measured_s,),
            vs_solver=1.0,
            time_model_ratio=s.measured_s / s.predicted_s,
            fits_budget=True,
        )  # fmt: skip
        for i, s in enumerate(steps)
    )
    fit = calibrate_time_model(timed)
    choice = MeasuredChoice(budget_bytes=1, candidates=timed, chosen="c0", reason="r", rounds=1, time_model=fit)
    show_choice(Output(json_mode=False), choice)
    out = capsys.readouterr().out
    assert f"time model: measured/predicted {fit.ratio_before:.2f} (median), 1.00 once calibrated" in out
    assert "keep-all step x1.30, what a plan changes x2.00" in out
    d = choice.to_dict()
    assert d["time_model_ratio"] == pytest.approx(fit.ratio_before) and d["time_model_ratio_after"] == pytest.approx(
        1.0
    )
