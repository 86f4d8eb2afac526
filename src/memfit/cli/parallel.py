"""``--world-size N --parallel ddp|fsdp2`` on ``memfit plan`` and ``memfit fit``: parse, and print
what one rank holds (the accounting lives in :mod:`memfit.plan.parallel`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from memfit.cli.common import Output, is_html, mib, parse_dtype
from memfit.errors import SpecError
from memfit.estimation.allocator import AllocatorPrediction, allocator_model
from memfit.estimation.calibrate_time import host_device
from memfit.estimation.devices import DeviceSpec, get_device, interconnect
from memfit.estimation.parallel import estimate_plan_allocator
from memfit.fitting.types import ReservedFit
from memfit.plan.comm import CommTime, Interconnect, window_with_comm
from memfit.plan.parallel import (
    Parallel,
    ParallelKind,
    launch_command,
    rank_report,
)
from memfit.plan.window import window_peak_bytes


def parallel_from_args(args: argparse.Namespace, *, command: str) -> Parallel | None:
    """The layout the args ask for, or None for one process.

    Raises:
        SpecError: ``--world-size`` above 1 or ``--param-dtype`` / ``--reduce-dtype`` without
            ``--parallel``, or an option that runs the model here (its single-process measurement
            says nothing of one rank's memory).
    """
    kind = getattr(args, "parallel", None)
    world = getattr(args, "world_size", 1) or 1
    mixed = [o for o in ("param_dtype", "reduce_dtype") if getattr(args, o, None)]
    if kind is None and mixed:
        raise SpecError(
            f"memfit {command}: --{mixed[0].replace('_', '-')} is FSDP2's MixedPrecisionPolicy; add --parallel fsdp2 (and --world-size N)."
        )
    if kind is None:
        if world > 1:
            raise SpecError(
                f"memfit {command}: --world-size {world} needs --parallel ddp or --parallel fsdp2 (how the ranks hold the model)."
            )
        return None
    runs_here = [
        o
        for o, on in (
            ("--measure", getattr(args, "measure", False)),
            ("--report FILE.png", bool(getattr(args, "report", None)) and not is_html(args.report)),
        )
        if on
    ]
    if runs_here:
        raise SpecError(
            f"memfit {command}: {', '.join(runs_here)} run(s) one process here, which says nothing of one rank of a "
            f"--parallel {kind} job; leave it out (the per-rank prediction is checked against gloo ranks in the tests)."
        )
    if mixed and command not in ("estimate", "train") and not getattr(args, "estimate", False):
        raise SpecError(
            f"memfit {command}: --{mixed[0].replace('_', '-')} (FSDP2 mixed precision) plans from fake-tensor steps in that dtype; "
            f"add --estimate --target NAME."
        )
    return Parallel(
        kind=ParallelKind(kind),
        world_size=world,
        bucket_cap_bytes=round(args.bucket_cap_mb * 2**20),
        reshard_after_forward=args.reshard_after_forward,
        param_dtype=getattr(args, "param_dtype", None),
        reduce_dtype=getattr(args, "reduce_dtype", None),
    )


def show_allocator(
    out: Output, args: argparse.Namespace, wl: Any, stats: Any, plan: Any, device: str, *, fitted: bool = False
) -> tuple[AllocatorPrediction, dict[str, Any]]:
    """The CUDA allocator model of a plan made from estimated stats
    (:func:`memfit.estimation.parallel.estimate_plan_allocator`), printed with what it means for
    ``--budget``; returns it and its JSON. ``fitted``: the plan was fitted to the budget as reserved
    memory (``plan_for_budget(reserved_fn=...)``)."""
    with out.console.status("the CUDA allocator: the plan's fake step, replayed ..."):
        alloc = estimate_plan_allocator(
            args.model, wl, stats, plan, device, seq_len=args.seq_len, dtype=parse_dtype(args.dtype),
            optimizer=getattr(args, "optimizer", "adamw"), seed=args.seed,
        )  # fmt: skip
    d: dict[str, Any] = {"allocator": alloc.to_dict()}
    if alloc.workspace_bytes:
        d |= {
            "predicted_allocated_bytes": alloc.predicted_allocated_bytes,
            "predicted_reserved_bytes": alloc.predicted_reserved_bytes,
        }
        budget = getattr(args, "budget", None)
        over = budget is not None and alloc.predicted_reserved_bytes > budget
        out.print(
            f"CUDA allocator (model: the plan's step replayed through torch's caching allocator): reserved "
            f"{mib(alloc.predicted_reserved_bytes)}, allocated {mib(alloc.predicted_allocated_bytes)} with "
            f"{mib(alloc.workspace_bytes)} of cuBLAS workspaces. On CUDA reserved memory is what runs out; the budget "
            + ("was compared with it" if fitted else "was compared with the live tensors")
            + (
                f": lower --budget by {mib(alloc.predicted_reserved_bytes - budget)} for reserved to fit"
                if over
                else ""
            )
        )
    return alloc, d


def reserved_fn_from_args(args: argparse.Namespace, wl: Any) -> Callable[[Any, Any], int] | None:
    """On CUDA (``--estimate --target GPU``, or a model on a CUDA device) the budget is reserved memory:
    a plan's predicted reserved bytes (:func:`memfit.estimation.parallel.estimate_plan_allocator`, one
    fake step of the plan replayed through the caching-allocator model) for ``plan_for_budget``'s
    ``reserved_fn``; None on the CPU (NOTE [ On CUDA a budget is reserved memory ])."""
    device: DeviceSpec | str
    if getattr(args, "estimate", False):
        device = args.target
        if get_device(device).name == "cpu":
            return None
    else:
        on = next((p.device for p in wl.model.parameters()), None)
        if on is None or on.type != "cuda":
            return None
        device = host_device()  # a GPU the device table lacks: its error says so
    seq_len = args.seq_len if getattr(args, "estimate", False) and args.seq_len != "auto" else None

    def reserved(plan: Any, stats: Any) -> int:
        return estimate_plan_allocator(
            args.model, wl, stats, plan, device, seq_len=seq_len, dtype=parse_dtype(args.dtype),
            optimizer=getattr(args, "optimizer", "adamw"), seed=args.seed,
        ).predicted_reserved_bytes  # fmt: skip

    return reserved


def reserved_line(r: ReservedFit | None) -> str | None:
    """The line that says the budget meant reserved memory, or None when it meant live tensors."""
    if r is None:
        return None
    how = (
        "the plan for the budget fits as it is"
        if r.solves == 1
        else f"solved for live tensors of {mib(r.live_target_bytes)} ({r.solves} solves)"
    )
    return (
        f"budget means reserved memory (CUDA): predicted reserved {mib(r.predicted_reserved_bytes)} within "
        f"{mib(r.budget_bytes)}; {how}"
    )


def tokens_per_sample(plan: Any) -> int | None:
    """Tokens per sample from a plan's batch fingerprint (a 2-D integer tensor first), else None."""
    batch = (plan.fingerprint or {}).get("batch") or []
    first = batch[0] if batch else None
    if first and len(first["shape"]) == 2 and first["dtype"].startswith(("int", "uint")):
        return int(first["shape"][1])
    return None


