"""``--report out.png`` for ``memfit plan`` and ``memfit fit``: draw the numbers it is given.

Both reports have (a) the memory/time frontier: the planner's best plan at every budget from the
minimum to store-all, on the same measured stats as the chosen plan, with the chosen point, the
baseline policies and the budget; and (b) a measured memory timeline of one step of the chosen
plan, stacked by parameters, optimizer state, gradients and activations. The fit report adds the
candidates' predicted samples/s against micro-batch size, with the measured ones (its panel (b);
the timeline is (c) there). The steps behind them are run by :mod:`memfit.fitting.report_inputs` (library tier):
this module measures nothing.

For ``memfit fit`` the frontier is at the chosen micro-batch (:func:`memfit.fitting.report_inputs.gather_fit_report`
profiles exactly that size). Its time axis is one optimizer step over the global batch ``G``:
``(G / b) * (micro-step time - optimizer time) + optimizer time``, which is what the fit maximises
(as samples/s).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.fitting.types import PlanResult, ReportInputs
from memfit.plan.types import Plan
from memfit.report.frontier import FrontierPoint, frontier, predict_point
from memfit.report.plots import Marker, plot_report

if TYPE_CHECKING:
    from memfit.fitting.result import FitResult

__all__ = ["fit_report", "plan_report"]

_TIMELINE_NOTE = "parameters & optimizer state measured before the step; gradients tracked exactly (post-accumulate-grad hooks); activations = the rest"


def plan_report(
    path: str | Path,
    result: PlanResult,
    inputs: ReportInputs,
    *,
    measured: tuple[int, float] | None = None,
) -> str:
    """Write the report of ``memfit plan``.

    Args:
        path: the PNG to write.
        result: the :class:`memfit.fitting.budget.PlanResult`.
        inputs: what :func:`memfit.fitting.report_inputs.gather_plan_report` measured for it.
        measured: ``(peak_bytes, step_s)`` of the plan when ``--measure`` ran it.

    Returns:
        The PNG's path.
    """
    plan, costs = result.plan, inputs.costs
    points = frontier(costs)
    n = len(plan.blocks)
    chosen = Marker(
        label=f"chosen plan ({_not_kept(plan)} of {n} blocks not kept)",
        peak_bytes=plan.predicted_peak_bytes,
        step_s=plan.predicted_step_s,
    )
    return plot_report(
        path,
        title=f"memfit plan: {inputs.model}, batch {inputs.batch_size}, budget {_mib(plan.budget_bytes)}",
        frontier=points,
        chosen=chosen,
        budget_bytes=plan.budget_bytes,
        timeline=inputs.timeline,
        anchors=_anchors(inputs, lambda s: s),
        measured=Marker(label="chosen plan, measured", peak_bytes=measured[0], step_s=measured[1])
        if measured
        else None,
        notes={
            "frontier": f"{len(points)} plans, predicted from one profile (margin {costs.margin:.0%})",
            "timeline": _TIMELINE_NOTE,
        },
    )


def fit_report(path: str | Path, result: FitResult, inputs: ReportInputs) -> str:
    """Write the report of ``memfit fit``.

    Args:
        path: the PNG to write.
        result: the :class:`memfit.fitting.FitResult`.
        inputs: what :func:`memfit.fitting.report_inputs.gather_fit_report` measured at the chosen micro-batch.

    Returns:
        The PNG's path.
    """
    b, k, g = result.micro_batch, result.accumulation_steps, result.global_batch
    costs, opt_s = inputs.costs, inputs.optimizer_s

    def window_s(step_s: float) -> float:  # one micro-step's prediction -> one optimizer step over G
        return (g / b) * max(0.0, step_s - opt_s) + opt_s

    points = [
        FrontierPoint(
            budget_bytes=p.budget_bytes,
            predicted_peak_bytes=p.predicted_peak_bytes,
            predicted_step_s=window_s(p.predicted_step_s),
            not_kept_blocks=p.not_kept_blocks,
            options=p.options,
            segments=p.segments,
        )
        for p in frontier(costs)
    ]
    plan = result.plan
    pred = predict_point(costs, plan)
    label = f"chosen: micro-batch {b} x {k}, {f'policy {result.policy}, ' if result.policy is not None else ''}{_not_kept(plan)} of {len(plan.blocks)} blocks not kept"
    if pred is not None:
        chosen = Marker(label=label, peak_bytes=pred.peak_bytes, step_s=window_s(pred.step_s))
    else:  # the profile's selective options differ from the fit's: show the fit's own prediction
        chosen = Marker(
            label=label + " (fit's prediction)",
            peak_bytes=result.predicted_peak_bytes,
            step_s=g / result.predicted_samples_per_s,
        )
    measured = None
    if result.measured_peak_bytes is not None and result.measured_samples_per_s:
        measured = Marker(
            label="chosen, measured window",
            peak_bytes=result.measured_peak_bytes,
            step_s=g / result.measured_samples_per_s,
        )
    return plot_report(
        path,
        title=f"memfit fit: {inputs.model}, global batch {g}, budget {_mib(result.budget_bytes)}",
        frontier=points,
        chosen=chosen,
        budget_bytes=result.budget_bytes,
        timeline=inputs.timeline,
        anchors=_anchors(inputs, window_s),
        measured=measured,
        time_label=f"predicted seconds per optimizer step ({g} samples, micro-batch {b})",
        candidates=result.candidates,
        measurements=result.measurements,
        chosen_micro_batch=b,
        notes={"frontier": f"at micro-batch {b}, from a profile at that size", "timeline": _TIMELINE_NOTE},
    )


def _anchors(inputs: ReportInputs, to_time: Callable[[float], float]) -> list[Marker]:
    """Predicted points of the baseline policies the model supports."""
    out = []
    for a in inputs.anchors:
        pred = predict_point(inputs.costs, a.plan)
        if pred is not None:
            out.append(Marker(label=a.label, peak_bytes=pred.peak_bytes, step_s=to_time(pred.step_s)))
    return out


def _not_kept(plan: Plan) -> int:
    """Blocks whose activations the plan does not keep: their own option, or inside a segment
    (recomputed with it, though their decision reads ``keep``)."""
    in_segments = {i for s in plan.segments for i in range(s.start, s.stop)}
    return len(in_segments | {i for i, b in enumerate(plan.blocks) if b.option.value != "keep"})


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"
