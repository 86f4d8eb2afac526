"""plan_compiled: the fastest checkpoint plan whose *compiled* training step fits a budget.

For a user who will ``torch.compile`` the model: memfit chooses what to checkpoint so that the
compiled step fits ``budget_bytes`` and runs fastest. Compiling changes both sides of the
trade: inductor's min-cut partitioner already recomputes cheap pointwise ops inside what a plan
keeps, and ``torch._functorch.config.activation_memory_budget`` (a fraction, not bytes) makes it
recompute more; so the eager cost model's peaks are off for compiled code (benchmarks/frontier.py
on small GPT-2s: memfit's minimum plans rose from 43 to 50 MiB and from 84 to 92 MiB compiled, a
store-all plan fell from 540 to 463 MiB). memfit therefore measures compiled candidates and keeps
the fastest that fits:

- ``compiler``: the model as it is, compiled with the largest fraction whose measured peak fits
  (bisection over fractions, judged in bytes: NOTE [ Fractions from bytes ]).
- ``memfit``: memfit's block plan (per-block keep/recompute, segments, fused activations, the
  chunked head) compiled with the compiler's default partitioning. Planned first for the
  budget itself; when its compiled peak is over, planned again for the budget lowered by the
  overshoot (the eager plan's budget corrected by what compiling measured).
- ``memfit+compiler``: memfit's plan for the budget, with the largest fraction on top that makes
  it fit (the blocks the plan recomputes whole, and the compiler trimming the rest); and, when
  memfit's plan uses the chunked head or fused activations, those alone with every block kept,
  at the largest fraction that fits (memfit's savings the compiler cannot make, the compiler's
  cheap-op recompute for the rest: ``memfit head/activations f=...``).

Every fitting candidate is then timed in interleaved rounds (the same method as
:mod:`memfit.profiling.side_by_side`), each against the compiler's own candidate round by round (the median of
its time over the compiler's in the same round: a round slowed by the machine slows both), and the
fastest is returned as a plan file, unless it gains less than ``min_gain`` (2 %) over the
compiler's own, which is then chosen: a change to the model has to pay. A candidate whose plan
compiles to the same graphs as one measured before (inductor: the same partitioned forward and
backward code, :class:`memfit.apply.compiled.MemoryBudgetBackend`) is the same program: it is
timed once and reported ``same_as`` the first. ``plan.compile_settings``
records the compile settings, and the plan's predicted peak and step time are the measured
compiled ones. :func:`memfit.apply.compiled.compile_plan` applies it.

Peaks are measured with the profiler (:func:`memfit.capture.compiled.profiled_step_peak_bytes`):
the live-tensor tracker cannot see compiled code. Each candidate is compiled on a copy of the model;
the model itself is never changed.

NOTE [ Fractions from bytes ]
The fraction scales the partitioner's default *saved* activations, not the step's peak (a peak
can sit in the optimizer step, the head or the first block's backward), and torch gives no map
from fraction to bytes. The peak falls as the fraction falls (not strictly: on GPT-2 at 0.0 the
partitioner gives up and the peak returns to that of no recompute), so memfit measures 1.0 and
then bisects (0, 1) for ``fraction_steps`` compiles, keeping the largest fraction measured to fit.
When nothing on that grid fits (a budget near the compiler's floor), it keeps halving below the
grid's smallest fraction for up to ``fraction_steps`` more compiles and stops at the first that
fits (frontier.py, 6-layer GPT-2 at 101 MiB: 0.25 measured 107 MiB, 0.1 fits at 89 MiB; without
the descent the compiler's own candidate was missed). 0.0 is never tried. When the grid's largest
fitting fraction leaves more than ``fraction_slack`` (5 %) of the budget unused, the bisection goes
on (up to ``fraction_steps`` more compiles) until the fitting peak is within it: frontier.py,
24-layer GPT-2 at 241 MiB: the grid k/8 stopped at 0.25 (212 MiB; 0.375 measured 243 MiB) and
torch.compile at 0.3 (233 MiB) ran about 1 % faster. The result is the largest fitting fraction on
the grid k / 2**steps, or on the finer grid where it went on (or on the descent 2**-(steps + j)),
when the peak falls monotonically, and a measured fitting fraction in any case.

Known limitations:
    - Every candidate compiles once (10-60 s each with inductor on a CPU, up to
      ``3 * fraction_steps + 5`` compiles, ``fraction_steps`` more per fraction search whose
      grid has no fitting fraction or leaves the budget unused), on its own copy of the model; copies of fitting
      candidates are kept until they are timed.
    - dynamo's caches are reset before and after (the candidates' graphs would otherwise stay
      cached on the model's code and count against dynamo's recompile limit).
    - Plans with segments compile as :func:`memfit.apply.compiled.compile_applied` says (NOTE
      [ Compiled segments ]): compiled whole, nested segments act as their innermost ones, so a
      plan's compiled peak can differ from its eager one; the mode measures it either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memfit.apply.compiled import COMPILE_MODES
from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec
from memfit.errors import BudgetInfeasibleError, SpecError
from memfit.fitting.budget import plan_for_budget
from memfit.fitting.compiled_bench import (
    CandidateBench,
    CompiledCandidate,
    choose,
    largest_fitting_fraction,
    plan_key,
)
from memfit.fitting.types import PlanResult
from memfit.plan import KeepAll, Plan, policy_plan
from memfit.plan.details import CompileSettings
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.types import Option
from memfit.profiling.blocks import profile
from memfit.units import format_bytes
from memfit.workload import Workload

KINDS = ("compiler", "memfit", "memfit+compiler")
"""Candidate kinds: the compiler's fraction alone, memfit's block plan, and both."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompiledPlanResult:
    """The chosen compiled plan and every candidate measured on the way."""

    plan: Plan
    chosen: CompiledCandidate
    candidates: tuple[CompiledCandidate, ...]
    budget_bytes: int
    mode: str
    backend: str
    eager: PlanResult
    time_spread: float | None = None
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "budget_bytes": self.budget_bytes,
            "compile": p.compile_settings.to_dict() if p.compile_settings else None,
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "predicted_step_s": p.predicted_step_s,
            "measured_peak_bytes": self.chosen.peak_bytes,
            "measured_step_s": self.chosen.step_s,
            "chosen": self.chosen.name,
            "candidates": [c.to_dict() for c in self.candidates],
            "time_spread": self.time_spread,
            "baseline_peak_bytes": self.eager.stats.peak_bytes,
            "baseline_step_s": self.eager.stats.step_s,
            "eager_min_budget_bytes": self.eager.min_budget_bytes,
            "blocks": [b.to_dict() for b in p.blocks],
            "head": p.head,
            "activations": p.activations,
            "recomputed_blocks": len(p.recomputed),
            "batch_size": self.eager.stats.batch_size,
            "model": self.eager.stats.model,
            "notes": list(self.notes),
        }


