"""``--measure-choice`` of ``memfit plan`` and ``memfit fit``: after solving, time the solver's plan
beside the strongest alternatives that fit the budget and keep the fastest measured
(:mod:`memfit.fitting.choice`, NOTE [ Choosing by measurement ]). On by default on CUDA, where the
cost model's order was seen wrong; on the CPU only when asked (it runs a few steps per candidate)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from memfit.cli.common import Output, mib, settle_model, step_from_args
from memfit.cli.device import resolve_device
from memfit.cli.parallel import reserved_fn_from_args
from memfit.errors import SpecError
from memfit.fitting import stats_at
from memfit.fitting.choice import MeasuredChoice, choose_by_measurement


def settle(args: argparse.Namespace, out: Output, *, command: str) -> dict[str, Any]:
    """``--model`` (:func:`memfit.cli.common.settle_model`), then :func:`settle_device_and_choice`:
    :mod:`memfit.cli.main` calls it before ``memfit plan`` and ``memfit fit`` run."""
    settle_model(args)
    return settle_device_and_choice(args, out, command=command)


def settle_device_and_choice(args: argparse.Namespace, out: Output, *, command: str) -> dict[str, Any]:
    """:func:`memfit.cli.device.resolve_device`, then refuse a ``--measure-choice`` that cannot run
    (before any work: with ``--estimate`` the fake steps would run first)."""
    settled = resolve_device(args, out, command=command)
    wants_choice(args, command=command)
    return settled


def wants_choice(args: argparse.Namespace, *, command: str) -> bool:
    """Whether to choose by measurement: ``--measure-choice`` given, or left out on CUDA, for a budget
    solved on this machine (not ``--estimate``, ``--parallel`` or ``--policy``, which fix or predict the plan).

    Raises:
        SpecError: ``--measure-choice`` given where nothing can be timed.
    """
    asked = getattr(args, "measure_choice", None)
    if asked is False:
        return False
    blocked = [
        flag
        for flag, given in (
            ("--estimate", getattr(args, "estimate", False)),
            ("--parallel", bool(getattr(args, "parallel", None))),
            ("--policy", getattr(args, "policy", None) is not None),
            ("--compile", bool(getattr(args, "compile", None))),
            ("--no-measure", getattr(args, "no_measure", False)),
        )
        if given
    ]
    if asked and (blocked or getattr(args, "budget", None) is None):
        raise SpecError(
            f"memfit {command}: --measure-choice times plans for a --budget on this machine; "
            + (f"leave out {', '.join(blocked)} or --measure-choice." if blocked else "give --budget SIZE.")
        )
    if getattr(args, "choice_rounds", 3) < 1:
        raise SpecError(f"memfit {command}: --choice-rounds {args.choice_rounds} must be at least 1, e.g. 3.")
    on_cuda = str(getattr(args, "device", "cpu")).startswith("cuda")
    return bool(asked or (asked is None and on_cuda and not blocked and getattr(args, "budget", None) is not None))


def choose_plan(
    args: argparse.Namespace,
    out: Output,
    wl: Any,
    plan: Any,
    stats: Any,
    *,
    command: str,
    extra_bytes: int = 0,
    reserved_fn: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """The plan to keep and the JSON of its choice (``{}`` and ``plan`` itself when not choosing)."""
    if not wants_choice(args, command=command):
        return plan, {}
    with out.console.status("timing the plan against its alternatives ...") as status:
        choice = choose_by_measurement(
            wl, plan, stats, args.budget, step=step_from_args(args, batch_size=stats.batch_size, device=None),
            margin=getattr(args, "margin", 0.02), rounds=args.choice_rounds, extra_bytes=extra_bytes,
            reserved_fn=reserved_fn, progress=lambda s: status.update(f"measured choice: {s}"),
        )  # fmt: skip
    show_choice(out, choice)
    kept = choice.plan
    if kept is not plan:
        kept = kept.with_(budget_bytes=plan.budget_bytes)
    return kept, choice.to_dict()


def show_choice(out: Output, choice: MeasuredChoice) -> None:
    """The table of timed candidates and the line that says which was kept and why."""
    rows = [
        (
            c.label + (" <-" if c.label == choice.chosen else ""),
            mib(c.predicted_peak_bytes),
            mib(c.measured_peak_bytes) + ("" if c.fits_budget else " OVER"),
            f"{c.predicted_step_s * 1e3:.0f} ms",
            f"{c.measured_step_s * 1e3:.0f} ms",
            f"{c.vs_solver:.3f}x",
            f"{c.time_model_ratio:.2f}",
        )
        for c in choice.candidates
    ]
    out.table(
        f"measured choice within {mib(choice.budget_bytes)} ({choice.rounds} interleaved rounds)",
        [
            "candidate",
            "predicted peak",
            "measured peak",
            "predicted step",
            "measured step",
            "vs memfit",
            "measured/predicted",
        ],
        rows,
    )
    out.print(f"kept {choice.chosen}: {choice.reason}")
    tm = choice.time_model
    if tm is not None:  # NOTE [ The time model learns ] in memfit.fitting.time_model
        out.print(
            f"time model: measured/predicted {tm.ratio_before:.2f} (median), {tm.ratio_after:.2f} once calibrated on "
            f"these rounds (keep-all step x{tm.keep_scale:.2f}, what a plan changes x{tm.change_scale:.2f}"
            + (f", {tm.step_overhead_s * 1e3:.2f} ms per step" if "overhead" in tm.fitted else "")
            + ")"
        )


def choose_for_plan(args: argparse.Namespace, out: Output, wl: Any, res: Any) -> tuple[Any, dict[str, Any]]:
    """``memfit plan``: its ``PlanResult`` with the kept plan, and the choice's JSON."""
    plan, d = choose_plan(
        args, out, wl, res.plan, res.stats, command="plan", reserved_fn=reserved_fn_from_args(args, wl)
    )
    return (res if plan is res.plan else dataclasses.replace(res, plan=plan)), d


def choose_for_fit(args: argparse.Namespace, out: Output, wl: Any, res: Any) -> tuple[Any, dict[str, Any]]:
    """``memfit fit``: its ``FitResult`` with the kept plan at the chosen micro-batch, and the
    choice's JSON. With accumulation the gradients kept between micro-steps count against the budget."""
    if not wants_choice(args, command="fit"):
        return res, {}
    stats = stats_at(list(res.profiles.values()), res.micro_batch)
    extra = res.grads_bytes if res.accumulation_steps > 1 else 0
    plan, d = choose_plan(
        args, out, wl, res.plan, stats, command="fit", extra_bytes=extra, reserved_fn=reserved_fn_from_args(args, wl)
    )
    return (res if plan is res.plan else dataclasses.replace(res, plan=plan)), d