def network_of(args: argparse.Namespace, device: str | None) -> Interconnect | None:
    """The links of ``device`` (an estimated device's name) with ``--gpus-per-node``, or None when
    there is no device or its table entry has no links."""
    gbps = getattr(args, "link_gbps", None)
    rate = gbps * 1e9 / 8 if gbps is not None else None
    return (
        interconnect(get_device(device), gpus_per_node=getattr(args, "gpus_per_node", 8), link_bytes_per_s=rate)
        if device
        else None
    )


def show_rank(
    out: Output,
    args: argparse.Namespace,
    parallel: Parallel,
    stats: Any,
    plan: Any,
    *,
    micro_batch: int,
    accumulation_steps: int,
    step_s: float | None,
    step_peak_bytes: int | None = None,
    comm_window: tuple[float, CommTime] | None = None,
    allocator: AllocatorPrediction | None = None,
    budget_bytes: int | None = None,
) -> dict[str, Any]:
    """Print rank 0's memory by part and by phase, throughput and the launch command; return them
    for JSON. ``step_peak_bytes``: the fit's peak, which counts gradients kept between micro-steps.
    ``comm_window``: the window's seconds with exposed communication and its collectives as the fit ranked
    the chosen candidate by (:func:`memfit.plan.comm.window_with_comm`); else computed here.
    ``allocator``: the rank's CUDA allocator model (:func:`memfit.estimation.parallel.estimate_rank_allocator`);
    else the lower bound from the peak (:func:`memfit.estimation.allocator.allocator_model`).
    ``budget_bytes``: say whether rank 0 fits it (``fits``, ``over_bytes``); no launch command when not."""
    rep = rank_report(stats, plan)
    if step_peak_bytes is None and accumulation_steps > 1:
        step_peak_bytes = window_peak_bytes(stats, plan, accumulation_steps)
    if step_peak_bytes is not None and accumulation_steps > 1:
        rep["predicted_peak_bytes_with_accumulation"] = step_peak_bytes
    _show_rank_memory(
        out, parallel, stats, rep, micro_batch=micro_batch, accumulation_steps=accumulation_steps, allocator=allocator
    )
    result: dict[str, Any] = {"parallel": parallel.to_dict(), "rank": rep}
    global_batch = micro_batch * accumulation_steps * parallel.world_size
    if step_s:
        _show_throughput(
            out,
            args,
            parallel,
            stats,
            plan,
            result,
            window_s=step_s * accumulation_steps,
            accumulation_steps=accumulation_steps,
            global_batch=global_batch,
            comm_window=comm_window,
        )
    if budget_bytes is not None and not _rank_fits(out, result, rep, rep["memory"], budget_bytes):
        return result
    _show_launch(out, args, parallel, plan, result, global_batch=global_batch, micro_batch=micro_batch)
    return result


