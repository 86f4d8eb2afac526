"""`memfit demo`: the main job on the built-in GPT and corpus.

Measures the demo model with and without a checkpoint plan side by side (gradients compared, peaks
and step times measured), then trains it with the plan applied, with a progress bar, and writes a
plot of the loss and of the two peaks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from memfit.apply import apply_plan, remove_plan
from memfit.capture.step import make_optimizer, training_step
from memfit.cli.common import Output, mib, positive_int
from memfit.plan import policy_plan
from memfit.units import format_bytes
from memfit.verify import verify
from memfit.workload import load_workload

HELP = "the main job: measure, verify and train the built-in GPT with a checkpoint plan"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", metavar="SPEC", help="workload (default: demo)")
    p.add_argument("--policy", default="sqrt", metavar="P", help="checkpoint policy (default: sqrt)")
    p.add_argument("--steps", type=positive_int, default=150, help="training steps (default 150)")
    p.add_argument("--batch-size", type=positive_int, default=None, metavar="B")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default="out/memfit-demo.png", metavar="PNG", help="plot path ('' for none)")


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    wl = load_workload(args.model, seed=args.seed)
    bs = args.batch_size or wl.default_batch_size
    n_params = sum(p.numel() for p in wl.model.parameters())
    out.print(f"[bold]memfit demo[/]: {wl.name}, {n_params / 1e6:.2f} M parameters, batch {bs}, policy {args.policy!r}")

    plan = policy_plan(wl.model, args.policy)
    with out.console.status("measuring one step with and without the plan, side by side ..."):
        check = verify(wl, plan, batch_size=bs, seed=args.seed, repeats=3)
    out.table(
        "one training step (forward, backward, AdamW)",
        ["", "without memfit", f"with policy {args.policy!r}"],
        [
            ("peak memory", mib(check.baseline_peak_bytes), mib(check.measured_peak_bytes)),
            ("step time", f"{check.baseline_step_s * 1e3:.0f} ms", f"{check.measured_step_s * 1e3:.0f} ms"),
            ("gradients", "reference", f"max rel. error {check.max_grad_rel_err:.1g}"),
            ("buffers", "reference", "equal" if check.buffers_equal else "DIFFER"),
        ],
    )

    # Train from fresh weights with the plan applied.
    wl = load_workload(args.model, seed=args.seed)
    model = apply_plan(wl.model, plan)
    opt = make_optimizer(model, "adamw", lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    torch.manual_seed(args.seed + 100)
    losses: list[float] = []
    t0 = time.perf_counter()
    with out.progress() as bar:
        task = bar.add_task("training", total=args.steps, info="")
        for step in range(args.steps):
            batch = wl.make_batch(bs)
            losses.append(training_step(model, batch, wl.loss_fn, opt))
            opt.zero_grad(set_to_none=True)
            sched.step()
            rate = (step + 1) * bs / (time.perf_counter() - t0)
            bar.update(task, advance=1, info=f"loss {losses[-1]:.3f}  {rate:.1f} samples/s")
    train_s = time.perf_counter() - t0
    remove_plan(model)
    k = max(1, min(10, len(losses) // 5))
    first, last = statistics.mean(losses[:k]), statistics.mean(losses[-k:])
    out.print(
        f"loss {first:.3f} -> {last:.3f} (mean of the first and last {k} steps) in {train_s:.0f} s; "
        f"peak memory {format_bytes(check.measured_peak_bytes)} instead of {format_bytes(check.baseline_peak_bytes)} "
        f"({check.measured_peak_bytes / check.baseline_peak_bytes:.0%}) at "
        f"{check.measured_step_s / check.baseline_step_s:.2f}x step time, same gradients"
    )
    report = _plot(args.report, losses, check, args.policy) if args.report else None
    if report:
        out.print(f"plot: {report}")
    return {
        "model": wl.name,
        "batch_size": bs,
        "policy": args.policy,
        "verify": check.to_dict(),
        "baseline_peak_bytes": check.baseline_peak_bytes,
        "measured_peak_bytes": check.measured_peak_bytes,
        "baseline_step_s": check.baseline_step_s,
        "measured_step_s": check.measured_step_s,
        "steps": args.steps,
        "loss_first": first,
        "loss_last": last,
        "losses": losses,
        "train_s": train_s,
        "report": report,
    }


def _plot(path: str, losses: list[float], check: Any, policy: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    ax1.plot(range(1, len(losses) + 1), losses, lw=1.2)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats per byte)")
    ax1.set_title(f"training with policy {policy!r}")
    ax1.grid(alpha=0.3)
    peaks = [check.baseline_peak_bytes / 2**20, check.measured_peak_bytes / 2**20]
    bars = ax2.bar(["without\nmemfit", f"policy\n{policy!r}"], peaks, color=["#999999", "#3b7dd8"])
    for b, v in zip(bars, peaks, strict=True):
        ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f} MiB", ha="center", va="bottom")
    ax2.set_ylabel("peak memory of a step (MiB)")
    ax2.set_title("measured peak")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
