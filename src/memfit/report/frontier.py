"""The memory/time frontier: the planner's best plan at every budget, on the same measured stats.

Every point is what :func:`memfit.plan.solve.solve` answers for some budget between the smallest
one any plan fits in (:func:`memfit.plan.solve.min_budget`) and the one that keeps everything:
its predicted peak and step time. Budgets are taken where the answer can change (one per point of
the solver's Pareto front, :func:`memfit.plan.solve.chain_front`) plus an even grid, so the
frontier is the solver's exact staircase, not a sample of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.errors import PlanMismatchError
from memfit.plan.costmodel import ChainCosts, Prediction, predict
from memfit.plan.solve import chain_front, min_budget, solve
from memfit.plan.types import Plan

__all__ = ["FrontierPoint", "frontier", "keep_all_plan", "predict_point"]

MAX_FRONT_BUDGETS = 400
"""At most this many budgets from the Pareto front are solved (evenly spaced when there are more)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontierPoint:
    """The solver's answer at some budget.

    Attributes:
        budget_bytes: the smallest budget tried at which the solver chose this plan.
        predicted_peak_bytes: its predicted whole-step peak (without the margin).
        predicted_step_s: its predicted step time.
        not_kept_blocks: blocks recomputed, selective or offloaded.
        options: the option of every block.
        segments: recomputed segments ``(start, stop)``.
        head: the head option (None: the model's own head).
    """

    budget_bytes: int
    predicted_peak_bytes: int
    predicted_step_s: float
    not_kept_blocks: int
    options: tuple[str, ...]
    segments: tuple[tuple[int, int], ...]
    head: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_s": self.predicted_step_s,
            "not_kept_blocks": self.not_kept_blocks,
            "options": list(self.options),
            "segments": [list(s) for s in self.segments],
            "head": self.head,
        }


def keep_all_plan(costs: ChainCosts) -> Plan:
    """The plan that keeps every block (store-all), for :func:`memfit.plan.costmodel.predict`."""
    return Plan(policy="none", chain_path="", blocks=tuple(costs.decision(i, "keep") for i in range(len(costs))))


def frontier(costs: ChainCosts, *, grid: int = 48) -> list[FrontierPoint]:
    """The solver's best plan over budgets from the minimum to store-all, cheapest first per peak.

    Args:
        costs: the cost model (``ChainCosts.from_stats(stats)``, or the accumulation variant).
        grid: evenly spaced budgets added to those where the front changes.

    Returns:
        Points by increasing predicted peak; step time never increases along the list (points
        that a smaller peak beats are dropped). The first is the minimum-budget plan, the last
        the fastest plan (store-all when nothing is cheaper).
    """
    lo, _ = min_budget(costs)
    store_all = predict(costs, keep_all_plan(costs))
    hi = max(lo, math.ceil(store_all.peak_bytes * (1 + costs.margin)) + 1)
    fixed = max(costs.pre_peak_bytes, costs.post_peak_bytes)
    budgets = {lo, hi}
    budgets.update(int(lo + (hi - lo) * i / max(1, grid - 1)) for i in range(grid))
    for c in costs.head_choices():
        front = chain_front(c)
        if len(front) > MAX_FRONT_BUDGETS:
            step = len(front) / MAX_FRONT_BUDGETS
            front = [front[int(i * step)] for i in range(MAX_FRONT_BUDGETS)]
        for p in front:  # the budget at which this point first fits (as solve() checks it), plus a byte
            need = max(c.start_bytes + p.excess, fixed)
            budgets.add(min(hi, max(lo, math.ceil(need * (1 + costs.margin)) + 1)))
    by_plan: dict[tuple[Any, ...], FrontierPoint] = {}
    for b in sorted(budgets):
        sol = solve(costs, b)
        key = (sol.options, sol.segments, sol.head)
        if key in by_plan:
            continue
        by_plan[key] = FrontierPoint(
            budget_bytes=b,
            predicted_peak_bytes=sol.prediction.peak_bytes,
            predicted_step_s=sol.prediction.step_s,
            not_kept_blocks=sum(o != "keep" for o in sol.options),
            options=sol.options,
            segments=sol.segments,
            head=sol.head,
        )
    points = sorted(by_plan.values(), key=lambda p: (p.predicted_peak_bytes, p.predicted_step_s))
    out: list[FrontierPoint] = []
    for p in points:
        if not out or p.predicted_step_s < out[-1].predicted_step_s:
            out.append(p)
    return out


def predict_point(costs: ChainCosts, plan: Plan) -> Prediction | None:
    """The cost model's prediction for ``plan``, or None when the costs lack one of its options
    (a selective policy another profile calibrated)."""
    try:
        return predict(costs, plan)
    except PlanMismatchError:
        return None
