"""What ``--report`` draws, measured: the library side of :mod:`memfit.report`.

:mod:`memfit.report` draws what it is given and measures nothing; the functions here run the steps
it needs and return a typed :class:`ReportInputs`:

- the cost model the frontier is solved on (for ``memfit plan`` the plan's own; for ``memfit fit``
  a profile at exactly the chosen micro-batch, since the fit interpolated between two others and
  does not keep its stats, with the accumulation's gradients alive from the second micro-step,
  :func:`memfit.fitting.accumulation_costs`);
- a measured memory timeline of one step of the chosen plan (:func:`memfit.profiling.timeline.record_timeline`);
- the baseline policies the model supports, as plans (the report predicts them on the costs).
"""

from __future__ import annotations

from memfit.capture.chain import discover_chain
from memfit.capture.snapshot import preserved_state
from memfit.capture.step import StepSpec
from memfit.errors import MemfitError
from memfit.fitting import FitResult, accumulation_costs, gradient_bytes
from memfit.fitting.types import Anchor, PlanResult, ReportInputs
from memfit.plan import policy_plan
from memfit.plan.costmodel import ChainCosts
from memfit.profiling.blocks import profile
from memfit.profiling.timeline import record_timeline
from memfit.workload import Workload

__all__ = ["gather_fit_report", "gather_plan_report"]

_ANCHORS = (("none", "no checkpointing"), ("all", "policy 'all' (HF-style)"), ("sqrt", "policy 'sqrt'"))


def gather_plan_report(
    workload: Workload, result: PlanResult, *, optimizer: str = "adamw", seed: int = 0
) -> ReportInputs:
    """Record a step of ``result.plan`` for the report of ``memfit plan``.

    Args:
        workload: the workload the plan was made for (its model is used, then restored).
        result: the :class:`memfit.fitting.budget.PlanResult`.
        optimizer: the step's optimizer.
        seed: seed for the recorded step.

    Returns:
        The :class:`ReportInputs` (the costs are the plan's own).
    """
    stats = result.stats
    tl = record_timeline(workload, result.plan, batch_size=stats.batch_size, optimizer=optimizer, seed=seed)
    return ReportInputs(
        model=stats.model,
        batch_size=stats.batch_size,
        costs=result.costs,
        optimizer_s=max(0.0, stats.step_s - stats.fwd_s - stats.bwd_s),
        timeline=tl,
        anchors=anchor_plans(workload),
    )


def gather_fit_report(
    workload: Workload, result: FitResult, *, optimizer: str = "adamw", seed: int = 0
) -> ReportInputs:
    """Profile the chosen micro-batch once more and record a window for the report of ``memfit fit``.

    Args:
        workload: the workload that was fitted (its model is used, then restored).
        result: the :class:`memfit.fitting.FitResult`.
        optimizer: the step's optimizer.
        seed: seed for the profile and the recorded step.

    Returns:
        The :class:`ReportInputs` at the chosen micro-batch.
    """
    b, k, g = result.micro_batch, result.accumulation_steps, result.global_batch
    with preserved_state(workload.model):
        stats = profile(workload, step=StepSpec(batch_size=b, optimizer=optimizer, seed=seed, repeats=1))
    costs = ChainCosts.from_stats(stats, margin=result.margin)
    if k > 1:
        grads_bytes, later = gradient_bytes(workload.model, workload.blocks)
        costs = accumulation_costs(costs, grads_bytes=grads_bytes, later_grads_bytes=later)
    tl = record_timeline(workload, result.plan, batch_size=g, micro_batch=b, optimizer=optimizer, seed=seed)
    return ReportInputs(
        model=stats.model,
        batch_size=b,
        costs=costs,
        optimizer_s=max(0.0, stats.step_s - stats.fwd_s - stats.bwd_s),
        timeline=tl,
        anchors=anchor_plans(workload),
    )


def anchor_plans(workload: Workload) -> tuple[Anchor, ...]:
    """Plans of the baseline policies (``none``, ``all``, ``sqrt``) the model supports."""
    chain = discover_chain(workload.model, workload.blocks)
    out = []
    for name, label in _ANCHORS:
        try:
            plan = policy_plan(workload.model, name, chain=chain)
        except MemfitError:  # 'sqrt' needs an nn.Sequential chain
            continue
        out.append(Anchor(label=label, plan=plan))
    return tuple(out)
