"""Model states placed in estimates: ``memfit estimate --states``, and the check before any fake step
that ``estimate``, ``plan --estimate`` and ``fit --estimate`` make (NOTE [ Model states by placement ]
in :mod:`memfit.estimation.states`)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from memfit.capture.chain import discover_chain
from memfit.cli.common import Output, mib
from memfit.errors import BudgetInfeasibleError
from memfit.estimation.devices import get_device
from memfit.estimation.states import (
    Placed,
    StateSizes,
    available_host_bytes,
    place,
    placed_peak_bytes,
    placed_step_s,
    state_sizes,
    states_floor,
)
from memfit.optim.states import ModelStates
from memfit.units import format_bytes
from memfit.workload import Workload

STATES_CHOICES = ("auto", *(m.value for m in ModelStates))


def sizes_of(wl: Workload, args: argparse.Namespace) -> StateSizes:
    """The model states' sizes of a fake-built workload (shapes only), its blocks as the units."""
    blocks = discover_chain(wl.model, wl.blocks).blocks
    return state_sizes(
        wl.model,
        optimizer=getattr(args, "optimizer", "adamw"),
        master_weights=getattr(args, "master_weights", False),
        blocks=blocks,
    )


def host_budget_of(args: argparse.Namespace) -> int | None:
    """``--host-budget``, else this machine's available memory less the margin."""
    given = getattr(args, "host_budget", None)
    return given if given is not None else available_host_bytes()


def check_floor(args: argparse.Namespace, wl: Workload, *, command: str, budget_bytes: int | None) -> Placed | None:
    """``fit``/``plan --estimate``: refuse before any fake step when the model states alone exceed the
    budget with the placements the command runs (every state on the device, or ``--states`` where the
    command has it); with ``--parallel fsdp2`` each rank holds ``1/world`` of them."""
    if budget_bytes is None:
        return None
    given = getattr(args, "states", None)
    if given == "auto" and not getattr(args, "parallel", None):  # plan/fit --estimate --states auto: what they plan
        placements = [ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD]
    else:
        placements = [ModelStates.DEVICE] if given in (None, "auto") else [ModelStates.parse(given)]
    world = getattr(args, "world_size", 1) or 1
    per_rank = budget_bytes * world if getattr(args, "parallel", None) == "fsdp2" else budget_bytes
    sizes = sizes_of(wl, args)
    hint = ""
    if world == 1 and len(placements) < len(ModelStates):  # the host placements: priced by memfit estimate
        best = min((place(sizes, m) for m in ModelStates), key=lambda p: p.device_states_bytes)
        hint = (
            f"With placement {best.states.value} they need {format_bytes(best.device_states_bytes)} on the device: "
            f"`{estimate_call(args)}` prices every placement."
        )
    return states_floor(
        sizes,
        budget_bytes=per_rank,
        host_budget_bytes=None if placements == [ModelStates.DEVICE] else host_budget_of(args),
        placements=placements,
        subsystem=f"memfit {command}",
        hint=hint,
    )


def estimate_call(args: argparse.Namespace) -> str:
    """The ``memfit estimate`` call that prices every placement of this job."""
    words = ["memfit", "estimate", "--model", args.model]
    batch = getattr(args, "batch_size", None) or getattr(args, "min_micro_batch", None)
    for flag, value in (("--batch-size", batch), ("--seq-len", args.seq_len), ("--dtype", args.dtype)):
        if value is not None and value != "auto":
            words += [flag, str(value)]
    target = getattr(args, "target", None) or getattr(args, "device", None)  # plan/fit: --target; estimate: --device
    words += ["--optimizer", getattr(args, "optimizer", "adamw"), "--device", str(target), "--states", "auto"]
    return shlex.join(words)


def refuse_early(
    args: argparse.Namespace, wl: Workload, out: Output, budget_bytes: int | None
) -> dict[str, Any] | None:
    """``memfit estimate``: when model states alone (with the best placement ``--states`` allows) do
    not fit, the answer without any fake step; None when they may fit."""
    if budget_bytes is None:
        return None
    sizes = sizes_of(wl, args)
    allowed = list(ModelStates) if args.states == "auto" else [ModelStates.parse(args.states)]
    host = host_budget_of(args)
    try:
        states_floor(
            sizes, budget_bytes=budget_bytes, host_budget_bytes=host, placements=allowed, subsystem="memfit estimate"
        )
    except BudgetInfeasibleError as err:
        placed = [place(sizes, m) for m in allowed]
        ok = [p for p in placed if host is None or p.host_bytes <= host]
        # the placement the refusal names: the least device need within the host budget, else the least host need
        best = min(ok, key=lambda p: p.device_states_bytes) if ok else min(placed, key=lambda p: p.host_bytes)
        device = _device_parts(best, activations=0, other=sizes.buffers_bytes)
        over = max(device["peak_bytes"] - budget_bytes, 0)
        result = _verdict(
            best, device, budget_bytes, host, over_bytes=over, host_over=host is not None and best.host_bytes > host
        )
        out.print(f"[bold]{wl.name}[/]: {err}".replace("memfit estimate: ", ""))
        out.print(_verdict_line(result))
        return {"model": wl.name, "refused_before_fake_step": True, "reason": str(err)} | result
    return None


