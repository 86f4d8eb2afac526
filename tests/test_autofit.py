"""Auto-fit: micro-batch x accumulation x plan, predicted then measured."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memfit import BudgetInfeasibleError
from memfit.autofit import autofit, interpolate_stats, measure_window, micro_batch_options, stats_at
from memfit.plan.calibrate import MODES
from memfit.profiling import profile
from memfit.workload import load_workload

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import kw_workload  # noqa: E402

DEMO_SMALL = "demo?n_layer=4&n_embd=32&seq_len=32"


@pytest.mark.parametrize("g", [1, 7, 16, 64])
def test_micro_batch_options_cover_the_global_batch(g: int) -> None:
    opts = micro_batch_options(g)
    assert len({b for b, _ in opts}) == len(opts)
    assert {b for b, _ in opts} >= {1, g}
    for b, sizes in opts:
        assert sum(sizes) == g and max(sizes) == b and all(s > 0 for s in sizes)
        assert len(sizes) == -(-g // b)


def test_interpolation_reproduces_measured_points_and_is_linear() -> None:
    wl = kw_workload()
    s2 = profile(wl, batch_size=2, repeats=1, modes=("keep", "recompute"))
    s6 = profile(wl, batch_size=6, repeats=1, modes=("keep", "recompute"))
    at2 = interpolate_stats(s2, s6, 2)
    assert at2.blocks == s2.blocks and at2.peak_bytes == s2.peak_bytes
    assert [b.saved_bytes for b in interpolate_stats(s2, s6, 6).blocks] == [b.saved_bytes for b in s6.blocks]
    s4 = profile(wl, batch_size=4, repeats=1, modes=("keep", "recompute"))
    mid = interpolate_stats(s2, s6, 4)
    assert abs(mid.peak_bytes - s4.peak_bytes) <= 0.02 * s4.peak_bytes
    assert interpolate_stats(s2, s6, 100).step_s >= 0
    # Piecewise over three profiles: measured sizes as measured, others from the two around them
    # (outside: the nearest two), whatever order the profiles come in.
    three = [s6, s2, s4]
    assert stats_at(three, 4) is s4
    assert stats_at(three, 5) == interpolate_stats(s4, s6, 5)
    assert stats_at(three, 3) == interpolate_stats(s2, s4, 3)
    assert stats_at(three, 1) == interpolate_stats(s2, s4, 1) and stats_at(three, 9) == interpolate_stats(s4, s6, 9)


def test_fit_measured_peak_within_budget_and_close_to_prediction() -> None:
    wl = load_workload(DEMO_SMALL)
    full = profile(wl, batch_size=16, repeats=1, modes=("keep",)).peak_bytes
    budget = int(full * 0.6)
    res = autofit(wl, budget, 16, repeats=1, modes=MODES)
    assert res.measured_peak_bytes is not None and res.measured_peak_bytes <= budget
    assert abs(res.measured_peak_bytes - res.predicted_peak_bytes) <= 0.10 * res.measured_peak_bytes
    assert res.micro_batch * (res.accumulation_steps - 1) < 16 <= res.micro_batch * res.accumulation_steps
    chosen = next(c for c in res.candidates if c.micro_batch == res.micro_batch)
    assert chosen.feasible and chosen.predicted_peak_bytes <= budget


def test_fit_infeasible_budget_says_the_minimum() -> None:
    wl = load_workload(DEMO_SMALL)
    with pytest.raises(BudgetInfeasibleError, match="micro-batch of 1"):
        autofit(wl, 10_000, 8, repeats=1, measure=False, modes=MODES)


def test_resolve_replans_from_the_profiles_without_running_the_model() -> None:
    """A replan re-solves the fit's profiles: no forward runs, the tighter budget is respected by
    the prediction and by a measured window, and an impossible budget says the minimum."""
    wl = load_workload(DEMO_SMALL)
    full = profile(wl, batch_size=16, repeats=1, modes=("keep",)).peak_bytes
    res = autofit(wl, int(full * 0.8), 16, repeats=1, modes=MODES, measure=False)
    assert sorted(res.profiles) == list(res.profiled_batch_sizes) and len(res.later_grads_bytes) == 4
    forwards = []
    handle = wl.model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        same = res.resolve(res.budget_bytes)
        tight_budget = int(res.predicted_peak_bytes * 0.7)
        tight = res.resolve(tight_budget, max_micro_batch=res.micro_batch)
        with pytest.raises(BudgetInfeasibleError, match="micro-batch of 1"):
            res.resolve(10_000)
    finally:
        handle.remove()
    assert forwards == []
    assert (same.micro_batch, same.plan.blocks) == (res.micro_batch, res.plan.blocks)
    assert same.predicted_peak_bytes == res.predicted_peak_bytes
    assert tight.micro_batch <= res.micro_batch and tight.predicted_peak_bytes <= tight_budget
    assert tight.measured_peak_bytes is None and tight.resolved_from_budget_bytes == res.budget_bytes
    # `memfit fit --json` keys after the profiled sizes (DESIGN's contract, as before FitResult was typed)
    assert list(res.to_dict())[-2:] == ["profiled_batch_sizes", "margin"] and res.to_dict()["margin"] == 0.02
    assert list(tight.to_dict())[-2:] == ["margin", "resolved_from_budget_bytes"]
    assert tight.to_dict()["resolved_from_budget_bytes"] == res.budget_bytes
    assert tight.predicted_peak_bytes < res.predicted_peak_bytes
    chosen = next(c for c in tight.candidates if c.micro_batch == tight.micro_batch)
    m = measure_window(wl, chosen, 16, repeats=1)
    assert m.within_budget and m.peak_bytes <= tight_budget
