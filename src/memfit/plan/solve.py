"""The planner: the fastest plan whose predicted peak fits a memory budget.

size: the fronts, their search and the answer are one algorithm (NOTE [ Solver ]), read together.

NOTE [ Solver ]
Under the cost model (NOTE [ Cost model ] in :mod:`memfit.plan.costmodel`) a plan is a sequence of
*items*: a block in one of its options (keep, recompute, each selective option, offload, the tiled
and host-held ones: top-level items, as selective and offload are) or a
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

Segments nest and have any length: the ranges are every ``[s, t)`` a segment can hold (the
'first'/'inner' fronts of a segment's inside, which depend on ``t`` through the gradients alive
while it is recomputed) and every ``[s, N)`` of the top level, and each tries every segment
``[s, u)`` inside it, so the work is about ``N^3 / 6`` segment steps (:func:`search_work`). Fronts
are numpy arrays (:class:`_Front`) whose points record where they came from, so a plan is built only
for the answer. Every plan is searched up to ``SEARCH_WORK_LIMIT`` steps (33 blocks; about half a
second on a loaded 2-core CPU, benchmarks/solver_timing.py); longer chains search nested segments
up to the longest length within the limit, never shorter than 8 blocks or sqrt(N)
(:func:`search_limits`; 64 blocks: 14, 100 blocks: 10), and the plan file's ``search`` says which.
Within that bound the search is exact (tests/test_solver.py checks a forced bound against brute
force over exactly the bounded plans). Before, chains over 16 blocks searched only non-nested
segments of at most 8 blocks.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

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


class _Front:
    """A Pareto front as arrays, excess ascending and cost descending, with where each point came
    from: ``code`` (the option's index in the block's options, or -1 for a segment ``[s, u)``),
    ``u`` (where the rest starts), ``ia`` (the segment's inner point, or -1) and ``ib`` (the rest's
    point, or -1 at the range's end); :meth:`_Fronts.unpack` follows them."""

    __slots__ = ("e", "c", "ns", "nc", "code", "u", "ia", "ib")

    def __init__(
        self,
        e: np.ndarray,
        c: np.ndarray,
        ns: np.ndarray,
        nc: np.ndarray,
        code: np.ndarray,
        u: np.ndarray,
        ia: np.ndarray,
        ib: np.ndarray,
    ) -> None:
        self.e, self.c, self.ns, self.nc, self.code, self.u, self.ia, self.ib = e, c, ns, nc, code, u, ia, ib

    def __len__(self) -> int:
        return len(self.e)

    def take(self, idx: np.ndarray) -> _Front:
        return _Front(*(a[idx] for a in (self.e, self.c, self.ns, self.nc, self.code, self.u, self.ia, self.ib)))

    @staticmethod
    def concat(parts: list[_Front]) -> _Front:
        return _Front(*(np.concatenate([getattr(p, k) for p in parts]) for k in _Front.__slots__))


def _empty() -> _Front:
    i = np.zeros(0, dtype=np.int64)
    return _Front(i, np.zeros(0), i, i, i, i, i, i)


def _tail(excess: int) -> _Front:
    one = np.ones(1, dtype=np.int64)
    return _Front(one * excess, np.zeros(1), 0 * one, 0 * one, -2 * one, 0 * one, -one, -one)


def _pareto(f: _Front, cap: float) -> _Front:
    """The points no other point beats: sorted by (excess, cost, segments, changed blocks), a
    point is kept when it is cheaper than every point before it (ties go to fewer segments, then
    fewer blocks changed from 'keep'); points over ``cap`` are dropped."""
    order = np.lexsort((f.nc, f.ns, f.c, f.e))
    order = order[f.e[order] <= cap]
    c = f.c[order]
    if len(c) == 0:
        return f.take(order)
    before = np.empty_like(c)
    before[0] = np.inf
    np.minimum.accumulate(c[:-1], out=before[1:])
    return f.take(order[c < before - 1e-15])


def _combine(items: _Front, retained: int, rest: _Front, cap: float) -> _Front:
    """Front of ``item (+) rest`` over all pairs, in one merge.

    ``items`` (made a front here) and ``rest`` are fronts (excess ascending, cost descending); an
    item that keeps ``retained`` bytes followed by a rest plan peaks at ``max(item.E, retained +
    rest.E)``. The cheapest pair under a peak ``T`` is the cheapest item under ``T`` plus the
    cheapest rest under ``T - retained``, so walking the thresholds (every item's and every shifted
    rest point's excess) in order gives the whole front. The result keeps the items' provenance,
    with ``ib`` the rest's point.
    """
    items = _pareto(items, cap)
    if not len(items) or not len(rest):
        return _empty()
    ea, er = items.e, rest.e + retained
    j_of_a = np.searchsorted(er, ea, side="right") - 1  # the rest under each item's excess
    i_of_r = np.searchsorted(ea, er, side="right") - 1  # the items under each rest's excess
    new = (i_of_r < 0) | (ea[np.maximum(i_of_r, 0)] != er)  # thresholds not already an item's
    th = np.concatenate([ea, er[new]])
    ii = np.concatenate([np.arange(len(ea)), i_of_r[new]])
    jj = np.concatenate([j_of_a, np.flatnonzero(new)])
    order = np.argsort(th, kind="stable")
    order = order[(th[order] <= cap) & (ii[order] >= 0) & (jj[order] >= 0)]
    ii, jj = ii[order], jj[order]
    out = items.take(ii)
    out.e = np.maximum(out.e, er[jj])
    out.c = out.c + rest.c[jj]
    out.ns = out.ns + rest.ns[jj]
    out.nc = out.nc + rest.nc[jj]
    out.ib = jj
    return out


class _Fronts:
    """The fronts of a chain's ranges under a cap, memoised."""

    def __init__(self, costs: ChainCosts, cap: float, segments: bool, top_only: str | None = None) -> None:
        self.c = costs
        self.cap = cap
        self.segments = segments and costs.segments_allowed
        self.top_only = top_only  # the one option of the top-level items (a segment is 'recompute')
        n = len(costs)
        # seg_stop[s]: a segment starting at block s ends at or before it (within s's container).
        spans = costs.segment_spans if costs.segment_spans is not None else ((0, n),)
        self.seg_stop = list(range(n))
        for a, b in spans:
            for s in range(a, b):
                self.seg_stop[s] = b
        self.max_len, self.nested = search_limits(n) if self.segments else (0, False)
        # Segment quantities of [s, u) for every segment searched, in the order
        # ChainCosts.segment_fwd_peak and segment_extra_s compute them (same floats).
        self.seg_fwd: dict[tuple[int, int], int] = {}
        self.seg_x: dict[tuple[int, int], float] = {}
        for s in range(n if self.segments else 0):
            fwd, x = 0, 0.0
            for u in range(s + 1, min(n, s + self.max_len, self.seg_stop[s]) + 1):
                i = u - 1
                fwd = max(
                    fwd, (costs.recompute(i - 1).retained_bytes if i > s else 0) + costs.recompute(i).fwd_peak_bytes
                )
                x += costs.recompute(i).extra_s
                self.seg_fwd[s, u], self.seg_x[s, u] = fwd, x
        self.grad_base = [costs.segment_grad_base(t) if t else 0 for t in range(n + 1)] if self.segments else []
        self.opt_names = [list(o) for o in costs.options]
        self.memo: dict[tuple[int, int, str], _Front] = {}
        self.top_tail = _tail(costs.head_peak_bytes)
        self.inner_tail = _tail(_NEG)

    def item(self, i: int, opt: str, g: int, kind: str, state: int = 0) -> tuple[int, int]:
        """(excess, retained bytes) of block ``i`` in ``opt``; ``g``: bytes alive above its start in
        its forward, ``state`` in its backward (a segment's generator state). Inside a recompute
        (``kind`` 'first': the segment's first block, 'inner': a later one) also the unit it
        gathers (FSDP2), as predict counts it."""
        oc = self.c.options[i][opt]
        d, held, own = oc.retained_bytes, 0, 0
        if kind != "top":
            own = self.c.gathered(i)
            d += own
            held = self.c.recompute_held(i, i if kind == "first" else i - 1)
        e = max(oc.fwd_peak_bytes + g - own, d + oc.bwd_base_bytes + oc.bwd_peak_bytes - held + state)
        return e, d

    def seq(self, s: int, t: int, kind: str) -> _Front:
        """Front of plans for blocks ``s .. t-1``: kind 'top' (the chain, head after it), 'inner'
        (inside a segment ending at t) or 'first' (an inner range that may not be one segment)."""
        key = (s, t, kind)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        if kind == "inner" and not self.c.recompute_gathered_bytes:
            # The plans of 'first' and the range as one segment (an inner range's first block holds
            # what a segment's first block does, unless FSDP2 units are gathered: then below).
            out = self.seq(s, t, "first")
            if self.nested and 2 <= t - s <= self.max_len and t <= self.seg_stop[s]:
                out = _pareto(
                    _Front.concat(
                        [out, self.segment(s, t, t, self.grad_base[t], self.inner_tail, inside=True, last=True)]
                    ),
                    self.cap,
                )
            self.memo[key] = out
            return out
        c = self.c
        g = 0 if kind == "top" else self.grad_base[t]
        rest_kind = "top" if kind == "top" else "inner"
        tail = self.top_tail if kind == "top" else self.inner_tail

        def rest(u: int) -> _Front:
            return tail if u == t else self.seq(u, t, rest_kind)

        parts: list[_Front] = []
        r1 = rest(s + 1)
        for k, opt in enumerate(self.opt_names[s]):
            if kind != "top" and opt not in SEGMENT_OPTIONS:
                continue  # selective and offload blocks are top-level items only
            if kind == "top" and self.top_only is not None and opt != self.top_only:
                continue
            e, d = self.item(s, opt, g, kind, 0 if kind == "top" else c.checkpoint_state_bytes)
            if e <= self.cap:
                # The last item of a segment's inside, recomputed on its own: the segment's
                # recompute stops before it (NOTE [ Cost model ], early stop), so it runs once.
                oc = c.options[s][opt]
                x = 0.0 if kind != "top" and s + 1 == t and opt == "recompute" else oc.extra_s
                one = np.ones(1, dtype=np.int64)
                item = _Front(
                    one * e, np.full(1, x), 0 * one, one * (opt != "keep"), one * k, one * (s + 1), -one, -one
                )
                parts.append(_combine(item, d, r1, self.cap))
        if self.segments and (kind == "top" or self.nested) and (kind != "top" or self.top_only in (None, "recompute")):
            for u in range(s + 2, min(t, s + self.max_len, self.seg_stop[s]) + 1):
                if kind == "first" and u == t:
                    continue  # the range as one segment: only as an 'inner' range
                parts.append(self.segment(s, u, t, g, rest(u), inside=kind != "top", last=kind != "top" and u == t))
        out = _pareto(_Front.concat(parts), self.cap) if parts else _empty()
        self.memo[key] = out
        return out

    def segment(self, s: int, u: int, t: int, g: int, rest: _Front, *, inside: bool, last: bool = False) -> _Front:
        """Plans that start with segment ``[s, u)`` (any inner plan) followed by ``rest``; ``inside``
        an enclosing segment's recompute (it also keeps the units it gathers, FSDP2); ``last``:
        the last item of an enclosing segment's inside, whose recompute stops before it, so its own
        recompute is its only one (no seconds beyond its inside's)."""
        f = self.seg_fwd[s, u] + g
        if f > self.cap:
            return _empty()
        inner = self.seq(s, u, "first")
        n = len(inner)
        items = _Front(
            np.maximum(inner.e, f), inner.c + (0.0 if last else self.seg_x[s, u]), inner.ns + 1, inner.nc,
            np.full(n, -1, dtype=np.int64), np.full(n, u, dtype=np.int64), np.arange(n), np.full(n, -1, dtype=np.int64),
        )  # fmt: skip
        return _combine(items, self.c.segment_retained(u) + (self.c.gathered(s, u) if inside else 0), rest, self.cap)

    def unpack(self, s: int, t: int, kind: str, k: int) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
        """The options and segments of point ``k`` of a range's front."""
        opts: list[str] = []
        segs: list[tuple[int, int]] = []
        stack = [(s, t, kind, k)]
        while stack:
            s, t, kind, k = stack.pop()
            f = self.memo[s, t, kind]
            code, u, ia, ib = int(f.code[k]), int(f.u[k]), int(f.ia[k]), int(f.ib[k])
            if code == -2:  # the range's end
                continue
            rest_kind = "top" if kind == "top" else "inner"
            if u < t:
                stack.append((u, t, rest_kind, ib))
            if code >= 0:
                opts.append(self.opt_names[s][code])
            else:
                segs.append((s, u))
                stack.append((s, u, "first", ia))
        return tuple(opts), tuple(segs)


SEARCH_WORK_LIMIT = 6000
"""Segment steps (one segment tried at one position of one range) the solver may search for a
chain: about half a second of solving in pure Python on a 2-core x86 CPU
(benchmarks/solver_timing.py). Within it every plan is searched (about 33 blocks with two options
per block); longer chains search segments up to the longest length that keeps within it."""


MIN_SEGMENT_LIMIT = 8  # the longest segment a long chain searches is never shorter


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


def search_limits(n_blocks: int) -> tuple[int, bool]:
    """(longest segment, nested segments allowed) searched for a chain of ``n_blocks``.

    Every plan (segments of any length, nested) is searched while :func:`search_work` stays within
    SEARCH_WORK_LIMIT (up to 33 blocks). Longer chains search nested segments of at most the
    longest length that stays within it, and never less than 8 blocks or ceil(sqrt(n)) (the
    segments of checkpoint_sequential's sqrt(N) plan, which nest inside longer ones); past about
    150 blocks the work, and the time, grows as n^2. Keep/recompute and the other options per
    block stay exhaustive.
    """
    if search_work(n_blocks, n_blocks) <= SEARCH_WORK_LIMIT:
        return n_blocks, True
    max_len = max(MIN_SEGMENT_LIMIT, math.isqrt(n_blocks - 1) + 1)
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


def chain_front(
    costs: ChainCosts, *, cap_bytes: float = math.inf, segments: bool = True, top_only: str | None = None
) -> list[_Point]:
    """The Pareto front (peak above ``start_bytes``, extra seconds) of all plans of the chain
    (``top_only``: of those whose top-level items all run in that option; a segment is
    ``recompute``)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * len(costs) + 1000))
    try:
        fronts = _Fronts(costs, cap_bytes, segments, top_only)
        n = len(costs)
        top = fronts.seq(0, n, "top")
    finally:
        sys.setrecursionlimit(limit)
    return [_Point(int(top.e[k]), float(top.c[k]), *fronts.unpack(0, n, "top", k)) for k in range(len(top))]


def _head_searches(costs: ChainCosts) -> list[tuple[ChainCosts, str | None]]:
    """The searches that take every plan at its own ``H`` or above (NOTE [ The head's peak per
    option ] in :mod:`memfit.plan.costmodel`): all plans with the largest ``H`` (a plan's own when
    it runs in the option whose step had the largest, alone or mixed: with keep and recompute,
    every mixed plan), and the plans of each other option alone with that option's ``H`` (with
    every block kept: one plan)."""
    out: list[tuple[ChainCosts, str | None]] = [(costs, None)]
    for name, h in costs.head_peak_bytes_by_option.items():
        if h < costs.head_peak_bytes and all(name in o for o in costs.options):
            out.append((replace(costs, head_peak_bytes=h), name))
    return out


def _front(costs: ChainCosts, *, cap_bytes: float = math.inf, segments: bool = True) -> list[_Point]:
    """The fronts of :func:`_head_searches`, each point's excess with the ``H`` of its plan."""
    return [
        p
        for c, only in _head_searches(costs)
        for p in chain_front(c, cap_bytes=cap_bytes, segments=segments, top_only=only)
    ]


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
        if not c.additive:  # the additive excess leaves out held inputs, dropped tensors: the least prediction
            sol = min((_solution(c, p) for p in front), key=lambda s: (s.prediction.peak_bytes, s.prediction.step_s))
        else:
            sol = _solution(c, min(front, key=lambda p: (p.excess, p.cost)))
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
        sol = _cheapest_fitting(c, front, budget_bytes)
        if sol is not None and (best is None or sol.prediction.step_s < best.prediction.step_s):
            best = sol
    if best is None:
        need, sol = min_budget(costs, segments=segments)
        raise BudgetInfeasibleError(
            f"memfit.plan: budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the minimum "
            f"this model can run in at this batch size: {format_bytes(need)} ({need} bytes, with the "
            f"{costs.margin:.0%} safety margin; {breakdown or 'see memfit profile'}; the minimal plan "
            f"recomputes {sum(o.startswith('recompute') for o in sol.options)} of {len(costs)} blocks"
            f"{_tiled_words(sol.options)} and peaks in the "
            f"{sol.prediction.peak_event}). Raise the budget, lower --batch-size, or use gradient "
            "accumulation with smaller micro-batches.",
            min_budget_bytes=need,
        )
    return best


