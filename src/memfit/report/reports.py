"""``--report out.png`` for ``memfit plan`` and ``memfit fit``: gather the numbers, then draw.

Both reports have (a) the memory/time frontier: the planner's best plan at every budget from the
minimum to store-all, on the same measured stats as the chosen plan, with the chosen point, the
baseline policies and the budget; and (b) a measured memory timeline of one step of the chosen
plan, stacked by parameters, optimizer state, gradients and activations
(:mod:`memfit.report.timeline`). The fit report adds the candidates' predicted samples/s
against micro-batch size, with the measured ones (its panel (b); the timeline is (c) there).

For ``memfit fit`` the frontier is at the chosen micro-batch, from a profile at exactly that size
(the fit interpolated between two others and does not keep its stats), with the accumulation's
gradients alive from the second micro-step (:func:`memfit.autofit.accumulation_costs`). Its time
axis is one optimizer step over the global batch ``G``: ``(G / b) * (micro-step time - optimizer
time) + optimizer time``, which is what the fit maximises (as samples/s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.plan.costmodel import ChainCosts
from memfit.report.frontier import FrontierPoint, frontier, predict_point
from memfit.report.plots import Marker, plot_report
from memfit.report.timeline import record_timeline
from memfit.workload import Workload

__all__ = ["fit_report", "plan_report"]

_TIMELINE_NOTE = "parameters & optimizer state measured before the step; gradients tracked exactly (post-accumulate-grad hooks); activations = the rest"


def plan_report(
    path: str | Path,
    workload: Workload,
    result: Any,
    *,
    measured: tuple[int, float] | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
) -> str:
    """Write the report of ``memfit plan``.

    Args:
        path: the PNG to write.
        workload: the workload the plan was made for (its model is used, then restored).
        result: the :class:`memfit.planning.PlanResult`.
        measured: ``(peak_bytes, step_s)`` of the plan when ``--measure`` ran it.
        optimizer: the step's optimizer.
        seed: seed for the recorded step.

    Returns:
        The PNG's path.
    """
    plan, costs, stats = result.plan, result.costs, result.stats
    points = frontier(costs)
    n = len(plan.blocks)
    chosen = Marker(label=f"chosen plan ({_not_kept(plan)} of {n} blocks not kept)", peak_bytes=plan.predicted_peak_bytes, step_s=plan.predicted_step_s)
    tl = record_timeline(workload, plan, batch_size=stats.batch_size, optimizer=optimizer, seed=seed)
    return plot_report(
        path,
        title=f"memfit plan: {stats.model}, batch {stats.batch_size}, budget {_mib(plan.budget_bytes)}",
        frontier=points,
        chosen=chosen,
        budget_bytes=plan.budget_bytes,
        timeline=tl,
        anchors=_anchors(workload, costs, lambda s: s),
        measured=Marker(label="chosen plan, measured", peak_bytes=measured[0], step_s=measured[1]) if measured else None,
        notes={"frontier": f"{len(points)} plans, predicted from one profile (margin {costs.margin:.0%})", "timeline": _TIMELINE_NOTE},
    )


def fit_report(path: str | Path, workload: Workload, result: Any, *, optimizer: str = "adamw", seed: int = 0) -> str:
    """Write the report of ``memfit fit`` (profiles the chosen micro-batch once more).

    Args:
        path: the PNG to write.
        workload: the workload that was fitted (its model is used, then restored).
        result: the :class:`memfit.autofit.FitResult`.
        optimizer: the step's optimizer.
        seed: seed for the profile and the recorded step.

    Returns:
        The PNG's path.
    """
    from memfit.autofit import accumulation_costs, gradient_bytes
    from memfit.guard import preserved_state
    from memfit.profiling import profile

    b, k, g = result.micro_batch, result.accumulation_steps, result.global_batch
    with preserved_state(workload.model):
        stats = profile(workload, batch_size=b, optimizer=optimizer, seed=seed, repeats=1)
    costs = ChainCosts.from_stats(stats, margin=result.margin)
    if k > 1:
        grads_bytes, later = gradient_bytes(workload.model, workload.blocks)
        costs = accumulation_costs(costs, grads_bytes=grads_bytes, later_grads_bytes=later)
    opt_s = max(0.0, stats.step_s - stats.fwd_s - stats.bwd_s)

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
    label = f"chosen: micro-batch {b} x {k}, {_not_kept(plan)} of {len(plan.blocks)} blocks not kept"
    if pred is not None:
        chosen = Marker(label=label, peak_bytes=pred.peak_bytes, step_s=window_s(pred.step_s))
    else:  # the profile's selective options differ from the fit's: show the fit's own prediction
        chosen = Marker(label=label + " (fit's prediction)", peak_bytes=result.predicted_peak_bytes, step_s=g / result.predicted_samples_per_s)
    measured = None
    if result.measured_peak_bytes is not None and result.measured_samples_per_s:
        measured = Marker(label="chosen, measured window", peak_bytes=result.measured_peak_bytes, step_s=g / result.measured_samples_per_s)
    tl = record_timeline(workload, plan, batch_size=g, micro_batch=b, optimizer=optimizer, seed=seed)
    return plot_report(
        path,
        title=f"memfit fit: {stats.model}, global batch {g}, budget {_mib(result.budget_bytes)}",
        frontier=points,
        chosen=chosen,
        budget_bytes=result.budget_bytes,
        timeline=tl,
        anchors=_anchors(workload, costs, window_s),
        measured=measured,
        time_label=f"predicted seconds per optimizer step ({g} samples, micro-batch {b})",
        candidates=result.candidates,
        measurements=result.measurements,
        chosen_micro_batch=b,
        notes={"frontier": f"at micro-batch {b}, from a profile at that size", "timeline": _TIMELINE_NOTE},
    )


def _anchors(workload: Workload, costs: ChainCosts, to_time: Any) -> list[Marker]:
    """Predicted points of the baseline policies the model supports."""
    from memfit.capture.chain import discover_chain
    from memfit.plan import policy_plan

    chain = discover_chain(workload.model, workload.blocks)
    out = []
    for name, text in (("none", "no checkpointing"), ("all", "policy 'all' (HF-style)"), ("sqrt", "policy 'sqrt'")):
        try:
            plan = policy_plan(workload.model, name, chain=chain)
        except MemfitError:  # 'sqrt' needs an nn.Sequential chain
            continue
        pred = predict_point(costs, plan)
        if pred is not None:
            out.append(Marker(label=text, peak_bytes=pred.peak_bytes, step_s=to_time(pred.step_s)))
    return out


def _not_kept(plan: Any) -> int:
    return sum(b.action.value != "keep" for b in plan.blocks)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"
