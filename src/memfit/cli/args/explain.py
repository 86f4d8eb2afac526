"""``memfit explain``'s options."""

from __future__ import annotations

import argparse

from memfit.cli.args.shared import POLICY_HELP, add_device_arg, add_workload_args, policy_arg, size_arg
from memfit.cli.args.values import nonneg_int, plan_file_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_device_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--plan", type=plan_file_arg, metavar="PLAN.json", help="a plan file from `memfit plan --out`")
    src.add_argument(
        "--budget",
        type=size_arg,
        metavar="SIZE",
        help="plan for this memory budget (e.g. 300MiB) and explain that plan",
    )
    src.add_argument("--policy", type=policy_arg, metavar="P", help=POLICY_HELP)
    p.add_argument(
        "--blocks", metavar="I,J", help="print the tensors of these blocks only (indices; JSON always has all)"
    )
    p.add_argument("--repeats", type=nonneg_int, default=3, help="timed forwards per op (medians)")
