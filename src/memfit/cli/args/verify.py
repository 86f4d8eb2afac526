"""``memfit verify``'s options."""

from __future__ import annotations

import argparse

from memfit.cli.args.shared import (
    COMPILE_MODES,
    OPTIMIZERS,
    POLICY_HELP,
    add_device_arg,
    add_snapshot_arg,
    add_states_arg,
    add_workload_args,
    policy_arg,
    size_arg,
)
from memfit.cli.args.values import nonneg_int, plan_file_arg, positive_int
from memfit.cli.outputs import html_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_device_arg(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--plan", type=plan_file_arg, metavar="PLAN.json", help="a plan file from `memfit plan --out`")
    src.add_argument("--policy", type=policy_arg, metavar="P", help=POLICY_HELP)
    src.add_argument("--budget", type=size_arg, metavar="SIZE", help="plan for this memory budget (e.g. 300MiB)")
    p.add_argument(
        "--global-batch",
        type=positive_int,
        metavar="G",
        help="compare accumulation over micro-batches with one pass over G samples",
    )
    p.add_argument("--micro-batch", type=positive_int, metavar="b", help="micro-batch size (with --global-batch)")
    p.add_argument(
        "--bn",
        default="ghost",
        choices=["ghost", "freeze", "groupnorm"],
        help="with --global-batch: BatchNorm in train mode as is (ghost, default: cannot equal the big batch), frozen statistics in both runs, or both runs converted to GroupNorm",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    add_states_arg(p)
    p.add_argument("--repeats", type=nonneg_int, default=3, help="interleaved timed steps (0: no timing)")
    p.add_argument(
        "--options",
        default="block",
        choices=["block", "all"],
        help="with --budget: block (keep/recompute, default) or all (also selective and offload)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="block",
        choices=COMPILE_MODES,
        help="compile the planned model after applying the plan: each block (block, the default: torchtitan's order) or the whole model; checked against the unmodified model run eagerly, with the graph breaks counted",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        metavar="NAME",
        help="with --compile: the torch.compile backend (inductor; aot_eager traces the same graphs without generating code)",
    )
    p.add_argument(
        "--report",
        type=html_path,
        default=None,
        metavar="FILE.html",
        help="write one self-contained page: a step (or window) with no checkpointing and with the plan, what is alive "
        "at the peak, the blocks and the tensors they keep (runs both steps once more, eagerly)",
    )
    add_snapshot_arg(p)
