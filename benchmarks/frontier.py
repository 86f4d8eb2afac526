"""Memory/time frontier: memfit's plans at budgets from the minimum to store-all, against anchors.

For each model: profile once, plan for N budgets evenly spaced between the smallest feasible
budget and the no-checkpointing peak, then measure every plan and every anchor side by side in one
process (peaks with the live-tensor tracker; times as medians of interleaved rounds, as ratios to
no checkpointing measured in the same rounds). Anchors: HF `gradient_checkpointing_enable()`
(HF models), sqrt(N) segments (nn.Sequential chains), `every:K` for K in 1..4, and torch's
selective policy saving matmul and attention outputs (`create_selective_checkpoint_contexts`).

    .venv/bin/python benchmarks/frontier.py [--models demo hf:gpt2] [--budgets 8] [--repeats 5]

Writes benchmarks/results/frontier.json and benchmarks/results/frontier.png.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import types
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memfit.capture.chain import discover_chain
from memfit.compare import hf_gradient_checkpointing_setup, measure_setups, plan_setup
from memfit.errors import BudgetInfeasibleError, UnsupportedModelError
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.calibrate import MODES
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.solve import min_budget
from memfit.planning import plan_for_budget
from memfit.profiling import profile
from memfit.units import format_bytes

RESULTS = Path(__file__).parent / "results"
aten = torch.ops.aten
# The ops torch's documentation and torchtitan save in their selective policy: matmuls and attention.
SAVE_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
}


def _save_matmul_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def torch_selective_setup(model: nn.Module) -> Any:
    """Every block checkpointed with torch's selective policy (the anchor, without memfit)."""
    chain = discover_chain(model)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmul_and_attention)

    def fwd(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        orig = types.MethodType(type(self).forward, self)
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        return checkpoint(orig, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    for b in chain.blocks:
        b.forward = types.MethodType(fwd, b)

    def undo() -> None:
        for b in chain.blocks:
            del b.forward

    return undo


def bench(spec: str, n_budgets: int, repeats: int, console: Console) -> dict[str, Any]:
    wl = load_workload(spec)
    with console.status(f"{spec}: profiling") as status:
        # Block-level options, the planner's default (selective: benchmarks/selective_frontier.py).
        stats = profile(wl, repeats=repeats, modes=MODES, progress=lambda s: status.update(f"{spec}: profiling: {s}"))
    costs = ChainCosts.from_stats(stats)
    lo, _ = min_budget(costs)
    hi = predict(costs, policy_plan(wl.model, "none")).peak_with_margin_bytes
    budgets = [int(lo + (hi - lo) * k / (n_budgets - 1)) for k in range(n_budgets)]
    setups: dict[str, Any] = {"none": plan_setup(policy_plan(wl.model, "none"))}
    plans = {}
    for b in budgets:
        try:
            res = plan_for_budget(wl, b, stats=stats)
        except BudgetInfeasibleError:
            continue
        name = f"memfit@{format_bytes(b)}"
        plans[name] = {"budget_bytes": b, "predicted_peak_bytes": res.plan.predicted_peak_bytes, "predicted_step_s": res.plan.predicted_step_s, "plan": res.plan.to_dict()}
        setups[name] = plan_setup(res.plan)
    anchors = []
    if hasattr(wl.model, "gradient_checkpointing_enable"):
        setups["HF gradient_checkpointing_enable"] = hf_gradient_checkpointing_setup
        anchors.append("HF gradient_checkpointing_enable")
    for pol in ["sqrt", "every:1", "every:2", "every:3", "every:4"]:
        try:
            setups[f"policy {pol}"] = plan_setup(policy_plan(wl.model, pol))
            anchors.append(f"policy {pol}")
        except UnsupportedModelError:
            pass
    setups["torch selective (save matmul+attention)"] = torch_selective_setup
    anchors.append("torch selective (save matmul+attention)")
    with console.status(f"{spec}: measuring") as status:
        rows = measure_setups(wl, setups, batch_size=stats.batch_size, repeats=repeats, progress=lambda s: status.update(f"{spec}: {s}"))
    by = {r.name: r.to_dict() for r in rows}
    for name, info in plans.items():
        by[name].update(info)
        fitting = [a for a in anchors if by[a]["peak_bytes"] <= info["budget_bytes"]]
        best = min(fitting, key=lambda a: by[a]["time_ratio"], default=None)
        by[name]["best_anchor_within_budget"] = best
        by[name]["best_anchor_time_ratio"] = by[best]["time_ratio"] if best else None
        by[name]["within_budget"] = by[name]["peak_bytes"] <= info["budget_bytes"]
        by[name]["prediction_error"] = (by[name]["peak_bytes"] - info["predicted_peak_bytes"]) / by[name]["peak_bytes"]
    # Noise: spread of the no-checkpointing step times around their median.
    none_s = by["none"]["step_s_samples"]
    noise = (max(none_s) - min(none_s)) / by["none"]["step_s"] if none_s else None
    return {
        "model": spec,
        "batch_size": stats.batch_size,
        "min_budget_bytes": lo,
        "store_all_bytes": hi,
        "time_noise": noise,
        "results": by,
        "memfit": list(plans),
        "anchors": anchors,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.4), squeeze=False)
    markers = "osD^v<>p*h"
    for ax, m in zip(axes[0], models, strict=True):
        res = m["results"]
        xs = [res[n]["peak_bytes"] / 2**20 for n in m["memfit"]]
        ys = [res[n]["time_ratio"] for n in m["memfit"]]
        ax.plot(xs, ys, "-o", color="#3b7dd8", label="memfit (budgets min..store-all)", zorder=3)
        for k, a in enumerate(m["anchors"]):
            ax.scatter([res[a]["peak_bytes"] / 2**20], [res[a]["time_ratio"]], marker=markers[k % len(markers)], s=60, label=a, zorder=4)
        ax.scatter([res["none"]["peak_bytes"] / 2**20], [1.0], marker="x", color="k", s=60, label="no checkpointing", zorder=4)
        ax.set_xlabel("measured peak of a training step (MiB)")
        ax.set_ylabel("step time / no checkpointing")
        ax.set_title(f"{m['model']} (batch {m['batch_size']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo", "hf:gpt2"])
    ap.add_argument("--budgets", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "frontier.json"))
    args = ap.parse_args()
    console = Console()
    report = {
        "benchmark": "frontier",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "command": f"python benchmarks/frontier.py --models {' '.join(args.models)} --budgets {args.budgets} --repeats {args.repeats}",
        "models": [bench(m, args.budgets, args.repeats, console) for m in args.models],
    }
    for m in report["models"]:
        t = Table(title=f"{m['model']}: memfit vs anchors (time noise ±{(m['time_noise'] or 0) * 50:.0f}%)", title_justify="left")
        for c in ("setup", "budget", "measured peak", "predicted", "time vs none", "best anchor within budget"):
            t.add_column(c, justify="left" if c in ("setup", "best anchor within budget") else "right")
        res = m["results"]
        for n in ["none", *m["memfit"], *m["anchors"]]:
            r = res[n]
            t.add_row(
                n,
                format_bytes(r["budget_bytes"]) if "budget_bytes" in r else "",
                format_bytes(r["peak_bytes"]),
                format_bytes(r["predicted_peak_bytes"]) if "predicted_peak_bytes" in r else "",
                f"{r['time_ratio']:.2f}x",
                f"{r['best_anchor_within_budget']} {r['best_anchor_time_ratio']:.2f}x" if r.get("best_anchor_within_budget") else "",
            )
        console.print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
