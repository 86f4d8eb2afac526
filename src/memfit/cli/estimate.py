"""`memfit estimate`: memory and time of a training step, without allocating the model.

Example:
    memfit estimate --model 'hf:llama?hidden_size=4096&intermediate_size=11008&num_hidden_layers=32&num_attention_heads=32&vocab_size=32000' \\
        --batch-size 1 --seq-len 4096 --dtype bfloat16 --optimizer adamw --device h100-sxm
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.capture.step import OPTIMIZERS
from memfit.cli.common import (
    Output,
    add_workload_args,
    mib,
    parse_dtype,
    plan_file_arg,
    policy_arg,
    positive_float,
)
from memfit.estimate import DEFAULT_MFU, DEVICES, estimate
from memfit.plan import Plan

HELP = "estimate a training step's memory (and time on a GPU) without allocating the model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument(
        "--device",
        metavar="NAME",
        help=f"device to estimate for (memory fit and step time): {', '.join(DEVICES)}",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="optimizer (default adamw)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--policy", type=policy_arg, metavar="P", help="checkpoint policy: none (default), all, sqrt, every:K, selective:PRESET, selective:save:OP,...")
    src.add_argument("--plan", type=plan_file_arg, metavar="PLAN.json", help="a plan file from `memfit plan --out`")
    p.add_argument(
        "--master-weights",
        action="store_true",
        help="mixed precision: fp32 master weights and fp32 optimizer state (with --dtype bfloat16/float16)",
    )
    p.add_argument(
        "--mfu",
        type=positive_float,
        default=DEFAULT_MFU,
        help=f"assumed fraction of the device's peak FLOP/s (default {DEFAULT_MFU})",
    )


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    dtype = parse_dtype(args.dtype)
    plan = Plan.load(args.plan) if args.plan else None
    with out.console.status("estimating: building the model with fake weights, one fake training step ..."):
        est = estimate(
            args.model,
            device=args.device,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            dtype=dtype,
            optimizer=args.optimizer,
            policy=args.policy,
            plan=plan,
            master_weights=args.master_weights,
            mfu=args.mfu,
            seed=args.seed,
        )
    b = est.breakdown
    phases = b.get("peak_bytes_by_phase", {})
    optimizer_note = f"{est.optimizer}" + (
        f" (fp32 master weights {mib(b['master_weights_bytes'])} + state)" if est.master_weights else ""
    )
    rows: list[tuple[str, str]] = [
        ("parameters", f"{mib(est.params_bytes)} ({est.n_params:,} x {est.dtype})"),
        ("gradients", mib(est.grads_bytes)),
        ("optimizer state", f"{mib(est.optimizer_bytes)} ({optimizer_note})"),
        ("activations", f"{mib(est.activations_bytes)} (peak above the step's start, gradients excluded)"),
        (
            "peak (whole step)",
            f"{mib(est.peak_bytes)}, in {b.get('peak_phase', '?')} "
            + "(" + ", ".join(f"{k} {mib(v)}" for k, v in phases.items()) + ")",
        ),
    ]
    if est.device is not None:
        if est.device_memory_bytes is not None:
            verdict = "fits" if est.fits else "does NOT fit"
            left = est.headroom_bytes or 0
            rows.append(
                (
                    f"on {est.device}",
                    f"{verdict} in {mib(est.device_memory_bytes)} "
                    + (f"({mib(left)} to spare)" if left >= 0 else f"(short by {mib(-left)})"),
                )
            )
        timing = b.get("time", {})
        if est.step_s is not None:
            rows.append(
                (
                    "step time",
                    f"{est.step_s * 1e3:.0f} ms = {est.flops / 1e12:.1f} TFLOP at "
                    f"{timing['peak_flops_per_s'] / 1e12:.0f} TFLOP/s x mfu {est.mfu} "
                    f"+ optimizer {timing['optimizer_s'] * 1e3:.0f} ms at memory bandwidth",
                )
            )
        else:
            rows.append(("step time", f"unknown: {timing.get('reason', 'no peak FLOP/s for this device')}"))
    rows.append(("FLOPs", f"{est.flops / 1e12:.2f} TFLOP (forward {b['forward_flops'] / 1e12:.2f}, backward {b['backward_flops'] / 1e12:.2f})"))
    seq = f", seq {est.seq_len}" if est.seq_len else ""
    out.table(
        f"estimate {est.model}: batch {est.batch_size}{seq}, policy {est.policy!r} "
        f"({b['estimate_s']:.1f} s, nothing allocated)",
        ["", "estimate"],
        rows,
    )
    return est.to_dict()