def plan_compiled(
    workload: Workload,
    budget_bytes: int,
    *,
    mode: str = "model",
    backend: str = "inductor",
    step: StepSpec | None = None,
    fraction_steps: int = 3,
    fraction_slack: float = 0.05,
    replans: int = 2,
    min_gain: float = 0.02,
    kinds: tuple[str, ...] = KINDS,
    stats: Stats | None = None,
    progress: Callable[[str], None] | None = None,
) -> CompiledPlanResult:
    """Measure compiled candidates and return the fastest whose compiled step fits ``budget_bytes``.

    Args:
        workload: the workload (its model is not changed: candidates compile copies).
        budget_bytes: peak bytes allowed for a whole compiled training step.
        mode: ``"model"`` (the whole model compiled) or ``"block"`` (each block, torchtitan's order).
        backend: the compile backend's name: ``"inductor"``; ``"aot_eager_decomp_partition"`` runs
            the same partitioner without generating code (quick, for tests).
        step: the step (:class:`~memfit.capture.step.StepSpec`: batch size, optimizer, seed;
            ``repeats``: timed rounds, medians, also for the eager profile, default 3). Candidates
            compile the model as it is: no ``dtype`` or ``device``.
        fraction_steps: bisection steps per fraction search.
        fraction_slack: a fraction search whose largest fitting fraction on its grid leaves more
            than this share of the budget unused bisects on (up to ``fraction_steps`` more compiles;
            :func:`largest_fitting_fraction`); 0 stops at the grid.
        replans: how often memfit's plan is solved again for a budget lowered by the measured overshoot.
        min_gain: memfit's candidates replace the compiler's own (the largest fitting fraction,
            nothing of memfit's applied) only when they measure at least this much faster, as the
            median over timed rounds of their time over its time in the same round.
        kinds: the candidate kinds to try (:data:`KINDS`).
        stats: a profile (keep and recompute per block), to skip measuring eagerly.
        progress: called with a short text as the work advances.

    Returns:
        A :class:`CompiledPlanResult`; apply its plan with :func:`memfit.apply.compiled.compile_plan`.

    Raises:
        SpecError: an unknown mode or kind, or a step with a dtype or device.
        BudgetInfeasibleError: no candidate's compiled peak fits; the message gives the smallest
            measured and the fix.
    """
    step = _checked(mode, kinds, fraction_slack, min_gain, step or StepSpec())
    repeats = step.repeats_or(3)
    say = progress or (lambda _s: None)
    eager = _eager_plan(workload, budget_bytes, step=replace(step, repeats=repeats), stats=stats, progress=say)
    stats = eager.stats
    bench = CandidateBench(
        workload, stats.batch_size, budget_bytes, mode=mode, backend=backend, optimizer=step.optimizer, seed=step.seed
    )
    torch._dynamo.reset()
    # Every candidate keeps its own graphs: more cache entries per code object than dynamo's
    # default limit of 8, past which it would silently run the code eagerly.
    with torch._dynamo.config.patch(cache_size_limit=256, accumulated_cache_size_limit=4096):
        try:
            search = _Search(
                bench=bench,
                budget_bytes=budget_bytes,
                fraction_steps=fraction_steps,
                fraction_slack=fraction_slack,
                say=say,
            )
            _measure_candidates(search, workload, eager, kinds, replans)
            timed, spread = bench.time_fitting(repeats, say)
        finally:
            bench.release()
            torch._dynamo.reset()
    if not timed:
        raise _none_fits(bench, budget_bytes, eager)
    best, note = choose(timed, min_gain)
    return _result(
        best, note, timed, spread, bench=bench, eager=eager, budget_bytes=budget_bytes, mode=mode, backend=backend
    )


