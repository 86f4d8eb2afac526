"""``memfit fit``'s options."""

from __future__ import annotations

import argparse

from memfit.cli.args.shared import (
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
    add_workload_args(p, batch=False, seq_auto=True)
    p.add_argument(
        "--budget",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="peak memory of a training step, e.g. 2GiB (required)",
    )
    p.add_argument(
        "--policy",
        type=policy_arg,
        default=None,
        metavar="P",
        help="keep this checkpoint policy's plan and choose only micro-batch and accumulation steps for --budget: "
        + POLICY_HELP,
    )
    p.add_argument(
        "--global-batch",
        type=positive_int,
        default=None,
        metavar="G",
        help="samples per optimizer step (over all ranks with --world-size); required, except with --seq-len auto (default: the micro-batch)",
    )
    p.add_argument(
        "--max-micro-batch",
        type=positive_int,
        default=None,
        metavar="b",
        help="largest micro-batch to consider; with --seq-len auto, the micro-batch the length is searched at (default 1)",
    )
    p.add_argument(
        "--min-micro-batch",
        type=positive_int,
        default=None,
        metavar="b",
        help="smallest micro-batch to consider, the last one of a window too (default: the smallest the model runs "
        "in train mode; BatchNorm refuses 1)",
    )
    p.add_argument(
        "--seq-multiple",
        type=positive_int,
        default=1,
        metavar="N",
        help="with --seq-len auto: round the length down to a multiple of N (e.g. 128)",
    )
    p.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=None,
        metavar="T",
        help="with --seq-len auto: search no further than T tokens",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--repeats", type=positive_int, default=2, help="timed repeats (medians)")
    add_planner_args(p)
    p.add_argument("--no-measure", action="store_true", help="predict only: do not run the chosen candidate")
    p.add_argument("--out", type=output_path, metavar="PLAN.json", help="write the chosen plan")
    p.add_argument(
        "--report",
        type=report_path,
        default=None,
        metavar="FILE",
        help="FILE.html: one self-contained page (the window's memory with no checkpointing and with the plan, what is alive at "
        "the peak, the blocks, the frontier at the chosen micro-batch, the micro-batch x accumulation candidates); FILE.png: "
        "frontier, memory timeline and candidates (both profile the chosen micro-batch once more)",
    )
    add_snapshot_arg(p)
    add_estimate_args(p)
    add_parallel_args(p)
