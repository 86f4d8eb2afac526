"""Auto-fit candidates: every micro-batch size of a global batch, with the planner's answer for it,
predicted from the profiles around it (NOTE [ Auto-fit ] in :mod:`memfit.fitting.search`, steps 1-2)."""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from memfit.capture.chain import discover_chain
from memfit.capture.stats import BlockStats, HeadOptionStats, OptionStats, ParallelInfo, Stats
from memfit.errors import BudgetInfeasibleError, MemfitError, SpecError
from memfit.plan.comm import CommTime, Interconnect, window_with_comm
from memfit.plan.costmodel import ChainCosts, Prediction, predict
from memfit.plan.parallel import layout_of
from memfit.plan.solve import min_budget, plan_from_solution, solve
from memfit.plan.types import Plan
from memfit.plan.window import window_costs
from memfit.units import format_bytes

__all__ = [
    "Candidate",
    "accumulation_costs",
    "costs_breakdown",
    "first_feasible",
    "gradient_bytes",
    "interpolate_stats",
    "micro_batch_options",
    "predict_candidates",
    "stats_at",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One (micro-batch, accumulation steps) choice with the planner's answer for it.

    ``predicted_window_s`` and ``predicted_samples_per_s`` are compute only; with the device's
    links (``predict_candidates(..., net=)``) ``communication`` holds the window's collectives and
    ``predicted_window_with_comm_s`` / ``predicted_samples_per_s_with_comm`` the window with the
    exposed ones (:func:`memfit.plan.comm.window_with_comm`), which then rank the candidates.
    """

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
    communication: CommTime | None = None
    predicted_window_with_comm_s: float | None = None
    predicted_samples_per_s_with_comm: float | None = None

    @property
    def ranked_samples_per_s(self) -> float:
        """What candidates are ranked by: samples/s with exposed communication where it is
        modelled, else compute only (0 when infeasible)."""
        if self.predicted_samples_per_s_with_comm is not None:
            return self.predicted_samples_per_s_with_comm
        return self.predicted_samples_per_s or 0.0

    def to_dict(self) -> dict[str, Any]:
        comm = ("communication", "predicted_window_with_comm_s", "predicted_samples_per_s_with_comm")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan" and f.name not in comm}
        d["sizes"] = list(self.sizes)
        if self.communication is not None:  # only where modelled: the JSON of other fits is unchanged
            d["communication"] = self.communication.to_dict()
            d["predicted_window_with_comm_s"] = self.predicted_window_with_comm_s
            d["predicted_samples_per_s_with_comm"] = self.predicted_samples_per_s_with_comm
        return d


def costs_breakdown(stats: Stats) -> str:
    """The model states' parts, for a refusal: ``parameters 1.00 MiB, gradients ..., optimizer state ...``."""
    return (
        f"parameters {format_bytes(stats.params_bytes)}, gradients {format_bytes(stats.grads_bytes)}, "
        f"optimizer state {format_bytes(stats.optimizer_bytes)}"
    )


def micro_batch_options(
    global_batch: int, *, max_micro_batch: int | None = None, even: bool = False, min_micro_batch: int = 1
) -> list[tuple[int, tuple[int, ...]]]:
    """Every distinct micro-batch size for a global batch, with its micro-batch sizes.

    ``b = ceil(G / k)`` for ``k = 1 .. G``: each size once, the last micro-batch taking the rest.
    ``even``: only sizes that divide ``G`` (every micro-batch the same size, as a training loop
    whose data loader has a fixed batch size needs, e.g. HF Trainer's). ``min_micro_batch``: no
    micro-batch below it, the last one included (a model with BatchNorm refuses a micro-batch of 1:
    :func:`memfit.accumulate.batchnorm.smallest_micro_batch`).

    >>> micro_batch_options(5, min_micro_batch=2)
    [(5, (5,)), (3, (3, 2))]
    """
    if global_batch < 1:
        raise SpecError(f"memfit.fit: global batch {global_batch} must be at least 1.")
    out: dict[int, tuple[int, ...]] = {}
    for k in range(1, global_batch + 1):
        b = math.ceil(global_batch / k)
        if (max_micro_batch is not None and b > max_micro_batch) or (even and global_batch % b):
            continue
        steps = math.ceil(global_batch / b)
        if global_batch - b * (steps - 1) < min_micro_batch:  # the last micro-batch, the smallest
            continue
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
    if isinstance(a, HeadOptionStats) and isinstance(b, HeadOptionStats):
        # A head option's peaks grow with the batch like the model's own head's.
        return HeadOptionStats(
            **{f.name: _lerp(getattr(a, f.name), getattr(b, f.name), wa, wb, x) for f in dataclasses.fields(a)}
        )
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
            if f.name == "options":
                vals[f.name] = {
                    m: OptionStats(
                        **{
                            g.name: _lerp(getattr(ca, g.name), getattr(vb[m], g.name), wa, wb, x)
                            for g in dataclasses.fields(ca)
                        }
                    )
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
        elif f.name == "calibration" and va.parallel is not None and vb.parallel is not None:
            vals[f.name] = dataclasses.replace(va, parallel=_interpolate_parallel(va.parallel, vb.parallel, wa, wb, x))
        else:
            vals[f.name] = _lerp(va, vb, wa, wb, x)
    return Stats(**vals)


def _interpolate_parallel(a: ParallelInfo, b: ParallelInfo, wa: int, wb: int, x: int) -> ParallelInfo:
    """Rank Stats' layout facts at micro-batch ``x``: the bytes that grow with it (the end of the
    blocks' backward, the one-process peak) on the line through ``a`` and ``b``, the rest (parameter
    and gradient units) as they are."""
    end = (
        None
        if a.backward_end_bytes is None or b.backward_end_bytes is None
        else _lerp(a.backward_end_bytes, b.backward_end_bytes, wa, wb, x)
    )
    return dataclasses.replace(
        a,
        backward_end_bytes=end,
        single_process_peak_bytes=_lerp(a.single_process_peak_bytes, b.single_process_peak_bytes, wa, wb, x),
    )


def accumulation_costs(costs: ChainCosts, *, grads_bytes: int, later_grads_bytes: list[int]) -> ChainCosts:
    """The cost model of micro-steps 2..k: every gradient is alive before the forward.

    ``later_grads_bytes[i]`` is the bytes of gradients produced before block ``i``'s backward in a
    single step (blocks after it and the head); they are counted in the measured ``bwd_base`` and
    already included in ``grads_bytes`` here, so they are taken out of it.
    """
    options = tuple(
        {
            name: dataclasses.replace(o, bwd_base_bytes=o.bwd_base_bytes - later_grads_bytes[i])
            for name, o in opts.items()
        }
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
    fixed_plan: Plan | None = None,
    net: Interconnect | None = None,
    min_micro_batch: int = 1,
) -> list[Candidate]:
    """The planner's answer for every micro-batch size, best predicted throughput first.

    ``profiles``: profiles at two or more micro-batch sizes; each size is predicted from the two
    profiled sizes around it (:func:`stats_at`). ``fixed_plan``: a policy's plan
    (:func:`memfit.plan.policies.policy_plan`) that every size keeps instead of solving; a size is
    feasible when that plan's predicted peak (with the margin) fits the budget. ``net``: the
    device's links, for rank Stats (:func:`memfit.plan.parallel.rank_stats`): each window then
    adds its exposed communication (:func:`memfit.plan.comm.window_with_comm`) and the candidates
    are ranked by that (more micro-steps per optimizer step sync gradients for more samples at once;
    a smaller micro-batch hides less of its all-gathers). ``min_micro_batch``: no micro-batch below it
    (:func:`micro_batch_options`).

    Raises:
        SpecError: ``net`` with one process's Stats.
    """
    options = micro_batch_options(
        global_batch, max_micro_batch=max_micro_batch, even=even, min_micro_batch=min_micro_batch
    )
    out = [
        _candidate(
            profiles,
            b,
            sizes,
            budget_bytes,
            global_batch,
            grads_bytes=grads_bytes,
            later_grads_bytes=later_grads_bytes,
            margin=margin,
            fixed_plan=fixed_plan,
            net=net,
        )  # fmt: skip
        for b, sizes in options
    ]
    out.sort(key=lambda c: (not c.feasible, -c.ranked_samples_per_s, -c.micro_batch))
    return out


def _candidate(
    profiles: Sequence[Stats],
    b: int,
    sizes: tuple[int, ...],
    budget_bytes: int,
    global_batch: int,
    *,
    grads_bytes: int,
    later_grads_bytes: list[int],
    margin: float,
    fixed_plan: Plan | None,
    net: Interconnect | None,
) -> Candidate:
    """The candidate of micro-batch ``b`` over the micro-steps ``sizes``: its plan (solved, or
    ``fixed_plan``), predicted peak and window, or why no plan fits."""
    k = len(sizes)
    st = stats_at(profiles, b)
    costs = ChainCosts.from_stats(st, margin=margin)
    if k > 1 and st.calibration.parallel is not None:  # a rank's window (memfit.plan.window)
        costs = window_costs(st, k, costs)
    elif k > 1:
        costs = accumulation_costs(costs, grads_bytes=grads_bytes, later_grads_bytes=later_grads_bytes)
    try:
        if fixed_plan is None:
            sol = solve(costs, budget_bytes, breakdown=costs_breakdown(st))
            pred, recomputed = sol.prediction, sol.options.count("recompute")
        else:
            pred, recomputed = _fixed_prediction(costs, fixed_plan, budget_bytes), len(fixed_plan.recomputed)
    except BudgetInfeasibleError as err:
        reason = _infeasible_reason(err, st, k, margin=margin, fixed_plan=fixed_plan, grads_bytes=grads_bytes)
        return Candidate(micro_batch=b, accumulation_steps=k, sizes=sizes, feasible=False, reason=reason)
    window_s = _window_s(profiles, st, sizes, pred.step_s)
    details: dict[str, Any] = {
        "micro_batch": b,
        "accumulation_steps": k,
        "parallel": layout_of(st),
        "states": st.states,
    }
    if fixed_plan is None:
        plan = plan_from_solution(
            sol,
            costs,
            chain_path=st.chain_path,
            fingerprint={**st.fingerprint, "batch": None},
            budget_bytes=budget_bytes,
            **details,
        )
    else:
        plan = fixed_plan.with_(
            chain_path=st.chain_path, fingerprint={**st.fingerprint, "batch": None}, budget_bytes=budget_bytes,
            predicted_peak_bytes=pred.peak_bytes, predicted_step_s=pred.step_s,
            margin=costs.margin, predicted_peak_with_margin_bytes=pred.peak_with_margin_bytes, peak_event=pred.peak_event, **details,
        )  # fmt: skip
    comm_s, ct = (
        window_with_comm(st, plan, net, accumulation_steps=k, compute_window_s=window_s)
        if net is not None
        else (None, None)
    )
    return Candidate(
        micro_batch=b,
        accumulation_steps=k,
        sizes=sizes,
        feasible=True,
        plan=plan,
        predicted_peak_bytes=pred.peak_bytes,
        predicted_window_s=window_s,
        predicted_samples_per_s=global_batch / window_s,
        recomputed_blocks=recomputed,
        communication=ct,
        predicted_window_with_comm_s=comm_s,
        predicted_samples_per_s_with_comm=global_batch / comm_s if comm_s else None,
    )


def _window_s(profiles: Sequence[Stats], st: Stats, sizes: tuple[int, ...], step_s: float) -> float:
    """Seconds of one optimizer step's window: a pass (forward, backward and recomputes, from the
    predicted ``step_s``) per micro-step, the last one at its own size, and one optimizer step."""
    k = len(sizes)
    opt_s = max(0.0, st.step_s - st.fwd_s - st.bwd_s)
    pass_s = step_s - opt_s  # forward + backward (+ recompute) of one micro-batch
    last = stats_at(profiles, sizes[-1])
    last_pass_s = pass_s * (max(1e-9, last.step_s - opt_s) / max(1e-9, st.step_s - opt_s)) if k > 1 else 0.0
    return (k - 1) * pass_s + (last_pass_s if k > 1 else pass_s) + opt_s


def _infeasible_reason(
    err: BudgetInfeasibleError, st: Stats, k: int, *, margin: float, fixed_plan: Plan | None, grads_bytes: int
) -> str:
    """What a micro-batch that does not fit needs; under accumulation also what its single step needs
    alone, since the gradients held from one micro-step to the next make the difference (a budget a
    plan without accumulation met is refused for a window of several micro-steps)."""
    need = err.min_budget_bytes or 0
    if k == 1:
        return f"needs {format_bytes(need)}"
    single = ChainCosts.from_stats(st, margin=margin)
    alone = predict(single, fixed_plan).peak_with_margin_bytes if fixed_plan is not None else min_budget(single)[0]
    held = st.grads_bytes if st.calibration.parallel is not None else grads_bytes
    return (
        f"needs {format_bytes(need)} over {k} micro-steps of accumulation, which keep the gradients "
        f"({format_bytes(held)}) alive from one micro-step to the next (one step of {st.batch_size} "
        f"sample{'s' if st.batch_size != 1 else ''} alone, "
        f"without accumulation, needs {format_bytes(alone)})"
    )


def first_feasible(
    cands: list[Candidate], budget_bytes: int, smallest: Stats, *, policy: str | None = None
) -> Candidate:
    """The best feasible candidate, or BudgetInfeasibleError with the minimum (``smallest``: the
    profile at micro-batch 1; ``policy``: the text of the policy every candidate keeps, if any)."""
    for c in cands:
        if c.feasible:
            return c
    one = min(cands, key=lambda c: c.micro_batch)
    if policy is None:
        raise BudgetInfeasibleError(
            f"memfit.fit: no micro-batch fits {format_bytes(budget_bytes)}; even a micro-batch of {one.micro_batch} "
            f"{one.reason} ({costs_breakdown(smallest)}). Raise the budget or use a smaller model.",
        )
    raise BudgetInfeasibleError(
        f"memfit.fit: no micro-batch fits {format_bytes(budget_bytes)} with policy {policy!r}; even a micro-batch of "
        f"{one.micro_batch} {one.reason} with it ({costs_breakdown(smallest)}). Raise the budget, take a policy that "
        "recomputes more, or leave out --policy and let memfit search the plan.",
    )


def _fixed_prediction(costs: ChainCosts, plan: Plan, budget_bytes: int) -> Prediction:
    """A fixed plan's prediction on ``costs``, or BudgetInfeasibleError with what it needs (the
    solver's test: predicted peak times ``1 + margin`` within the budget)."""
    pred = predict(costs, plan)
    if pred.peak_bytes > budget_bytes / (1 + costs.margin):
        raise BudgetInfeasibleError(
            f"memfit.fit: policy {plan.policy!r} needs {format_bytes(pred.peak_with_margin_bytes)} (with the {costs.margin:.0%} margin), "
            f"over the budget of {format_bytes(budget_bytes)}.",
            min_budget_bytes=pred.peak_with_margin_bytes,
        )
    return pred
