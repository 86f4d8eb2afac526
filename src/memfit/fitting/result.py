"""What an auto-fit returns: :class:`FitResult` (the JSON of ``memfit fit``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.capture.stats import Stats
from memfit.errors import MemfitError
from memfit.fitting.candidates import Candidate, first_feasible, predict_candidates
from memfit.fitting.window import Measurement
from memfit.plan.comm import Interconnect
from memfit.plan.policies import Policy
from memfit.plan.types import Plan

__all__ = ["EstimatedFit", "FitResult"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimatedFit:
    """How an estimated fit's profiles were made (NOTE [ Estimated stats ] in :mod:`memfit.estimation.stats`).

    Attributes:
        device: the device table entry the profiles were estimated for (``"h100-sxm"``).
        mfu: assumed fraction of the device's peak FLOP/s (per-block seconds come from it).
        kernels: whose kernels' saved tensors the bytes count: ``"cuda"`` or ``"cpu"``.
    """

    device: str | None
    mfu: float | None
    kernels: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "mfu": self.mfu, "kernels": self.kernels}


@dataclass(frozen=True, kw_only=True, slots=True)
class FitResult:
    """What ``memfit fit`` reports (field names are the JSON contract of DESIGN.md).

    Attributes (besides the reported choice and its candidates):
        margin: the safety margin on predicted peaks the fit used (a fraction).
        estimated: how the profiles were estimated, or None when they were measured here.
        resolved_from_budget_bytes: for a result of :meth:`resolve`, the budget of the fit it
            was resolved from; None for a fit that profiled.
        policy: the checkpoint policy every candidate kept (``memfit fit --policy``); None when
            the planner chose the plan per micro-batch.
        interconnect: the links candidates were ranked with (their exposed communication); None:
            compute only.
        min_micro_batch: the smallest micro-batch the fit considered (no micro-batch below it, the
            last one of a window included).
        min_micro_batch_reason: why it is above 1, in one line: the user's ``min_micro_batch``, or
            BatchNorm refusing smaller ones (:func:`memfit.accumulate.batchnorm.smallest_micro_batch`);
            None at 1.
    """

    budget_bytes: int
    global_batch: int
    micro_batch: int
    accumulation_steps: int
    predicted_peak_bytes: int
    predicted_samples_per_s: float
    measured_peak_bytes: int | None
    measured_samples_per_s: float | None
    plan: Plan
    candidates: tuple[Candidate, ...]
    measurements: tuple[Measurement, ...] = ()
    profiled_batch_sizes: tuple[int, ...] = ()
    margin: float = 0.02
    estimated: EstimatedFit | None = None
    resolved_from_budget_bytes: int | None = None
    profiles: dict[int, Stats] = field(default_factory=dict, repr=False, compare=False)
    grads_bytes: int = 0
    later_grads_bytes: tuple[int, ...] = ()
    policy: Policy | None = None
    interconnect: Interconnect | None = field(default=None, repr=False, compare=False)
    min_micro_batch: int = 1
    min_micro_batch_reason: str | None = None

    @property
    def chosen_candidate(self) -> Candidate:
        """The candidate of the chosen micro-batch (its communication, where modelled)."""
        return next(c for c in self.candidates if c.micro_batch == self.micro_batch)

    def resolve(self, budget_bytes: int, *, max_micro_batch: int | None = None, even: bool = False) -> FitResult:
        """The fit for another budget from this fit's profiles: the solver only, nothing runs.

        What a replan after an out-of-memory error needs: the profiles at the two micro-batch sizes
        are reused (NOTE [ Auto-fit ] step 2), so this takes milliseconds where :func:`autofit`
        profiles again. Nothing is measured (``measured_*`` are None): the caller's next step is
        the check. The plan's fingerprint leaves the batch out (it fits any micro-batch's shape).

        Raises:
            BudgetInfeasibleError: no micro-batch fits the new budget (the message gives the minimum).
            MemfitError: this result has no profiles (it was not made by :func:`autofit`).
        """
        if not self.profiles or not self.later_grads_bytes:
            raise MemfitError(
                "FitResult.resolve: this result carries no profiles; run memfit.fitting.autofit() for the new budget instead."
            )
        cands = predict_candidates(
            list(self.profiles.values()),
            budget_bytes,
            self.global_batch,
            grads_bytes=self.grads_bytes,
            later_grads_bytes=list(self.later_grads_bytes),
            margin=self.margin,
            max_micro_batch=max_micro_batch,
            even=even,
            fixed_plan=self.plan if self.policy is not None else None,
            net=self.interconnect,
            min_micro_batch=self.min_micro_batch,
        )
        chosen = first_feasible(
            cands,
            budget_bytes,
            self.profiles[min(self.profiles)],
            policy=str(self.policy) if self.policy is not None else None,
        )
        assert chosen.plan is not None
        return FitResult(
            budget_bytes=budget_bytes,
            global_batch=self.global_batch,
            micro_batch=chosen.micro_batch,
            accumulation_steps=chosen.accumulation_steps,
            predicted_peak_bytes=chosen.predicted_peak_bytes or 0,
            predicted_samples_per_s=chosen.predicted_samples_per_s or 0.0,
            measured_peak_bytes=None,
            measured_samples_per_s=None,
            plan=chosen.plan,
            candidates=tuple(cands),
            profiled_batch_sizes=self.profiled_batch_sizes,
            margin=self.margin,
            estimated=self.estimated,
            resolved_from_budget_bytes=self.budget_bytes,
            profiles=self.profiles,
            grads_bytes=self.grads_bytes,
            later_grads_bytes=self.later_grads_bytes,
            policy=self.policy,
            interconnect=self.interconnect,
            min_micro_batch=self.min_micro_batch,
            min_micro_batch_reason=self.min_micro_batch_reason,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_samples_per_s": self.predicted_samples_per_s,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_samples_per_s": self.measured_samples_per_s,
            "policy": str(self.policy) if self.policy is not None else None,
            "plan": self.plan.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "measurements": [m.to_dict() for m in self.measurements],
            "min_micro_batch": self.min_micro_batch,
            **({"min_micro_batch_reason": self.min_micro_batch_reason} if self.min_micro_batch_reason else {}),
            "profiled_batch_sizes": list(self.profiled_batch_sizes),
            "margin": self.margin,
            **({"estimated": self.estimated.to_dict()} if self.estimated is not None else {}),
            **(
                {"resolved_from_budget_bytes": self.resolved_from_budget_bytes}
                if self.resolved_from_budget_bytes is not None
                else {}
            ),
        }
