"""``memfit profile``'s options."""

from __future__ import annotations

import argparse

from memfit.cli.args.shared import OPTIMIZERS, add_device_arg, add_snapshot_arg, add_states_arg, add_workload_args
from memfit.cli.args.values import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="optimizer of the measured step")
    add_states_arg(p)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed steps (medians)")
    add_device_arg(p)
    add_snapshot_arg(p)
