"""The planner: the fastest plan whose predicted peak fits a memory budget.

NOTE [ Solver ]
Under the cost model (NOTE [ Cost model ] in :mod:`memfit.plan.costmodel`) a plan is a sequence of
*items*: a block in one of its options (keep, recompute, each selective option, offload) or a
segment ``[s, t)`` with an inner plan (whose blocks are kept or recomputed). Every
event of an item is its own excess ``E`` above the retained bytes ``S`` of the items before it, so
a sequence's peak is ``max_k (S_k + E_k)`` and its cost is the sum of the items' extra seconds.
For a range of blocks, the solver keeps the Pareto front of (``E``, extra seconds) over all plans
of that range (a dynamic program over ranges in the rotor/revolve line of work, exact in bytes:
no memory discretisation):

    front(s, t) = pareto( item(s) (+) front(next, t)  for every first item of [s, t) )
    a (+) b     = (max(a.E, a.D + b.E), a.cost + b.cost)

where a segment's own front is that of its inner range, recomputed with the gradient state of its
last block. Points whose ``E`` exceeds the budget are dropped early (no feasible plan can contain
them). The answer is the cheapest point of the whole chain's front within the budget. Tests check
it against brute force over every plan of chains of up to 10 blocks, with two options per block,
and with up to five options per block (tests/test_selective.py). The work per item grows with the
number of options, linearly.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Any

from memfit.errors import BudgetInfeasibleError
from memfit.plan.costmodel import SEGMENT_OPTIONS, ChainCosts, Prediction, predict
from memfit.plan.types import Plan, Segment
from memfit.units import format_bytes

_NEG = -(1 << 62)  # the excess of an empty sequence


@dataclass(frozen=True, slots=True)
class _Point:
    excess: int  # E: peak above the sequence's starting live bytes
    cost: float  # extra seconds
    opts: tuple[str, ...]  # option per block of the range, in order
    segs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    """The solver's choice: per-block options, segments and the cost model's prediction."""

    options: tuple[str, ...]
    segments: tuple[tuple[int, int], ...]
    prediction: Prediction
    head: str | None = None


def _pareto(points: list[_Point], cap: float) -> list[_Point]:
    # Ties (same excess and cost): fewer segments, then fewer blocks changed from 'keep'.
    points.sort(key=lambda p: (p.excess, p.cost, len(p.segs), len(p.opts) - p.opts.count("keep")))
    out: list[_Point] = []
    best = math.inf
    for p in points:
        if p.excess > cap:
            break
        if p.cost < best - 1e-15:
            out.append(p)
            best = p.cost
    return out


def _combine(items: list[_Point], retained: int, rest: list[_Point], cap: float) -> list[_Point]:
    """Front of ``item (+) rest`` over all pairs, in one merge.

    ``items`` and ``rest`` are fronts (excess ascending, cost descending); an item that keeps
    ``retained`` bytes followed by a rest plan peaks at ``max(item.E, retained + rest.E)``. The
    cheapest pair under a peak ``T`` is the cheapest item under ``T`` plus the cheapest rest under
    ``T - retained``, so walking the thresholds in order gives the whole front.
    """
    items = _pareto(list(items), cap)
    if not items or not rest:
        return []
    shifted = [(retained + r.excess, r) for r in rest]
    thresholds = sorted({p.excess for p in items} | {e for e, _ in shifted})
    out: list[_Point] = []
    i = j = -1
    for th in thresholds:
        if th > cap:
            break
        while i + 1 < len(items) and items[i + 1].excess <= th:
            i += 1
        while j + 1 < len(shifted) and shifted[j + 1][0] <= th:
            j += 1
        if i < 0 or j < 0:
            continue
        a, b = items[i], shifted[j][1]
        out.append(_Point(max(a.excess, shifted[j][0]), a.cost + b.cost, a.opts + b.opts, a.segs + b.segs))
    return out


class _Fronts:
    def __init__(self, costs: ChainCosts, cap: float, segments: bool, top_only: str | None = None) -> None:
        self.c = costs
        self.cap = cap
        self.segments = segments and costs.segments_allowed
        self.top_only = top_only  # the one option of the top-level items (a segment is 'recompute')
        # seg_stop[s]: a segment starting at block s ends at or before it (within s's container).
        spans = costs.segment_spans if costs.segment_spans is not None else ((0, len(costs)),)
        self.seg_stop = list(range(len(costs)))
        for a, b in spans:
            for s in range(a, b):
                self.seg_stop[s] = b
        self.max_len, self.nested = search_limits(len(costs))
        self.memo: dict[tuple[int, int, str], list[_Point]] = {}
        self.seg_memo: dict[tuple[int, int, int], list[tuple[int, float, tuple[str, ...], tuple[tuple[int, int], ...]]]] = {}

    def item(self, i: int, opt: str, g: int, kind: str, state: int = 0) -> tuple[int, int, float]:
        """(excess, retained bytes, extra seconds) of block ``i`` in ``opt``; ``g``: bytes alive
        above its start in its forward, ``state`` in its backward (a segment's generator state)."""
        oc = self.c.options[i][opt]
        d, held, own = oc.retained_bytes, 0, 0
        if kind != "top":  # inside a recompute: the unit it gathers (FSDP2), as predict counts it
            own = self.c.gathered(i)
            d += own
            held = self.c.recompute_held(i, i if kind == "first" else i - 1)
        e = max(oc.fwd_peak_bytes + g - own, d + oc.bwd_base_bytes + oc.bwd_peak_bytes - held + state)
        return e, d, oc.extra_s

    def seq(self, s: int, t: int, kind: str) -> list[_Point]:
        """Front of plans for blocks ``s .. t-1``: kind 'top' (the chain, head after it), 'inner'
        (inside a segment ending at t) or 'first' (an inner range that may not be one segment)."""
        key = (s, t, kind)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        c = self.c
        g = 0 if kind == "top" else c.segment_grad_base(t)
        rest_kind = "top" if kind == "top" else "inner"
        tail = [_Point(c.head_peak_bytes if kind == "top" else _NEG, 0.0, (), ())]

        def rest(u: int) -> list[_Point]:
            return tail if u == t else self.seq(u, t, rest_kind)

        cand: list[_Point] = []
        r1 = rest(s + 1)
        for opt in c.options[s]:
            if kind != "top" and opt not in SEGMENT_OPTIONS:
                continue  # selective and offload blocks are top-level items only
            if kind == "top" and self.top_only is not None and opt != self.top_only:
                continue
            e, d, x = self.item(s, opt, g, kind, 0 if kind == "top" else c.checkpoint_state_bytes)
            if e <= self.cap:
                cand.extend(_combine([_Point(e, x, (opt,), ())], d, r1, self.cap))
        if self.segments and (kind == "top" or self.nested) and (kind != "top" or self.top_only in (None, "recompute")):
            for u in range(s + 2, min(t, s + self.max_len, self.seg_stop[s]) + 1):
                if kind == "first" and u == t:
                    continue
                f = c.segment_fwd_peak(s, u) + g
                if f > self.cap:
                    continue
                x0 = c.segment_extra_s(s, u)
                seg = ((s, u),)
                inner = [_Point(max(f, p.excess), x0 + p.cost, p.opts, seg + p.segs) for p in self.seq(s, u, "first")]
                kept = c.segment_retained(u) + (c.gathered(s, u) if kind != "top" else 0)
                cand.extend(_combine(inner, kept, rest(u), self.cap))
        out = _pareto(cand, self.cap)
        self.memo[key] = out
        return out


EXHAUSTIVE_MAX_BLOCKS = 16
LONG_CHAIN_MAX_SEGMENT = 8


def search_limits(n_blocks: int) -> tuple[int, bool]:
    """(longest segment, nested segments allowed) searched for a chain of ``n_blocks``.

    Up to EXHAUSTIVE_MAX_BLOCKS blocks every plan is searched. Longer chains (with segments
    allowed) search segments of at most LONG_CHAIN_MAX_SEGMENT blocks, not nested, which keeps a
    100-block chain well under a second; keep/recompute per block stays exhaustive.
    """
    if n_blocks <= EXHAUSTIVE_MAX_BLOCKS:
        return n_blocks, True
    return LONG_CHAIN_MAX_SEGMENT, False


def search_description(costs: ChainCosts) -> str:
    if not costs.segments_allowed:
        return "exhaustive (per-block options; the container cannot run segments)"
    max_len, nested = search_limits(len(costs))
    if nested:
        return "exhaustive (per-block options, segments and nesting)"
    return f"per-block options exhaustive; segments of up to {max_len} blocks, not nested ({len(costs)} blocks)"


def _fixed_peak(costs: ChainCosts) -> int:
    return max(costs.pre_peak_bytes, costs.post_peak_bytes)


def chain_front(costs: ChainCosts, *, cap_bytes: float = math.inf, segments: bool = True, top_only: str | None = None) -> list[_Point]:
    """The Pareto front (peak above ``start_bytes``, extra seconds) of all plans of the chain
    (``top_only``: of those whose top-level items all run in that option; a segment is
    ``recompute``)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * len(costs) + 1000))
    try:
        return _Fronts(costs, cap_bytes, segments, top_only).seq(0, len(costs), "top")
    finally:
        sys.setrecursionlimit(limit)


def _head_searches(costs: ChainCosts) -> list[tuple[ChainCosts, str | None]]:
    """The searches that take every plan at its own ``H`` or above (NOTE [ The head's peak per
    option ] in :mod:`memfit.plan.costmodel`): all plans with the largest ``H`` (a plan's own when
    it runs in the option whose step had the largest, alone or mixed: with keep and recompute,
    every mixed plan), and the plans of each other option alone with that option's ``H`` (with
    every block kept: one plan)."""
    out: list[tuple[ChainCosts, str | None]] = [(costs, None)]
    for mode, h in costs.head_peak_bytes_by_mode.items():
        if h < costs.head_peak_bytes and all(mode in o for o in costs.options):
            out.append((replace(costs, head_peak_bytes=h), mode))
    return out


def _front(costs: ChainCosts, *, cap_bytes: float = math.inf, segments: bool = True) -> list[_Point]:
    """The fronts of :func:`_head_searches`, each point's excess with the ``H`` of its plan."""
    return [p for c, only in _head_searches(costs) for p in chain_front(c, cap_bytes=cap_bytes, segments=segments, top_only=only)]


