"""``memfit train``'s options."""

from __future__ import annotations

import argparse

from memfit.cli.args.shared import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_MAX_SKIPS,
    EXIT_DIVERGED,
    NORMALIZE,
    OPTIMIZERS,
    add_layout_args,
    add_states_arg,
    add_workload_args,
    device_arg,
    policy_arg,
    size_arg,
)
from memfit.cli.args.values import nonneg_int, plan_file_arg, positive_float, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, batch=False)
    p.add_argument(
        "--global-batch",
        type=positive_int,
        required=True,
        metavar="G",
        help="samples per optimizer step, over all ranks",
    )
    add_sizing_args(p)
    p.add_argument(
        "--steps",
        type=positive_int,
        required=True,
        metavar="N",
        help="optimizer steps (in total, counting those of a resumed run)",
    )
    p.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help="learning rate (default 3e-4 for adamw/adam, 0.05 for sgd; with --resume: replaces the saved one)",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    add_states_arg(p, auto=True)
    p.add_argument(
        "--normalize",
        default="auto",
        choices=list(NORMALIZE),
        help="loss normalisation (auto: tokens for (loss_sum, count) workloads, else mean)",
    )
    plan = p.add_mutually_exclusive_group()
    plan.add_argument(
        "--policy",
        type=policy_arg,
        default=None,
        metavar="P",
        help="apply a checkpoint policy first: none, all, sqrt, every:K, selective:PRESET, offload; with --budget the fit (and every replan) keeps it and chooses the micro-batch",
    )
    plan.add_argument("--plan", type=plan_file_arg, default=None, metavar="PLAN.json", help="apply this plan file first (`memfit plan --out`; refused when made for another model); "
                      "its predicted peak is compared with the measured one when micro-batch and layout are those it was made for")  # fmt: skip
    p.add_argument(
        "--max-grad-norm",
        type=positive_float,
        default=None,
        metavar="X",
        help="clip the global gradient norm at each step (a number > 0)",
    )
    p.add_argument(
        "--amp", default=None, choices=["bf16", "fp16"], help="autocast the forward (fp16 adds a GradScaler)"
    )
    p.add_argument("--device", type=device_arg, default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    add_saving_args(p)
    add_ranks_args(p)
    p.add_argument(
        "--progress-jsonl",
        default=None,
        metavar="PATH",
        help="append one JSON line per step: loss, skip reason, tracked peak bytes, process RSS bytes",
    )


def add_sizing_args(p: argparse.ArgumentParser) -> None:
    """How a micro-step is sized: fixed, or fitted to a memory budget (micro-batch and plan)."""
    sizing = p.add_mutually_exclusive_group()
    sizing.add_argument(
        "--micro-batch",
        type=positive_int,
        default=None,
        metavar="b",
        help="samples per micro-step on each rank (default: the rank's whole share, no accumulation)",
    )
    sizing.add_argument(
        "--budget",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="fit micro-batch and checkpoint plan to this peak memory per rank (memfit fit; with --policy: the micro-batch for that policy's plan)",
    )
    p.add_argument(
        "--min-micro-batch",
        type=positive_int,
        default=None,
        metavar="b",
        help="with --budget: the smallest micro-batch the fit considers (default: the smallest the model runs in "
        "train mode; BatchNorm refuses 1)",
    )
    p.add_argument("--guard", action="store_true", help="enforce --budget with the memory tracker on every step: going over it counts as out of memory and triggers a replan "
                   "(the CPU stand-in for a GPU's out-of-memory; ~10 us per op: 1.1x-2.4x slower steps, the more so the smaller the ops)")  # fmt: skip
    p.add_argument(
        "--keep-head", action="store_true", help="with --budget: never replace the model's head (no chunked loss)"
    )
    p.add_argument(
        "--keep-activations",
        action="store_true",
        help="with --budget: never fuse activation modules (see memfit.apply.activations)",
    )
    p.add_argument(
        "--max-replans",
        type=nonneg_int,
        default=3,
        metavar="N",
        help="out-of-memory replans allowed before the run stops (default 3)",
    )


def add_saving_args(p: argparse.ArgumentParser) -> None:
    """``--resume``, ``--save``, ``--save-every``, ``--max-skips``."""
    p.add_argument("--resume", default=None, metavar="PATH", help="continue from a state saved with --save")
    p.add_argument("--save", default=None, metavar="PATH", help="save the training state at the end, on SIGINT/SIGTERM and every --save-every steps "
                   "(atomic: written beside PATH, then renamed over it; PATH.lock keeps other runs out)")  # fmt: skip
    p.add_argument(
        "--save-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --save: also save every N optimizer steps",
    )
    p.add_argument("--max-skips", type=positive_int, default=DEFAULT_MAX_SKIPS, metavar="N",
                   help=f"stop (exit {EXIT_DIVERGED}) after N consecutive windows skipped for a NaN/inf loss or gradient (default {DEFAULT_MAX_SKIPS})")  # fmt: skip


def add_ranks_args(p: argparse.ArgumentParser) -> None:
    """Data parallelism under torchrun (as ``memfit plan/fit --parallel`` print it)."""
    g = p.add_argument_group("data parallelism under torchrun (as memfit plan/fit --parallel print it)")
    g.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --parallel: the ranks the layout was planned for (checked against torchrun's; default: torchrun's)",
    )
    add_layout_args(g)
    g.add_argument(
        "--collective-timeout",
        type=positive_float,
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"the longest a rank waits for the others at one collective (default {DEFAULT_COLLECTIVE_TIMEOUT_S:g}); "
        "a rank that stopped or hangs then ends the run with the last complete save named",
    )
