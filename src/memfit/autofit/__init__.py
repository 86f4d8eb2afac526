"""Auto-fit: micro-batch x accumulation steps x checkpoint plan for a budget and a global batch.

One module per stage: :mod:`~memfit.autofit.candidates` (sizes, interpolation between profiles,
the planner's answer per size), :mod:`~memfit.autofit.window` (a candidate's measured window),
:mod:`~memfit.autofit.result` (:class:`FitResult`), :mod:`~memfit.autofit.fit` (the search,
NOTE [ Auto-fit ]). ``memfit.autofit.autofit`` is looked up at call time by the training loop's
replanner (tests stand in for it there).
"""

from memfit.autofit.candidates import (
    Candidate,
    accumulation_costs,
    gradient_bytes,
    interpolate_stats,
    micro_batch_options,
    predict_candidates,
    stats_at,
)
from memfit.autofit.fit import autofit
from memfit.autofit.result import EstimatedFit, FitResult
from memfit.autofit.window import Measurement, measure_window

__all__ = [
    "Candidate",
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
