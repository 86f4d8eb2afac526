"""What ``--report`` draws, measured: the library side of :mod:`memfit.report`.

:mod:`memfit.report` draws what it is given and measures nothing; the functions here run the steps
it needs and return a typed :class:`ReportInputs`:

- the cost model the frontier is solved on (for ``memfit plan`` the plan's own; for ``memfit fit``
  a profile at exactly the chosen micro-batch, since the fit interpolated between two others and
  does not keep its stats, with the accumulation's gradients alive from the second micro-step,
  :func:`memfit.fitting.accumulation_costs`);
- a measured memory timeline of one step of the chosen plan (:func:`memfit.profiling.timeline.record_timeline`);
- the baseline policies the model supports, as plans (the report predicts them on the costs);
- for the HTML report (``records=True``), :class:`StepRecords`: the same step with no
  checkpointing, and the plan explained per block (:func:`memfit.profiling.residuals.explain`);
  ``memfit verify`` gathers only these (:func:`gather_step_records`).
"""

from __future__ import annotations

import torch

from memfit.capture.chain import discover_chain
from memfit.capture.snapshot import preserved_state
from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec
from memfit.errors import MemfitError
from memfit.fitting import FitResult, accumulation_costs, gradient_bytes
from memfit.fitting.types import Anchor, PlanResult, ReportInputs, StepRecords
from memfit.plan import policy_plan
from memfit.plan.costmodel import ChainCosts
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile
from memfit.profiling.residuals import explain
from memfit.profiling.timeline import record_timeline
from memfit.profiling.types import StepTimeline
from memfit.workload import Workload

__all__ = ["gather_fit_report", "gather_plan_report", "gather_step_records"]

_ANCHORS = (("none", "no checkpointing"), ("all", "policy 'all' (HF-style)"), ("sqrt", "policy 'sqrt'"))


def gather_plan_report(
    workload: Workload, result: PlanResult, *, optimizer: str = "adamw", seed: int = 0, records: bool = False
) -> ReportInputs:
    """Record a step of ``result.plan`` for the report of ``memfit plan``.

    Args:
        workload: the workload the plan was made for (its model is used, then restored).
        result: the :class:`memfit.fitting.budget.PlanResult`.
        optimizer: the step's optimizer.
        seed: seed for the recorded step.
        records: also record a step with no checkpointing and explain the plan (the HTML report).

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
        records=gather_step_records(
            workload, result.plan, batch_size=stats.batch_size, optimizer=optimizer, seed=seed, plan_timeline=tl
        )
        if records
        else None,
    )


def gather_fit_report(
    workload: Workload,
    result: FitResult,
    *,
    optimizer: str = "adamw",
    seed: int = 0,
    records: bool = False,
    options: tuple[str, ...] | None = None,
    stats: Stats | None = None,
) -> ReportInputs:
    """Profile the chosen micro-batch once more and record a window for the report of ``memfit fit``.

    Args:
        workload: the workload that was fitted (its model is used, then restored).
        result: the :class:`memfit.fitting.FitResult`.
        optimizer: the step's optimizer.
        seed: seed for the profile and the recorded step.
        records: also record the window with no checkpointing and explain the plan at the
            chosen micro-batch (the HTML report).
        options: the block options the profile calibrates (:func:`memfit.profiling.profile`'s;
            default: all of them): those the fit chose from, so that the frontier is made of plans
            the fit could choose (``memfit demo`` fits on the base options, and profiling the others
            took most of its report's time).
        stats: the chosen micro-batch's profile when the fit made it on those options
            (``result.profiles``): used instead of profiling again.

    Returns:
        The :class:`ReportInputs` at the chosen micro-batch.
    """
    b, k, g = result.micro_batch, result.accumulation_steps, result.global_batch
    if stats is None:
        with preserved_state(workload.model):
            stats = profile(
                workload,
                step=StepSpec(batch_size=b, optimizer=optimizer, seed=seed, repeats=1),
                **({"options": options} if options is not None else {}),
            )
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
        records=gather_step_records(
            workload, result.plan, batch_size=g, micro_batch=b, optimizer=optimizer, seed=seed, plan_timeline=tl
        )
        if records
        else None,
    )


def gather_step_records(
    workload: Workload,
    plan: Plan,
    *,
    batch_size: int,
    micro_batch: int | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
    plan_timeline: StepTimeline | None = None,
) -> StepRecords:
    """Record one step (or accumulation window) with no checkpointing and with ``plan``, and
    explain the plan per block at the micro-batch, for the HTML report.

    Args:
        workload: the workload (its model is used, then restored).
        plan: the plan.
        batch_size: samples in the step.
        micro_batch: samples per micro-step (default: ``batch_size``).
        optimizer: the step's optimizer.
        seed: seed for the steps.
        plan_timeline: the plan's step, when already recorded.

    Returns:
        The :class:`StepRecords`. A step with no checkpointing that runs out of memory, or a plan
        :func:`~memfit.profiling.residuals.explain` cannot read, leaves its field None with the reason.
    """
    micro = micro_batch or batch_size
    tl = plan_timeline or record_timeline(
        workload, plan, batch_size=batch_size, micro_batch=micro, optimizer=optimizer, seed=seed
    )
    baseline, baseline_error = None, ""
    try:
        baseline = record_timeline(
            workload, None, batch_size=batch_size, micro_batch=micro, optimizer=optimizer, seed=seed
        )
    except torch.OutOfMemoryError as err:  # the reason for checkpointing: said on the page
        baseline_error = f"no checkpointing ran out of memory on this device ({str(err).splitlines()[0][:120]})"
    explanation, explanation_error = None, ""
    try:
        explanation = explain(workload, plan, step=StepSpec(batch_size=micro, seed=seed, repeats=1)).to_dict()
    except MemfitError as err:
        explanation_error = " ".join(str(err).split())
    return StepRecords(
        baseline_timeline=baseline,
        plan_timeline=tl,
        explanation=explanation,
        baseline_error=baseline_error,
        explanation_error=explanation_error,
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
