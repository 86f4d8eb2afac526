"""`memfit plan`: the fastest checkpoint plan under a memory budget (and, with --measure, its check)."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.capture.compare import measure_setups, plan_setup
from memfit.capture.step import OPTIMIZERS
from memfit.cli.common import (
    Output,
    add_workload_args,
    margin_arg,
    mib,
    output_path,
    parse_dtype,
    positive_int,
    size_arg,
)
from memfit.plan import policy_plan
from memfit.plan.planner import plan_for_budget
from memfit.workload import load_workload

HELP = "choose the fastest checkpoint plan whose whole-step peak fits a memory budget"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--budget", type=size_arg, required=True, metavar="SIZE", help="peak memory of a training step, e.g. 300MiB")
    p.add_argument("--measure", action="store_true", help="run the plan, no checkpointing and policy 'all' side by side and report measured peaks and times")
    p.add_argument("--out", type=output_path, metavar="PLAN.json", help="write the plan file (applies with memfit.apply_plan or --plan)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats (medians)")
    p.add_argument("--margin", type=margin_arg, default=0.02, help="safety margin on predicted peaks (default 0.02 = 2%%)")
    p.add_argument("--options", default="block", choices=["block", "all"], help="block: keep/recompute per block and segments (default); all: also selective variants and offload (slower to measure)")
    p.add_argument("--keep-head", action="store_true", help="never replace the model's head: without it, causal LMs may get the chunked loss (logits never materialised; see memfit.apply.head)")
    p.add_argument("--keep-activations", action="store_true", help="never fuse activation modules (GPT-2's gelu_new and other python-written activations run as one torch kernel otherwise; see memfit.apply.activations)")
    p.add_argument("--report", type=output_path, default=None, metavar="PNG", help="write a PNG: the memory/time frontier with the chosen plan, and a memory timeline of one step")


def make_plan(args: argparse.Namespace, out: Output) -> tuple[Any, Any]:
    """Load the workload and plan for ``args.budget`` (shared with ``memfit verify --budget``)."""
    dtype = parse_dtype(args.dtype)
    wl = load_workload(args.model, seq_len=args.seq_len, dtype=dtype, seed=args.seed)
    with out.console.status("measuring the workload ...") as status:
        res = plan_for_budget(
            wl,
            args.budget,
            batch_size=args.batch_size,
            optimizer=getattr(args, "optimizer", "adamw"),
            seed=args.seed,
            repeats=getattr(args, "repeats", 3),
            margin=getattr(args, "margin", 0.02),
            options=getattr(args, "options", "block"),
            heads=not getattr(args, "keep_head", False),
            activations=not getattr(args, "keep_activations", False),
            progress=lambda s: status.update(f"planning: {s}"),
        )
    return wl, res


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    wl, res = make_plan(args, out)
    plan = res.plan
    result = res.to_dict()
    if args.out:
        plan.save(args.out)
        result["plan_file"] = args.out
    if args.measure:
        with out.console.status("measuring side by side ...") as status:
            rows = measure_setups(
                wl,
                {
                    "none": plan_setup(policy_plan(wl.model, "none")),
                    "memfit": plan_setup(plan),
                    "all": plan_setup(policy_plan(wl.model, "all")),
                },
                batch_size=res.stats.batch_size,
                optimizer=args.optimizer,
                repeats=args.repeats,
                seed=args.seed,
                progress=lambda s: status.update(f"measuring: {s}"),
            )
        by = {r.name: r for r in rows}
        result.update(
            measured_peak_bytes=by["memfit"].peak_bytes,
            measured_step_s=by["memfit"].step_s,
            baseline_peak_bytes=by["none"].peak_bytes,
            baseline_step_s=by["none"].step_s,
            all_peak_bytes=by["all"].peak_bytes,
            all_step_s=by["all"].step_s,
            within_budget=by["memfit"].peak_bytes <= args.budget,
            prediction_error=(by["memfit"].peak_bytes - plan.predicted_peak_bytes) / max(1, by["memfit"].peak_bytes),
        )
    short = "".join({"recompute": "R", "selective": "S", "offload": "O"}.get(b.action.value, ".") for b in plan.blocks)
    out.print(
        f"[bold]{wl.name}[/], batch {res.stats.batch_size}: budget {mib(args.budget)}; minimum {mib(res.min_budget_bytes)}, "
        f"no checkpointing {mib(result['baseline_peak_bytes'])}"
        + (" (measured)" if args.measure else " (with the plan's fused activations)" if plan.activations else "")
    )
    out.print(f"plan: {short}  (R = recompute, S = selective, O = offload, . = keep){'  segments ' + str([(s.start, s.stop) for s in plan.segments]) if plan.segments else ''}"
              + (f"; head: {plan.head} (fused, chunked cross-entropy)" if plan.head else "")
              + ("; activations: fused (one torch kernel each)" if plan.activations else ""))
    rows = [
        ("peak memory", mib(plan.predicted_peak_bytes), mib(result.get("measured_peak_bytes")), mib(result["baseline_peak_bytes"])),
        (
            "step time",
            f"{plan.predicted_step_s * 1e3:.0f} ms",
            f"{result['measured_step_s'] * 1e3:.0f} ms" if "measured_step_s" in result else "-",
            f"{result['baseline_step_s'] * 1e3:.0f} ms",
        ),
    ]
    out.table("plan", ["", "predicted", "measured", "no checkpointing"], rows)
    if args.measure:
        out.print(
            f"policy 'all' for comparison: {mib(result['all_peak_bytes'])}, {result['all_step_s'] * 1e3:.0f} ms; "
            f"memfit {'fits' if result['within_budget'] else 'DOES NOT FIT'} the budget"
        )
    for note in res.notes:
        out.warn(note)
    if args.measure and not result["within_budget"]:
        result["exit_code"] = 1  # the measured plan does not fit: say so in the exit status too
    if args.measure and result["measured_peak_bytes"] >= result["baseline_peak_bytes"] and plan.blocks and any(b.action.value != "keep" for b in plan.blocks):
        from memfit.verify import no_saving_note

        out.warn(no_saving_note(result["measured_peak_bytes"], result["baseline_peak_bytes"]))
    if args.out:
        out.print(f"wrote {args.out}")
    if getattr(args, "report", None):
        from memfit.report import plan_report

        measured = (result["measured_peak_bytes"], result["measured_step_s"]) if args.measure else None
        with out.console.status("report: frontier and a recorded step ..."):
            result["report"] = plan_report(args.report, wl, res, measured=measured, optimizer=args.optimizer, seed=args.seed)
        out.print(f"report: {result['report']}")
    return result