def _result(
    best: CompiledCandidate,
    note: str | None,
    timed: list[CompiledCandidate],
    spread: float | None,
    *,
    bench: CandidateBench,
    eager: PlanResult,
    budget_bytes: int,
    mode: str,
    backend: str,
) -> CompiledPlanResult:
    """The result of :func:`plan_compiled`: the chosen candidate's plan carrying its measured
    peak and step time, and every candidate measured (the timed ones with their times)."""
    plan = best.plan.with_(
        budget_bytes=budget_bytes,
        predicted_peak_bytes=best.peak_bytes,
        predicted_step_s=best.step_s,
        compile_settings=CompileSettings(
            mode=mode,
            backend=backend,
            activation_memory_budget=best.activation_memory_budget,
            candidate=best.name,
            measured_peak_bytes=best.peak_bytes,
            measured_step_s=best.step_s,
            compile_s=best.compile_s,
        ),
        baseline_peak_bytes=eager.stats.peak_bytes,
        baseline_step_s=eager.stats.step_s,
    )
    by_name = {c.name: c for c in timed}
    cands = tuple(by_name.get(c.name, c) for c in bench.measured)
    notes = (note,) if note else ()
    return CompiledPlanResult(
        plan=plan,
        chosen=best,
        candidates=cands,
        budget_bytes=budget_bytes,
        mode=mode,
        backend=backend,
        eager=eager,
        time_spread=spread,
        notes=notes,
    )


