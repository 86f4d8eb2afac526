"""Choose by measurement: time the solver's plan beside the strongest alternatives that fit the
budget, in interleaved rounds, and keep the fastest measured one.

NOTE [ Choosing by measurement ]
The solver ranks plans by the cost model's step time, and that order can be wrong: on an H200
memfit's plan for a Llama 8 x 1024 took 1.42x of no checkpointing where ``every:2`` fitted the same
budget at 1.34x (benchmarks/results/gpu_check_real_shapes_2026-12-04.json). So after solving, the
candidates are

- the solver's plan and its next-best plans (:func:`memfit.plan.solve.ranked_solutions`), on the
  stats the plan was solved on;
- the fixed policies a user would run instead (``none``, the two fastest-predicted ``every:k``,
  ``sqrt``, ``all``), predicted on a profile of the model's own activations (a policy runs the
  model as it is: no fused activations, no chunked head), kept where their predicted peak fits,

and each is measured: its peak once with the tracker (the allocator's on CUDA), its step time as
the median of interleaved rounds (candidate A, B, C, A, B, C, ...:
:func:`memfit.profiling.side_by_side.measure_setups`), so that machine noise hits all alike. The
fastest measured candidate whose measured peak fits the budget is kept; fastest by ``vs_solver``,
the median over rounds of its time over the solver plan's in the same round (on a loaded machine a
ratio of medians swings with the load; a paired ratio cancels what slows a whole round). The chosen plan is
therefore never slower, as measured in those rounds, than a fixed policy that was timed there; a
candidate whose measured peak is over the budget is listed and never chosen.

Each candidate also records ``time_model_ratio``, its measured over its predicted step time: how far
the cost model was off for it (the docs' "Choosing by measurement" reports the ratios measured). The
timed steps then calibrate the time model (:func:`memfit.fitting.time_model.fit_time_model`, NOTE [ The
time model learns ]): ``MeasuredChoice.time_model`` holds the fit with the median ratio before and after,
and ``plan_for_budget(..., time_model=)`` solves on the calibrated times.

Known limitations:
    - The rounds are short (a few steps): on a noisy machine two candidates within a few percent
      may swap places from one run to the next. Either is then about as fast as the other.
    - With accumulation (``extra_bytes``) the kept gradients are added to a single measured step's
      peak: an upper bound of the window's peak, not its measurement.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec
from memfit.errors import MemfitError, SpecError
from memfit.fitting.budget import plan_for_policy
from memfit.fitting.time_model import TimedStep, TimeModelFit, fit_time_model
from memfit.plan.costmodel import ChainCosts
from memfit.plan.policies import EveryNth, KeepAll, Policy, RecomputeAll, Sqrt
from memfit.plan.solve import plan_from_solution, ranked_solutions
from memfit.plan.types import Plan
from memfit.profiling.side_by_side import measure_setups, paired_ratio, plan_setup
from memfit.units import format_bytes
from memfit.workload import Workload

__all__ = [
    "MeasuredCandidate",
    "MeasuredChoice",
    "calibrate_time_model",
    "choice_candidates",
    "choose_by_measurement",
    "pick_fastest",
]

DEFAULT_ROUNDS = 3
"""Interleaved timed rounds per candidate (after one warm-up round)."""
SOLVER_ALTERNATIVES = 2
"""Next-best solver plans timed beside the solver's own."""
EVERY_K_CANDIDATES = 2
"""``every:k`` policies timed (the fastest predicted of those that fit)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Contender:
    """A plan to time: its label (``memfit``, ``memfit #2``, ``every:3``), kind (``solver`` or
    ``policy``) and the plan with its prediction."""

    label: str
    kind: str
    plan: Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredCandidate:
    """One timed candidate.

    Attributes:
        label: ``memfit`` (the solver's plan), ``memfit #2`` ..., or the policy's name.
        kind: ``solver`` or ``policy``.
        plan: the plan timed.
        predicted_peak_bytes: the cost model's peak (``extra_bytes`` included).
        predicted_step_s: the cost model's step time.
        measured_peak_bytes: the measured step's peak (``extra_bytes`` included).
        measured_step_s: median over the rounds.
        step_s_samples: the rounds' times.
        vs_solver: median over rounds of this candidate's time over the solver plan's in the same round.
        time_model_ratio: ``measured_step_s / predicted_step_s`` (1: the model was right).
        fits_budget: the measured peak is within the budget.
    """

    label: str
    kind: str
    plan: Plan
    predicted_peak_bytes: int
    predicted_step_s: float
    measured_peak_bytes: int
    measured_step_s: float
    step_s_samples: tuple[float, ...]
    vs_solver: float
    time_model_ratio: float
    fits_budget: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_s": self.predicted_step_s,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_step_s": self.measured_step_s,
            "vs_solver": self.vs_solver,
            "time_model_ratio": self.time_model_ratio,
            "fits_budget": self.fits_budget,
            "recomputed_blocks": len(self.plan.recomputed),
            "segments": [[s.start, s.stop] for s in self.plan.segments],
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredChoice:
    """What :func:`choose_by_measurement` timed and kept.

    Attributes:
        budget_bytes: the budget the candidates were held to.
        candidates: every timed candidate, the solver's plan first.
        chosen: the kept candidate's label.
        reason: one line on why it was kept.
        rounds: timed rounds per candidate.
        left_out: the fixed policies not timed, with why (predicted over the budget, cannot run here).
        time_model: the time model calibrated on the timed candidates (NOTE [ The time model learns ]);
            None where none could be fitted.
    """

    budget_bytes: int
    candidates: tuple[MeasuredCandidate, ...]
    chosen: str
    reason: str
    rounds: int
    left_out: tuple[str, ...] = ()
    time_model: TimeModelFit | None = None

    @property
    def plan(self) -> Plan:
        """The kept plan."""
        return next(c.plan for c in self.candidates if c.label == self.chosen)

    @property
    def time_model_ratio(self) -> float:
        """Median over the candidates of measured over predicted step time."""
        return statistics.median(c.time_model_ratio for c in self.candidates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured_choice": [c.to_dict() for c in self.candidates],
            "measured_choice_chosen": self.chosen,
            "measured_choice_reason": self.reason,
            "measured_choice_rounds": self.rounds,
            "measured_choice_left_out": list(self.left_out),
            "time_model_ratio": self.time_model_ratio,
            "time_model_ratio_after": None if self.time_model is None else self.time_model.ratio_after,
            "time_model": None if self.time_model is None else self.time_model.to_dict(),
        }


def choose_by_measurement(
    workload: Workload,
    plan: Plan,
    stats: Stats,
    budget_bytes: int,
    *,
    step: StepSpec | None = None,
    margin: float = 0.02,
    rounds: int = DEFAULT_ROUNDS,
    extra_bytes: int = 0,
    reserved_fn: Callable[[Plan, Stats], int] | None = None,
    policy_stats: Stats | None = None,
    progress: Callable[[str], None] | None = None,
) -> MeasuredChoice:
    """Time ``plan`` (the solver's, solved on ``stats``) beside the strongest alternatives that fit
    ``budget_bytes`` and keep the fastest measured (NOTE [ Choosing by measurement ]).

    Measuring never changes the model (:func:`~memfit.profiling.side_by_side.measure_setups`).

    Args:
        workload: the workload, measured where its model is.
        plan: the solver's plan for ``budget_bytes``.
        stats: the stats it was solved on (its next-best plans are solved on them too).
        budget_bytes: the budget (on CUDA with ``reserved_fn``: reserved memory).
        step: the step (batch size, optimizer, seed; ``repeats`` is not used: see ``rounds``).
        margin: the planner's margin on predicted peaks.
        rounds: interleaved timed rounds per candidate.
        extra_bytes: bytes the step's peak does not hold but the budget must (gradients kept
            between the micro-steps of a window), added to every peak.
        reserved_fn: on CUDA, a plan's predicted reserved bytes: fixed policies fit by it.
        policy_stats: a profile of the model's own activations at the plan's batch
            (``plan_for_policy(...).stats``), to predict the fixed policies without profiling again.
        progress: called with a short text as the work advances.

    Returns:
        The candidates, measured, and the kept one.

    Raises:
        SpecError: ``rounds`` below 1.
    """
    if rounds < 1:
        raise SpecError(f"memfit.fitting: rounds {rounds} must be at least 1; give e.g. rounds=3.")
    # every candidate at the batch the plan was solved for
    step = replace(step or StepSpec(), batch_size=stats.batch_size)
    contenders, left_out = choice_candidates(
        workload, plan, stats, budget_bytes, step=step, margin=margin, extra_bytes=extra_bytes,
        reserved_fn=reserved_fn, policy_stats=policy_stats, progress=progress,
    )  # fmt: skip
    rows = measure_setups(
        workload,
        {c.label: plan_setup(c.plan) for c in contenders},
        batch_size=step.batch_size,
        optimizer=step.optimizer,
        repeats=rounds,
        seed=step.seed,
        progress=progress,
    )
    solver_samples = list(rows[0].step_s_samples)
    measured = tuple(
        MeasuredCandidate(
            label=c.label,
            kind=c.kind,
            plan=c.plan,
            predicted_peak_bytes=(c.plan.predicted_peak_bytes or 0) + extra_bytes,
            predicted_step_s=c.plan.predicted_step_s or 0.0,
            measured_peak_bytes=r.peak_bytes + extra_bytes,
            measured_step_s=r.step_s,
            step_s_samples=r.step_s_samples,
            vs_solver=paired_ratio(list(r.step_s_samples), solver_samples),
            time_model_ratio=r.step_s / c.plan.predicted_step_s if c.plan.predicted_step_s else float("nan"),
            fits_budget=r.peak_bytes + extra_bytes <= budget_bytes,
        )
        for c, r in zip(contenders, rows, strict=True)
    )
    chosen, reason = pick_fastest(measured)
    on_cuda = next((p.device.type == "cuda" for p in workload.model.parameters()), False)
    return MeasuredChoice(
        budget_bytes=budget_bytes, candidates=measured, chosen=chosen, reason=reason, rounds=rounds, left_out=left_out,
        time_model=calibrate_time_model(measured, overhead=on_cuda),
    )  # fmt: skip


def calibrate_time_model(measured: Sequence[MeasuredCandidate], *, overhead: bool = False) -> TimeModelFit | None:
    """The time model fitted to the timed candidates (NOTE [ The time model learns ]): each one's
    keep-all base (its plan's ``baseline_step_s``), predicted and measured step, on the profile of its
    kind (the solver's plans on the stats they were solved on, the fixed policies on theirs); None
    where no candidate has them. ``overhead``: also a per-step term (on CUDA)."""
    steps = [
        TimedStep(
            base_s=c.plan.baseline_step_s, predicted_s=c.predicted_step_s, measured_s=c.measured_step_s, profile=c.kind
        )
        for c in measured
        if c.plan.baseline_step_s and c.predicted_step_s > 0 and c.measured_step_s > 0
    ]
    return fit_time_model(steps, overhead=overhead) if steps else None


def choice_candidates(
    workload: Workload,
    plan: Plan,
    stats: Stats,
    budget_bytes: int,
    *,
    step: StepSpec,
    margin: float = 0.02,
    extra_bytes: int = 0,
    reserved_fn: Callable[[Plan, Stats], int] | None = None,
    policy_stats: Stats | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Contender], tuple[str, ...]]:
    """The plans :func:`choose_by_measurement` times (the solver's first) and the fixed policies
    left out, with why. Profiles the model's own activations once, for the policies (unless
    ``policy_stats`` are given)."""
    out = [Contender(label="memfit", kind="solver", plan=plan)]
    costs = ChainCosts.from_stats(stats, margin=margin)
    live_budget = max(0, budget_bytes - extra_bytes)
    for sol in ranked_solutions(costs, live_budget, limit=SOLVER_ALTERNATIVES + 1):
        alt = plan_from_solution(
            sol, costs, chain_path=stats.chain_path, fingerprint=stats.fingerprint, budget_bytes=plan.budget_bytes,
            baseline_peak_bytes=stats.peak_bytes, baseline_step_s=stats.step_s,
        )  # fmt: skip
        if len(out) <= SOLVER_ALTERNATIVES and not any(_same(alt, c.plan) for c in out):
            out.append(Contender(label=f"memfit #{len(out) + 1}", kind="solver", plan=alt))
    policies, left_out = _fixed_policies(
        workload, live_budget, step=step, margin=margin, reserved_fn=reserved_fn, stats=policy_stats, progress=progress
    )
    out += [Contender(label=str(pol), kind="policy", plan=p) for pol, p in policies]
    return out, left_out


def _fixed_policies(
    workload: Workload,
    budget_bytes: int,
    *,
    step: StepSpec,
    margin: float,
    reserved_fn: Callable[[Plan, Stats], int] | None,
    stats: Stats | None,
    progress: Callable[[str], None] | None,
) -> tuple[list[tuple[Policy, Plan]], tuple[str, ...]]:
    """``none``, the fastest-predicted fitting ``every:k``, ``sqrt`` and ``all`` where predicted to fit."""
    if stats is None:
        stats = plan_for_policy(workload, KeepAll(), step=step, margin=margin, progress=progress).stats
    n = len(stats.blocks)
    fits: list[tuple[Policy, Plan]] = []
    left_out: list[str] = []
    for pol in (KeepAll(), *(EveryNth(k=k) for k in range(2, n)), Sqrt(), RecomputeAll()):
        try:
            p = plan_for_policy(workload, pol, step=step, margin=margin, stats=stats).plan
        except MemfitError as err:  # sqrt where the chain cannot run segments
            left_out.append(f"{pol}: {str(err).partition(': ')[2] or err}")
            continue
        need = reserved_fn(p, stats) if reserved_fn is not None else p.predicted_peak_with_margin_bytes or 0
        if need <= budget_bytes:
            fits.append((pol, p))
        elif not isinstance(pol, EveryNth):
            left_out.append(f"{pol}: predicted {format_bytes(need)}, over the budget {format_bytes(budget_bytes)}")
    every = sorted((f for f in fits if isinstance(f[0], EveryNth)), key=lambda f: f[1].predicted_step_s or 0.0)
    keep = {id(f) for f in every[:EVERY_K_CANDIDATES]}
    return [f for f in fits if not isinstance(f[0], EveryNth) or id(f) in keep], tuple(left_out)


def _same(a: Plan, b: Plan) -> bool:
    return (a.blocks, a.segments, a.head, a.activations) == (b.blocks, b.segments, b.head, b.activations)


def pick_fastest(measured: tuple[MeasuredCandidate, ...]) -> tuple[str, str]:
    """The fastest measured candidate whose measured peak fits, and why it was kept. Fastest: the
    least ``vs_solver``, the paired ratio (a round the machine slowed slows every candidate alike)."""
    fitting = [c for c in measured if c.fits_budget]
    solver = measured[0]
    if not fitting:
        return solver.label, (
            "no candidate's measured peak fits the budget: the solver's plan is kept (raise the budget or lower the batch)"
        )
    best = min(fitting, key=lambda c: (c.vs_solver, c.measured_step_s))
    if best is solver:
        return best.label, (
            f"the solver's plan measured fastest of {len(fitting)} candidates within the budget (paired rounds)"
        )
    return best.label, (
        f"measured fastest of {len(fitting)} candidates within the budget: {best.vs_solver:.3f}x the solver's plan's "
        "step time (median over rounds of the time over the solver plan's in the same round)"
    )
