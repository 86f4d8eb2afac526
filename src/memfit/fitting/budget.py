"""plan_for_budget: measure a workload, then choose the fastest plan that fits a budget.

Library tier: it measures (:func:`memfit.profiling.blocks.profile`) and then plans (:mod:`memfit.plan`,
pure functions of the stats).

NOTE [ On CUDA a budget is reserved memory ]
The solver fits the peak of live tensors. On a GPU what runs out is the caching allocator's
reserved memory: the live tensors rounded to its blocks, cuBLAS workspaces, and freed blocks kept
cached (:mod:`memfit.estimation.allocator`). Given ``reserved_fn`` (a plan's predicted reserved
bytes), :func:`fit_reserved` makes the budget mean reserved memory: solve for the budget, predict the
plan's reserved bytes, and while they are over, lower the live-tensor target by the excess and
solve again (at most :data:`MAX_RESERVED_SOLVES` solves; the target never goes below the least any
plan needs, and a plan that is still over there is refused). The excess changes little from plan
to plan (workspaces and the cache are most of it), so one more solve usually fits. On the CPU there
is no ``reserved_fn`` and nothing changes. ``fitting`` sits below ``estimation``: the caller (the
CLI, or code with :func:`memfit.estimation.parallel.estimate_plan_allocator`) gives the function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from memfit.capture.chain import discover_chain
from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec
from memfit.errors import BudgetInfeasibleError, SpecError
from memfit.fitting.bounded import bounded_profile
from memfit.fitting.candidates import costs_breakdown
from memfit.fitting.time_model import TimeModelFit, calibrated_costs
from memfit.fitting.types import PlanResult, ReservedFit
from memfit.plan.costmodel import DEFAULT_MARGIN, ChainCosts, Prediction, predict
from memfit.plan.details import AccumulationWindow
from memfit.plan.options import BASE_OPTIONS, DEFAULT_OPTIONS
from memfit.plan.parallel import Parallel, layout_of, rank_param_table, rank_stats
from memfit.plan.policies import KeepAll, Offload, Policy, Selective, Sqrt, parse_policy, policy_plan
from memfit.plan.solve import min_budget, plan_from_solution, solve
from memfit.plan.types import Plan
from memfit.plan.window import window_costs, window_peak_bytes
from memfit.profiling.blocks import profile
from memfit.units import format_bytes
from memfit.workload import Workload

PLANNER_OPTIONS = {"block": BASE_OPTIONS, "all": DEFAULT_OPTIONS}
MAX_RESERVED_SOLVES = 4
"""Solves :func:`fit_reserved` tries before it refuses (NOTE [ On CUDA a budget is reserved memory ])."""
T = TypeVar("T")


def fit_reserved(
    budget_bytes: int,
    first: T,
    solve_at: Callable[[int], T],
    reserved_of: Callable[[T], int],
    live_of: Callable[[T], int],
    *,
    floor_bytes: int,
    subsystem: str = "memfit.plan",
) -> tuple[T, ReservedFit]:
    """The first solution whose predicted reserved bytes fit ``budget_bytes``
    (NOTE [ On CUDA a budget is reserved memory ]).

    Args:
        budget_bytes: the budget, meaning reserved memory.
        first: the solution for ``budget_bytes`` as a live-tensor target.
        solve_at: solves for a live-tensor target (bytes).
        reserved_of: a solution's predicted reserved bytes.
        live_of: a solution's live-tensor peak as the solver counts it (margin included).
        floor_bytes: the least target any solution takes (the minimum budget).
        subsystem: names the caller in the error.

    Returns:
        The solution and how it was reached.

    Raises:
        BudgetInfeasibleError: still over at the floor or after :data:`MAX_RESERVED_SOLVES` solves.
    """
    target, sol = budget_bytes, first
    reserved = reserved_of(sol)
    solves = 1
    while reserved > budget_bytes:
        if target <= floor_bytes or solves >= MAX_RESERVED_SOLVES:
            raise BudgetInfeasibleError(
                f"{subsystem}: on CUDA the budget is reserved memory, and no plan fits {format_bytes(budget_bytes)}: "
                f"the plan for live tensors of {format_bytes(target)} is predicted to reserve {format_bytes(reserved)} "
                f"(cuBLAS workspaces, allocator blocks and cache; {solves} solves, least live-tensor budget "
                f"{format_bytes(floor_bytes)}). Raise --budget to at least {format_bytes(reserved)}, "
                "or lower --batch-size."
            )
        # below the solution's own peak: the target it was solved for may lie above it
        target = max(floor_bytes, min(target, live_of(sol)) - (reserved - budget_bytes))
        sol = solve_at(target)
        reserved = reserved_of(sol)
        solves += 1
    return sol, ReservedFit(
        budget_bytes=budget_bytes, live_target_bytes=target, predicted_reserved_bytes=reserved, solves=solves
    )


def plan_for_budget(
    workload: Workload,
    budget_bytes: int,
    *,
    step: StepSpec | None = None,
    margin: float = DEFAULT_MARGIN,
    stats: Stats | None = None,
    options: str = "block",
    heads: bool = True,
    activations: bool = True,
    tiling: bool = True,
    tile_modules: tuple[str, ...] | None = None,
    progress: Callable[[str], None] | None = None,
    stats_fn: Callable[[int], Stats] | None = None,
    parallel: Parallel | None = None,
    accumulation_steps: int = 1,
    segments: bool = True,
    reserved_fn: Callable[[Plan, Stats], int] | None = None,
    time_model: TimeModelFit | None = None,
    predict_profile_peak: Callable[[int], int | None] | None = None,
    bounded: bool = False,
) -> PlanResult:
    """Profile the workload (unless ``stats`` is given) and solve for the budget.

    Measuring never changes the model: :func:`~memfit.profiling.blocks.profile` trains it and draws
    random numbers, then restores its parameters, buffers, gradients, flags, applied plan and the
    RNGs bitwise; the step's ``dtype`` measures a cast copy. The plan is returned, not applied: apply it with
    :func:`memfit.apply_plan`.

    Args:
        workload: the workload to plan for.
        budget_bytes: peak live bytes allowed for a whole training step.
        step: the step measured (:class:`~memfit.capture.step.StepSpec`; ``repeats`` default 3).
        margin: relative safety margin on predicted peaks.
        stats: a profile with both options (keep, recompute), to plan without measuring again.
        options: ``"block"`` calibrates keep and recompute per block (and segments); ``"all"``
            also selective variants and, off the CPU, offload. Block-level is the default
            because selective plans measured slower than predicted on CPU GPT-2 (per-op Python
            overhead of torch's selective checkpointing, memory-bound elementwise recompute);
            see benchmarks/results/selective_frontier.json.
        heads: also consider head options (the chunked loss of :mod:`memfit.apply.head`) where
            the model takes them.
        activations: fuse activation modules that have a fused kernel (:mod:`memfit.apply.activations`).
        tiling: also consider tiling the blocks' position-wise submodules over the sequence
            (:mod:`memfit.apply.tiling`), and off the CPU holding recomputed blocks' inputs on the host
            (:mod:`memfit.apply.host_inputs`); False plans without either (``--no-tiling``).
        tile_modules: the submodules to tile, by name within a block or class name (each must be
            position-wise); None: found (NOTE [ Which modules are tiled ]).
        progress: called with a short text as the work advances.
        stats_fn: makes the stats for a batch size instead of profiling, e.g. estimated ones
            for a device this machine does not have (:func:`memfit.estimation.stats_fn`); nothing
            runs on the model then.
        parallel: plan for rank 0 of a DDP or FSDP2 job (``budget_bytes`` is per rank; the
            stats, measured or estimated, are one process's at the per-rank batch; NOTE
            [ Per-rank accounting ] in :mod:`memfit.plan.parallel`).
        accumulation_steps: with ``parallel``, solve for a rank's window of this many micro-steps
            (:func:`memfit.plan.window.window_costs`: gradients kept between them): the window's
            peak fits the budget. The plan's ``predicted_peak_bytes`` stays one micro-step's; the
            window's is in ``plan.accumulation_window``.
        segments: also consider segments (several blocks recomputed as one unit); False plans
            with per-block options only (what :func:`memfit.apply.compiled.compile_applied` takes).
        reserved_fn: on CUDA, ``(plan, stats) -> predicted reserved bytes`` (e.g.
            :func:`memfit.estimation.parallel.estimate_plan_allocator`'s ``predicted_reserved_bytes``):
            the budget then means reserved memory, and the plan's predicted reserved bytes fit it
            (NOTE [ On CUDA a budget is reserved memory ]; ``PlanResult.reserved`` says how).
        time_model: the time model calibrated by a measured choice on these stats
            (``MeasuredChoice.time_model``, NOTE [ The time model learns ] in
            :mod:`memfit.fitting.time_model`): the plan is solved on, and predicted with, its times.
        predict_profile_peak: ``batch size -> bytes``, the profile's largest step (its keep-all step)
            predicted without running it (the CLI: a fake-tensor estimate; None where it cannot). With it the profile is
            bounded (NOTE [ Bounded measurement ] in :mod:`memfit.fitting.bounded`): taken at the
            step's batch where predicted within the memory free here, else at two smaller batches
            predicted within it and scaled to the batch; either way under the guard.
        bounded: bound the profile without a prediction: the guard allows what is free here, and a
            profile it stops is taken at two halvings of the batch and scaled (``memfit plan``'s).

    Returns:
        A :class:`PlanResult` whose plan fits ``budget_bytes`` by the cost model (margin included).

    Raises:
        BudgetInfeasibleError: no plan fits (with ``reserved_fn``: no plan's reserved bytes); the
            message gives the minimum and the fix.
    """
    if stats is None:
        stats = _stats_to_plan_on(
            workload, step, options=options, heads=heads, activations=activations, tiling=tiling,
            tile_modules=tile_modules, progress=progress, stats_fn=stats_fn,
            bounded=(budget_bytes, predict_profile_peak) if predict_profile_peak is not None or bounded else None,
        )  # fmt: skip
    check_states_match(stats, step)
    if parallel is not None and stats.calibration.parallel is None:
        stats = rank_stats(stats, rank_param_table(workload.model, stats, parallel), parallel)
    step_costs, costs = _costs_to_solve(stats, margin, time_model, accumulation_steps)
    if progress:
        progress("solving")
    need, _ = min_budget(costs, segments=segments)
    plan, reserved = _solve_for(
        costs, stats, budget_bytes, need, segments=segments, reserved_fn=reserved_fn, progress=progress
    )
    store_all = predict(costs, policy_plan(workload.model, KeepAll(), batch=None).with_(segments=()))
    notes = saving_notes(plan, need, store_all, stats)
    if accumulation_steps > 1:  # the file carries the window's per-rank peak for memfit train
        window = AccumulationWindow(steps=accumulation_steps, predicted_peak_bytes=plan.predicted_peak_bytes or 0)
        plan = plan.with_(predicted_peak_bytes=predict(step_costs, plan).peak_bytes, accumulation_window=window)
    return PlanResult(
        plan=plan.with_(states=stats.states), stats=stats, costs=costs, min_budget_bytes=need, store_all=store_all,
        notes=notes, reserved=reserved,
    )  # fmt: skip


def _costs_to_solve(
    stats: Stats, margin: float, time_model: TimeModelFit | None, accumulation_steps: int
) -> tuple[ChainCosts, ChainCosts]:
    """The cost model of one micro-step (times calibrated by ``time_model`` where given) and the one
    the solver fits to the budget: the micro-step's, or a rank's window of ``accumulation_steps``."""
    step_costs = ChainCosts.from_stats(stats, margin=margin)
    if time_model is not None:
        step_costs = calibrated_costs(step_costs, time_model)
    if accumulation_steps <= 1:
        return step_costs, step_costs
    if stats.calibration.parallel is None:
        raise _window_needs_parallel(accumulation_steps)
    return step_costs, window_costs(stats, accumulation_steps, step_costs)


def _solve_for(
    costs: ChainCosts,
    stats: Stats,
    budget_bytes: int,
    need_bytes: int,
    *,
    segments: bool,
    reserved_fn: Callable[[Plan, Stats], int] | None,
    progress: Callable[[str], None] | None,
) -> tuple[Plan, ReservedFit | None]:
    """The fastest plan for ``budget_bytes`` on ``costs``; with ``reserved_fn``, the first whose
    reserved bytes fit (NOTE [ On CUDA a budget is reserved memory ])."""

    def plan_at(target_bytes: int) -> Plan:
        sol = solve(costs, target_bytes, segments=segments, breakdown=costs_breakdown(stats))
        return plan_from_solution(
            sol,
            costs,
            chain_path=stats.chain_path,
            fingerprint=stats.fingerprint,
            budget_bytes=budget_bytes,
            min_budget_bytes=need_bytes,
            baseline_peak_bytes=stats.peak_bytes,
            baseline_step_s=stats.step_s,
            parallel=layout_of(stats),
        )

    plan = plan_at(budget_bytes)
    if reserved_fn is None:
        return plan, None
    if progress:
        progress("fitting reserved memory")
    return fit_reserved(
        budget_bytes, plan, plan_at, lambda p: reserved_fn(p, stats), live_of=_live_bytes, floor_bytes=need_bytes
    )


def _stats_to_plan_on(
    workload: Workload,
    step: StepSpec | None,
    *,
    options: str,
    heads: bool,
    activations: bool,
    tiling: bool,
    tile_modules: tuple[str, ...] | None,
    progress: Callable[[str], None] | None,
    stats_fn: Callable[[int], Stats] | None,
    bounded: tuple[int, Callable[[int], int | None] | None] | None = None,
) -> Stats:
    """:func:`plan_for_budget`'s stats: made by ``stats_fn`` (estimated), else profiled (with
    ``bounded``, the budget and the profile's predictor: :func:`memfit.fitting.bounded.bounded_profile`)."""
    if stats_fn is not None:
        if progress:
            progress("estimating")
        return stats_fn((step.batch_size if step else None) or workload.default_batch_size)
    if options not in PLANNER_OPTIONS:
        raise SpecError(f"memfit.plan: options {options!r} unknown; use one of {', '.join(PLANNER_OPTIONS)}.")

    def run(at: StepSpec | None) -> Stats:
        return profile(
            workload,
            step=at,
            options=PLANNER_OPTIONS[options],
            heads=heads,
            activations=activations,
            tiling=tiling,
            tile_modules=tile_modules,
            host_inputs=tiling,
            progress=progress,
        )

    if bounded is None:
        return run(step)
    return bounded_profile(workload, step or StepSpec(), *bounded, run=run, progress=progress)


def check_states_match(stats: Stats, step: StepSpec | None) -> None:
    """Refuse stats measured with another model-states placement than ``step`` asks for (no
    ``step``: the stats' own): the gradients' bytes and the optimizer step's peak differ between them."""
    wanted = step.states if step is not None else stats.states
    if stats.states != wanted:
        raise SpecError(
            f"memfit.plan: the stats were measured with the model states placed {stats.states!r}, and the "
            f"step asks for {str(wanted)!r}. Profile again with that placement, or plan with "
            f"--states {stats.states}."
        )


def _live_bytes(plan: Plan) -> int:
    return plan.predicted_peak_with_margin_bytes or plan.predicted_peak_bytes or 0


def plan_for_policy(
    workload: Workload,
    policy: Policy,
    *,
    step: StepSpec | None = None,
    margin: float = DEFAULT_MARGIN,
    stats: Stats | None = None,
    progress: Callable[[str], None] | None = None,
    stats_fn: Callable[[int], Stats] | None = None,
    parallel: Parallel | None = None,
    accumulation_steps: int = 1,
) -> PlanResult:
    """A named policy's plan with its predicted peak and step time: what ``memfit plan --policy P``
    reports, beside memfit's own plans.

    The model is profiled as it is (keep and recompute per block, and the policy's own option for
    ``Selective`` and ``Offload``; no fused activations, no chunked head: the policy describes the
    model as you have it), and the policy's plan is walked through the same cost model the solver
    uses. Measuring never changes the model (see :func:`plan_for_budget`).

    Args:
        workload: the workload.
        policy: the policy (:mod:`memfit.plan.policies`; its text is parsed too).
        step, margin, progress: as :func:`plan_for_budget`.
        stats: a profile with keep and recompute (and the policy's option) of the model as it is,
            to skip measuring.
        stats_fn: makes the stats for a batch size instead of profiling (estimated ones:
            :func:`memfit.estimation.stats_fn` with ``activations=False``, the model as it is).
        parallel: predict rank 0 of a DDP or FSDP2 job (as :func:`plan_for_budget`).
        accumulation_steps: with ``parallel``, also predict a rank's window of this many
            micro-steps (:func:`memfit.plan.window.window_peak_bytes`), in
            ``plan.accumulation_window``; ``predicted_peak_bytes`` stays one micro-step's.

    Returns:
        A :class:`PlanResult` whose plan is the policy's, with ``budget_bytes`` None.

    Raises:
        SpecError: unknown policy, or a selective or offload option the profile could not
            calibrate here (offload on the CPU; a selective policy that caches nothing in this
            model or caches outputs the model mutates), with the reason.
        UnsupportedModelError: ``sqrt`` where the chain cannot run segments.
    """
    policy = parse_policy(policy)
    plan = policy_plan(workload.model, policy)  # an unknown policy or sqrt on a ModuleList: before measuring
    if stats is None and stats_fn is not None:
        if progress:
            progress("estimating")
        stats = stats_fn((step.batch_size if step else None) or workload.default_batch_size)
    if stats is None:
        stats = profile(
            workload,
            step=step,
            options=policy_options(policy),
            heads=False,
            activations=False,
            tiling=False,
            host_inputs=False,
            progress=progress,
        )
    check_policy_stats(stats, policy)
    check_states_match(stats, step)
    if parallel is not None and stats.calibration.parallel is None:
        stats = rank_stats(stats, rank_param_table(workload.model, stats, parallel), parallel)
    if plan.chain_path != stats.chain_path or isinstance(policy, Sqrt):
        # the profile measured the towers in the order they ran, and saw where segments may lie
        chain = discover_chain(workload.model, stats.chain_path)
        plan = policy_plan(workload.model, policy, chain=chain, segment_spans=stats.segment_spans)
    costs = ChainCosts.from_stats(stats, margin=margin)
    pred = predict(costs, plan)
    need, _ = min_budget(costs)
    plan = plan.with_(
        chain_path=stats.chain_path,
        fingerprint=stats.fingerprint,
        budget_bytes=None,
        predicted_peak_bytes=pred.peak_bytes,
        predicted_step_s=pred.step_s,
        margin=costs.margin,
        predicted_peak_with_margin_bytes=pred.peak_with_margin_bytes,
        peak_event=pred.peak_event,
        min_budget_bytes=need,
        baseline_peak_bytes=stats.peak_bytes,
        baseline_step_s=stats.step_s,
        parallel=layout_of(stats),
        states=stats.states,
    )
    if accumulation_steps > 1:  # the file carries the window's per-rank peak for memfit train
        if stats.calibration.parallel is None:
            raise _window_needs_parallel(accumulation_steps)
        window = window_peak_bytes(stats, plan, accumulation_steps)
        plan = plan.with_(accumulation_window=AccumulationWindow(steps=accumulation_steps, predicted_peak_bytes=window))
    store_all = predict(costs, policy_plan(workload.model, KeepAll()).with_(segments=()))
    return PlanResult(
        plan=plan,
        stats=stats,
        costs=costs,
        min_budget_bytes=need,
        store_all=store_all,
        notes=saving_notes(plan, need, store_all, stats),
    )


def policy_option(policy: Policy) -> str | None:
    """The profile option a policy's blocks need besides keep and recompute (its name in
    ``Stats``), or None."""
    if isinstance(policy, Selective):
        return str(policy)
    if isinstance(policy, Offload):
        return "offload"
    return None


def policy_options(policy: Policy) -> tuple[str, ...]:
    """The block options a profile calibrates to predict ``policy``'s plan: keep and recompute
    (segments are made of them), and the policy's own option (:func:`policy_option`)."""
    option = policy_option(policy)
    return BASE_OPTIONS if option is None else (*BASE_OPTIONS, option)


def check_policy_stats(stats: Stats, policy: Policy, *, subsystem: str = "memfit.plan") -> None:
    """Refuse stats that cannot predict ``policy``'s plan, saying why and what runs it instead.

    A policy plans the model as it is, so the stats must be of the model's own activations and
    hold the policy's option (a profile drops offload on the CPU and a selective policy that
    caches nothing; estimated stats calibrate keep and recompute only).

    Raises:
        SpecError: with the reason and the commands that run the policy for real.
    """
    option = policy_option(policy)
    why = stats.calibration.dropped_options.get(option) if option is not None else None
    if why is None and option is not None and any(option not in b.options for b in stats.blocks):
        why = f"the {'estimated ' if stats.calibration.estimated is not None else ''}stats calibrate {', '.join(sorted(stats.blocks[0].options)) if stats.blocks else 'no option'} only"
    if why is None and stats.activations is not None:
        why = f"the stats are of {stats.activations} activations and a policy runs the model's own (make them with activations=False)"
    if why is not None:
        raise SpecError(
            f"{subsystem}: policy {str(policy)!r} cannot be predicted here: {why}, so the profile has no "
            f"calibration for it. Run it with `memfit verify --policy {policy}` (gradients and the measured "
            f"peak) or see it with `memfit explain --policy {policy}`."
        )


def saving_notes(plan: Plan, min_budget_bytes: int, store_all: Prediction, stats: Stats) -> tuple[str, ...]:
    """Warnings for plans that cannot save memory: the chosen plan recomputes blocks and is not
    predicted below keeping everything, or no plan at all is (the peak lies outside the blocks)."""
    notes = []
    changes = any(b.option.value != "keep" for b in plan.blocks) or bool(plan.segments)
    if min_budget_bytes >= store_all.peak_with_margin_bytes:
        notes.append(
            f"no plan saves memory on this model: the least any plan needs ({format_bytes(min_budget_bytes)}) is "
            f"what keeping every activation needs ({format_bytes(store_all.peak_with_margin_bytes)}); the peak lies "
            f"outside the {len(stats.blocks)} blocks in {stats.chain_path or 'the model'!r}. Check `memfit profile`, "
            "or name the blocks: memfit.set_blocks(model, *paths)."
        )
    elif changes and plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes >= store_all.peak_bytes:
        notes.append(
            f"the plan recomputes blocks but is predicted at {format_bytes(plan.predicted_peak_bytes)}, not below "
            f"keeping every activation ({format_bytes(store_all.peak_bytes)})."
        )
    return tuple(notes)


def _window_needs_parallel(accumulation_steps: int) -> SpecError:
    return SpecError(
        f"memfit.plan: accumulation_steps {accumulation_steps} plans a rank's window of a data-parallel job; "
        "give parallel=Parallel(...) (--world-size N --parallel ddp|fsdp2), or use memfit.fitting for one process."
    )