def _checked(mode: str, kinds: tuple[str, ...], fraction_slack: float, min_gain: float, step: StepSpec) -> StepSpec:
    """``step``, once :func:`plan_compiled`'s options are checked (each refusal says what to pass)."""
    if mode not in COMPILE_MODES:
        raise SpecError(
            f"memfit.plan: compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}. Use 'model' (the whole model compiled) or 'block'."
        )
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise SpecError(f"memfit.plan: candidate kinds {unknown or kinds!r} unknown; use some of {', '.join(KINDS)}.")
    if not 0.0 <= fraction_slack < 1.0:
        raise SpecError(
            f"memfit.plan: fraction_slack {fraction_slack!r} is not a fraction in [0, 1). Use 0.05 (bisect until the budget is used to within 5 %) or 0."
        )
    if not 0.0 <= min_gain < 1.0:
        raise SpecError(
            f"memfit.plan: min_gain {min_gain!r} is not a fraction in [0, 1). Use 0.02 (memfit's changes must gain 2 %) or 0 for the fastest measured."
        )
    if step.dtype is not None or step.device is not None:
        raise SpecError(
            "memfit.plan: compiled candidates compile the model as it is; move or cast it first "
            "(model.to(device, dtype)) and give a StepSpec without dtype and device."
        )
    return step


@dataclass(frozen=True, kw_only=True, slots=True)
class _Search:
    """What every fraction search of one :func:`plan_compiled` shares."""

    bench: CandidateBench
    budget_bytes: int
    fraction_steps: int
    fraction_slack: float
    say: Callable[[str], None]

    def fractions(self, kind: str, name: str, plan: Plan, eager_budget_bytes: int | None) -> None:
        """Measure ``plan`` compiled at the activation-memory fractions of a search (:func:`_fraction_search`)."""
        _fraction_search(
            self.bench,
            kind,
            name,
            plan,
            eager_budget_bytes,
            self.budget_bytes,
            self.fraction_steps,
            self.fraction_slack,
            self.say,
        )


def _measure_candidates(
    search: _Search, workload: Workload, eager: PlanResult, kinds: tuple[str, ...], replans: int
) -> None:
    """Compile and measure the candidates of ``kinds`` on ``search.bench``: the compiler's own (the
    model kept whole, fractions searched), memfit's plans (solved again for a budget lowered by the
    measured overshoot up to ``replans`` times), and memfit's plan with the compiler trimming the rest."""
    bench, budget_bytes = search.bench, search.budget_bytes
    if "compiler" in kinds:
        stats = eager.stats
        base = policy_plan(workload.model, KeepAll()).with_(
            chain_path=stats.chain_path, fingerprint=stats.fingerprint, policy="compiler"
        )
        search.fractions("compiler", "compiler", base, None)
    if "memfit" in kinds or "memfit+compiler" in kinds:
        _memfit_search(bench, workload, eager, budget_bytes, replans if "memfit" in kinds else 0, search.say)
    if "memfit+compiler" not in kinds:
        return
    over = next(
        (c for c in bench.measured if c.kind == "memfit" and c.peak_bytes is not None and c.peak_bytes > budget_bytes),
        None,
    )
    if over is not None:  # the plan alone is over: let the compiler trim the rest
        search.fractions("memfit+compiler", over.name, over.plan, over.eager_budget_bytes)
    opts = _options_only(eager.plan)
    if opts is not None:
        search.fractions("memfit+compiler", "memfit head/activations", opts, None)


