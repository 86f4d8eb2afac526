"""autofit: micro-batch x accumulation steps x checkpoint plan for a budget and a global batch.

NOTE [ Auto-fit ]
1. Measure: profile the workload at micro-batch 1 and 4, then at the best guess of step 2 (every
   option calibrated). A model whose BatchNorm refuses a micro-batch of 1 in train mode (one value
   per channel: ``BatchNorm1d`` on ``(1, C)``) starts at the smallest micro-batch its forward runs
   (1, 2, ... tried without gradients; :func:`memfit.accumulate.batchnorm.smallest_micro_batch`),
   or at ``min_micro_batch``; no candidate has a micro-batch below it, the last one of a window
   included, and the result says why (``FitResult.min_micro_batch_reason``). Bytes of a step are affine in the micro-batch size (activations and their
   gradients grow linearly; parameters, optimizer state and fixed overheads do not); seconds are
   close to affine but not quite (on CPU GPT-2 the seconds per sample grow with the micro-batch),
   so every size is predicted piecewise linearly from the two profiled sizes around it. A size
   whose profile (its keep-all step) is predicted past the budget is not profiled but predicted
   from the sizes profiled; every profile and window runs under the guard (NOTE [ Bounded
   measurement ] in :mod:`memfit.fitting.bounded`).
2. Predict: for every micro-batch size ``b`` (``k = ceil(G / b)`` micro-steps, the last one
   possibly smaller), the planner's solver gives the fastest plan whose peak fits the budget.
   From the second micro-step on, the gradients of the whole model are alive before the forward
   (they accumulate), which the cost model adds to the step's starting bytes; for one rank of a
   DDP or FSDP2 job (``parallel``) the window's cost model is the per-rank one
   (:func:`memfit.plan.window.window_costs`, as ``memfit plan --accumulation-steps K``). A window takes
   ``k`` forward-backward passes and one optimizer step; samples/s is ``G`` over that. With the
   device's links (``interconnect``, estimated stats of a rank) the window adds the communication
   the two-stream simulation leaves exposed (:func:`memfit.plan.comm.window_with_comm`: FSDP2
   gathers every unit on every micro-step, gradients sync on the last) and candidates are ranked
   by that: on a slow link fewer, larger micro-steps win where compute alone prefers small ones.
3. Check: the best candidate runs one measured window (the live-tensor tracker's peak, a timed
   window); a candidate whose measured peak exceeds the budget is dropped and the next one tried.
   Further candidates run while their prediction beats the best measured window (skipping
   micro-batches within 25 % of a measured one), up to ``max_tries``; the best measured one wins.

With a ``policy`` (``memfit fit --policy P``) every candidate keeps that policy's plan: the profiles
calibrate what it needs (keep, recompute and its own option; the model as it is: no chunked head, no
fused activations, as ``memfit plan --policy`` predicts it), step 2 predicts the plan's window peak
per micro-batch instead of solving (feasible when it fits with the margin), and step 3 is unchanged:
the fastest measured window within the budget wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from memfit.accumulate.batchnorm import smallest_micro_batch
from memfit.capture.chain import discover_chain
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec
from memfit.errors import MemfitError, SpecError
from memfit.fitting.bounded import (
    MeasurementGuardError,
    available_bytes,
    guarded,
    predict_peak_bytes,
    profile_peak_bytes,
    states_bytes,
)
from memfit.fitting.budget import check_policy_stats, policy_options
from memfit.fitting.candidates import (
    Candidate,
    first_feasible,
    gradient_bytes,
    predict_candidates,
)
from memfit.fitting.result import EstimatedFit, FitResult
from memfit.fitting.window import Measurement, measure_window
from memfit.plan.comm import Interconnect
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import Parallel, rank_param_table, rank_stats
from memfit.plan.policies import Policy, make_fingerprint, parse_policy, policy_plan
from memfit.profiling.blocks import profile
from memfit.units import format_bytes
from memfit.workload import Workload, cast_batch

__all__ = ["autofit"]


def _one_micro_step(step: StepSpec, global_batch: int, least: int | None, most: int | None) -> int | None:
    """The least micro-batch the fit may take: the whole batch where the optimizer steps inside the
    backward (a window of one micro-step, :mod:`memfit.optim.in_backward`), else ``least``."""
    if step.states == "device":
        return least
    if most is not None and most < global_batch:
        raise SpecError(
            f"memfit.fit: with --states {step.states} the window is one micro-step of the whole batch "
            f"({global_batch}), above the largest micro-batch {most}. Lower the global batch, or use --states device."
        )
    return global_batch


def autofit(
    workload: Workload,
    budget_bytes: int,
    global_batch: int,
    *,
    step: StepSpec | None = None,
    margin: float = 0.02,
    measure: bool = True,
    max_tries: int = 3,
    max_micro_batch: int | None = None,
    min_micro_batch: int | None = None,
    even: bool = False,
    options: tuple[str, ...] | None = None,
    heads: bool = True,
    activations: bool = True,
    tiling: bool = True,
    tile_modules: tuple[str, ...] | None = None,
    progress: Callable[[str], None] | None = None,
    stats_fn: Callable[[int], Stats] | None = None,
    parallel: Parallel | None = None,
    policy: Policy | None = None,
    interconnect: Interconnect | None = None,
) -> FitResult:
    """Choose micro-batch, accumulation steps and checkpoint plan for a budget (NOTE [ Auto-fit ]).

    Measuring never changes the model: the profiles and measured windows train it and draw random
    numbers, and afterwards its parameters, buffers, gradients, flags, applied plan and the RNGs
    are back bitwise, also when the fit raises (NOTE [ Measuring leaves the model as it was ] in
    :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload (a plan applied to its model is lifted while measuring).
        budget_bytes: peak live bytes allowed for a whole training step.
        global_batch: samples per optimizer step.
        step: the step (:class:`~memfit.capture.step.StepSpec`: optimizer, seed; ``repeats``:
            timed repeats in profiles and measured windows, default 2). The fit chooses the
            micro-batches and runs the model as it is: no ``batch_size``, ``dtype`` or ``device``.
        margin: the planner's safety margin on predicted peaks.
        measure: run the chosen candidate for real and fall back when it does not fit.
        max_tries: how many candidates to measure at most.
        max_micro_batch: largest micro-batch considered.
        min_micro_batch: smallest micro-batch considered (the last micro-batch of a window too);
            default: the smallest the model's forward runs in train mode (BatchNorm refuses 1).
        even: consider only micro-batches that divide ``global_batch`` (equal micro-batches).
        options: block options to calibrate (default: keep and recompute, ``BASE_OPTIONS``; pass
            ``memfit.plan.options.DEFAULT_OPTIONS`` to also consider selective and offload).
        heads: also consider head options (the chunked loss of :mod:`memfit.apply.head`).
        activations: fuse activation modules that have a fused kernel (:mod:`memfit.apply.activations`).
        tiling, tile_modules: consider tiled blocks and host-held inputs, as
            :func:`memfit.fitting.budget.plan_for_budget` takes them (not with ``policy``).
        progress: called with a short text as the work advances.
        stats_fn: makes the stats for a micro-batch size instead of profiling, e.g. estimated
            ones for a device this machine does not have (:func:`memfit.estimation.stats_fn`);
            with ``measure=False`` nothing runs on the model. The result's ``estimated``
            then names the device.
        parallel: fit rank 0 of a DDP or FSDP2 job: ``budget_bytes`` is per rank and
            ``global_batch`` the rank's share (NOTE [ Per-rank accounting ] in
            :mod:`memfit.plan.parallel`).
        policy: keep this checkpoint policy's plan (:mod:`memfit.plan.policies`) and choose only
            micro-batch and accumulation steps for it (NOTE [ Auto-fit ]); ``heads`` and
            ``activations`` are then not used (the policy runs the model as it is), and
            ``stats_fn`` must make stats of the model's own activations. Excludes ``options``.
        interconnect: with ``parallel``, the device's links (:func:`memfit.estimation.devices.interconnect`):
            candidates are ranked by their window with exposed communication
            (:func:`memfit.plan.comm.window_with_comm`) instead of compute only.

    Returns:
        The :class:`FitResult` (its ``policy`` is ``policy``).

    Raises:
        BudgetInfeasibleError: not even a micro-batch of 1 fits (the message gives the minimum).
        MemfitError: every measured candidate exceeded the budget.
        SpecError: ``policy`` with ``options``, ``interconnect`` without ``parallel``, a step with a batch size,
            dtype or device, or a policy the profiles cannot predict here
            (offload on the CPU, a selective policy on estimated stats; the message says what
            runs it instead).
    """
    step = step or StepSpec()
    if step.batch_size is not None or step.dtype is not None or step.device is not None:
        raise SpecError(
            "memfit.fit: the fit chooses its micro-batches and runs the model as it is; give a StepSpec without "
            "batch_size, dtype and device (cap the micro-batch with max_micro_batch=, cast or move the model first)."
        )
    optimizer, seed, repeats = step.optimizer, step.seed, step.repeats_or(2)
    min_micro_batch = _one_micro_step(step, global_batch, min_micro_batch, max_micro_batch)
    say = progress or (lambda _s: None)
    if max_micro_batch is not None and max_micro_batch < 1:
        raise SpecError(f"memfit.fit: max_micro_batch {max_micro_batch} must be at least 1.")
    if min_micro_batch is not None and min_micro_batch < 1:
        raise SpecError(f"memfit.fit: min_micro_batch {min_micro_batch} must be at least 1.")
    if global_batch < 1:
        raise SpecError(f"memfit.fit: global batch {global_batch} must be at least 1.")
    if interconnect is not None and parallel is None:
        raise SpecError(
            "memfit.fit: interconnect= times the collectives of a DDP or FSDP2 job; pass parallel= too (one process communicates nothing)."
        )
    fixed = None
    if policy is not None:
        if options is not None:
            raise SpecError(
                f"memfit.fit: options {tuple(options)} choose the options a plan search may use and policy {str(policy)!r} fixes the plan; "
                "pass options= or policy=, not both (--options all or --policy)."
            )
        policy = parse_policy(policy)
        fixed = policy_plan(
            workload.model, policy, chain=discover_chain(workload.model, workload.blocks)
        )  # refusals before measuring
        options, heads, activations, tiling = policy_options(policy), False, False, False
    with leave_unchanged(workload.model):  # profiles and measured windows train on it
        cap = min(global_batch, max_micro_batch or global_batch)
        smallest, why_smallest = _smallest_micro_batch(
            workload, cap, min_micro_batch, seed=seed, measure=stats_fn is None
        )
        if why_smallest is not None:
            say(why_smallest)
        grads_bytes, later = gradient_bytes(workload.model, workload.blocks)
        profiled: dict[int, Stats] = {}
        dev = next((p.device for p in workload.model.parameters()), torch.device("cpu"))
        avail = available_bytes(dev)
        limit_bytes = budget_bytes if avail is None else min(budget_bytes, avail)
        over: set[int] = set()  # sizes profiled past the budget, under the guard: nothing else fits

        def profile_at(b: int) -> Stats | None:
            """Stats at micro-batch ``b``: None where a profile is predicted, or found, past the
            budget (NOTE [ Bounded measurement ]): the sizes profiled predict it."""
            if b not in profiled:
                if stats_fn is None and profiled and b not in over:
                    pts = {k: profile_peak_bytes(st) for k, st in profiled.items()}
                    pred = predict_peak_bytes(pts, b, floor_bytes=states_bytes(next(iter(profiled.values()))))
                    if pred is not None and pred > limit_bytes:
                        say(
                            f"micro-batch {b}: a profile would need {format_bytes(pred)}; predicted from the sizes profiled"
                        )
                        return None
                say(f"{'estimating' if stats_fn else 'profiling'} micro-batch {b}")
                if stats_fn is not None:
                    profiled[b] = stats_fn(b)
                else:
                    try:
                        with guarded(budget_bytes, f"the profile at micro-batch {b}", device=dev):
                            profiled[b] = profile(
                                workload,
                                step=replace(step, batch_size=b, repeats=repeats),
                                options=options or BASE_OPTIONS,
                                heads=heads,
                                activations=activations,
                                tiling=tiling,
                                tile_modules=tile_modules,
                                host_inputs=tiling,
                            )
                    except MeasurementGuardError as err:
                        if not profiled:
                            raise
                        say(str(err))
                        return None
                if policy is not None:
                    check_policy_stats(profiled[b], policy, subsystem="memfit.fit")
                if parallel is not None:
                    st = profiled[b]
                    profiled[b] = rank_stats(st, rank_param_table(workload.model, st, parallel), parallel)
            return profiled[b]

        def candidates(*sizes: int) -> list[Candidate]:
            nonlocal fixed
            say("solving")
            stats = [st for b in sorted(set(sizes) | set(profiled)) if (st := profile_at(b)) is not None]
            if fixed is not None and policy is not None and fixed.chain_path != stats[0].chain_path:
                # the profile measured the towers in the order they ran (NOTE [ Chain discovery ])
                fixed = policy_plan(workload.model, policy, chain=discover_chain(workload.model, stats[0].chain_path))
            if len(stats) < 2 and stats_fn is None and smallest < cap:
                say(f"micro-batch {smallest + 1} cannot be profiled within the budget: micro-batch {smallest} only")
            return predict_candidates(
                stats,
                budget_bytes,
                global_batch,
                grads_bytes=grads_bytes,
                later_grads_bytes=later,
                margin=margin,
                # one profile predicts no other size: a second one did not fit the budget
                max_micro_batch=max_micro_batch if len(stats) > 1 or stats_fn is not None else smallest,
                even=even,
                fixed_plan=fixed,
                net=interconnect,
                min_micro_batch=smallest,
            )

        # Small sizes first (they fit wherever anything does), then profile the best guess too so
        # that the chosen point is measured or interpolated, never extrapolated (NOTE [ Auto-fit ]).
        lo_b, hi_b = smallest, min(max(4, 2 * smallest), cap)
        if lo_b == hi_b:
            hi_b = min(lo_b + 1, global_batch)
        profile_at(lo_b)
        while hi_b > lo_b + 1 and profile_at(hi_b) is None:  # the largest second size a profile fits
            hi_b = max(lo_b + 1, hi_b // 2)
        cands = candidates(lo_b, hi_b)
        if not any(c.feasible for c in cands) and stats_fn is None and hi_b not in profiled and hi_b > lo_b:
            # Nothing fits at the one size profiled (its window holds the gradients across micro-steps),
            # while a larger micro-batch with recompute may: its profile runs past the budget, under the
            # guard (NOTE [ Bounded measurement ]), rather than refusing a budget a plan meets.
            say(f"no plan at micro-batch {lo_b} fits: profiling micro-batch {hi_b} under the guard")
            over.add(hi_b)
            cands = candidates(lo_b, hi_b)
        guess = next((c.micro_batch for c in cands if c.feasible), None)
        if guess is not None and guess > hi_b:
            cands = candidates(guess)
        first_feasible(cands, budget_bytes, profiled[lo_b], policy=str(policy) if policy is not None else None)
        feasible = [c for c in cands if c.feasible]
        # Plans carry the fingerprint of a micro-batch of their own size.
        torch.manual_seed(seed)
        measurements: list[Measurement] = []
        chosen = feasible[0]
        if measure:
            fits: list[tuple[Measurement, Candidate]] = []
            stopped: list[int] = []  # micro-batches whose window the guard stopped
            for cand in feasible:
                if len(measurements) >= max_tries:
                    break
                # A candidate is run only while its prediction beats the best measured window so far;
                # neighbours of a measured micro-batch (within 25 %) would measure the same.
                if fits and (cand.predicted_samples_per_s or 0.0) <= max(m.samples_per_s for m, _ in fits):
                    break
                if fits and any(abs(cand.micro_batch - m.micro_batch) <= 0.25 * m.micro_batch for m in measurements):
                    continue
                say(f"measuring micro-batch {cand.micro_batch} x {cand.accumulation_steps}")
                try:
                    with guarded(budget_bytes, f"the measured window at micro-batch {cand.micro_batch}", device=dev):
                        m = measure_window(
                            workload, cand, global_batch, optimizer=optimizer, seed=seed, repeats=repeats,
                            states=step.states,
                        )  # fmt: skip
                except MeasurementGuardError as err:
                    say(str(err))
                    stopped.append(cand.micro_batch)
                    continue
                measurements.append(m)
                if m.within_budget:
                    fits.append((m, cand))
            if not fits:
                raise MemfitError(
                    f"memfit.fit: the {len(measurements) + len(stopped)} best candidates exceeded the budget of "
                    f"{format_bytes(budget_bytes)} when run (peaks "
                    + ", ".join(format_bytes(m.peak_bytes) for m in measurements)
                    + (f"; micro-batches {stopped} stopped by the guard" if stopped else "")
                    + f"). Raise the budget, or the planner's safety margin (now {margin}: --margin of memfit "
                    "plan and fit, margin= of memfit.autofit)."
                )
            best_m, chosen = max(fits, key=lambda mc: mc[0].samples_per_s)
        else:
            best_m = None
        plan = chosen.plan
        assert plan is not None
        torch.manual_seed(seed)
        # The plan's own chain: a profile orders the towers as the forward runs them (CLIP runs its
        # vision tower first), so the chain discovered from the workload alone may list them otherwise.
        chain = discover_chain(workload.model, plan.chain_path or workload.blocks)
        plan = plan.with_(fingerprint=make_fingerprint(workload.model, chain, workload.make_batch(chosen.micro_batch)))
        return FitResult(
            budget_bytes=budget_bytes,
            global_batch=global_batch,
            micro_batch=chosen.micro_batch,
            accumulation_steps=chosen.accumulation_steps,
            predicted_peak_bytes=chosen.predicted_peak_bytes or 0,
            predicted_samples_per_s=chosen.predicted_samples_per_s or 0.0,
            measured_peak_bytes=best_m.peak_bytes if best_m else None,
            measured_samples_per_s=best_m.samples_per_s if best_m else None,
            plan=plan,
            candidates=tuple(cands),
            measurements=tuple(measurements),
            profiled_batch_sizes=tuple(sorted(profiled)),
            margin=margin,
            estimated=_estimated_fit(profiled),
            profiles=dict(sorted(profiled.items())),
            grads_bytes=grads_bytes,
            later_grads_bytes=tuple(later),
            policy=policy,
            interconnect=interconnect,
            min_micro_batch=smallest,
            min_micro_batch_reason=why_smallest,
        )


def _smallest_micro_batch(
    workload: Workload, cap: int, min_micro_batch: int | None, *, seed: int, measure: bool
) -> tuple[int, str | None]:
    """Where the fit starts: ``min_micro_batch``, else the smallest micro-batch the model's forward
    runs in train mode (NOTE [ Auto-fit ] step 1); and why, in one line, when above 1. Runs inside
    the fit's snapshot (a forward moves BatchNorm's running statistics)."""
    if min_micro_batch is not None:
        why = f"micro-batches start at {min_micro_batch} (min_micro_batch)" if min_micro_batch > 1 else None
        smallest = min_micro_batch
    elif not measure:  # estimated stats: nothing runs on the model
        return 1, None
    else:
        dev = next((p.device for p in workload.model.parameters()), torch.device("cpu"))

        def runs(b: int) -> None:
            torch.manual_seed(seed)
            batch = cast_batch(workload.make_batch(b), device=dev)  # where the model is, as a profile's
            with torch.no_grad():
                workload.loss_fn(workload.model, batch)

        smallest = smallest_micro_batch(runs, cap=cap)
        why = (
            f"micro-batches start at {smallest}: BatchNorm in train mode refuses {smallest - 1} sample"
            f"{'s' if smallest > 2 else ''} (one value per channel); set --min-micro-batch to choose"
            if smallest > 1
            else None
        )
    if smallest > cap:
        raise SpecError(
            f"memfit.fit: micro-batches must have at least {smallest} samples"
            f"{' (BatchNorm in train mode refuses fewer)' if min_micro_batch is None else ' (min_micro_batch)'}, "
            f"but the global batch and max_micro_batch allow at most {cap}. Raise them to at least {smallest}"
            f"{', or put the BatchNorm layers in eval mode' if min_micro_batch is None else ', or lower min_micro_batch'}."
        )
    return smallest, why


def _estimated_fit(profiles: dict[int, Stats]) -> EstimatedFit | None:
    """How the profiles were estimated (NOTE [ Estimated stats ] in :mod:`memfit.estimation.stats`),
    or None when they were measured."""
    est = next((st.calibration.estimated for st in profiles.values() if st.calibration.estimated is not None), None)
    return EstimatedFit(device=est.device, mfu=est.mfu, kernels=est.kernels) if est is not None else None
