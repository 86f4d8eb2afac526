"""On CUDA a budget means reserved memory (NOTE [ On CUDA a budget is reserved memory ] in
memfit.fitting.budget): the loop against a hand-built table (binding, lowered, infeasible), and
plan_for_budget / `memfit plan --estimate --device h100` against the allocator model's replay."""

from __future__ import annotations

import json

import pytest

from memfit.cli.main import main
from memfit.errors import BudgetInfeasibleError
from memfit.estimation import estimate, load_fake_workload, stats_fn
from memfit.estimation.parallel import estimate_plan_allocator
from memfit.fitting.budget import MAX_RESERVED_SOLVES, fit_reserved, plan_for_budget
from memfit.plan import policy_plan

MiB = 2**20
# Live-tensor peaks a solver can reach (MiB), and the cache + workspaces the allocator adds to each.
PEAKS = (20, 30, 45, 60, 80)
EXCESS = {20: 70, 30: 72, 45: 75, 60: 80, 80: 84}


def _solve_at(target: int) -> int:
    """The largest reachable peak at or below ``target`` (the fastest plan that fits)."""
    return max(p for p in PEAKS if p <= target)


def _fit(budget: int, solve_at=_solve_at, excess=EXCESS):
    return fit_reserved(budget, solve_at(budget), solve_at, lambda p: p + excess[p], lambda p: p, floor_bytes=PEAKS[0])


def test_a_plan_whose_reserved_fits_is_kept_in_one_solve() -> None:
    sol, fit = _fit(200)
    assert sol == 80 and fit.solves == 1 and fit.predicted_reserved_bytes == 164 <= 200
    assert fit.live_target_bytes == 200


def test_the_live_target_is_lowered_by_the_excess_until_reserved_fits() -> None:
    # 130: the plan for 130 live (80) reserves 164; lowered to 80 - 34 = 46: 45 reserves 120.
    sol, fit = _fit(130)
    assert sol == 45 and fit.predicted_reserved_bytes == 120 <= 130 and fit.solves == 2
    brute = max(p for p in PEAKS if p + EXCESS[p] <= 130)  # the fastest plan whose reserved fits
    assert sol == brute


def test_no_plan_fits_reserved_names_the_least_reserved_and_the_fix() -> None:
    with pytest.raises(BudgetInfeasibleError, match=r"reserved memory.*Raise --budget to at least 90 B,"):
        _fit(85)


def test_the_loop_is_bounded() -> None:
    calls = []

    def creeping(target: int) -> int:  # each solution 1 B below its target, each reserving 1 B too many
        calls.append(target)
        return target - 1

    with pytest.raises(BudgetInfeasibleError, match=f"{MAX_RESERVED_SOLVES} solves"):
        fit_reserved(1000, 999, creeping, lambda p: 1001, lambda p: p, floor_bytes=0)
    assert len(calls) == MAX_RESERVED_SOLVES - 1


@pytest.mark.slow
def test_plan_for_budget_fits_reserved_on_an_estimated_h100() -> None:
    spec, budget = "demo?n_layer=4", 110 * MiB
    wl = load_fake_workload(spec)
    stats = stats_fn(wl, device="h100-sxm")(8)

    def reserved(plan, st) -> int:
        return estimate_plan_allocator(spec, wl, st, plan, "h100-sxm").predicted_reserved_bytes

    live = plan_for_budget(wl, budget, stats=stats)
    assert live.reserved is None and "budget_means" not in live.to_dict()  # the CPU's meaning: live tensors
    assert reserved(live.plan, stats) > budget  # the live-tensor plan would run out on the GPU
    res = plan_for_budget(wl, budget, stats=stats, reserved_fn=reserved)
    assert res.reserved is not None and res.reserved.solves >= 2
    assert reserved(res.plan, stats) == res.reserved.predicted_reserved_bytes <= budget
    assert res.plan.budget_bytes == budget and res.to_dict()["budget_means"] == "reserved"
    assert res.plan.predicted_peak_bytes < live.plan.predicted_peak_bytes


@pytest.mark.slow
def test_cli_plan_estimate_h100_budget_means_reserved(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "demo?n_layer=4", "--batch-size", "8", "--estimate", "--target", "h100-sxm"]
    assert main([*args, "--budget", "110MiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["budget_means"] == "reserved" and d["predicted_reserved_bytes"] <= 110 * MiB
    assert d["live_target_bytes"] < 110 * MiB
    assert main([*args, "--budget", "90MiB"]) == 2
    err = capsys.readouterr().err
    assert "reserved memory" in err and "Raise --budget to at least" in err


@pytest.mark.slow
def test_cli_fit_estimate_h100_budget_means_reserved(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--model", "demo?n_layer=4", "--global-batch", "16", "--estimate", "--target", "h100-sxm"]
    assert main([*args, "--budget", "110MiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["budget_means"] == "reserved" and d["budget_bytes"] == 110 * MiB
    assert d["predicted_reserved_bytes"] <= 110 * MiB and d["live_target_bytes"] < 110 * MiB


def test_a_plan_with_segments_is_estimated_for_a_gpu() -> None:
    """The reserved fit replays a solved plan's fake step; segments compare generator states there,
    which must not read the fake mode's tensors (torch.equal on them raised)."""
    wl = load_fake_workload("demo?n_layer=4")
    plan = policy_plan(wl.model, "sqrt")
    assert plan.segments
    seg = estimate(wl, device="h100-sxm", plan=plan)
    workspaces = seg.breakdown["allocator"]["workspace_bytes"]
    assert seg.peak_bytes + workspaces <= seg.predicted_allocated_bytes <= seg.predicted_reserved_bytes
