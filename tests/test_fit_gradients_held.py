"""A budget a single step meets but a window of micro-steps does not: the refusal says that the
gradients held from one micro-step to the next make the difference, with their bytes
(memfit.fitting.candidates)."""

from __future__ import annotations

import pytest

from memfit import StepSpec, profile
from memfit.errors import BudgetInfeasibleError
from memfit.fitting.budget import plan_for_budget
from memfit.fitting.candidates import first_feasible, gradient_bytes, predict_candidates
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.solve import min_budget
from memfit.units import format_bytes


def test_a_budget_plan_accepts_is_refused_for_accumulation_with_the_gradients_named() -> None:
    wl = load_workload("demo?n_layer=2&n_embd=32&seq_len=32")
    profiles = [
        profile(wl, step=StepSpec(batch_size=b, repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
        for b in (1, 2)
    ]
    one = profiles[0]
    grads, later = gradient_bytes(wl.model)
    assert grads == sum(p.numel() * p.element_size() for p in wl.model.parameters() if p.requires_grad)
    least_single, _ = min_budget(ChainCosts.from_stats(one, margin=0.02))
    budget = least_single + 1024  # one step of 1 sample fits; a window of two holds the gradients too
    assert plan_for_budget(wl, budget, stats=one).plan.predicted_peak_bytes is not None  # plan accepts it
    cands = predict_candidates(
        profiles, budget, 2, grads_bytes=grads, later_grads_bytes=later, margin=0.02, max_micro_batch=2
    )
    with pytest.raises(BudgetInfeasibleError) as exc:
        first_feasible(cands, budget, one)
    msg = str(exc.value)
    assert "over 2 micro-steps of accumulation" in msg and f"gradients ({format_bytes(grads)})" in msg
    assert f"one step of 1 sample alone, without accumulation, needs {format_bytes(least_single)}" in msg
    assert len(msg.splitlines()) == 1
