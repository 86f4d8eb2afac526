"""autofit: micro-batch x accumulation steps x checkpoint plan for a budget and a global batch.

NOTE [ Auto-fit ]
1. Measure: profile the workload at micro-batch 1 and 4, then at the best guess of step 2 (every
   option calibrated). Bytes of a step are affine in the micro-batch size (activations and their
   gradients grow linearly; parameters, optimizer state and fixed overheads do not); seconds are
   close to affine but not quite (on CPU GPT-2 the seconds per sample grow with the micro-batch),
   so every size is predicted piecewise linearly from the two profiled sizes around it.
2. Predict: for every micro-batch size ``b`` (``k = ceil(G / b)`` micro-steps, the last one
   possibly smaller), the planner's solver gives the fastest plan whose peak fits the budget.
   From the second micro-step on, the gradients of the whole model are alive before the forward
   (they accumulate), which the cost model adds to the step's starting bytes. A window takes
   ``k`` forward-backward passes and one optimizer step; samples/s is ``G`` over that.
3. Check: the best candidate runs one measured window (the live-tensor tracker's peak, a timed
   window); a candidate whose measured peak exceeds the budget is dropped and the next one tried.
   Further candidates run while their prediction beats the best measured window (skipping
   micro-batches within 25 % of a measured one), up to ``max_tries``; the best measured one wins.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.accumulate import Accumulator
from memfit.apply.engine import plan_applied
from memfit.capture.chain import discover_chain
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.stats import BlockStats, ModeCosts, Stats
from memfit.capture.step import make_optimizer
from memfit.capture.tracker import MemoryTracker
from memfit.errors import BudgetInfeasibleError, MemfitError, SpecError
from memfit.plan.calibrate import MODES
from memfit.plan.costmodel import ChainCosts
from memfit.plan.parallel import Parallel, dtype_itemsize, layout_of, param_table, rank_stats
from memfit.plan.policies import make_fingerprint
from memfit.plan.solve import plan_from_solution, solve
from memfit.plan.types import Plan
from memfit.planning import costs_breakdown
from memfit.profiling import profile
from memfit.units import format_bytes
from memfit.workload import Workload, cast_batch, iter_tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One (micro-batch, accumulation steps) choice with the planner's answer for it."""

    micro_batch: int
    accumulation_steps: int
    sizes: tuple[int, ...]
    feasible: bool
    plan: Plan | None = None
    predicted_peak_bytes: int | None = None
    predicted_window_s: float | None = None
    predicted_samples_per_s: float | None = None
    recomputed_blocks: int | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        d["sizes"] = list(self.sizes)
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """A candidate's measured window: whole-window peak (bytes) and time (seconds, median)."""

    micro_batch: int
    peak_bytes: int
    window_s: float
    samples_per_s: float
    within_budget: bool

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimatedFit:
    """How an estimated fit's profiles were made (NOTE [ Estimated stats ] in :mod:`memfit.estimate.stats`).

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
            raise MemfitError("FitResult.resolve: this result carries no profiles; run memfit.autofit.autofit() for the new budget instead.")
        cands = predict_candidates(
            list(self.profiles.values()),
            budget_bytes,
            self.global_batch,
            grads_bytes=self.grads_bytes,
            later_grads_bytes=list(self.later_grads_bytes),
            margin=self.margin,
            max_micro_batch=max_micro_batch,
            even=even,
        )
        chosen = _first_feasible(cands, budget_bytes, self.profiles[min(self.profiles)])
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
            "plan": self.plan.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "measurements": [m.to_dict() for m in self.measurements],
            "profiled_batch_sizes": list(self.profiled_batch_sizes),
            "margin": self.margin,
            **({"estimated": self.estimated.to_dict()} if self.estimated is not None else {}),
            **({"resolved_from_budget_bytes": self.resolved_from_budget_bytes} if self.resolved_from_budget_bytes is not None else {}),
        }


# --- candidates and interpolation -----------------------------------------------------------------


def micro_batch_options(global_batch: int, *, max_micro_batch: int | None = None, even: bool = False) -> list[tuple[int, tuple[int, ...]]]:
    """Every distinct micro-batch size for a global batch, with its micro-batch sizes.

    ``b = ceil(G / k)`` for ``k = 1 .. G``: each size once, the last micro-batch taking the rest.
    ``even``: only sizes that divide ``G`` (every micro-batch the same size, as a training loop
    whose data loader has a fixed batch size needs, e.g. HF Trainer's).
    """
    if global_batch < 1:
        raise SpecError(f"memfit.fit: global batch {global_batch} must be at least 1.")
    out: dict[int, tuple[int, ...]] = {}
    for k in range(1, global_batch + 1):
        b = math.ceil(global_batch / k)
        if (max_micro_batch is not None and b > max_micro_batch) or (even and global_batch % b):
            continue
        steps = math.ceil(global_batch / b)
        out.setdefault(b, tuple([b] * (steps - 1) + [global_batch - b * (steps - 1)]))
    return sorted(out.items(), reverse=True)


def _lerp(a: Any, b: Any, wa: float, wb: float, x: float) -> Any:
    """Affine inter/extrapolation between values measured at sizes ``wa`` and ``wb``.

    Seconds (floats) never shrink as the batch grows: on a noisy machine the larger size can
    measure faster, and a negative slope extrapolated would predict negative times.
    """
    if isinstance(a, bool) or isinstance(a, str) or a is None:
        return a
    if isinstance(a, int | float) and isinstance(b, int | float):
        if wa == wb:
            return a
        slope = (b - a) / (wb - wa)
        if isinstance(a, float):
            lo_w, lo_v = (wa, a) if wa < wb else (wb, b)
            slope = max(0.0, slope)
            return float(max(0.0, lo_v + slope * max(0.0, x - lo_w)))
        return int(round(a + slope * (x - wa)))
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _lerp(a[k], b[k], wa, wb, x) if k in b else a[k] for k in a}
    return a


def stats_at(profiles: Sequence[Stats], batch_size: int) -> Stats:
    """Stats at ``batch_size``, piecewise linear over profiles at two or more sizes.

    Between two profiled sizes, the line through them; outside, the line through the nearest two.
    One line through the smallest and the largest size is not enough: on CPU GPT-2 the seconds per
    sample grow with the micro-batch (1.0x at 4, 1.2x at 16), so a line through 1 and 16 made
    every size between look slower than it is, and the fit chose 16 where 2 to 8 ran faster.
    """
    ps = sorted(profiles, key=lambda st: st.batch_size)
    if not ps:
        raise MemfitError("memfit.fit: no profile to predict from.")
    if len(ps) == 1:
        return interpolate_stats(ps[0], ps[0], batch_size)
    for st in ps:
        if st.batch_size == batch_size:
            return st
    k = bisect.bisect_left([st.batch_size for st in ps], batch_size)
    k = min(max(k, 1), len(ps) - 1)
    return interpolate_stats(ps[k - 1], ps[k], batch_size)


def interpolate_stats(lo: Stats, hi: Stats, batch_size: int) -> Stats:
    """Stats at ``batch_size`` from stats measured at two other sizes (NOTE [ Auto-fit ])."""
    wa, wb, x = lo.batch_size, hi.batch_size, batch_size

    def block(a: BlockStats, b: BlockStats) -> BlockStats:
        vals = {}
        for f in dataclasses.fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if f.name == "modes":
                vals[f.name] = {
                    m: ModeCosts(**{g.name: _lerp(getattr(ca, g.name), getattr(vb[m], g.name), wa, wb, x) for g in dataclasses.fields(ca)})
                    for m, ca in va.items()
                    if m in vb
                }
            else:
                vals[f.name] = _lerp(va, vb, wa, wb, x)
        return BlockStats(**vals)

    vals = {}
    for f in dataclasses.fields(lo):
        va, vb = getattr(lo, f.name), getattr(hi, f.name)
        if f.name == "blocks":
            vals[f.name] = tuple(block(a, b) for a, b in zip(va, vb, strict=True))
        elif f.name in ("fingerprint", "model", "dtype", "device", "optimizer", "chain_path"):
            vals[f.name] = va
        elif f.name == "batch_size":
            vals[f.name] = batch_size
        else:
            vals[f.name] = _lerp(va, vb, wa, wb, x)
    return Stats(**vals)


def accumulation_costs(costs: ChainCosts, *, grads_bytes: int, later_grads_bytes: list[int]) -> ChainCosts:
    """The cost model of micro-steps 2..k: every gradient is alive before the forward.

    ``later_grads_bytes[i]`` is the bytes of gradients produced before block ``i``'s backward in a
    single step (blocks after it and the head); they are counted in the measured ``bwd_base`` and
    already included in ``grads_bytes`` here, so they are taken out of it.
    """
    options = tuple(
        {name: dataclasses.replace(o, bwd_base_bytes=o.bwd_base_bytes - later_grads_bytes[i]) for name, o in opts.items()}
        for i, opts in enumerate(costs.options)
    )
    return dataclasses.replace(
        costs,
        options=options,
        start_bytes=costs.start_bytes + grads_bytes,
        pre_peak_bytes=costs.pre_peak_bytes + grads_bytes,
    )


def gradient_bytes(model: nn.Module, blocks: str | None = None) -> tuple[int, list[int]]:
    """All gradient bytes, and per block the gradient bytes of the blocks after it.

    The inputs of :func:`accumulation_costs`: ``(grads_bytes, later_grads_bytes)`` for the model
    and its chain (``blocks`` as in :func:`memfit.capture.chain.discover_chain`).

    Gradients of the head (parameters used after the chain) also exist before a block's backward
    in a single step; they are not taken out, which over-counts micro-steps 2..k by at most the
    head's gradients (safe side).
    """
    chain = discover_chain(model, blocks)
    seen: set[int] = set()
    per_block = []
    for b in chain.blocks:
        n = 0
        for p in b.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                n += p.numel() * p.element_size()
        per_block.append(n)
    unique = {id(p): p for p in model.parameters() if p.requires_grad}
    total = sum(p.numel() * p.element_size() for p in unique.values())
    later = [sum(per_block[i + 1 :]) for i in range(len(per_block))]
    return total, later


# --- the search --------------------------------------------------------------------------------


def predict_candidates(
    profiles: Sequence[Stats],
    budget_bytes: int,
    global_batch: int,
    *,
    grads_bytes: int,
    later_grads_bytes: list[int],
    margin: float,
    max_micro_batch: int | None = None,
    even: bool = False,
) -> list[Candidate]:
    """The planner's answer for every micro-batch size, best predicted throughput first.

    ``profiles``: profiles at two or more micro-batch sizes; each size is predicted from the two
    profiled sizes around it (:func:`stats_at`).
    """
    out: list[Candidate] = []
    for b, sizes in micro_batch_options(global_batch, max_micro_batch=max_micro_batch, even=even):
        k = len(sizes)
        st = stats_at(profiles, b)
        costs = ChainCosts.from_stats(st, margin=margin)
        if k > 1:
            costs = accumulation_costs(costs, grads_bytes=grads_bytes, later_grads_bytes=later_grads_bytes)
        try:
            sol = solve(costs, budget_bytes, breakdown=costs_breakdown(st))
        except BudgetInfeasibleError as err:
            out.append(Candidate(micro_batch=b, accumulation_steps=k, sizes=sizes, feasible=False, reason=f"needs {format_bytes(err.min_budget_bytes or 0)}"))
            continue
        opt_s = max(0.0, st.step_s - st.fwd_s - st.bwd_s)
        pass_s = sol.prediction.step_s - opt_s  # forward + backward (+ recompute) of one micro-batch
        last = stats_at(profiles, sizes[-1])
        last_pass_s = pass_s * (max(1e-9, last.step_s - opt_s) / max(1e-9, st.step_s - opt_s)) if k > 1 else 0.0
        window_s = (k - 1) * pass_s + (last_pass_s if k > 1 else pass_s) + opt_s
        plan = plan_from_solution(
            sol,
            costs,
            chain_path=st.chain_path,
            fingerprint={**st.fingerprint, "batch": None},
            budget_bytes=budget_bytes,
            extra={"micro_batch": b, "accumulation_steps": k, **({"parallel": layout_of(st)} if layout_of(st) else {})},
        )
        out.append(
            Candidate(
                micro_batch=b,
                accumulation_steps=k,
                sizes=sizes,
                feasible=True,
                plan=plan,
                predicted_peak_bytes=sol.prediction.peak_bytes,
                predicted_window_s=window_s,
                predicted_samples_per_s=global_batch / window_s,
                recomputed_blocks=sol.options.count("recompute"),
            )
        )
    out.sort(key=lambda c: (not c.feasible, -(c.predicted_samples_per_s or 0.0), -c.micro_batch))
    return out


def measure_window(
    workload: Workload,
    candidate: Candidate,
    global_batch: int,
    *,
    optimizer: str = "adamw",
    seed: int = 0,
    repeats: int = 2,
) -> Measurement:
    """Run one real window of the candidate (plan applied, accumulation) and measure it.

    Measuring never changes the model: the window's optimizer steps, gradients, buffers and random
    draws are undone bitwise afterwards (:func:`memfit.capture.snapshot.leave_unchanged`).
    """
    with leave_unchanged(workload.model):
        model = workload.model
        model.zero_grad(set_to_none=True)
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        opt = make_optimizer(model, optimizer, lr=1e-6)
        torch.manual_seed(seed)
        batch = cast_batch(workload.make_batch(global_batch), device=dev)
        assert candidate.plan is not None
        with plan_applied(model, candidate.plan):
            acc = Accumulator(model, opt, micro_batch=candidate.micro_batch)
            acc.step(batch, workload.loss_fn, count_fn=workload.count_fn)  # optimizer state exists now
            tracker = MemoryTracker(device=dev)
            tracker.track(model, opt, iter_tensors(batch))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            with tracker:
                acc.step(batch, workload.loss_fn, count_fn=workload.count_fn)
            # On CUDA the allocator's peak is what the GPU's memory is compared with.
            peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else tracker.peak_bytes
            times = []
            for _ in range(max(1, repeats)):
                t0 = time.perf_counter()
                acc.step(batch, workload.loss_fn, count_fn=workload.count_fn)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    window_s = statistics.median(times)
    return Measurement(
        micro_batch=candidate.micro_batch,
        peak_bytes=peak,
        window_s=window_s,
        samples_per_s=global_batch / window_s,
        within_budget=peak <= (candidate.plan.budget_bytes or 0),
    )


def autofit(
    workload: Workload,
    budget_bytes: int,
    global_batch: int,
    *,
    optimizer: str = "adamw",
    seed: int = 0,
    repeats: int = 2,
    margin: float = 0.02,
    measure: bool = True,
    max_tries: int = 3,
    max_micro_batch: int | None = None,
    even: bool = False,
    modes: tuple[str, ...] | None = None,
    heads: bool = True,
    activations: bool = True,
    progress: Callable[[str], None] | None = None,
    stats_fn: Callable[[int], Stats] | None = None,
    parallel: Parallel | None = None,
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
        optimizer: the step's optimizer.
        seed: seed for data and dropout.
        repeats: timed repeats in profiles and measured windows.
        margin: the planner's safety margin on predicted peaks.
        measure: run the chosen candidate for real and fall back when it does not fit.
        max_tries: how many candidates to measure at most.
        max_micro_batch: largest micro-batch considered.
        even: consider only micro-batches that divide ``global_batch`` (equal micro-batches).
        modes: block options to calibrate (default: keep and recompute, ``MODES``; pass
            ``memfit.plan.calibrate.DEFAULT_MODES`` to also consider selective and offload).
        heads: also consider head options (the chunked loss of :mod:`memfit.apply.head`).
        activations: fuse activation modules that have a fused kernel (:mod:`memfit.apply.activations`).
        progress: called with a short text as the work advances.
        stats_fn: makes the stats for a micro-batch size instead of profiling, e.g. estimated
            ones for a device this machine does not have (:func:`memfit.estimate.stats_fn`);
            with ``measure=False`` nothing runs on the model. The result's ``estimated``
            then names the device.
        parallel: fit rank 0 of a DDP or FSDP2 job: ``budget_bytes`` is per rank and
            ``global_batch`` the rank's share (NOTE [ Per-rank accounting ] in
            :mod:`memfit.plan.parallel`).

    Returns:
        The :class:`FitResult`.

    Raises:
        BudgetInfeasibleError: not even a micro-batch of 1 fits (the message gives the minimum).
        MemfitError: every measured candidate exceeded the budget.
    """
    say = progress or (lambda _s: None)
    if max_micro_batch is not None and max_micro_batch < 1:
        raise SpecError(f"memfit.fit: max_micro_batch {max_micro_batch} must be at least 1.")
    if global_batch < 1:
        raise SpecError(f"memfit.fit: global batch {global_batch} must be at least 1.")
    with leave_unchanged(workload.model):  # profiles and measured windows train on it
        cap = min(global_batch, max_micro_batch or global_batch)
        grads_bytes, later = gradient_bytes(workload.model, workload.blocks)
        profiled: dict[int, Stats] = {}

        def profile_at(b: int) -> Stats:
            if b not in profiled:
                say(f"{'estimating' if stats_fn else 'profiling'} micro-batch {b}")
                if stats_fn is not None:
                    profiled[b] = stats_fn(b)
                else:
                    profiled[b] = profile(workload, batch_size=b, optimizer=optimizer, seed=seed, repeats=repeats, modes=modes or MODES, heads=heads, activations=activations)
                if parallel is not None:
                    st = profiled[b]
                    profiled[b] = rank_stats(st, param_table(workload.model, [x.name for x in st.blocks], itemsize=dtype_itemsize(st.dtype)), parallel)
            return profiled[b]

        def candidates(*sizes: int) -> list[Candidate]:
            say("solving")
            return predict_candidates(
                [profile_at(b) for b in sorted(set(sizes) | set(profiled))],
                budget_bytes,
                global_batch,
                grads_bytes=grads_bytes,
                later_grads_bytes=later,
                margin=margin,
                max_micro_batch=max_micro_batch,
                even=even,
            )

        # Small sizes first (they fit wherever anything does), then profile the best guess too so
        # that the chosen point is measured or interpolated, never extrapolated (NOTE [ Auto-fit ]).
        lo_b, hi_b = 1, min(4, cap)
        if lo_b == hi_b:
            hi_b = min(2, global_batch)
        cands = candidates(lo_b, hi_b)
        guess = next((c.micro_batch for c in cands if c.feasible), None)
        if guess is not None and guess > hi_b:
            cands = candidates(guess)
        _first_feasible(cands, budget_bytes, profiled[lo_b])
        feasible = [c for c in cands if c.feasible]
        # Plans carry the fingerprint of a micro-batch of their own size.
        torch.manual_seed(seed)
        measurements: list[Measurement] = []
        chosen = feasible[0]
        if measure:
            fits: list[tuple[Measurement, Candidate]] = []
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
                m = measure_window(workload, cand, global_batch, optimizer=optimizer, seed=seed, repeats=repeats)
                measurements.append(m)
                if m.within_budget:
                    fits.append((m, cand))
            if not fits:
                raise MemfitError(
                    f"memfit.fit: the {len(measurements)} best candidates exceeded the budget of "
                    f"{format_bytes(budget_bytes)} when run (peaks "
                    + ", ".join(format_bytes(m.peak_bytes) for m in measurements)
                    + f"). Raise --margin (now {margin}) or the budget."
                )
            best_m, chosen = max(fits, key=lambda mc: mc[0].samples_per_s)
        else:
            best_m = None
        plan = chosen.plan
        assert plan is not None
        torch.manual_seed(seed)
        plan = plan.with_(fingerprint=make_fingerprint(workload.model, discover_chain(workload.model, workload.blocks), workload.make_batch(chosen.micro_batch)))
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
        )