def ranked_solutions(costs: ChainCosts, budget_bytes: int, *, segments: bool = True, limit: int = 3) -> list[Solution]:
    """Up to ``limit`` plans that fit ``budget_bytes``, fastest predicted first (over head options
    too): :func:`solve`'s answer and the next-best ones of the fronts (a plan slower and no smaller
    than another is not one), for a caller that times them (:mod:`memfit.fitting.choice`). Empty
    when none fits."""
    found: list[Solution] = []
    for c in costs.head_choices():
        usable = budget_bytes / (1 + c.margin)
        if _fixed_peak(c) > usable:
            continue
        fitting = 0
        for p in sorted(
            _front(c, cap_bytes=usable - c.start_bytes, segments=segments), key=lambda p: (p.cost, p.excess)
        ):
            sol = _solution(c, p)
            if c.additive or sol.prediction.peak_with_margin_bytes <= budget_bytes:
                found.append(sol)
                fitting += 1
            if fitting >= limit:
                break
    unique = {(s.options, s.segments, s.head): s for s in sorted(found, key=lambda s: s.prediction.step_s)}
    return list(unique.values())[:limit]


def _cheapest_fitting(costs: ChainCosts, front: list[_Point], budget_bytes: int) -> Solution | None:
    """The cheapest point of ``front`` whose :func:`predict` fits; where the costs are additive
    (:attr:`ChainCosts.additive`) its excess is its prediction: the cheapest."""
    for p in sorted(front, key=lambda p: (p.cost, p.excess)):
        sol = _solution(costs, p)
        if costs.additive or sol.prediction.peak_with_margin_bytes <= budget_bytes:
            return sol
    return None