def _none_fits(bench: CandidateBench, budget_bytes: int, eager: PlanResult) -> BudgetInfeasibleError:
    """The refusal when no compiled candidate fits: the lowest compiled peak measured, and the fix."""
    measured = [c for c in bench.measured if c.peak_bytes is not None]
    low = min(measured, key=lambda c: c.peak_bytes or 0, default=None)
    facts = (
        f"the lowest compiled peak measured is {format_bytes(low.peak_bytes or 0)} ({low.name})"
        if low
        else "no candidate compiled"
    )
    return BudgetInfeasibleError(
        f"memfit.plan: no compiled plan fits {format_bytes(budget_bytes)}: {facts}; eagerly memfit's plans reach "
        f"{format_bytes(eager.min_budget_bytes)}. Raise the budget, lower --batch-size, or plan for eager training (drop --compile).",
        min_budget_bytes=low.peak_bytes if low else None,
    )


def _eager_plan(
    workload: Workload,
    budget_bytes: int,
    *,
    step: StepSpec,
    stats: Stats | None,
    progress: Callable[[str], None],
) -> PlanResult:
    """memfit's eager block plan for the budget; the smallest one when the budget is below
    the eager minimum (compiling may still bring it under)."""
    if stats is None:
        # Untiled: a tiled submodule runs untiled inside torch.compile (memfit.apply.tiling).
        stats = profile(workload, step=step, options=BASE_OPTIONS, tiling=False, host_inputs=False, progress=progress)
    try:
        return plan_for_budget(workload, budget_bytes, stats=stats)
    except BudgetInfeasibleError as err:
        assert err.min_budget_bytes is not None
        return plan_for_budget(workload, err.min_budget_bytes, stats=stats)


def _memfit_search(
    bench: CandidateBench,
    workload: Workload,
    eager: PlanResult,
    budget_bytes: int,
    replans: int,
    say: Callable[[str], None],
) -> None:
    """memfit's plan compiled; re-solved for an eager budget lowered by the measured overshoot.

    The overshoot is taken off the plan's own predicted peak (with margin), so each re-solve asks
    the eager cost model for a plan that saves at least what compiling added; an eager minimum
    reached, or a budget whose plan was measured already, ends the search.
    """
    plan, eager_budget = eager.plan, eager.plan.budget_bytes or budget_bytes
    seen: set[tuple[Any, ...]] = set()
    for attempt in range(replans + 1):
        seen.add(plan_key(plan))
        say(f"compiling memfit's plan for {format_bytes(eager_budget)}")
        c = bench.measure(f"memfit@{format_bytes(eager_budget)}", "memfit", plan, 1.0, eager_budget_bytes=eager_budget)
        if c.peak_bytes is None or c.peak_bytes <= budget_bytes or attempt == replans:
            return
        predicted = plan.predicted_peak_with_margin_bytes or eager_budget
        lower = max(min(eager_budget, predicted) - (c.peak_bytes - budget_bytes), eager.min_budget_bytes)
        nxt = plan_for_budget(workload, lower, stats=eager.stats).plan
        if plan_key(nxt) in seen:
            return
        plan, eager_budget = nxt, lower


def _options_only(plan: Plan) -> Plan | None:
    """``plan``'s head and activation options with every block kept and no segment (None when it
    has neither option: that plan is the compiler's own candidate)."""
    if plan.head is None and plan.activations is None:
        return None
    keep = tuple(dataclasses.replace(b, option=Option.KEEP, policy=None) for b in plan.blocks)
    return plan.with_(blocks=keep, segments=(), policy="memfit head/activations")


def _fraction_search(
    bench: CandidateBench,
    kind: str,
    label: str,
    plan: Plan,
    eager_budget: int | None,
    budget_bytes: int,
    steps: int,
    slack: float,
    say: Callable[[str], None],
) -> None:
    def peak_at(f: float) -> int | None:
        done = (
            next((c for c in bench.measured if c.name == label), None)
            if kind == "memfit+compiler" and f == 1.0
            else None
        )
        if done is not None:  # measured already as the memfit candidate
            return done.peak_bytes
        say(f"compiling {label} at activation_memory_budget {f:g}")
        return bench.measure(f"{label} f={f:g}", kind, plan, f, eager_budget_bytes=eager_budget).peak_bytes

    largest_fitting_fraction(peak_at, budget_bytes, steps=steps, slack=slack)
