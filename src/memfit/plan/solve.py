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
import operator
import sys
from dataclasses import dataclass
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


# Inside the search a front point is a plain tuple (excess, cost, segments, changed blocks, back):
# ``back`` is the plan as a tree, a pair ``(left, right)`` read in order, a leaf ``("o", option)``
# or ``("s", start, stop)``, or None (nothing); :func:`_unpack` flattens it once at the end. Ties in
# (excess, cost) go to fewer segments, then fewer blocks changed from 'keep'.
_Pt = tuple[int, float, int, int, Any]
_TIE_KEY = operator.itemgetter(0, 1, 2, 3)


def _pareto(points: list[_Pt], cap: float) -> list[_Pt]:
    points.sort(key=_TIE_KEY)
    out: list[_Pt] = []
    best = math.inf
    for p in points:
        if p[0] > cap:
            break
        if p[1] < best - 1e-15:
            out.append(p)
            best = p[1]
    return out


def _combine(items: list[_Pt], retained: int, rest: list[_Pt], cap: float) -> list[_Pt]:
    """Front of ``item (+) rest`` over all pairs, in one merge.

    ``items`` (made a front here) and ``rest`` are fronts (excess ascending, cost descending); an
    item that keeps ``retained`` bytes followed by a rest plan peaks at ``max(item.E, retained +
    rest.E)``. The cheapest pair under a peak ``T`` is the cheapest item under ``T`` plus the
    cheapest rest under ``T - retained``, so walking the thresholds in order gives the whole front.
    """
    items = _pareto(items, cap)
    if not items or not rest:
        return []
    out: list[_Pt] = []
    na, nr = len(items), len(rest)
    i = j = 0  # items / rest points within the threshold
    while i < na or j < nr:
        th = min(items[i][0] if i < na else math.inf, retained + rest[j][0] if j < nr else math.inf)
        if th > cap:
            break
        while i < na and items[i][0] <= th:
            i += 1
        while j < nr and retained + rest[j][0] <= th:
            j += 1
        if i and j:
            a, b = items[i - 1], rest[j - 1]
            out.append((max(a[0], retained + b[0]), a[1] + b[1], a[2] + b[2], a[3] + b[3], (a[4], b[4])))
    return out


def _unpack(back: Any) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """The options and segments of a point's plan tree, in order."""
    opts: list[str] = []
    segs: list[tuple[int, int]] = []
    stack = [back]
    while stack:
        b = stack.pop()
        if b is None:
            continue
        if b[0] == "o":
            opts.append(b[1])
        elif b[0] == "s":
            segs.append((b[1], b[2]))
        else:
            stack.append(b[1])
            stack.append(b[0])
    return tuple(opts), tuple(segs)


class _Fronts:
    def __init__(self, costs: ChainCosts, cap: float, segments: bool) -> None:
        self.c = costs
        self.cap = cap
        self.segments = segments and costs.segments_allowed
        n = len(costs)
        # seg_stop[s]: a segment starting at block s ends at or before it (within s's container).
        spans = costs.segment_spans if costs.segment_spans is not None else ((0, n),)
        self.seg_stop = list(range(n))
        for a, b in spans:
            for s in range(a, b):
                self.seg_stop[s] = b
        self.max_len, self.nested = search_limits(n, options=_n_options(costs)) if self.segments else (0, False)
        # Segment quantities of [s, u) for every segment searched, in the order
        # ChainCosts.segment_fwd_peak and segment_extra_s compute them (same floats).
        self.seg_fwd: dict[tuple[int, int], int] = {}
        self.seg_x: dict[tuple[int, int], float] = {}
        for s in range(n if self.segments else 0):
            fwd, x = 0, 0
            for u in range(s + 1, min(n, s + self.max_len, self.seg_stop[s]) + 1):
                i = u - 1
                fwd = max(fwd, (costs.recompute(i - 1).retained_bytes if i > s else 0) + costs.recompute(i).fwd_peak_bytes)
                x += costs.recompute(i).extra_s
                self.seg_fwd[s, u], self.seg_x[s, u] = fwd, x
        self.grad_base = [costs.segment_grad_base(t) if t else 0 for t in range(n + 1)] if self.segments else []
        self.memo: dict[tuple[int, int, str], list[_Pt]] = {}

    def item(self, i: int, opt: str, g: int) -> tuple[int, int, float]:
        oc = self.c.options[i][opt]
        e = max(oc.fwd_peak_bytes + g, oc.retained_bytes + oc.bwd_base_bytes + oc.bwd_peak_bytes)
        return e, oc.retained_bytes, oc.extra_s

    def seq(self, s: int, t: int, kind: str) -> list[_Pt]:
        """Front of plans for blocks ``s .. t-1``: kind 'top' (the chain, head after it), 'inner'
        (inside a segment ending at t) or 'first' (an inner range that may not be one segment)."""
        key = (s, t, kind)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        if kind == "inner":  # the plans of 'first' and the range as one segment
            out = self.seq(s, t, "first")
            if self.nested and 2 <= t - s <= self.max_len and t <= self.seg_stop[s]:
                out = _pareto(out + self.segment(s, t, t, self.grad_base[t], [(_NEG, 0.0, 0, 0, None)]), self.cap)
            self.memo[key] = out
            return out
        c = self.c
        g = 0 if kind == "top" else self.grad_base[t]
        rest_kind = "top" if kind == "top" else "inner"
        tail = [(c.head_peak_bytes if kind == "top" else _NEG, 0.0, 0, 0, None)]

        def rest(u: int) -> list[_Pt]:
            return tail if u == t else self.seq(u, t, rest_kind)

        cand: list[_Pt] = []
        r1 = rest(s + 1)
        for opt in c.options[s]:
            if kind != "top" and opt not in SEGMENT_OPTIONS:
                continue  # selective and offload blocks are top-level items only
            e, d, x = self.item(s, opt, g)
            if e <= self.cap:
                cand.extend(_combine([(e, x, 0, int(opt != "keep"), ("o", opt))], d, r1, self.cap))
        if self.segments and (kind == "top" or self.nested):
            for u in range(s + 2, min(t, s + self.max_len, self.seg_stop[s]) + 1):
                if kind == "first" and u == t:
                    continue  # the range as one segment: added by 'inner'
                cand.extend(self.segment(s, u, t, g, rest(u)))
        out = _pareto(cand, self.cap)
        self.memo[key] = out
        return out

    def segment(self, s: int, u: int, t: int, g: int, rest: list[_Pt]) -> list[_Pt]:
        """Plans that start with segment ``[s, u)`` (any inner plan) followed by ``rest``."""
        f = self.seg_fwd[s, u] + g
        if f > self.cap:
            return []
        x0 = self.seg_x[s, u]
        inner = [(max(f, p[0]), x0 + p[1], p[2] + 1, p[3], (("s", s, u), p[4])) for p in self.seq(s, u, "first")]
        return _combine(inner, self.c.segment_retained(u), rest, self.cap)


