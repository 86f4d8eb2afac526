"""``memfit estimate``'s options."""

from __future__ import annotations

import argparse

from memfit.cli.args.shared import (
    ESTIMATE_DEVICES,
    ESTIMATE_STATES,
    MFU_HELP,
    OPTIMIZERS,
    add_parallel_args,
    add_workload_args,
    policy_arg,
    size_arg,
)
from memfit.cli.args.values import plan_file_arg, positive_float
from memfit.cli.outputs import html_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument(
        "--device",
        "--target",
        dest="device",
        metavar="NAME",
        help=f"device to estimate for (memory fit and step time; --target as on plan and fit): {', '.join(ESTIMATE_DEVICES)}",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="optimizer (default adamw)")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--policy",
        type=policy_arg,
        metavar="P",
        help="checkpoint policy: none (default), all, sqrt, every:K, selective:PRESET, selective:save:OP,...",
    )
    src.add_argument("--plan", type=plan_file_arg, metavar="PLAN.json", help="a plan file from `memfit plan --out`")
    p.add_argument(
        "--master-weights",
        action="store_true",
        help="mixed precision: fp32 master weights and fp32 optimizer state (with --dtype bfloat16/float16)",
    )
    p.add_argument("--mfu", type=positive_float, default=None, help=MFU_HELP)
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="when --device is this machine: measure real steps and fit the mfu to them instead of --mfu (memfit.estimation.calibrate_time)",
    )
    p.add_argument(
        "--report",
        type=html_path,
        default=None,
        metavar="FILE.html",
        help="write one self-contained page: the estimated step's memory by part and its peak per phase, the blocks' "
        "options (--plan), and with --parallel rank 0's memory by part and phase (nothing runs)",
    )
    add_states_args(p)
    add_parallel_args(p)


def add_states_args(p: argparse.ArgumentParser) -> None:
    """``--states``, ``--budget`` and ``--host-budget`` of ``memfit estimate``."""
    p.add_argument(
        "--budget",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="device memory the step may use, for the fit verdict (default: the --device's memory)",
    )
    p.add_argument(
        "--states",
        default="auto",
        choices=ESTIMATE_STATES,
        help="where parameters, gradients and optimizer state live: auto (default: the fastest placement that "
        "fits, else the one with the least device peak), device, step-in-backward, host-optimizer, host-params",
    )
    p.add_argument(
        "--host-budget",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="host memory the model states may use (default: this machine's available memory less 10 %%)",
    )
