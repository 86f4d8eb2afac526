"""`memfit demo`: the main job on the built-in GPT and corpus.

1. Measure one training step of the whole global batch without memfit (the memory it needs).
2. Auto-fit to a budget (default: half of that): micro-batch, accumulation steps and checkpoint
   plan, predicted and then measured.
3. Verify the plan: same gradients and buffers as the unmodified model.
4. Train with the fitted plan and exact gradient accumulation, with a progress bar.
5. Print predicted against measured memory and speed, and write a plot.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from memfit.accumulate import Accumulator
from memfit.apply import apply_plan, remove_plan
from memfit.autofit import autofit
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.step import make_optimizer, measure_step, warm_up
from memfit.capture.tracker import MemoryTracker
from memfit.cli.common import Output, check_output_path, mib, positive_float, positive_int, size_arg
from memfit.plan.calibrate import DEFAULT_MODES, MODES
from memfit.units import format_bytes
from memfit.verify import verify
from memfit.workload import iter_tensors, load_workload

HELP = "the main job: auto-fit the built-in GPT to a memory budget, verify, and train it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", metavar="SPEC", help="workload (default: demo)")
    p.add_argument("--global-batch", type=positive_int, default=16, metavar="G", help="samples per optimizer step (default 16)")
    p.add_argument("--budget", type=size_arg, default=None, metavar="SIZE", help="memory budget (default: half of what a step of the global batch needs without memfit)")
    p.add_argument("--steps", type=positive_int, default=50, help="optimizer steps (default 50)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--all-options", action="store_true", help="also calibrate selective (and offload) options: slower, sometimes faster plans")
    p.add_argument("--report", default="out/memfit-demo.png", metavar="PNG", help="plot path ('' for none)")


def _baseline_peak(wl: Any, global_batch: int, seed: int) -> int:
    """Measured peak of one plain step of the whole global batch (no memfit)."""
    with leave_unchanged(wl.model) as model:  # the run then starts from the weights it was built with
        opt = make_optimizer(model, "adamw", lr=1e-6)
        torch.manual_seed(seed)
        batch = wl.make_batch(global_batch)
        warm_up(model, batch, wl.loss_fn, opt, seed=seed)
        mem = measure_step(model, batch, wl.loss_fn, opt, seed=seed)
    return mem.peak_bytes


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    t_all = time.perf_counter()
    if args.report:
        check_output_path(args.report, create_dir=True)  # before the work, not after 50 steps
    wl = load_workload(args.model, seed=args.seed)
    g = args.global_batch
    n_params = sum(p.numel() for p in wl.model.parameters())
    out.print(f"[bold]memfit demo[/]: {wl.name}, {n_params / 1e6:.2f} M parameters, global batch {g}")

    with out.console.status("measuring a plain step of the global batch ..."):
        need = _baseline_peak(wl, g, args.seed)
    budget = args.budget if args.budget is not None else need // 2
    out.print(f"a training step of {g} samples needs {mib(need)} without memfit; budget {mib(budget)}")

    with out.console.status("auto-fit ...") as status:
        fit = autofit(
            wl,
            budget,
            g,
            seed=args.seed,
            repeats=2,
            modes=DEFAULT_MODES if args.all_options else MODES,
            progress=lambda s: status.update(f"auto-fit: {s}"),
        )
    plan = fit.plan
    out.print(
        f"auto-fit: micro-batch {fit.micro_batch} x {fit.accumulation_steps} micro-steps, "
        f"{len(plan.recomputed)} of {len(plan.blocks)} blocks recomputed"
        + (f", segments {[(s.start, s.stop) for s in plan.segments]}" if plan.segments else "")
    )

    with out.console.status("verifying the plan against the unmodified model ..."):
        check = verify(wl, plan.with_(fingerprint={**plan.fingerprint, "batch": None}), batch_size=fit.micro_batch, seed=args.seed, repeats=0)

    # Train from fresh weights with the fitted plan and exact accumulation.
    wl = load_workload(args.model, seed=args.seed)
    model = apply_plan(wl.model, plan.with_(fingerprint={**plan.fingerprint, "batch": None}))
    opt = make_optimizer(model, "adamw", lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    acc = Accumulator(model, opt, micro_batch=fit.micro_batch, scheduler=sched)
    torch.manual_seed(args.seed + 100)
    losses: list[float] = []
    step_times: list[float] = []
    train_peak = None
    with out.progress() as bar:
        task = bar.add_task("training", total=args.steps, info="")
        for step in range(args.steps):
            batch = wl.make_batch(g)
            t0 = time.perf_counter()
            if step == 1:  # measure the peak of a steady-state window (optimizer state exists)
                tracker = MemoryTracker(device="cpu").track(model, opt, iter_tensors(batch))
                with tracker:
                    res = acc.step(batch, wl.loss_fn, count_fn=wl.count_fn)
                train_peak = tracker.peak_bytes
            else:
                res = acc.step(batch, wl.loss_fn, count_fn=wl.count_fn)
                step_times.append(time.perf_counter() - t0)
            losses.append(res.loss)
            rate = g / statistics.median(step_times) if step_times else 0.0
            bar.update(task, advance=1, info=f"loss {res.loss:.3f}  {rate:.1f} samples/s")
    remove_plan(model)
    samples_per_s = g / statistics.median(step_times)
    k = max(1, min(10, len(losses) // 5))
    first, last = statistics.mean(losses[:k]), statistics.mean(losses[-k:])

    out.table(
        f"memfit demo: budget {mib(budget)}, global batch {g}",
        ["", "predicted", "measured"],
        [
            ("peak memory of a training step", mib(fit.predicted_peak_bytes), mib(train_peak)),
            ("samples/s", f"{fit.predicted_samples_per_s:.1f}", f"{samples_per_s:.1f}"),
            ("without memfit (one step of the global batch)", "", mib(need)),
            ("gradients vs unmodified model", "", f"max rel. error {check.max_grad_rel_err:.1g}, buffers {'equal' if check.buffers_equal else 'DIFFER'}"),
        ],
    )
    out.print(
        f"loss {first:.3f} -> {last:.3f} (mean of the first and last {k} steps); peak "
        f"{format_bytes(train_peak or 0)} instead of {format_bytes(need)} "
        f"({(train_peak or 0) / need:.0%}); {time.perf_counter() - t_all:.0f} s in all"
    )
    report = _plot(args.report, losses, need, budget, fit, train_peak) if args.report else None
    if report:
        out.print(f"plot: {report}")
    return {
        "model": wl.name,
        "global_batch": g,
        "budget_bytes": budget,
        "baseline_peak_bytes": need,
        "micro_batch": fit.micro_batch,
        "accumulation_steps": fit.accumulation_steps,
        "predicted_peak_bytes": fit.predicted_peak_bytes,
        "measured_peak_bytes": train_peak,
        "predicted_samples_per_s": fit.predicted_samples_per_s,
        "measured_samples_per_s": samples_per_s,
        "fit": fit.to_dict(),
        "verify": check.to_dict(),
        "steps": args.steps,
        "loss_first": first,
        "loss_last": last,
        "losses": losses,
        "report": report,
        "total_s": time.perf_counter() - t_all,
    }


def _plot(path: str, losses: list[float], need: int, budget: int, fit: Any, peak: int | None) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [2, 1.2, 1.2]})
    ax1.plot(range(1, len(losses) + 1), losses, lw=1.2)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("loss (nats per byte)")
    ax1.set_title(f"training: micro-batch {fit.micro_batch} x {fit.accumulation_steps}")
    ax1.grid(alpha=0.3)
    vals = [need / 2**20, fit.predicted_peak_bytes / 2**20, (peak or 0) / 2**20]
    bars = ax2.bar(["without\nmemfit", "memfit\npredicted", "memfit\nmeasured"], vals, color=["#999999", "#9ec3f0", "#3b7dd8"])
    ax2.axhline(budget / 2**20, color="#d62728", ls="--", lw=1, label=f"budget {budget / 2**20:.0f} MiB")
    for b, v in zip(bars, vals, strict=True):
        ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax2.set_ylabel("peak memory of a step (MiB)")
    ax2.set_title("memory")
    ax2.legend(fontsize=8)
    feas = [c for c in fit.candidates if c.feasible]
    ax3.scatter([c.micro_batch for c in feas], [c.predicted_samples_per_s for c in feas], s=18, color="#3b7dd8", label="predicted (fits)")
    ax3.scatter([fit.micro_batch], [fit.predicted_samples_per_s], s=80, facecolors="none", edgecolors="#d62728", label="chosen")
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel("micro-batch")
    ax3.set_ylabel("samples/s")
    ax3.set_title("auto-fit candidates")
    ax3.legend(fontsize=8)
    ax3.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
