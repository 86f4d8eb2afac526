"""``memfit demo``'s options."""

from __future__ import annotations

import argparse

from memfit.cli.args.shared import POLICY_HELP, policy_arg, size_arg
from memfit.cli.args.values import positive_float, positive_int, seed_arg
from memfit.cli.outputs import png_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", metavar="SPEC", help="workload (default: demo)")
    p.add_argument(
        "--global-batch", type=positive_int, default=8, metavar="G", help="samples per optimizer step (default 8)"
    )
    p.add_argument(
        "--budget",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="memory budget (default: half of what a step of the global batch needs without memfit)",
    )
    p.add_argument("--steps", type=positive_int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument(
        "--all-options",
        action="store_true",
        help="also calibrate selective (and offload) options: slower, sometimes faster plans",
    )
    p.add_argument(
        "--policy",
        type=policy_arg,
        default=None,
        metavar="P",
        help="keep this checkpoint policy's plan and fit only micro-batch and accumulation steps to the budget: "
        + POLICY_HELP,
    )
    p.add_argument(
        "--report",
        type=png_path,
        default="out/memfit-demo.png",
        metavar="PNG",
        help="plot path ('' for none); the HTML report is written beside it (same name, .html)",
    )


def first_line(args: argparse.Namespace) -> str:
    """What ``memfit demo`` prints first, before torch is imported (which takes seconds): a phase line
    (``memfit: ...``), as the command's other progress lines; ``memfit demo: ...`` is its error line's."""
    return (
        f"memfit: {args.model}, global batch {args.global_batch}, {args.steps} training steps: measure, "
        "auto-fit, verify, train, report (starting: importing torch ...)"
    )