def _estimated_fit(profiles: dict[int, Stats]) -> EstimatedFit | None:
    """How the profiles were estimated (NOTE [ Estimated stats ] in :mod:`memfit.estimate.stats`),
    or None when they were measured."""
    est = next((st.calibration["estimated"] for st in profiles.values() if "estimated" in st.calibration), None)
    return EstimatedFit(device=est.get("device"), mfu=est.get("mfu"), kernels=est.get("kernels")) if est else None


def _first_feasible(cands: list[Candidate], budget_bytes: int, smallest: Stats) -> Candidate:
    """The best feasible candidate, or BudgetInfeasibleError with the minimum (``smallest``: the profile at micro-batch 1)."""
    for c in cands:
        if c.feasible:
            return c
    one = min(cands, key=lambda c: c.micro_batch)
    raise BudgetInfeasibleError(
        f"memfit.fit: no micro-batch fits {format_bytes(budget_bytes)}; even a micro-batch of {one.micro_batch} "
        f"{one.reason} ({costs_breakdown(smallest)}). Raise the budget or use a smaller model.",
    )


__all__ = [
    "Candidate",
    "EstimatedFit",
    "FitResult",
    "Measurement",
    "accumulation_costs",
    "autofit",
    "gradient_bytes",
    "interpolate_stats",
    "measure_window",
    "micro_batch_options",
    "predict_candidates",
    "stats_at",
]
