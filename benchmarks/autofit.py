"""Auto-fit against an exhaustive measured grid and against halving on out-of-memory.

For each model, global batch and budget: every (micro-batch, checkpoint policy) in the grid is run
for real (one window of the global batch with exact accumulation: measured peak with the
live-tensor tracker, time as the median of timed windows), and the best grid throughput among
those whose peak fits the budget is compared with `memfit fit`'s choice (measured the same way).
Besides the policies, the grid has at every micro-batch and budget the planner's own plan for
that micro-batch (`memfit plan --batch-size b --budget B`: one profile per micro-batch, solved per
budget; it does not know about accumulation, so it can exceed the budget once gradients
accumulate, and then it does not count). The anchor is accelerate's `find_executable_batch_size`-style halving: start with the whole batch
as one micro-batch and halve it until a step fits (no checkpointing).

    .venv/bin/python benchmarks/autofit.py [--models demo hf:gpt2] [--global-batches 16 32] [--fractions 0.3 0.5 0.75] [--rounds 3]

Writes benchmarks/results/autofit.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from memfit import StepSpec
from memfit.accumulate import Accumulator
from memfit.apply import plan_applied, remove_plan
from memfit.capture.step import make_optimizer
from memfit.capture.tracker import MemoryTracker
from memfit.errors import BudgetInfeasibleError, MemfitError, UnsupportedModelError
from memfit.fitting import autofit
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.options import BASE_OPTIONS
from memfit.profiling.blocks import profile
from memfit.units import format_bytes
from memfit.workload import iter_tensors

RESULTS = Path(__file__).parent / "results"
POLICIES = ["none", "all", "sqrt", "every:2"]


def run_window(wl: Any, plan: Any, micro: int, batch: Any, rounds: int) -> tuple[int, float]:
    """Measured peak (bytes) and median window seconds of one global batch at this micro-batch."""
    model = wl.model
    remove_plan(model)
    model.zero_grad(set_to_none=True)
    opt = make_optimizer(model, "adamw", lr=1e-6)
    with plan_applied(model, plan):
        acc = Accumulator(model, opt, micro_batch=micro)
        acc.step(batch, wl.loss_fn, count_fn=wl.count_fn)
        tracker = MemoryTracker(device="cpu").track(model, opt, iter_tensors(batch))
        with tracker:
            acc.step(batch, wl.loss_fn, count_fn=wl.count_fn)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            acc.step(batch, wl.loss_fn, count_fn=wl.count_fn)
            times.append(time.perf_counter() - t0)
    opt.zero_grad(set_to_none=True)
    return tracker.peak_bytes, statistics.median(times)


def bench(spec: str, global_batch: int, fractions: list[float], rounds: int, console: Console) -> dict[str, Any]:
    wl = load_workload(spec)
    torch.manual_seed(0)
    batch = wl.make_batch(global_batch)
    micro_batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, global_batch) if b <= global_batch})
    grid: dict[str, dict[str, Any]] = {}
    with console.status(f"{spec} G={global_batch}: grid") as status:
        for b in micro_batches:
            for pol in POLICIES:
                try:
                    plan = policy_plan(wl.model, pol)
                except UnsupportedModelError:
                    continue
                status.update(f"{spec} G={global_batch}: grid micro-batch {b}, {pol}")
                peak, window_s = run_window(wl, plan, b, batch, rounds)
                grid[f"{b}/{pol}"] = {
                    "micro_batch": b,
                    "policy": pol,
                    "peak_bytes": peak,
                    "window_s": window_s,
                    "samples_per_s": global_batch / window_s,
                }
    need = grid[f"{global_batch}/none"]["peak_bytes"]
    budgets = [int(need * f) for f in fractions]
    planned: dict[int, dict[str, dict[str, Any]]] = {budget: {} for budget in budgets}
    with console.status(f"{spec} G={global_batch}: planner grid") as status:
        for b in micro_batches:
            status.update(f"{spec} G={global_batch}: profiling micro-batch {b}")
            stats = profile(wl, step=StepSpec(batch_size=b, repeats=2), options=BASE_OPTIONS)
            for budget in budgets:
                try:
                    plan = plan_for_budget(wl, budget, stats=stats).plan
                except BudgetInfeasibleError:
                    continue
                status.update(f"{spec} G={global_batch}: micro-batch {b}, memfit plan for {format_bytes(budget)}")
                peak, window_s = run_window(wl, plan.with_(fingerprint={}), b, batch, rounds)
                planned[budget][f"{b}/memfit"] = {
                    "micro_batch": b,
                    "policy": "memfit plan"
                    + (" +chunked head" if plan.head else "")
                    + (" +fused act" if plan.activations else ""),
                    "peak_bytes": peak,
                    "window_s": window_s,
                    "samples_per_s": global_batch / window_s,
                }
    rows = []
    for budget in budgets:
        fitting = [g for g in [*grid.values(), *planned[budget].values()] if g["peak_bytes"] <= budget]
        best = max(fitting, key=lambda g: g["samples_per_s"], default=None)
        # accelerate-style halving: whole batch, then halve until a plain step fits
        b = global_batch
        halving = None
        while b >= 1:
            g = grid.get(f"{b}/none")
            if g and g["peak_bytes"] <= budget:
                halving = g
                break
            b //= 2
        with console.status(f"{spec} G={global_batch}: memfit fit at {format_bytes(budget)}") as status:
            t0 = time.perf_counter()
            try:
                fit = autofit(
                    wl,
                    budget,
                    global_batch,
                    step=StepSpec(repeats=2),
                    options=BASE_OPTIONS,
                    progress=lambda s: status.update(f"{spec} G={global_batch} fit: {s}"),
                )
                fit_s = time.perf_counter() - t0
                peak, window_s = run_window(
                    wl,
                    fit.plan.with_(fingerprint={**fit.plan.fingerprint, "batch": None}),
                    fit.micro_batch,
                    batch,
                    rounds,
                )
                chosen = {
                    "micro_batch": fit.micro_batch,
                    "accumulation_steps": fit.accumulation_steps,
                    "recomputed_blocks": len(fit.plan.recomputed),
                    "segments": [(s.start, s.stop) for s in fit.plan.segments],
                    "head": fit.plan.head,
                    "activations": fit.plan.activations,
                    "predicted_peak_bytes": fit.predicted_peak_bytes,
                    "predicted_samples_per_s": fit.predicted_samples_per_s,
                    "peak_bytes": peak,
                    "samples_per_s": global_batch / window_s,
                    "within_budget": peak <= budget,
                    "fit_seconds": fit_s,
                }
            except (BudgetInfeasibleError, MemfitError) as err:
                chosen = {"error": str(err)}
        rows.append(
            {
                "budget_bytes": budget,
                "budget_fraction": budget / need,
                "best_grid": best,
                "halving": halving,
                "memfit": chosen,
                "memfit_vs_best": (chosen.get("samples_per_s", 0) / best["samples_per_s"])
                if best and "samples_per_s" in chosen
                else None,
                "planner_grid": planned[budget],
            }
        )
    return {"model": spec, "global_batch": global_batch, "plain_peak_bytes": need, "grid": grid, "budgets": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo", "hf:gpt2"])
    ap.add_argument("--global-batches", nargs="+", type=int, default=[16, 32])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.3, 0.5, 0.75])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "autofit.json"))
    args = ap.parse_args()
    console = Console()
    report = {
        "benchmark": "autofit",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "command": "python benchmarks/autofit.py --models "
        + " ".join(args.models)
        + " --global-batches "
        + " ".join(map(str, args.global_batches)),
        "runs": [bench(m, g, args.fractions, args.rounds, console) for m in args.models for g in args.global_batches],
    }
    t = Table(title="memfit fit vs the best measured grid point within the budget", title_justify="left")
    for c in (
        "model",
        "G",
        "budget",
        "best grid (b/policy)",
        "grid samples/s",
        "memfit choice",
        "memfit samples/s",
        "memfit/best",
        "fits",
        "halving (b)",
        "halving samples/s",
    ):
        t.add_column(c)
    violations = 0
    for r in report["runs"]:
        for row in r["budgets"]:
            best, m, h = row["best_grid"], row["memfit"], row["halving"]
            violations += int("within_budget" in m and not m["within_budget"])
            t.add_row(
                r["model"],
                str(r["global_batch"]),
                format_bytes(row["budget_bytes"]),
                f"{best['micro_batch']}/{best['policy']}" if best else "none fits",
                f"{best['samples_per_s']:.1f}" if best else "-",
                f"{m['micro_batch']}x{m['accumulation_steps']}, {m['recomputed_blocks']} R"
                if "micro_batch" in m
                else m.get("error", "")[:40],
                f"{m['samples_per_s']:.1f}" if "samples_per_s" in m else "-",
                f"{row['memfit_vs_best']:.0%}" if row["memfit_vs_best"] else "-",
                str(m.get("within_budget", "-")),
                str(h["micro_batch"]) if h else "OOM",
                f"{h['samples_per_s']:.1f}" if h else "-",
            )
    report["budget_violations"] = violations
    console.print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"budget violations: {violations}; wrote {out}")


if __name__ == "__main__":
    main()
