"""autofit: micro-batch x accumulation steps x checkpoint plan for a budget and a global batch.

size: autofit and its search's steps (profiles, candidates, measured windows), read together as NOTE [ Auto-fit ].

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
   from the sizes profiled (from one, on the line through it and the model states:
   :func:`memfit.fitting.bounded.states_point`); every profile and window runs under the guard (NOTE [ Bounded
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
from dataclasses import dataclass, field, replace

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
    states_point,
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
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile
from memfit.units import format_bytes
from memfit.workload import Workload, cast_batch

__all__ = ["WindowOverBudgetError", "autofit"]


def _one_micro_step(step: StepSpec, global_batch: int, least: int | None, most: int | None) -> int | None:
    """The least micro-batch the fit may take: the whole batch where the optimizer steps inside the
    backward (a window of one micro-step, :mod:`memfit.optim.in_backward`), else ``least``."""
    if step.states != "step-in-backward":  # the host optimizer sums a window's micro-steps on the host
        return least
    if most is not None and most < global_batch:
        raise SpecError(
            f"memfit.fit: with --states {step.states} the window is one micro-step of the whole batch "
            f"({global_batch}), above the largest micro-batch {most}. Lower the global batch, or use --states device."
        )
    return global_batch


class WindowOverBudgetError(MemfitError):
    """Every candidate auto-fit ran measured over the budget (or was stopped by the guard).

    ``measured_peak_bytes``: the least peak measured (None when the guard stopped every window), so
    that a search over lengths can correct its prediction with it (NOTE [ Longest sequence ])."""

    def __init__(self, message: str, *, measured_peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.measured_peak_bytes = measured_peak_bytes


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
    min_micro_batch = _check_args(step, global_batch, max_micro_batch, min_micro_batch, parallel, interconnect)
    fixed = None
    if policy is not None:
        policy, fixed = _fixed_policy(workload, policy, options)
        options, heads, activations, tiling = policy_options(policy), False, False, False
    with leave_unchanged(workload.model):  # profiles and measured windows train on it
        search = _MicroBatchSearch(
            workload=workload, budget_bytes=budget_bytes, global_batch=global_batch, step=step, margin=margin,
            max_micro_batch=max_micro_batch, even=even, options=options, heads=heads, activations=activations,
            tiling=tiling, tile_modules=tile_modules, say=progress or (lambda _s: None), stats_fn=stats_fn,
            parallel=parallel, policy=policy, fixed=fixed, interconnect=interconnect,
        )  # fmt: skip
        search.start(min_micro_batch)
        cands = search.search()
        feasible = [c for c in cands if c.feasible]
        # Plans carry the fingerprint of a micro-batch of their own size.
        torch.manual_seed(step.seed)
        measurements: list[Measurement] = []
        chosen, best_m = feasible[0], None
        if measure:
            measurements, best_m, chosen = search.measure(feasible, max_tries)
        return search.result(chosen, best_m, cands, measurements)


def _check_args(
    step: StepSpec,
    global_batch: int,
    max_micro_batch: int | None,
    min_micro_batch: int | None,
    parallel: Parallel | None,
    interconnect: Interconnect | None,
) -> int | None:
    """Refuse arguments the fit cannot take, before any work; the least micro-batch (:func:`_one_micro_step`)."""
    if step.batch_size is not None or step.dtype is not None or step.device is not None:
        raise SpecError(
            "memfit.fit: the fit chooses its micro-batches and runs the model as it is; give a StepSpec without "
            "batch_size, dtype and device (cap the micro-batch with max_micro_batch=, cast or move the model first)."
        )
    min_micro_batch = _one_micro_step(step, global_batch, min_micro_batch, max_micro_batch)
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
    return min_micro_batch


def _fixed_policy(workload: Workload, policy: Policy, options: tuple[str, ...] | None) -> tuple[Policy, Plan]:
    """The policy parsed and its plan (refusals before measuring)."""
    if options is not None:
        raise SpecError(
            f"memfit.fit: options {tuple(options)} choose the options a plan search may use and policy {str(policy)!r} fixes the plan; "
            "pass options= or policy=, not both (--options all or --policy)."
        )
    policy = parse_policy(policy)
    return policy, policy_plan(workload.model, policy, chain=discover_chain(workload.model, workload.blocks))


@dataclass(kw_only=True)
class _MicroBatchSearch:
    """Auto-fit's state between its steps (NOTE [ Auto-fit ]): the profiles made, keyed by micro-batch."""

    workload: Workload
    budget_bytes: int
    global_batch: int
    step: StepSpec
    margin: float
    max_micro_batch: int | None
    even: bool
    options: tuple[str, ...] | None
    heads: bool
    activations: bool
    tiling: bool
    tile_modules: tuple[str, ...] | None
    say: Callable[[str], None]
    stats_fn: Callable[[int], Stats] | None
    parallel: Parallel | None
    policy: Policy | None
    fixed: Plan | None
    interconnect: Interconnect | None
    profiled: dict[int, Stats] = field(default_factory=dict)
    scaled_from_one: Stats | None = None  # with one profile: the states point larger sizes are scaled on
    one_process: dict[int, Stats] = field(default_factory=dict)  # the profiles before the per-rank accounting
    over: set[int] = field(default_factory=set)  # sizes profiled past the budget, under the guard: nothing else fits

    def start(self, min_micro_batch: int | None) -> None:
        """Where the micro-batches start, the gradients' bytes, and the measurement limit."""
        model = self.workload.model
        self.cap = min(self.global_batch, self.max_micro_batch or self.global_batch)
        self.smallest, self.why_smallest = _smallest_micro_batch(
            self.workload, self.cap, min_micro_batch, seed=self.step.seed, measure=self.stats_fn is None
        )
        if self.why_smallest is not None:
            self.say(self.why_smallest)
        self.grads_bytes, self.later = gradient_bytes(model, self.workload.blocks)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        avail = available_bytes(self.device)
        self.limit_bytes = self.budget_bytes if avail is None else min(self.budget_bytes, avail)

    # --- step 1: stats per micro-batch ----------------------------------------------------------------

    def profile_at(self, b: int) -> Stats | None:
        """Stats at micro-batch ``b``: None where a profile is predicted, or found, past the
        budget (NOTE [ Bounded measurement ]): the sizes profiled predict it."""
        if b not in self.profiled:
            if self.stats_fn is None and self.profiled and b not in self.over:
                pts = {k: profile_peak_bytes(st) for k, st in self.profiled.items()}
                pred = predict_peak_bytes(pts, b, floor_bytes=states_bytes(next(iter(self.profiled.values()))))
                if pred is not None and pred > self.limit_bytes:
                    self.say(
                        f"micro-batch {b}: a profile would need {format_bytes(pred)}; predicted from the sizes profiled"
                    )
                    return None
            self.say(f"{'estimating' if self.stats_fn else 'profiling'} micro-batch {b}")
            if self.stats_fn is not None:
                self.profiled[b] = self.stats_fn(b)
            else:
                st = self._profile(b)
                if st is None:
                    return None
                self.profiled[b] = st
            if self.policy is not None:
                check_policy_stats(self.profiled[b], self.policy, subsystem="memfit.fit")
            self.one_process[b] = self.profiled[b]
            if self.parallel is not None:
                self.profiled[b] = self._rank(self.profiled[b])
        return self.profiled[b]

    def _rank(self, st: Stats) -> Stats:
        assert self.parallel is not None
        return rank_stats(st, rank_param_table(self.workload.model, st, self.parallel), self.parallel)

    def _states_point(self) -> Stats:
        """Where only one micro-batch could be profiled: its stats at 0 samples, the model states
        alone (:func:`memfit.fitting.bounded.states_point`), to scale larger micro-batches on."""
        point = states_point(self.one_process[min(self.one_process)], self.later)
        return self._rank(point) if self.parallel is not None else point

    def _profile(self, b: int) -> Stats | None:
        """One guarded profile at micro-batch ``b``; None where the guard stopped it (not the first)."""
        try:
            with guarded(self.budget_bytes, f"the profile at micro-batch {b}", device=self.device):
                return profile(
                    self.workload,
                    step=replace(self.step, batch_size=b, repeats=self.step.repeats_or(2)),
                    options=self.options or BASE_OPTIONS,
                    heads=self.heads,
                    activations=self.activations,
                    tiling=self.tiling,
                    tile_modules=self.tile_modules,
                    host_inputs=self.tiling,
                )
        except MeasurementGuardError as err:
            if not self.profiled:
                raise
            self.say(str(err))
            return None

    # --- step 2: predict ------------------------------------------------------------------------------

    def candidates(self, *sizes: int) -> list[Candidate]:
        """Every micro-batch's candidate, from the profiles at ``sizes`` and those made."""
        self.say("solving")
        stats = [st for b in sorted(set(sizes) | set(self.profiled)) if (st := self.profile_at(b)) is not None]
        if self.fixed is not None and self.policy is not None and self.fixed.chain_path != stats[0].chain_path:
            # the profile measured the towers in the order they ran (NOTE [ Chain discovery ])
            self.fixed = policy_plan(
                self.workload.model, self.policy, chain=discover_chain(self.workload.model, stats[0].chain_path)
            )
        self.scaled_from_one = None
        if len(stats) < 2 and self.stats_fn is None and self.smallest < self.cap:
            # A second profile did not fit the budget: larger micro-batches are scaled on the line through
            # the one profile and the model states, which do not grow with it (NOTE [ Bounded measurement ]).
            self.say(
                f"micro-batch {self.smallest + 1} cannot be profiled within the budget: larger micro-batches are "
                f"scaled from micro-batch {self.smallest} (activations grow with it, the model states do not)"
            )
            self.scaled_from_one = self._states_point()
            stats = [self.scaled_from_one, *stats]
        return predict_candidates(
            stats,
            self.budget_bytes,
            self.global_batch,
            grads_bytes=self.grads_bytes,
            later_grads_bytes=self.later,
            margin=self.margin,
            max_micro_batch=self.max_micro_batch,
            even=self.even,
            fixed_plan=self.fixed,
            net=self.interconnect,
            min_micro_batch=self.smallest,
        )

    def search(self) -> list[Candidate]:
        """Profile (or predict) the sizes that place the best candidate, and every candidate; refuses
        when none is feasible."""
        # Small sizes first (they fit wherever anything does), then profile the best guess too so
        # that the chosen point is measured or interpolated, never extrapolated (NOTE [ Auto-fit ]).
        lo_b, hi_b = self.smallest, min(max(4, 2 * self.smallest), self.cap)
        if lo_b == hi_b:
            hi_b = min(lo_b + 1, self.global_batch)
        self.profile_at(lo_b)
        while hi_b > lo_b + 1 and self.profile_at(hi_b) is None:  # the largest second size a profile fits
            hi_b = max(lo_b + 1, hi_b // 2)
        cands = self.candidates(lo_b, hi_b)
        if not any(c.feasible for c in cands) and self.stats_fn is None and hi_b not in self.profiled and hi_b > lo_b:
            # Nothing fits at the one size profiled (its window holds the gradients across micro-steps),
            # while a larger micro-batch with recompute may: its profile runs past the budget, under the
            # guard (NOTE [ Bounded measurement ]), rather than refusing a budget a plan meets.
            self.say(f"no plan at micro-batch {lo_b} fits: profiling micro-batch {hi_b} under the guard")
            self.over.add(hi_b)
            cands = self.candidates(lo_b, hi_b)
        guess = next((c.micro_batch for c in cands if c.feasible), None)
        if guess is not None and guess > hi_b:
            cands = self.candidates(guess)
        policy = str(self.policy) if self.policy is not None else None
        first_feasible(cands, self.budget_bytes, self.profiled[lo_b], policy=policy)
        return cands

    # --- step 3: check --------------------------------------------------------------------------------

    def measure(self, feasible: list[Candidate], max_tries: int) -> tuple[list[Measurement], Measurement, Candidate]:
        """Measure the best candidates' windows under the guard; the measurements, the fastest within
        the budget and its candidate.

        Raises:
            MemfitError: every measured candidate exceeded the budget.
        """
        measurements: list[Measurement] = []
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
            self.say(f"measuring micro-batch {cand.micro_batch} x {cand.accumulation_steps}")
            try:
                with guarded(
                    self.budget_bytes, f"the measured window at micro-batch {cand.micro_batch}", device=self.device
                ):
                    m = measure_window(
                        self.workload, cand, self.global_batch, optimizer=self.step.optimizer, seed=self.step.seed,
                        repeats=self.step.repeats_or(2), states=self.step.states,
                    )  # fmt: skip
            except MeasurementGuardError as err:
                self.say(str(err))
                stopped.append(cand.micro_batch)
                continue
            measurements.append(m)
            if m.within_budget:
                fits.append((m, cand))
        if not fits:
            raise WindowOverBudgetError(
                f"memfit.fit: the {len(measurements) + len(stopped)} best candidates exceeded the budget of "
                f"{format_bytes(self.budget_bytes)} when run (peaks "
                + ", ".join(format_bytes(m.peak_bytes) for m in measurements)
                + (f"; micro-batches {stopped} stopped by the guard" if stopped else "")
                + f"). Raise the budget, or the planner's safety margin (now {self.margin}: --margin of memfit "
                "plan and fit, margin= of memfit.autofit).",
                measured_peak_bytes=min((m.peak_bytes for m in measurements), default=None),
            )
        best_m, chosen = max(fits, key=lambda mc: mc[0].samples_per_s)
        return measurements, best_m, chosen

    def result(
        self, chosen: Candidate, best_m: Measurement | None, cands: list[Candidate], measurements: list[Measurement]
    ) -> FitResult:
        """The :class:`FitResult` of the chosen candidate, its plan fingerprinted at its micro-batch."""
        plan = chosen.plan
        assert plan is not None
        model = self.workload.model
        torch.manual_seed(self.step.seed)
        # The plan's own chain: a profile orders the towers as the forward runs them (CLIP runs its
        # vision tower first), so the chain discovered from the workload alone may list them otherwise.
        chain = discover_chain(model, plan.chain_path or self.workload.blocks)
        plan = plan.with_(fingerprint=make_fingerprint(model, chain, self.workload.make_batch(chosen.micro_batch)))
        return FitResult(
            budget_bytes=self.budget_bytes,
            global_batch=self.global_batch,
            micro_batch=chosen.micro_batch,
            accumulation_steps=chosen.accumulation_steps,
            predicted_peak_bytes=chosen.predicted_peak_bytes or 0,
            predicted_samples_per_s=chosen.predicted_samples_per_s or 0.0,
            measured_peak_bytes=best_m.peak_bytes if best_m else None,
            measured_samples_per_s=best_m.samples_per_s if best_m else None,
            plan=plan,
            candidates=tuple(cands),
            measurements=tuple(measurements),
            profiled_batch_sizes=tuple(sorted(self.profiled)),
            margin=self.margin,
            estimated=_estimated_fit(self.profiled),
            # with one profile, the states point too: the sizes scaled on it are predicted again from them
            profiles=dict(sorted(self.profiled.items()))
            | ({0: self.scaled_from_one} if self.scaled_from_one is not None else {}),
            grads_bytes=self.grads_bytes,
            later_grads_bytes=tuple(self.later),
            policy=self.policy,
            interconnect=self.interconnect,
            min_micro_batch=self.smallest,
            min_micro_batch_reason=self.why_smallest,
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
