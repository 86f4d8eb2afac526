"""Block-only vs selective vs full frontiers: what op-level and head options buy at each budget.

For each model (default `hf:gpt2` and `hf:llama`, 12 layers, d=256, B=4, T=256): two profiles with
every option calibrated (keep, recompute, the selective presets and MILP variants, offload on a
GPU): one of the model as it is, one as memfit runs it (fused activations where the model has
activation modules with a fused kernel, `memfit.apply.activations`; the chunked head of
`memfit.apply.head`). Then, for budgets from the minimum to store-all, three plans:

- *block-only*: each block kept or recomputed (and segments where the container allows them);
- *selective*: each block in any calibrated option, the model's own head and activations;
- *memfit*: the full planner, every block option, the head options and fused activations.

All plans are then measured side by side in one process (`memfit.profiling.side_by_side.measure_setups`:
live-tensor peak of a whole step, medians of interleaved step times), with the anchors `none`
(the reference), `all` (every block recomputed), both with the chunked head, `none` with fused
activations, and each selective preset on every block. Store-all, its activations and the peak of
`all` are the unmodified model's. Two
budgets are the issue's checks: half of store-all activations (the budget is the store-all peak
minus half its activation bytes), and the measured peak of policy `all`. At the latter, plans are
made with a zero safety margin (the planner's default 2 % margin would refuse every plan, `all`
itself included, at exactly its own peak), and a plan counts only if its *measured* peak fits.

    .venv/bin/python benchmarks/selective_frontier.py [--models hf:gpt2 hf:llama] [--budgets 8]
        [--repeats 5] [--device cpu] [--out benchmarks/results/selective_frontier.json]

Writes the JSON and prints one table per model. Times are ratios to `none` (the unmodified model)
from the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from memfit import StepSpec
from memfit.errors import BudgetInfeasibleError, MemfitError
from memfit.models.registry import load_workload
from memfit.plan import Offload, Option, Selective, policy_plan
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.solve import min_budget, plan_from_solution, solve
from memfit.plan.types import SELECTIVE_PRESETS, Plan
from memfit.profiling.blocks import profile
from memfit.profiling.side_by_side import measure_setups, plan_setup
from memfit.units import format_bytes

RESULTS = Path(__file__).parent / "results"
CODES = {Option.KEEP: ".", Option.RECOMPUTE: "R", Option.SELECTIVE: "S", Option.OFFLOAD: "O"}


def describe(plan: Plan) -> str:
    """``..SSRR`` (keep, selective, recompute, offload), segments, ``+chunked head`` (chunked loss)
    and ``+fused act`` (fused activations)."""
    s = "".join(CODES[b.option] for b in plan.blocks)
    s += " seg " + ",".join(f"[{g.start},{g.stop})" for g in plan.segments) if plan.segments else ""
    return s + (f" +{plan.head} head" if plan.head else "") + (f" +{plan.activations} act" if plan.activations else "")


def key(plan: Plan) -> tuple:
    return (
        tuple((b.option.value, b.policy) for b in plan.blocks),
        tuple((s.start, s.stop) for s in plan.segments),
        plan.head,
        plan.activations,
    )


def bench_model(spec: str, *, n_budgets: int, repeats: int, device: str | None, console: Console) -> dict[str, Any]:
    wl = load_workload(spec)
    if device:
        wl.model.to(device)
    t0 = time.perf_counter()
    with console.status(f"{spec}: profiling") as status:
        # The model as users run it (its own activations): the baselines and the budgets.
        plain = profile(
            wl,
            step=StepSpec(repeats=3),
            heads=False,
            activations=False,
            progress=lambda s: status.update(f"{spec}: profile (model as is): {s}"),
        )
        # memfit's own: activations fused where the model has such modules, head options calibrated.
        stats = profile(wl, step=StepSpec(repeats=3), progress=lambda s: status.update(f"{spec}: profile: {s}"))
    profile_s = time.perf_counter() - t0
    costs = ChainCosts.from_stats(stats)
    plain_costs = ChainCosts.from_stats(plain)
    block_costs = plain_costs.restricted(block_only=True, heads=False)
    sel_costs = plain_costs
    base_s = plain_costs.base_step_s
    store_all = plain.peak_bytes
    acts = plain.activations_peak_bytes
    all_peak = plain.measured_peak_bytes_by_option["recompute"]
    lo = min(min_budget(c)[0] for c in (costs, block_costs, sel_costs))
    hi = int(store_all * (1 + costs.margin)) + 1
    checks = {"half_activations": store_all - acts // 2, "all_peak": all_peak}
    grid = [int(lo + (hi - lo) * k / (n_budgets - 1)) for k in range(n_budgets)] if n_budgets > 1 else [hi]
    budgets = sorted({*grid, *checks.values()})

    plans: dict[str, Plan] = {}
    rows: list[dict[str, Any]] = []
    for b in budgets:
        row: dict[str, Any] = {"budget_bytes": b, "checks": [k for k, v in checks.items() if v == b]}
        exact = "all_peak" in row["checks"]
        row["margin"] = 0.0 if exact else costs.margin
        for kind, c in zip(KINDS, (block_costs, sel_costs, costs), strict=True):
            if exact:
                c = replace(c, margin=0.0)
            try:
                sol = solve(c, b)
            except BudgetInfeasibleError as err:
                row[kind] = {"feasible": False, "min_budget_bytes": err.min_budget_bytes}
                continue
            plan = plan_from_solution(
                sol, c, chain_path=stats.chain_path, fingerprint=stats.fingerprint, budget_bytes=b
            )
            name = next((n for n, p in plans.items() if key(p) == key(plan)), f"plan{len(plans)}")
            plans.setdefault(name, plan)
            row[kind] = {
                "feasible": True,
                "setup": name,
                "plan": describe(plan),
                "policies": sorted({d.policy for d in plan.blocks if d.policy}),
                "predicted_peak_bytes": sol.prediction.peak_bytes,
                "predicted_peak_event": sol.prediction.peak_event,
                "predicted_time_ratio": sol.prediction.step_s / base_s,
            }
        rows.append(row)

    anchors: dict[str, Plan] = {"none": policy_plan(wl.model, "none"), "all": policy_plan(wl.model, "all")}
    for h in stats.head_options:
        anchors[f"none +{h} head"] = anchors["none"].with_(head=h)
        anchors[f"all +{h} head"] = anchors["all"].with_(head=h)
    if stats.activations:
        anchors[f"none +{stats.activations} act"] = anchors["none"].with_(activations=stats.activations)
    for preset in SELECTIVE_PRESETS:
        anchors[f"selective:{preset}"] = policy_plan(wl.model, Selective(preset=preset))
    if "offload" in stats.blocks[0].options:
        anchors["offload"] = policy_plan(wl.model, Offload())
    setups = {n: plan_setup(p.with_(fingerprint={})) for n, p in anchors.items()}
    setups.update({n: plan_setup(p.with_(fingerprint={})) for n, p in plans.items()})
    with console.status(f"{spec}: measuring {len(setups)} setups") as status:
        measured = measure_setups(wl, setups, repeats=repeats, progress=lambda s: status.update(f"{spec}: {s}"))
    by = {m.name: m for m in measured}
    for row in rows:
        for kind in KINDS:
            r = row.get(kind)
            if r and r.get("feasible"):
                m = by[r["setup"]]
                r.update(
                    measured_peak_bytes=m.peak_bytes, time_ratio=m.time_ratio, fits=m.peak_bytes <= row["budget_bytes"]
                )
    anchor_rows = {
        n: {
            "peak_bytes": by[n].peak_bytes,
            "time_ratio": by[n].time_ratio,
            "step_s": by[n].step_s,
            **_predict(costs if p.activations else plain_costs, p, base_s),
        }
        for n, p in anchors.items()
    }

    all_plan = describe(anchors["all"])
    result = {
        "model": spec,
        "batch_size": stats.batch_size,
        "device": stats.device,
        "dtype": stats.dtype,
        "n_blocks": len(stats.blocks),
        "options": list(stats.blocks[0].options),
        "calibration": stats.calibration.to_dict(),
        "activations": stats.activations,
        "head_options": {h: o.to_dict() for h, o in stats.head_options.items()},
        "head_peak_bytes": stats.head_peak_bytes,
        "time_scales": costs.time_scales.to_dict() if costs.time_scales else {},
        "profile_s": profile_s,
        "store_all_peak_bytes": store_all,
        "store_all_activations_bytes": acts,
        "min_budget_bytes": lo,
        "all_plan": all_plan,
        "anchors": anchor_rows,
        "calibration_steps": {
            m: {"step_s": t, "peak_bytes": stats.measured_peak_bytes_by_option.get(m)}
            for m, t in stats.step_s_by_option.items()
        },
        "calibration_steps_model_as_is": {
            m: {"step_s": t, "peak_bytes": plain.measured_peak_bytes_by_option.get(m)}
            for m, t in plain.step_s_by_option.items()
        },
        "frontier": rows,
        "setup_samples_s": {m.name: list(m.step_s_samples) for m in measured},
        "policies": {n: [d.to_dict() for d in p.blocks] for n, p in plans.items()},
    }
    result["done_when"] = check_done_when(result)
    return result


KINDS = ("block_only", "selective", "memfit")
"""Plans per budget: block-level options only; every block option (selective, offload) with the
model's own head and activations; memfit's full planner (every block option, the head options and
fused activations)."""


def check_done_when(m: dict[str, Any]) -> dict[str, Any]:
    """The issue's two checks from a model's stored rows (memfit's full planner; files from
    before head options have the selective plans only).

    - half of store-all activations: memfit's plan's measured step within 5 % of `none`, and
      its measured peak within the budget;
    - the measured peak of `all` (zero margin): memfit's plan is *another* plan than `all`,
      its measured peak fits, and its measured step is shorter than `all`'s. When the only plan
      that fits is `all` itself, memfit is `all` (no faster), whatever the timing noise says.
    """
    best = "memfit" if "memfit" in m["frontier"][0] else "selective"

    def at(check: str) -> dict[str, Any]:
        row = next(r for r in m["frontier"] if check in r["checks"])
        return {"budget_bytes": row["budget_bytes"], **{k: row[k] for k in KINDS if k in row}}

    half, allp = at("half_activations"), at("all_peak")
    hs, asel = half[best], allp[best]
    all_ratio = m["anchors"]["all"]["time_ratio"]
    same_as_all = bool(asel.get("feasible") and asel["plan"] == m.get("all_plan", "R" * m["n_blocks"]))
    return {
        "half_activations": {
            **half,
            "planner": best,
            "memfit_within_5_percent_of_none": bool(hs.get("feasible") and hs["fits"] and hs["time_ratio"] <= 1.05),
        },
        "all_peak": {
            **allp,
            "planner": best,
            "all_time_ratio": all_ratio,
            "memfit_is_the_all_plan": same_as_all,
            "memfit_faster_than_all": bool(
                asel.get("feasible") and asel["fits"] and not same_as_all and asel["time_ratio"] < all_ratio
            ),
        },
    }


def _predict(costs: ChainCosts, plan: Plan, base_s: float) -> dict[str, Any]:
    try:
        p = predict(costs, plan)
    except MemfitError:  # an anchor the profile did not calibrate (a preset it left out)
        return {}
    return {
        "predicted_peak_bytes": p.peak_bytes,
        "predicted_peak_event": p.peak_event,
        "predicted_time_ratio": p.step_s / base_s,
    }


def print_model(m: dict[str, Any], console: Console) -> None:
    t = Table(
        title=f"{m['model']} ({m['n_blocks']} blocks, batch {m['batch_size']}, {m['device']}): store-all {format_bytes(m['store_all_peak_bytes'])}, "
        f"activations {format_bytes(m['store_all_activations_bytes'])}",
        title_justify="left",
    )
    for c in (
        "budget",
        "block-only plan",
        "peak",
        "time",
        "selective plan",
        "peak",
        "time",
        "memfit plan",
        "peak",
        "time",
        "check",
    ):
        t.add_column(c, justify="left" if "plan" in c or c == "check" else "right")

    def cells(r: dict[str, Any] | None) -> tuple[str, str, str]:
        if not r or not r.get("feasible"):
            return ("infeasible", "", "")
        fit = "" if r["fits"] else " OVER"
        return (r["plan"], format_bytes(r["measured_peak_bytes"]) + fit, f"{r['time_ratio']:.3f}x")

    for r in m["frontier"]:
        t.add_row(
            format_bytes(r["budget_bytes"]),
            *cells(r.get("block_only")),
            *cells(r.get("selective")),
            *cells(r.get("memfit")),
            ",".join(r["checks"]),
        )
    for n, a in m["anchors"].items():
        t.add_row(
            "", f"anchor {n}", format_bytes(a["peak_bytes"]), f"{a['time_ratio']:.3f}x", "", "", "", "", "", "", ""
        )
    console.print(t)
    d = m["done_when"]
    h, a = d["half_activations"], d["all_peak"]
    console.print(
        f"  half of store-all activations ({format_bytes(h['budget_bytes'])}): {h['planner']} "
        f"{h[h['planner']].get('time_ratio', float('nan')):.3f}x of none -> within 5 %: {h['memfit_within_5_percent_of_none']}; "
        f"at the peak of 'all' ({format_bytes(a['budget_bytes'])}): {a['planner']} {a[a['planner']].get('time_ratio', float('nan')):.3f}x vs all "
        f"{a['all_time_ratio']:.3f}x"
        + (" (the same plan as 'all')" if a.get("memfit_is_the_all_plan") else "")
        + f" -> faster: {a['memfit_faster_than_all']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["hf:gpt2", "hf:llama"])
    ap.add_argument(
        "--budgets", type=int, default=8, help="budgets from the minimum to store-all (plus the two checks)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds (medians)")
    ap.add_argument("--device", default=None, help="run on this device (default: where the model is, the CPU)")
    ap.add_argument("--out", default=str(RESULTS / "selective_frontier.json"))
    ap.add_argument(
        "--recheck",
        metavar="JSON",
        help="recompute the checks of a stored result file in place, print it, measure nothing",
    )
    args = ap.parse_args()
    console = Console()
    if args.recheck:
        path = Path(args.recheck)
        report = json.loads(path.read_text())
        for m in report["models"]:
            m.setdefault("all_plan", "R" * m["n_blocks"])
            m["done_when"] = check_done_when(m)
            print_model(m, console)
        path.write_text(json.dumps(report, indent=2) + "\n")
        return
    report = {
        "benchmark": "selective_frontier",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        + (torch.cuda.get_device_name() if args.device and args.device.startswith("cuda") else "CPU"),
        "command": f"python benchmarks/selective_frontier.py --models {' '.join(args.models)} --budgets {args.budgets} --repeats {args.repeats}"
        + (f" --device {args.device}" if args.device else ""),
        "models": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.models:
        m = bench_model(spec, n_budgets=args.budgets, repeats=args.repeats, device=args.device, console=console)
        report["models"].append(m)
        print_model(m, console)
        out.write_text(json.dumps(report, indent=2) + "\n")  # after each model: a partial run keeps its results
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
