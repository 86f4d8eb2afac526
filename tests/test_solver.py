"""The planner's solver against brute force over every plan of small chains (cost model exact)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

import memfit.plan.solve as solve_module
from memfit import BudgetInfeasibleError
from memfit.plan.costmodel import ChainCosts, HeadCost, OptionCost, predict
from memfit.plan.solve import (
    SEARCH_WORK_LIMIT,
    min_budget,
    plan_from_solution,
    search_limits,
    search_work,
    solve,
)
from memfit.plan.types import BlockDecision, Option, Plan, Segment


def random_costs(n: int, seed: int, *, segments: bool, margin: float = 0.0) -> ChainCosts:
    rng = random.Random(seed)
    options = []
    for _ in range(n):
        out = rng.randint(1, 20)
        keep = OptionCost(
            retained_bytes=out + rng.randint(0, 60),
            fwd_peak_bytes=out + rng.randint(0, 80),
            bwd_peak_bytes=rng.randint(0, 50),
            bwd_base_bytes=rng.randint(-10, 40),
            extra_s=0.0,
        )
        rec = OptionCost(
            retained_bytes=out,
            fwd_peak_bytes=out + rng.randint(0, 40),
            bwd_peak_bytes=rng.randint(20, 120),
            bwd_base_bytes=keep.bwd_base_bytes + rng.randint(-3, 3),
            extra_s=rng.uniform(0.1, 1.0),
        )
        options.append({"keep": keep, "recompute": rec})
    return ChainCosts(
        names=tuple(str(i) for i in range(n)),
        options=tuple(options),
        start_bytes=rng.randint(0, 100),
        pre_peak_bytes=rng.randint(0, 100),
        head_peak_bytes=rng.randint(0, 100),
        post_peak_bytes=rng.randint(0, 150),
        base_step_s=1.0,
        segments_allowed=segments,
        margin=margin,
    )


def laminar_families(n: int) -> list[tuple[tuple[int, int], ...]]:
    """Every set of segments [s, t) (t - s >= 2) that pairwise nest or are disjoint."""
    intervals = [(s, t) for s in range(n) for t in range(s + 2, n + 1)]
    fams: list[tuple[tuple[int, int], ...]] = []
    for r in range(len(intervals) + 1):
        for combo in itertools.combinations(intervals, r):
            ok = all(
                a[1] <= b[0] or b[1] <= a[0] or (a[0] <= b[0] and b[1] <= a[1]) or (b[0] <= a[0] and a[1] <= b[1])
                for a, b in itertools.combinations(combo, 2)
            )
            if ok:
                fams.append(combo)
    return fams


def all_plans(n: int, segments: bool, max_len: int | None = None):
    """Every keep/recompute plan (with every laminar family of segments, of at most ``max_len``
    blocks each when given)."""
    fams = (
        [f for f in laminar_families(n) if max_len is None or all(t - s <= max_len for s, t in f)] if segments else [()]
    )
    for opts in itertools.product((Option.KEEP, Option.RECOMPUTE), repeat=n):
        for fam in fams:
            yield Plan(
                policy="brute",
                chain_path="",
                blocks=tuple(BlockDecision(name=str(i), option=a) for i, a in enumerate(opts)),
                segments=tuple(Segment(start=s, stop=t) for s, t in fam),
            )


def brute_force(costs: ChainCosts, segments: bool) -> list[tuple[int, float]]:
    out = []
    for plan in all_plans(len(costs), segments):
        for head in (None, *costs.head_options):
            p = predict(costs, plan.with_(head=head))
            out.append((p.peak_with_margin_bytes, p.step_s))
    return out


def check_budgets(costs: ChainCosts, segments: bool) -> None:
    table = brute_force(costs, segments)
    lo = min(peak for peak, _ in table)
    hi = max(peak for peak, _ in table)
    budgets = sorted(
        {
            lo - 1,
            lo,
            (lo + hi) // 2,
            (2 * lo + hi) // 3,
            hi,
            hi + 50,
            *(peak for peak, _ in table[:: max(1, len(table) // 7)]),
        }
    )
    for budget in budgets:
        fits = [t for peak, t in table if peak <= budget]
        if not fits:
            with pytest.raises(BudgetInfeasibleError) as err:
                solve(costs, budget, segments=segments)
            assert err.value.min_budget_bytes == lo
            continue
        sol = solve(costs, budget, segments=segments)
        assert sol.prediction.peak_with_margin_bytes <= budget
        assert sol.prediction.step_s == pytest.approx(min(fits), abs=1e-9), (budget, sol)
    need, sol = min_budget(costs, segments=segments)
    assert need == lo


@pytest.mark.parametrize("seed", range(6))
def test_keep_or_recompute_matches_brute_force_10_blocks(seed: int) -> None:
    check_budgets(random_costs(10, seed, segments=False), segments=False)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_segments_and_nesting_match_brute_force(seed: int) -> None:
    check_budgets(random_costs(5, 100 + seed, segments=True), segments=True)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_head_options_match_brute_force(seed: int) -> None:
    """A head option (smaller or larger H, faster or slower) is one more choice for the whole
    plan: the solver's answer equals brute force over every block plan with every head."""
    rng = random.Random(300 + seed)
    costs = random_costs(7 if seed % 2 else 5, 300 + seed, segments=bool(seed % 2 == 0))
    costs = dataclasses.replace(
        costs,
        head_options={
            "chunked": HeadCost(peak_bytes=rng.randint(0, costs.head_peak_bytes + 20), extra_s=rng.uniform(-0.3, 0.5))
        },
    )
    check_budgets(costs, segments=costs.segments_allowed)
    need, sol = min_budget(costs, segments=costs.segments_allowed)
    plan = plan_from_solution(sol, costs, chain_path="", fingerprint={}, budget_bytes=need)
    assert plan.head == sol.head and predict(costs, plan).peak_bytes == sol.prediction.peak_bytes