def choose(
    args: argparse.Namespace,
    est: Any,
    wl_sizes: StateSizes,
    *,
    budget_bytes: int | None,
    host_rate: float | None = None,
    in_backward: Any = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each allowed placement priced from the device step's estimate ``est``; the chosen one's verdict
    (auto: the fastest that fits the device and host budgets, else the least device peak) and the rows.
    ``in_backward``: the estimate of the fake step run with the step inside the backward, whose peak
    ``step-in-backward`` takes (else the arithmetic's upper bound)."""
    b = est.breakdown
    timing = b.get("time", {})
    compute_s, opt_s = timing.get("compute_s"), timing.get("optimizer_s")
    total = max(est.flops, 1)
    link = get_device(est.device).host_bytes_per_s if est.device else None
    host = host_budget_of(args)
    allowed = list(ModelStates) if args.states == "auto" else [ModelStates.parse(args.states)]
    rows = []
    for m in allowed:
        p = place(wl_sizes, m)
        peak = placed_peak_bytes(
            p,
            wl_sizes,
            device_peak_bytes=est.peak_bytes,
            start_bytes=b["start_bytes"],
            activations_bytes=est.activations_bytes,
        )
        stepped = in_backward is not None and m is ModelStates.STEP_IN_BACKWARD
        peak = in_backward.peak_bytes if stepped else peak
        step_s = None
        if compute_s is not None:
            step_s = placed_step_s(
                p, compute_s=compute_s, backward_s=compute_s * b["backward_flops"] / total, device_optimizer_s=opt_s,
                host_link_bytes_per_s=link, **({"host_optimizer_bytes_per_s": host_rate} if host_rate else {}),
            )  # fmt: skip
        fits_device = None if budget_bytes is None else peak <= budget_bytes
        fits_host = host is None or p.host_bytes <= host
        rows.append(
            {"placed": p, "peak_bytes": peak, "step_s": step_s, "fits_device": fits_device, "fits_host": fits_host,
             "peak_from": "fake step" if m is ModelStates.DEVICE or stepped else "arithmetic"}
        )  # fmt: skip
    order = {m: i for i, m in enumerate(ModelStates)}
    fitting = [r for r in rows if r["fits_device"] is not False and r["fits_host"]]
    if fitting:
        unknown = 0.0 if compute_s is None else float("inf")  # no device time: the placements' order
        pick = min(fitting, key=lambda r: (unknown if r["step_s"] is None else r["step_s"], order[r["placed"].states]))
    else:  # none fits: the least device peak, within the host budget where one is
        pick = min([r for r in rows if r["fits_host"]] or rows, key=lambda r: r["peak_bytes"])
    p = pick["placed"]
    other = pick["peak_bytes"] - p.device_states_bytes - est.activations_bytes
    device = _device_parts(p, activations=est.activations_bytes, other=other)
    device["peak_bytes"] = pick["peak_bytes"]
    over = None if budget_bytes is None else max(pick["peak_bytes"] - budget_bytes, 0)
    verdict = _verdict(p, device, budget_bytes, host, over_bytes=over, host_over=not pick["fits_host"])
    verdict["predicted_step_s"] = pick["step_s"]
    tokens = est.batch_size * est.seq_len if est.seq_len else None
    table = [_row(r, tokens) for r in rows]
    return verdict, table


def wants_in_backward_step(args: argparse.Namespace, est: Any, sizes: StateSizes, budget_bytes: int | None) -> bool:
    """Whether to run the fake step with the step inside the backward (its exact peak): when
    ``--states step-in-backward`` asks for it, or ``auto`` where the device step does not fit and the
    arithmetic's bound leaves it open (NOTE [ Model states by placement ])."""
    if getattr(args, "master_weights", False):
        return False
    if args.states == ModelStates.STEP_IN_BACKWARD.value:
        return True
    if args.states != "auto" or budget_bytes is None or est.peak_bytes <= budget_bytes:
        return False
    p = place(sizes, ModelStates.STEP_IN_BACKWARD)
    bound = placed_peak_bytes(
        p, sizes, device_peak_bytes=est.peak_bytes, start_bytes=est.breakdown["start_bytes"],
        activations_bytes=est.activations_bytes,
    )  # fmt: skip
    return bound - p.device_grads_bytes - p.step_temp_bytes <= budget_bytes


def show_states(out: Output, verdict: dict[str, Any], table: list[dict[str, Any]]) -> None:
    """The placements' table and the verdict line."""
    rows = [
        (
            ("-> " if r["states"] == verdict["states"] else "") + r["states"],
            mib(r["device_peak_bytes"]),
            mib(r["host_bytes"]),
            "?" if r["step_s"] is None else f"{r['step_s'] * 1e3:,.0f} ms",
            "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}",
            {True: "yes", False: "no", None: "?"}[r["fits"]],
        )
        for r in table
    ]
    out.table("model states placed", ["placement", "device peak", "host", "step", "tokens/s", "fits"], rows)
    out.print(_verdict_line(verdict))


# ---------------------------------------------------------------- private machinery


def _device_parts(p: Placed, *, activations: int, other: int) -> dict[str, int]:
    parts = {
        "params_bytes": p.device_params_bytes,
        "grads_bytes": p.device_grads_bytes,
        "optimizer_bytes": p.device_optimizer_bytes + p.step_temp_bytes,
        "activations_bytes": activations,
        "other_bytes": other,
    }
    return parts | {"peak_bytes": sum(parts.values())}


def _verdict(
    p: Placed, device: dict[str, int], budget: int | None, host: int | None, *, over_bytes: int | None, host_over: bool
) -> dict[str, Any]:
    host_parts = {
        "params_bytes": p.host_params_bytes,
        "grads_bytes": p.host_grads_bytes,
        "optimizer_bytes": p.host_optimizer_bytes,
    }
    fits = None if budget is None else (over_bytes == 0 and not host_over)
    names = {"params_bytes": "parameters", "grads_bytes": "gradients", "optimizer_bytes": "optimizer state",
             "activations_bytes": "activations", "other_bytes": "buffers and batch"}  # fmt: skip
    largest = sorted(((names[k], v) for k, v in device.items() if k in names and v > 0), key=lambda kv: -kv[1])[:3]
    out: dict[str, Any] = {
        "fits": fits,
        "states": p.states.value,
        "budget_bytes": budget,
        "host_budget_bytes": host,
        "device_bytes": device,
        "host_bytes": host_parts | {"total_bytes": p.host_bytes},
        "largest_parts": [{"part": n, "bytes": v} for n, v in largest],
        "host_link_bytes_per_step": p.link_bytes,
    }
    if fits is False:
        out["over_bytes"] = over_bytes
        if host_over:
            out["host_over_bytes"] = p.host_bytes - (host or 0)
    return out


def _verdict_line(v: dict[str, Any]) -> str:
    where = f"with model states placed {v['states']}"
    if v["fits"] is None:
        return f"{where}: no budget or device memory known (give --device NAME or --budget SIZE) to say whether it fits"
    if v["fits"]:
        return f"fits {where}: device peak {mib(v['device_bytes']['peak_bytes'])} of {mib(v['budget_bytes'])}, host {mib(v['host_bytes']['total_bytes'])}"
    largest = ", ".join(f"{p['part']} {mib(p['bytes'])}" for p in v["largest_parts"])
    host = (
        f"; host {mib(v['host_bytes']['total_bytes'])} over the host budget by {mib(v['host_over_bytes'])}"
        if "host_over_bytes" in v
        else ""
    )
    return f"does not fit {where} ({mib(v['over_bytes'])} over {mib(v['budget_bytes'])}; largest parts {largest}{host})"


def _row(r: dict[str, Any], tokens: int | None) -> dict[str, Any]:
    p: Placed = r["placed"]
    fits = None if r["fits_device"] is None else bool(r["fits_device"] and r["fits_host"])
    return {
        "states": p.states.value,
        "device_peak_bytes": r["peak_bytes"],
        "device_states_bytes": p.device_states_bytes,
        "host_bytes": p.host_bytes,
        "step_s": r["step_s"],
        "tokens_per_s": tokens / r["step_s"] if tokens and r["step_s"] else None,
        "fits": fits,
        "fits_host": r["fits_host"],
        "peak_from": r["peak_from"],
        "host_link_bytes_per_step": p.link_bytes,
    }


__all__ = [
    "check_floor",
    "choose",
    "estimate_call",
    "refuse_early",
    "show_states",
    "sizes_of",
    "wants_in_backward_step",
]