def _solution(costs: ChainCosts, p: _Point) -> Solution:
    plan = _to_plan(costs, p.opts, p.segs, policy="memfit")
    return Solution(options=p.opts, segments=p.segs, prediction=predict(costs, plan), head=costs.head)


def _to_plan(costs: ChainCosts, opts: tuple[str, ...], segs: tuple[tuple[int, int], ...], *, policy: str) -> Plan:
    return Plan(
        policy=policy,
        chain_path="",
        blocks=tuple(costs.decision(i, o) for i, o in enumerate(opts)),
        segments=tuple(Segment(start=s, stop=t) for s, t in sorted(segs)),
        head=costs.head,
        activations=costs.activations,
    )


def min_budget(costs: ChainCosts, *, segments: bool = True) -> tuple[int, Solution]:
    """The smallest budget any plan fits in (margin included) and that plan (over head options too)."""
    best: tuple[int, float, Solution] | None = None
    for c in costs.head_choices():
        front = _front(c, segments=segments)
        p = min(front, key=lambda p: (p.excess, p.cost))
        sol = _solution(c, p)
        key = (sol.prediction.peak_with_margin_bytes, sol.prediction.step_s, sol)
        if best is None or key[:2] < best[:2]:
            best = key
    assert best is not None
    return best[0], best[2]