def _tiled_words(options: tuple[str, ...]) -> str:
    """``", tiles 2 and holds 1 input on the host"`` for the infeasible-budget message."""
    tiled = sum(":tiles-" in o for o in options)
    host = sum(o.endswith(":host") for o in options)
    words = ([f"tiles {tiled}"] if tiled else []) + ([f"holds {host} input(s) on the host"] if host else [])
    return ", " + " and ".join(words) if words else ""


def plan_from_solution(
    sol: Solution,
    costs: ChainCosts,
    *,
    chain_path: str,
    fingerprint: dict[str, Any],
    budget_bytes: int | None,
    **details: Any,
) -> Plan:
    """The :class:`Plan` for a solution, with its prediction and the model's margin recorded;
    ``details``: further :class:`Plan` fields (``min_budget_bytes=...``)."""
    plan = _to_plan(costs.with_head(sol.head), sol.options, sol.segments, policy="memfit")
    return plan.with_(
        chain_path=chain_path,
        fingerprint=fingerprint,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=sol.prediction.peak_bytes,
        predicted_step_s=sol.prediction.step_s,
        margin=costs.margin,
        predicted_peak_with_margin_bytes=sol.prediction.peak_with_margin_bytes,
        peak_event=sol.prediction.peak_event,
        search=search_description(costs),
        time_scales=costs.time_scales,
        **details,
    )
