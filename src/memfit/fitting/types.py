"""What planning and fitting return, as data: :class:`PlanResult` (the JSON of ``memfit plan``) and
what ``--report`` draws (:class:`ReportInputs`). Nothing here measures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.capture.stats import Stats
from memfit.plan.costmodel import ChainCosts, Prediction
from memfit.plan.types import Plan
from memfit.profiling.types import StepTimeline

__all__ = ["Anchor", "PlanResult", "ReportInputs", "StepRecords"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReservedFit:
    """How a plan was fitted to a budget meaning CUDA reserved memory (NOTE [ On CUDA a budget is
    reserved memory ] in :mod:`memfit.fitting.budget`).

    Attributes:
        budget_bytes: the budget (reserved memory).
        live_target_bytes: the live-tensor target the chosen plan was solved for.
        predicted_reserved_bytes: the chosen plan's predicted ``max_memory_reserved``.
        solves: solves made (1: the plan for the budget fitted as it was).
    """

    budget_bytes: int
    live_target_bytes: int
    predicted_reserved_bytes: int
    solves: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_means": "reserved",
            "live_target_bytes": self.live_target_bytes,
            "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "reserved_solves": self.solves,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    """A plan with what it was made from: the measured stats and the cost model."""

    plan: Plan
    stats: Stats
    costs: ChainCosts
    min_budget_bytes: int
    store_all: Prediction
    notes: tuple[str, ...] = ()
    reserved: ReservedFit | None = None
    """Set when the budget meant CUDA reserved memory (``plan_for_budget(reserved_fn=...)``)."""

    def to_dict(self) -> dict[str, Any]:
        p, cal = self.plan, self.stats.calibration
        return {
            "budget_bytes": p.budget_bytes,
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "predicted_step_s": p.predicted_step_s,
            "baseline_peak_bytes": self.stats.peak_bytes,
            "baseline_step_s": self.stats.step_s,
            "min_budget_bytes": self.min_budget_bytes,
            "margin": self.costs.margin,
            "blocks": [b.to_dict() for b in p.blocks],
            "segments": [s.to_dict() for s in p.segments],
            "head": p.head,
            "activations": p.activations,
            "states": str(p.states),
            "recomputed_blocks": len(p.recomputed),
            "search": p.search,
            "peak_event": p.peak_event,
            "batch_size": self.stats.batch_size,
            "model": self.stats.model,
            "notes": list(self.notes),
            **(self.reserved.to_dict() if self.reserved is not None else {}),
            **({"estimated": cal.estimated.to_dict()} if cal.estimated is not None else {}),
            **({"parallel": cal.parallel.to_dict()} if cal.parallel is not None else {}),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Anchor:
    """A baseline policy's plan, drawn beside the frontier.

    Attributes:
        label: the legend's text.
        plan: the policy's plan for the model.
    """

    label: str
    plan: Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecords:
    """What the HTML report adds to a PNG's inputs: both steps recorded, and the plan explained.

    Attributes:
        baseline_timeline: one step of the same batch with no checkpointing (None: it did not run,
            ``baseline_error`` says why).
        plan_timeline: one step of the chosen plan.
        explanation: :func:`memfit.profiling.residuals.explain`'s JSON for the plan (per block,
            the tensors it keeps, recomputes or offloads); None when it could not run
            (``explanation_error``).
        baseline_error: why the baseline step is missing (one line).
        explanation_error: why the explanation is missing (one line).
    """

    baseline_timeline: StepTimeline | None
    plan_timeline: StepTimeline
    explanation: dict[str, Any] | None
    baseline_error: str = ""
    explanation_error: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportInputs:
    """Everything a report draws besides the plan or fit result itself.

    Attributes:
        model: the workload's name (the title).
        batch_size: samples per micro-step the costs are for.
        costs: the cost model the frontier is solved on.
        optimizer_s: seconds of the optimizer step in the profile the costs come from (a fit's time
            axis is one optimizer step over the global batch).
        timeline: the measured memory timeline of one step of the chosen plan.
        anchors: the baseline policies the model supports.
        records: for the HTML report: the no-checkpointing step and the plan explained (None: PNG only).
    """

    model: str
    batch_size: int
    costs: ChainCosts
    optimizer_s: float
    timeline: StepTimeline
    anchors: tuple[Anchor, ...]
    records: StepRecords | None = None