@pytest.mark.parametrize(
    "seed", [0, pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow), 4, 5]
)  # 1, 3: ~3 s each
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_head_per_option_matches_brute_force(seed: int) -> None:
    """``H`` differs between the calibration steps (NOTE [ The head's peak per option ]): a plan in
    one option alone has that option's, a mixed plan the largest. The solver's answer equals brute
    force over every plan, each predicted with its own ``H``, whichever option's step is higher."""
    rng = random.Random(500 + seed)
    costs = random_costs(6 if seed % 2 else 5, 500 + seed, segments=seed % 3 != 2)
    by_option = {"keep": rng.randint(0, 100), "recompute": rng.randint(0, 100)}
    costs = dataclasses.replace(costs, head_peak_bytes=max(by_option.values()), head_peak_bytes_by_option=by_option)
    if seed >= 4:
        h = {m: rng.randint(0, 120) for m in by_option}
        costs = dataclasses.replace(
            costs,
            head_options={
                "chunked": HeadCost(peak_bytes=max(h.values()), extra_s=rng.uniform(0.0, 0.5), peak_bytes_by_option=h)
            },
        )
    keep_all = Plan(
        policy="none", chain_path="", blocks=tuple(BlockDecision(name=n, option=Option.KEEP) for n in costs.names)
    )
    both = dataclasses.replace(costs, head_peak_bytes_by_option={})
    assert predict(costs, keep_all).peak_bytes <= predict(both, keep_all).peak_bytes
    check_budgets(costs, segments=costs.segments_allowed)


@pytest.mark.slow
def test_segments_six_blocks_with_margin() -> None:
    check_budgets(random_costs(6, 7, segments=True, margin=0.05), segments=True)


def test_non_binding_budget_keeps_everything() -> None:
    costs = random_costs(8, 3, segments=True)
    sol = solve(costs, 10**12)
    assert set(sol.options) == {"keep"} and sol.segments == ()
    assert sol.prediction.step_s == costs.base_step_s


