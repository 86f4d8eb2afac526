"""Fitting: choose what to run for a budget, from measured or estimated stats.

- :mod:`~memfit.fitting.budget`: :func:`plan_for_budget` (the fastest checkpoint plan under a
  budget) and :func:`plan_for_policy` (a fixed policy's plan, predicted);
- :mod:`~memfit.fitting.compiled` and :mod:`~memfit.fitting.compiled_bench`: :func:`plan_compiled`,
  the fastest plan whose *compiled* step fits;
- auto-fit, one module per stage: :mod:`~memfit.fitting.candidates` (sizes, interpolation between
  profiles, the planner's answer per size), :mod:`~memfit.fitting.window` (a candidate's measured
  window), :mod:`~memfit.fitting.result` (:class:`FitResult`), :mod:`~memfit.fitting.search`
  (:func:`autofit`, NOTE [ Auto-fit ]);
- :mod:`~memfit.fitting.types` (what planning returns, as data) and
  :mod:`~memfit.fitting.report_inputs` (the steps ``--report`` draws, measured).

``memfit.fitting.autofit`` is looked up at call time by the training loop's replanner (tests stand
in for it there).
"""

from memfit.fitting.budget import plan_for_budget, plan_for_policy
from memfit.fitting.candidates import (
    Candidate,
    accumulation_costs,
    gradient_bytes,
    interpolate_stats,
    micro_batch_options,
    predict_candidates,
    stats_at,
)
from memfit.fitting.compiled import CompiledPlanResult, plan_compiled
from memfit.fitting.result import EstimatedFit, FitResult
from memfit.fitting.search import autofit
from memfit.fitting.types import PlanResult
from memfit.fitting.window import Measurement, measure_window

__all__ = [
    "Candidate",
    "CompiledPlanResult",
    "PlanResult",
    "plan_compiled",
    "plan_for_budget",
    "plan_for_policy",
    "EstimatedFit",
    "FitResult",
    "Measurement",
    "accumulation_costs",
    "autofit",
    "gradient_bytes",
    "interpolate_stats",
    "measure_window",
    "micro_batch_options",
    "predict_candidates",
    "stats_at",
]
