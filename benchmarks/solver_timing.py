"""Solver timing: how long the planner's exact solver takes on long chains, against its targets.

The timing targets that used to be wall-clock asserts in unit tests (tests/test_solver.py: a
100-block chain solved in under a second, with and without segments; tests/test_offload.py: the
CPU copy bandwidth the offload cost model reads is a memcpy's, over 100 MB/s) are measured here,
where a busy machine makes a slow row instead of a failing test.

Chains are synthetic cost models (:class:`memfit.plan.costmodel.ChainCosts`): ``random`` has two
options per block (keep, recompute) with seeded sizes and times and no segments; ``uniform`` has
identical blocks on a chain that allows segments (the solver's largest search). Each chain is
solved at three budgets: the minimum it can run in, halfway, and the store-all peak. Every time
is the median of ``--repeats`` solves. ``search`` says what the solver searched (every plan up to
the work limit, nested segments of a bounded length past it; NOTE [ Solver ]). Chains that allow
segments are also solved with the search chains over 16 blocks had before (non-nested segments of
at most 8 blocks): ``flat_*`` columns, to show what nesting and longer segments gain.

Run: ``python benchmarks/solver_timing.py [--repeats 5] [--blocks 24 32 50 100]``. Writes
``benchmarks/results/solver_timing.json`` and prints a table; exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import memfit.plan.solve as solve_module
from memfit.apply.offload import measure_bandwidth
from memfit.plan.costmodel import ChainCosts, OptionCost, predict
from memfit.plan.solve import min_budget, search_description, solve
from memfit.plan.types import BlockDecision, Option, Plan

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "solver_timing.json"
TARGET_BLOCKS = 100
TARGET_SOLVE_S = 1.0  # per solve, at every budget, with and without segments
TARGET_COPY_BYTES_PER_S = 1e8  # a CPU memcpy, both ways


def random_chain(n_blocks: int, seed: int) -> ChainCosts:
    """Keep or recompute per block, sizes and times drawn from a seeded generator; no segments."""
    rng = random.Random(seed)
    options = []
    for _ in range(n_blocks):
        out_bytes = rng.randint(1, 20)
        keep = OptionCost(
            retained_bytes=out_bytes + rng.randint(0, 60),
            fwd_peak_bytes=out_bytes + rng.randint(0, 80),
            bwd_peak_bytes=rng.randint(0, 50),
            bwd_base_bytes=rng.randint(-10, 40),
            extra_s=0.0,
        )
        recompute = OptionCost(
            retained_bytes=out_bytes,
            fwd_peak_bytes=out_bytes + rng.randint(0, 40),
            bwd_peak_bytes=rng.randint(20, 120),
            bwd_base_bytes=keep.bwd_base_bytes + rng.randint(-3, 3),
            extra_s=rng.uniform(0.1, 1.0),
        )
        options.append({"keep": keep, "recompute": recompute})
    return ChainCosts(
        names=tuple(map(str, range(n_blocks))),
        options=tuple(options),
        start_bytes=rng.randint(0, 100),
        pre_peak_bytes=rng.randint(0, 100),
        head_peak_bytes=rng.randint(0, 100),
        post_peak_bytes=rng.randint(0, 150),
        base_step_s=1.0,
        segments_allowed=False,
    )


def uniform_chain(n_blocks: int) -> ChainCosts:
    """Identical blocks whose internals outweigh their input, on a chain that allows segments."""
    keep = OptionCost(retained_bytes=30, fwd_peak_bytes=35, bwd_peak_bytes=20, bwd_base_bytes=5, extra_s=0.0)
    recompute = OptionCost(retained_bytes=4, fwd_peak_bytes=12, bwd_peak_bytes=50, bwd_base_bytes=5, extra_s=0.3)
    return ChainCosts(
        names=tuple(map(str, range(n_blocks))),
        options=tuple({"keep": keep, "recompute": recompute} for _ in range(n_blocks)),
        start_bytes=100,
        pre_peak_bytes=100,
        head_peak_bytes=60,
        post_peak_bytes=200,
        base_step_s=1.0,
        segments_allowed=True,
    )


def store_all_peak_bytes(costs: ChainCosts) -> int:
    plan = Plan(
        policy="none",
        chain_path="",
        blocks=tuple(BlockDecision(name=name, option=Option.KEEP) for name in costs.names),
    )
    return predict(costs, plan).peak_with_margin_bytes


@contextlib.contextmanager
def flat_search() -> Iterator[None]:
    """The search chains over 16 blocks had before: segments of at most 8 blocks, not nested."""
    saved = solve_module.search_limits
    solve_module.search_limits = lambda n_blocks: (min(8, n_blocks), False)
    try:
        yield
    finally:
        solve_module.search_limits = saved


def time_solves(costs: ChainCosts, repeats: int) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    need, _ = min_budget(costs)
    min_budget_s = time.perf_counter() - t0
    top = store_all_peak_bytes(costs)
    flat_need = None
    if costs.segments_allowed:
        with flat_search():
            flat_need, _ = min_budget(costs)
    rows = []
    for label, budget in (("minimum", need), ("halfway", (need + top) // 2), ("store-all", top)):
        times_s, cpu_s = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            sol = solve(costs, budget)
            times_s.append(time.perf_counter() - t0)
            cpu_s.append(time.process_time() - c0)
        row = {
            "budget": label,
            "budget_bytes": budget,
            "solve_s": statistics.median(times_s),
            "solve_cpu_s": statistics.median(cpu_s),
            "min_budget_s": min_budget_s,
            "search": search_description(costs),
            "recomputed_blocks": sum(o != "keep" for o in sol.options),
            "segments": len(sol.segments),
            "nested_segments": sum(
                any(a <= s and t <= b and (a, b) != (s, t) for a, b in sol.segments) for s, t in sol.segments
            ),
            "predicted_extra_s": sol.prediction.step_s - costs.base_step_s,
        }
        if flat_need is not None:
            row["min_budget_bytes"] = need
            row["flat_min_budget_bytes"] = flat_need
            if budget >= flat_need:
                with flat_search():
                    row["flat_predicted_extra_s"] = solve(costs, budget).prediction.step_s - costs.base_step_s
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="solves per budget (median)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[24, 32, 50, 100], help="chain lengths")
    args = ap.parse_args()
    torch.set_num_threads(1)

    rows: list[dict[str, Any]] = []
    for n_blocks in args.blocks:
        chains = (
            ("random", random_chain(n_blocks, seed=11)),
            ("random+segments", dataclasses.replace(random_chain(n_blocks, seed=11), segments_allowed=True)),
            ("uniform", uniform_chain(n_blocks)),
        )
        for chain, costs in chains:
            for row in time_solves(costs, args.repeats):
                rows.append({"chain": chain, "blocks": n_blocks, "segments_allowed": costs.segments_allowed, **row})
    d2h, h2d = measure_bandwidth("cpu", nbytes=8 * 2**20, repeats=args.repeats)

    targeted = [r for r in rows if r["blocks"] == TARGET_BLOCKS]
    targets = {
        # CPU seconds: on a shared machine the wall clock counts other processes' turns too
        f"solve of a {TARGET_BLOCKS}-block chain < {TARGET_SOLVE_S} s (CPU)": bool(targeted)
        and all(r["solve_cpu_s"] < TARGET_SOLVE_S for r in targeted),
        f"CPU copy bandwidth > {TARGET_COPY_BYTES_PER_S:.0e} B/s both ways": min(d2h, h2d) > TARGET_COPY_BYTES_PER_S,
    }
    print(
        f"{'chain':16} {'blocks':>6} {'budget':>10} {'solve s':>9} {'cpu s':>7} {'recomputed':>10} {'segments':>8} {'nested':>6} {'extra s':>8} {'flat extra s':>12}"
    )
    for r in rows:
        flat = r.get("flat_predicted_extra_s")
        print(
            f"{r['chain']:16} {r['blocks']:6d} {r['budget']:>10} {r['solve_s']:9.4f} {r['solve_cpu_s']:7.3f} {r['recomputed_blocks']:10d} {r['segments']:8d} "
            f"{r['nested_segments']:6d} {r['predicted_extra_s']:8.3f} {'' if flat is None else f'{flat:.3f}':>12}"
            + (
                f"  minimum {r['min_budget_bytes']} (flat {r['flat_min_budget_bytes']})"
                if "flat_min_budget_bytes" in r and r["budget"] == "minimum"
                else ""
            )
        )
    print(f"CPU copy bandwidth: device->host {d2h / 1e9:.2f} GB/s, host->device {h2d / 1e9:.2f} GB/s")
    for name, ok in targets.items():
        print(f"{'ok  ' if ok else 'MISS'} {name}")

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "repeats": args.repeats,
        "rows": rows,
        "cpu_copy_bytes_per_s": {"device_to_host": d2h, "host_to_device": h2d},
        "targets": targets,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