def _show_rank_memory(
    out: Output,
    parallel: Parallel,
    stats: Any,
    rep: dict[str, Any],
    *,
    micro_batch: int,
    accumulation_steps: int,
    allocator: AllocatorPrediction | None,
) -> None:
    """Print rank 0's memory by part and by phase (and its CUDA allocator's, with an estimate for a
    device; added to ``rep``)."""
    mem, phases = rep["memory"], rep["peak_bytes_by_phase"]
    sharded = " (padded shards)" if parallel.kind is ParallelKind.FSDP2 else ""
    comm = (
        "DDP gradient buckets" if parallel.kind is ParallelKind.DDP else "gathered units + collective buffers (largest)"
    )
    rows = [
        (f"parameters{sharded}", mib(mem["params_bytes"])),
        (f"gradients{sharded}", mib(mem["grads_bytes"])),
        ("optimizer state", mib(mem["optimizer_bytes"])),
        (comm, mib(mem["comm_bytes"])),
        ("peak in forward (incl. loss)", mib(phases["forward"])),
        ("peak in the blocks' backward", mib(phases["backward"])),
        ("peak in embeddings' backward / optimizer step", mib(phases["after_blocks"])),
        ("peak of the step", mib(rep["predicted_peak_bytes"])),
        *(
            [
                (
                    f"peak with {accumulation_steps} micro-steps (gradients kept between them)",
                    mib(rep["predicted_peak_bytes_with_accumulation"]),
                )
            ]
            if "predicted_peak_bytes_with_accumulation" in rep
            else []
        ),
        ("one process, whole model, same micro-batch", mib(rep["single_process_peak_bytes"])),
    ]
    est = stats.calibration.estimated
    if est is not None and est.device:
        alloc = allocator or allocator_model(rep["predicted_peak_bytes"], get_device(est.device))
        rep["allocator"] = alloc.to_dict()
        # on CUDA a budget is reserved memory: what runs out
        rep["predicted_allocated_bytes"] = alloc.predicted_allocated_bytes
        rep["predicted_reserved_bytes"] = alloc.predicted_reserved_bytes
        rows.append(
            (
                "CUDA allocator (model): allocated / reserved" + (" at least" if alloc.method == "bound" else ""),
                f"{mib(alloc.predicted_allocated_bytes)} / {mib(alloc.predicted_reserved_bytes)}",
            )
        )
    out.table(
        f"rank 0 of {parallel.world_size} ({parallel.kind.value}; rank 0 holds the most), micro-batch {micro_batch}",
        ["", "bytes"],
        rows,
    )


def _show_throughput(
    out: Output,
    args: argparse.Namespace,
    parallel: Parallel,
    stats: Any,
    plan: Any,
    result: dict[str, Any],
    *,
    window_s: float,
    accumulation_steps: int,
    global_batch: int,
    comm_window: tuple[float, CommTime] | None,
) -> None:
    """Print the predicted samples (and tokens) per second over ``window_s`` seconds of compute per
    optimizer step, and with communication where the device's links are known (added to ``result``)."""
    result["predicted_samples_per_s"] = global_batch / window_s
    tokens = tokens_per_sample(plan) or tokens_per_sample(stats)  # a policy's plan has no batch; estimated stats do
    if tokens:
        result["predicted_tokens_per_s"] = global_batch * tokens / window_s
    comm = _communication(
        args,
        stats,
        plan,
        accumulation_steps=accumulation_steps,
        window_s=window_s,
        global_batch=global_batch,
        tokens=tokens,
        computed=comm_window,
    )
    out.print(
        f"predicted {result['predicted_samples_per_s']:.1f} samples/s"
        + (f", {result['predicted_tokens_per_s']:,.0f} tokens/s" if tokens else "")
        + f" over {parallel.world_size} ranks (compute only"
        + (
            ")"
            if comm
            else ": communication time needs a device with links in memfit's table, --estimate --target NAME)"
        )
    )
    if comm:
        result["communication"] = comm
        kinds = ", ".join(f"{k.replace('_', '-')} {v * 1e3:.3g}" for k, v in comm["seconds_by_kind"].items())
        out.print(
            f"communication over {comm['link']} ({comm['bus_bytes_per_s'] / 1e9:.0f} GB/s bus bandwidth of {comm['link_source'] or 'the link'}): {comm['comm_s'] * 1e3:.3g} ms of collectives "
            f"per optimizer step ({kinds} ms), {comm['exposed_s'] * 1e3:.3g} ms not hidden behind compute; with it "
            f"{comm['predicted_samples_per_s']:.1f} samples/s"
            + (f", {comm['predicted_tokens_per_s']:,.0f} tokens/s" if tokens else "")
        )