def test_infeasible_budget_names_the_minimum_and_the_fix() -> None:
    costs = random_costs(8, 5, segments=False)
    need, _ = min_budget(costs, segments=False)
    with pytest.raises(BudgetInfeasibleError, match="Raise the budget, lower --batch-size") as err:
        solve(costs, need - 1, segments=False)
    assert err.value.min_budget_bytes == need
    solve(costs, need, segments=False)  # the minimum itself fits


def test_hundred_block_chain_plans_from_the_minimum_to_store_all() -> None:
    """A long chain (timing: benchmarks/solver_timing.py): at the store-all peak the answer is
    store-all, the one plan without extra time; a larger budget never gives a slower plan."""
    costs = random_costs(100, 11, segments=False)
    need, _ = min_budget(costs, segments=False)
    store_all = next(all_plans(100, False))
    hi = predict(costs, store_all).peak_with_margin_bytes
    sols = [solve(costs, budget, segments=False) for budget in (need, (need + hi) // 2, hi)]
    assert sols[-1].options == ("keep",) * 100 and sols[-1].prediction == predict(costs, store_all)
    assert sols[0].prediction.peak_with_margin_bytes <= need < hi
    assert [s.prediction.step_s for s in sols] == sorted((s.prediction.step_s for s in sols), reverse=True)


def test_hundred_block_sequential_chain_with_segments() -> None:
    """Identical blocks whose internals outweigh their input (timing: benchmarks/solver_timing.py):
    at half the store-all peak, segments pay off."""
    keep = OptionCost(retained_bytes=30, fwd_peak_bytes=35, bwd_peak_bytes=20, bwd_base_bytes=5, extra_s=0.0)
    rec = OptionCost(retained_bytes=4, fwd_peak_bytes=12, bwd_peak_bytes=50, bwd_base_bytes=5, extra_s=0.3)
    costs = ChainCosts(
        names=tuple(map(str, range(100))),
        options=tuple({"keep": keep, "recompute": rec} for _ in range(100)),
        start_bytes=100,
        pre_peak_bytes=100,
        head_peak_bytes=60,
        post_peak_bytes=200,
        base_step_s=1.0,
        segments_allowed=True,
    )
    hi = predict(costs, next(all_plans(100, False))).peak_with_margin_bytes
    sol = solve(costs, hi // 2)
    assert sol.segments and sol.prediction.peak_with_margin_bytes <= hi // 2
    assert solve(costs, hi // 2, segments=False).prediction.step_s > sol.prediction.step_s  # they pay off


# --- long chains: nested segments of any length (NOTE [ Solver ], search_limits) ----------------------


def bounded_plans(n: int, max_len: int):
    """Every plan whose segments are at most ``max_len`` blocks long, nested or not."""
    return all_plans(n, True, max_len)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_length_bound_searches_exactly_the_bounded_plans(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the work limit the solver searches nested segments of at most ``max_len`` blocks: with
    the bound forced to 3 on a 6-block chain, its answers equal brute force over exactly the plans
    whose segments are at most 3 blocks long (nested ones included)."""
    monkeypatch.setattr(solve_module, "search_limits", lambda n: (3, True))
    costs = random_costs(6, 500 + seed, segments=True)
    table = [(predict(costs, p).peak_with_margin_bytes, predict(costs, p).step_s) for p in bounded_plans(6, 3)]
    lo = min(peak for peak, _ in table)
    assert min_budget(costs)[0] == lo
    for budget in sorted({lo, *(peak for peak, _ in table[::97])}):
        sol = solve(costs, budget)
        assert sol.prediction.step_s == pytest.approx(min(t for peak, t in table if peak <= budget), abs=1e-9)
        assert all(t - s <= 3 for s, t in sol.segments)


def test_search_limits_exact_then_bounded() -> None:
    """Chains within the work limit search every plan; longer ones keep nesting, with segments up to
    the longest length within the limit, never shorter than 8 blocks or sqrt(N) blocks
    (checkpoint_sequential's segments)."""
    assert search_limits(24) == (24, True) and search_limits(32) == (32, True)
    for n in (40, 64, 100):
        max_len, nested = search_limits(n)
        assert nested and max(8, n**0.5) <= max_len < n
        assert search_work(n, max_len) <= SEARCH_WORK_LIMIT < search_work(n, max_len + 1)
    assert search_limits(400) == (20, True) and search_work(400, 20) > SEARCH_WORK_LIMIT


def reference_plans(n: int) -> dict[str, Plan]:
    """Plans built by hand, independent of the solver: `all`, every second block, sqrt(N)
    segments of recomputed blocks, and sqrt(N) segments nested in pairs."""

    def plan(actions: list[Option], segs: list[tuple[int, int]]) -> Plan:
        return Plan(
            policy="ref",
            chain_path="",
            blocks=tuple(BlockDecision(name=str(i), option=a) for i, a in enumerate(actions)),
            segments=tuple(Segment(start=s, stop=t) for s, t in segs),
        )

    k = round(n**0.5)
    flat = [(s, min(n, s + k)) for s in range(0, n, k)]
    pairs = [(s, min(n, s + 2 * k)) for s in range(0, n, 2 * k)]
    rec = [Option.RECOMPUTE] * n
    return {
        "all": plan(rec, []),
        "every:2": plan([Option.RECOMPUTE if i % 2 == 0 else Option.KEEP for i in range(n)], []),
        "sqrt": plan(rec, flat),
        "sqrt kept inside": plan([Option.KEEP] * n, flat),
        "sqrt nested in pairs": plan(rec, flat + [p for p in pairs if p not in flat]),
    }


@pytest.mark.slow  # 3 and 7 s; the fast tier searches 100-block chains with the length bound (below)
@pytest.mark.parametrize("n", [24, 32])
def test_long_chain_at_least_as_good_as_hand_built_and_non_nested_plans(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 and 32 blocks (searched exactly): at the predicted peak of each hand-built plan the solver's
    plan is as fast or faster, and its minimum is at or below each; the non-nested search of
    segments up to 8 blocks (what chains over 16 blocks had before) never does better."""
    costs = random_costs(n, 700 + n, segments=True)
    need, _ = min_budget(costs)
    for name, ref in reference_plans(n).items():
        p = predict(costs, ref)
        assert need <= p.peak_with_margin_bytes, name
        sol = solve(costs, p.peak_with_margin_bytes)
        assert sol.prediction.step_s <= p.step_s + 1e-9, name
    exact = {b: solve(costs, b).prediction.step_s for b in (need, need + 20, need + 60)}
    monkeypatch.setattr(solve_module, "search_limits", lambda n: (8, False))
    need_flat, _ = min_budget(costs)
    assert need <= need_flat
    for b, t in exact.items():
        if b >= need_flat:
            assert t <= solve(costs, b).prediction.step_s + 1e-9


def test_nested_segments_pay_on_a_24_block_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded 24-block chain where the exact search finds a lower minimum than segments of at
    most 8 blocks without nesting; its plan's peak, walked again by the cost model, is what the
    solver said."""
    costs = random_costs(24, 11, segments=True)
    need, sol = min_budget(costs)
    plan = plan_from_solution(sol, costs, chain_path="", fingerprint={}, budget_bytes=need)
    assert predict(costs, plan).peak_with_margin_bytes == need
    monkeypatch.setattr(solve_module, "search_limits", lambda n: (8, False))
    need_flat, _ = min_budget(costs)
    assert need < need_flat, (need, need_flat)
    nested = [(s, t) for s, t in sol.segments if any(a <= s and t <= b and (a, b) != (s, t) for a, b in sol.segments)]
    assert nested or any(t - s > 8 for s, t in sol.segments), sol.segments
