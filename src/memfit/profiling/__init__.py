"""Profiling: measure a workload's training step, block by block and op by op.

One module per question: :mod:`~memfit.profiling.blocks` (:func:`profile`: a tracked step per block
option, the :class:`~memfit.capture.stats.Stats` every planner takes), :mod:`~memfit.profiling.timeline`
(one step's memory over time, for the report), :mod:`~memfit.profiling.residuals` (:func:`explain`:
what each block keeps and why), :mod:`~memfit.profiling.side_by_side` (set-ups timed round by round
in one process; :func:`~memfit.profiling.side_by_side.measure_plan`: ``memfit plan --measure``) and
:mod:`~memfit.profiling.types` (what the report draws).
"""

from memfit.profiling.blocks import profile
from memfit.profiling.residuals import BlockExplanation, Explanation, TensorDecision, explain
from memfit.profiling.side_by_side import PlanMeasurement, SetupResult, measure_plan, measure_setups, paired_ratio
from memfit.profiling.timeline import record_timeline
from memfit.profiling.types import StepTimeline

__all__ = [
    "BlockExplanation",
    "Explanation",
    "PlanMeasurement",
    "SetupResult",
    "StepTimeline",
    "TensorDecision",
    "explain",
    "measure_plan",
    "measure_setups",
    "paired_ratio",
    "profile",
    "record_timeline",
]