def solve(costs: ChainCosts, budget_bytes: int, *, segments: bool = True, breakdown: str = "") -> Solution:
    """The plan with the least predicted step time whose predicted peak (with margin) fits.

    Every head option of the costs (``costs.head_options``) is tried with the model's own head;
    the fastest fitting plan wins (its ``head`` says which).

    Args:
        costs: the cost model.
        budget_bytes: the memory budget (whole-step peak).
        segments: also consider segments (only where the chain allows them).
        breakdown: text describing the fixed memory, for the infeasible-budget message.

    Raises:
        BudgetInfeasibleError: no plan fits; ``min_budget_bytes`` on the error says what does.
    """
    best: Solution | None = None
    for c in costs.head_choices():  # the model's own head, then each head option: fastest wins
        usable = budget_bytes / (1 + c.margin)
        cap = usable - c.start_bytes
        front = _front(c, cap_bytes=cap, segments=segments) if _fixed_peak(c) <= usable else []
        if front:
            sol = _solution(c, min(front, key=lambda p: (p.cost, p.excess)))
            if best is None or sol.prediction.step_s < best.prediction.step_s:
                best = sol
    if best is None:
        need, sol = min_budget(costs, segments=segments)
        raise BudgetInfeasibleError(
            f"memfit.plan: budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the minimum "
            f"this model can run in at this batch size: {format_bytes(need)} ({need} bytes, with the "
            f"{costs.margin:.0%} safety margin; {breakdown or 'see memfit profile'}; the minimal plan "
            f"recomputes {sol.options.count('recompute')} of {len(costs)} blocks and peaks in the "
            f"{sol.prediction.peak_event}). Raise the budget, lower --batch-size, or use gradient "
            "accumulation with smaller micro-batches.",
            min_budget_bytes=need,
        )
    return best


def plan_from_solution(
    sol: Solution, costs: ChainCosts, *, chain_path: str, fingerprint: dict[str, Any], budget_bytes: int | None, extra: dict[str, Any] | None = None
) -> Plan:
    """The :class:`Plan` for a solution, with its prediction and the model's margin recorded."""
    plan = _to_plan(costs.with_head(sol.head), sol.options, sol.segments, policy="memfit")
    return plan.with_(
        chain_path=chain_path,
        fingerprint=fingerprint,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=sol.prediction.peak_bytes,
        predicted_step_s=sol.prediction.step_s,
        extra={
            "margin": costs.margin,
            "predicted_peak_with_margin_bytes": sol.prediction.peak_with_margin_bytes,
            "peak_event": sol.prediction.peak_event,
            "search": search_description(costs),
            **costs.info,
            **(extra or {}),
        },
    )
