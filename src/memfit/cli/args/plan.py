"""``memfit plan``'s options."""

from __future__ import annotations

import argparse

from memfit.cli.args.shared import (
    COMPILE_MODES,
    OPTIMIZERS,
    POLICY_HELP,
    add_estimate_args,
    add_parallel_args,
    add_planner_args,
    add_snapshot_arg,
    add_workload_args,
    policy_arg,
    size_arg,
)
from memfit.cli.args.values import positive_int
from memfit.cli.outputs import output_path, report_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--budget", type=size_arg, metavar="SIZE", help="peak memory of a training step, e.g. 300MiB")
    what.add_argument(
        "--policy",
        type=policy_arg,
        metavar="P",
        help="instead of a budget: predict a named policy's plan: " + POLICY_HELP,
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="run the plan, no checkpointing and policy 'all' side by side and report measured peaks and times",
    )
    p.add_argument(
        "--out",
        type=output_path,
        metavar="PLAN.json",
        help="write the plan file (applies with memfit.apply_plan or --plan)",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats (medians)")
    add_planner_args(p)
    p.add_argument(
        "--report",
        type=report_path,
        default=None,
        metavar="FILE",
        help="FILE.html: one self-contained page (memory over a step with no checkpointing and with the plan, what is alive "
        "at the peak, the blocks, the frontier; with --estimate, what needs no step); FILE.png: the frontier and a "
        "memory timeline of one step",
    )
    add_snapshot_arg(p)
    add_compile_args(p)
    add_estimate_args(p)
    add_parallel_args(p, accumulation=True)


def add_compile_args(p: argparse.ArgumentParser) -> None:
    """``--compile`` and the options of its search."""
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default=None,
        help="plan for a training step you will torch.compile (whole model, or each block): compiled candidates "
        "(the compiler's activation_memory_budget fraction, memfit's block plan, both) are measured and the fastest "
        "whose compiled peak fits --budget is written, with its compile settings (apply: memfit.apply.compiled.compile_plan)",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        metavar="NAME",
        help="with --compile: the backend (inductor; aot_eager_decomp_partition runs the same partitioner without generating code)",
    )
    p.add_argument(
        "--fraction-steps",
        type=positive_int,
        default=3,
        help="with --compile: bisection steps over the compiler's activation_memory_budget (one compile each)",
    )
    p.add_argument(
        "--min-gain", type=float, default=0.02, metavar="F",
        help="with --compile: memfit's candidates replace the compiler's own set-up only when measured at least this much faster (default 0.02; 0: the fastest measured)",
    )  # fmt: skip