def _show_launch(
    out: Output,
    args: argparse.Namespace,
    parallel: Parallel,
    plan: Any,
    result: dict[str, Any],
    *,
    global_batch: int,
    micro_batch: int,
) -> None:
    """Print the command that launches this training (``result["launch_command"]``)."""
    train = ["--model", args.model, "--global-batch", str(global_batch), "--micro-batch", str(micro_batch)]
    for flag, value in (("--seq-len", args.seq_len), ("--dtype", args.dtype)):
        if value is not None:
            train += [flag, str(value)]
    train += ["--steps", "1000"]
    plan_file = getattr(args, "out", None)
    if plan_file is None and getattr(args, "policy", None) is not None:
        train += ["--policy", str(args.policy)]  # memfit train applies the same policy's plan
    result["launch_command"] = launch_command(
        parallel, train, plan_file=plan_file, gpus_per_node=getattr(args, "gpus_per_node", None)
    )
    nodes = (
        ""
        if "--nnodes" not in result["launch_command"]
        else " (on every node, with MASTER_ADDR set to the first node's address)"
    )
    out.print(f"launch{nodes}: {result['launch_command']}")
    if plan_file is None and getattr(args, "policy", None) is None and not plan.is_plain:
        out.print(
            "  add --out PLAN.json to write the plan: the launch command then applies it (memfit train --plan PLAN.json)."
        )


def _rank_fits(out: Output, result: dict[str, Any], rep: dict[str, Any], mem: dict[str, Any], budget: int) -> bool:
    """Print whether rank 0's peak fits ``budget`` (the amount over and the largest parts when not) into
    ``result``; whether it fits."""
    peak = rep.get("predicted_peak_bytes_with_accumulation", rep["predicted_peak_bytes"])
    result["fits"] = peak <= budget
    if result["fits"]:
        out.print(f"rank 0 fits: {mib(peak)} of {mib(budget)}")
        return True
    names = {
        "params_bytes": "parameters",
        "grads_bytes": "gradients",
        "optimizer_bytes": "optimizer state",
        "comm_bytes": "communication buffers",
    }
    parts = sorted(((n, mem[k]) for k, n in names.items() if mem.get(k)), key=lambda kv: -kv[1])
    rest = peak - sum(v for _, v in parts)
    parts = sorted([*parts, ("activations and the rest", rest)], key=lambda kv: -kv[1])[:3]
    result["over_bytes"] = peak - budget
    result["largest_parts"] = [{"part": n, "bytes": v} for n, v in parts]
    largest = ", ".join(f"{n} {mib(v)}" for n, v in parts)
    out.print(
        f"rank 0 does not fit ({mib(peak - budget)} over {mib(budget)}; largest parts {largest}): no launch command"
    )
    return False


def _communication(
    args: argparse.Namespace,
    stats: Any,
    plan: Any,
    *,
    accumulation_steps: int,
    window_s: float,
    global_batch: int,
    tokens: int | None,
    computed: tuple[float, CommTime] | None = None,
) -> dict[str, Any] | None:
    """The collectives of one optimizer step over the estimated device's links (memfit.plan.comm),
    or None when the stats name no device with links. The window's seconds with them are the
    compute-only window plus the simulated exposed communication (``computed``: as the fit did it)."""
    if computed is None:
        est = stats.calibration.estimated
        net = network_of(args, est.device if est is not None else None)
        if net is None:
            return None
        computed = window_with_comm(stats, plan, net, accumulation_steps=accumulation_steps, compute_window_s=window_s)
    with_comm_s, ct = computed
    net_gpus = getattr(args, "gpus_per_node", 8)
    d = ct.to_dict() | {
        "gpus_per_node": net_gpus,
        "window_s": with_comm_s,
        "predicted_samples_per_s": global_batch / with_comm_s,
    }
    if tokens:
        d["predicted_tokens_per_s"] = global_batch * tokens / with_comm_s
    return d


__all__ = [
    "network_of",
    "parallel_from_args",
    "reserved_fn_from_args",
    "reserved_line",
    "show_allocator",
    "show_rank",
    "tokens_per_sample",
]