SEARCH_WORK_LIMIT = 6000
"""Segment steps (one segment tried at one position of one range) the solver may search for a
chain: about half a second of solving in pure Python on a 2-core x86 CPU
(benchmarks/solver_timing.py). Within it every plan is searched (about 33 blocks with two options
per block); longer chains search segments up to the longest length that keeps within it."""


def _n_options(costs: ChainCosts) -> int:
    return max((len(o) for o in costs.options), default=1)


def search_work(n_blocks: int, max_len: int) -> int:
    """Segment steps of a search with nested segments of at most ``max_len`` blocks: for every
    range ``[s, t)`` a segment can hold (``t - s <= max_len``, or ``t`` the chain's end), each
    segment ``[s, u)`` inside it."""
    work = 0
    for s in range(n_blocks):
        for t in range(s + 2, min(n_blocks, s + max_len) + 1):
            work += min(t, s + max_len) - s - 1
        if s + max_len < n_blocks:  # the ranges that run to the chain's end (the top level)
            work += max_len - 1
    return work


def search_limits(n_blocks: int, *, options: int = 2) -> tuple[int, bool]:
    """(longest segment, nested segments allowed) searched for a chain of ``n_blocks``.

    Every plan (segments of any length, nested) is searched while :func:`search_work` stays within
    SEARCH_WORK_LIMIT; past that, nested segments of at most the longest length that stays within
    it (at least 8 blocks, 2 * sqrt(n) where the limit allows: checkpoint_sequential's segments
    and the nestings of them). Keep/recompute and the other options per block stay exhaustive.
    ``options`` (the most options a block has) does not change the limits: options other than
    keep and recompute are top-level items, one step each.
    """
    del options  # documented above
    if search_work(n_blocks, n_blocks) <= SEARCH_WORK_LIMIT:
        return n_blocks, True
    max_len = 8
    while max_len < n_blocks and search_work(n_blocks, max_len + 1) <= SEARCH_WORK_LIMIT:
        max_len += 1
    return max_len, True


def search_description(costs: ChainCosts) -> str:
    if not costs.segments_allowed:
        return "exhaustive (per-block options; the container cannot run segments)"
    max_len, _ = search_limits(len(costs))
    if max_len >= len(costs):
        return "exhaustive (per-block options, segments and nesting)"
    return f"per-block options exhaustive; segments of up to {max_len} blocks, nested ({len(costs)} blocks)"


def _fixed_peak(costs: ChainCosts) -> int:
    return max(costs.pre_peak_bytes, costs.post_peak_bytes)


def _front(costs: ChainCosts, cap_bytes: float, segments: bool) -> list[_Pt]:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * len(costs) + 1000))
    try:
        return _Fronts(costs, cap_bytes, segments).seq(0, len(costs), "top")
    finally:
        sys.setrecursionlimit(limit)


def chain_front(costs: ChainCosts, *, cap_bytes: float = math.inf, segments: bool = True) -> list[_Point]:
    """The Pareto front (peak above ``start_bytes``, extra seconds) of all plans of the chain."""
    return [_Point(p[0], p[1], *_unpack(p[4])) for p in _front(costs, cap_bytes, segments)]


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
        front = chain_front(c, segments=segments)
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
        front = chain_front(c, cap_bytes=cap, segments=segments) if _fixed_peak(c) <= usable else []
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
