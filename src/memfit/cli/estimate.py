"""`memfit estimate`: memory and time of a training step, without allocating the model.

Example:
    memfit estimate --model 'hf:llama?hidden_size=4096&intermediate_size=11008&num_hidden_layers=32&num_attention_heads=32&vocab_size=32000' \\
        --batch-size 1 --seq-len 4096 --dtype bfloat16 --optimizer adamw --device h100-sxm
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from memfit.capture.step import StepSpec
from memfit.cli.common import (
    Output,
    mib,
    parse_dtype,
    settle_model,
    to_jsonable,
    write_html_report,
)
from memfit.cli.estimate_states import (
    choose,
    refuse_early,
    show_states,
    sizes_of,
    wants_in_backward_step,
)
from memfit.cli.parallel import parallel_from_args, show_rank
from memfit.cli.plan import calibrate_from_args, show_calibration
from memfit.errors import SpecError
from memfit.estimation import estimate, get_device
from memfit.estimation.allocator import allocator_model
from memfit.estimation.devices import published_mfu
from memfit.estimation.parallel import estimate_rank, estimate_rank_allocator
from memfit.estimation.stats import load_fake_workload
from memfit.plan import Plan
from memfit.plan.policies import Offload
from memfit.report.html import estimate_report_data


def settle(args: argparse.Namespace, out: Output, *, command: str) -> dict[str, Any]:
    """``--model``: given, or the ``--plan`` file's workload (:func:`memfit.cli.common.settle_model`);
    :mod:`memfit.cli.main` calls it before :func:`run`."""
    settle_model(args)
    return {}


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    dtype = parse_dtype(args.dtype)
    plan = Plan.load(args.plan) if args.plan else None
    parallel = parallel_from_args(args, command="estimate")
    if args.calibrate and args.device is None:
        raise SpecError(
            "memfit estimate: --calibrate fits the step time of --device NAME; give --device (this machine's, e.g. --device cpu)."
        )
    if args.calibrate:
        with out.console.status("calibrating: measuring real steps here ..."):
            cal = calibrate_from_args(args, get_device(args.device))
            args.mfu = cal.mfu if cal else args.mfu
    if parallel is not None:
        return _report(args, out, _run_rank(args, out, parallel, dtype, plan) | show_calibration(args, out), plan)
    # model states placed (memfit.estimation.states): no fake step when they alone cannot fit
    budget = args.budget or (get_device(args.device).memory_bytes if args.device else None)
    with out.console.status("model states: building the model with fake weights ..."):
        fake_wl = load_fake_workload(args.model, seq_len=args.seq_len, dtype=dtype, seed=args.seed)
    refused = refuse_early(args, fake_wl, out, budget)
    if refused is not None:
        return refused
    one_step = functools.partial(
        estimate,
        args.model,
        device=args.time_calibration.device if getattr(args, "time_calibration", None) else args.device,
        step=StepSpec(batch_size=args.batch_size, dtype=dtype, optimizer=args.optimizer, seed=args.seed),
        seq_len=args.seq_len,
        policy=args.policy,
        plan=plan,
        master_weights=args.master_weights,
        mfu=args.mfu,
    )
    with out.console.status("estimating: building the model with fake weights, one fake training step ..."):
        est = one_step()
    b = est.breakdown
    rows = _estimate_rows(args, est)
    seq = f", seq {est.seq_len}" if est.seq_len else ""
    out.table(
        f"estimate {est.model}: batch {est.batch_size}{seq}, policy {est.policy!r} "
        f"({b['estimate_s']:.1f} s, nothing allocated)",
        ["", "estimate"],
        rows,
    )
    sizes, in_backward = sizes_of(fake_wl, args), None
    if wants_in_backward_step(args, est, sizes, budget):
        with out.console.status("estimating: one more fake step, each parameter stepped inside the backward ..."):
            in_backward = one_step(states="step-in-backward")
    verdict, placements = choose(args, est, sizes, budget_bytes=budget, in_backward=in_backward)
    show_states(out, verdict, placements)
    result = (
        est.to_dict()
        | ({"allocator": est.breakdown["allocator"]} if "allocator" in est.breakdown else {})
        | show_calibration(args, out)
        | verdict
        | {"placements": placements}
    )
    return _report(args, out, result, plan)


def _estimate_rows(args: argparse.Namespace, est: Any) -> list[tuple[str, str]]:
    """The estimate's table: the model states, activations and peak by phase, the device's rows
    (with ``--device``) and the FLOPs."""
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
            + "("
            + ", ".join(f"{k} {mib(v)}" for k, v in phases.items())
            + ")",
        ),
    ]
    if est.device is not None:
        rows += _device_rows(args, est)
    rows.append(
        (
            "FLOPs",
            f"{est.flops / 1e12:.2f} TFLOP (forward {b['forward_flops'] / 1e12:.2f}, backward {b['backward_flops'] / 1e12:.2f})",
        )
    )
    return rows


def _device_rows(args: argparse.Namespace, est: Any) -> list[tuple[str, str]]:
    """The rows of an estimate for a device: its CUDA allocator, whether the step fits, the step
    time and the MFU it assumes."""
    b = est.breakdown
    rows: list[tuple[str, str]] = []
    alloc = allocator_model(est.peak_bytes, get_device(est.device))
    if est.predicted_reserved_bytes is not None:
        rows.append(
            (
                "CUDA allocator (model)",
                f"reserved {mib(est.predicted_reserved_bytes)} (what runs out on the GPU), allocated "
                f"{mib(est.predicted_allocated_bytes)} (+ {mib(alloc.workspace_bytes)} cuBLAS workspaces): the step's "
                "allocations replayed through torch's caching allocator",
            )
        )
    if est.device_memory_bytes is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        left = est.headroom_bytes or 0
        rows.append(
            (
                f"on {est.device}, every state on the device",
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
                f"{timing['peak_flops_per_s'] / 1e12:.0f} TFLOP/s x mfu {est.mfu:.3g} "
                f"+ optimizer {timing['optimizer_s'] * 1e3:.0f} ms at memory bandwidth",
            )
        )
    else:
        rows.append(("step time", f"unknown: {timing.get('reason', 'no peak FLOP/s for this device')}"))
    pub = published_mfu(get_device(est.device))
    if pub is not None and est.step_s is not None:
        used = "used" if abs(est.mfu - pub.mfu) <= 1e-9 else f"not used: --mfu {est.mfu:.3g}"
        rows.append(("mfu from a published run", f"{pub.mfu:.3g} ({used}) matches {pub.run} ({pub.source})"))
    elif est.step_s is not None and args.mfu is None:
        rows.append(("mfu", f"{est.mfu:.3g}: assumed (no published run of this device class; set --mfu)"))
    return rows


def _report(args: argparse.Namespace, out: Output, result: dict[str, Any], plan: Plan | None) -> dict[str, Any]:
    """``--report FILE.html``: the page of the estimate (its JSON is ``result``, as ``--json`` prints it)."""
    if args.report:
        write_html_report(
            args.report,
            result,
            estimate_report_data(to_jsonable(result), plan),
            settled=getattr(args, "settled_json", None),
        )
        out.print(f"report: {args.report}")
    return result


def _run_rank(args: argparse.Namespace, out: Output, parallel: Any, dtype: Any, plan: Plan | None) -> dict[str, Any]:
    """``--parallel``: one rank's step from the per-block estimate (memfit.estimation.parallel)."""
    if args.master_weights:
        raise SpecError(
            f"memfit estimate: --parallel {parallel.kind.value} does not model --master-weights yet (its per-rank "
            "accounting holds no fp32 master copies of the weights). Leave out --master-weights, or estimate one "
            "process with --master-weights and without --parallel."
        )
    if args.device is None:
        raise SpecError(
            "memfit estimate: --parallel needs --device NAME (per-block seconds come from its roofline); e.g. --device h100-sxm."
        )
    if isinstance(args.policy, Offload):
        raise SpecError(
            "memfit estimate: --parallel estimates policies none, all, sqrt, every:K and selective:..., not 'offload' "
            "(fake tensors have no host memory to copy to)."
        )
    if args.states not in ("auto", "device"):
        raise SpecError(
            f"memfit estimate: --parallel {parallel.kind.value} estimates every model state on the device (its per-rank "
            f"accounting has no host placements yet); leave out --states {args.states}, or estimate one process with it."
        )
    args.states = "device"
    budget = args.budget or get_device(args.device).memory_bytes
    if parallel.kind.value == "ddp":  # each rank holds every model state: no fake step when they alone cannot fit
        with out.console.status("model states: building the model with fake weights ..."):
            fake_wl = load_fake_workload(args.model, seq_len=args.seq_len, dtype=dtype, seed=args.seed)
        refused = refuse_early(args, fake_wl, out, budget)
        if refused is not None:
            return refused | {"parallel": parallel.to_dict()}
    with out.console.status("estimating one rank: fake-tensor steps, then the per-rank accounting ..."):
        stats, plan, pred = estimate_rank(
            args.model, parallel=parallel, device=cal.device if (cal := getattr(args, "time_calibration", None)) else args.device, plan=plan, policy=args.policy or "none", batch_size=args.batch_size,
            seq_len=args.seq_len, dtype=dtype, optimizer=args.optimizer, mfu=args.mfu, seed=args.seed,
        )  # fmt: skip
    short = "".join({"recompute": "R", "selective": "S"}.get(b.option.value, ".") for b in plan.blocks)
    out.print(
        f"[bold]{stats.model}[/], batch {stats.batch_size} per rank, plan {short} (R = recompute, S = selective, . = keep or offload); "
        f"estimated for {args.device} from fake-tensor steps"
    )
    alloc = None
    if get_device(args.device).name != "cpu":
        with out.console.status("the CUDA allocator: one more fake step (one process, the same plan), replayed ..."):
            alloc = estimate_rank_allocator(
                args.model, rank=stats, plan=plan, peak_bytes=pred.peak_bytes, device=args.device, seq_len=args.seq_len,
                dtype=dtype, optimizer=args.optimizer, seed=args.seed,
            )  # fmt: skip
    result = {"model": stats.model, "batch_size": stats.batch_size, "predicted_peak_bytes": pred.peak_bytes, "predicted_step_s": pred.step_s,
              "peak_event": pred.peak_event, "blocks": [b.to_dict() for b in plan.blocks], "estimated": est.to_dict() if (est := stats.calibration.estimated) else None}  # fmt: skip
    result.update(
        show_rank(
            out,
            args,
            parallel,
            stats,
            plan,
            micro_batch=stats.batch_size,
            accumulation_steps=1,
            step_s=pred.step_s,
            allocator=alloc,
            budget_bytes=budget,
        )
    )
    return result
