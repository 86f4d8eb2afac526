"""The verdict of ``memfit verify``: the tolerances a check is judged at, its notes, and the one
sentence that says why it failed.

:func:`memfit.verification.plans.verify` measures; this module judges what it measured: the
gradient tolerance and why (replayed ops, or sums in another order), the peak tolerance against the
plan's prediction and why, the notes a check prints, and the reason a check failed, the reasons
that are not memfit's first (:func:`failure_reason`, shared with
:func:`memfit.verification.accumulation.verify_accumulation`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import memfit.verification.gradients as grad_compare
from memfit.plan.costmodel import DEFAULT_MARGIN
from memfit.plan.types import Option, Plan
from memfit.units import format_bytes
from memfit.verification.islands import IslandReport
from memfit.verification.steps import StepsComparison


def largest_tiles(plan: Plan) -> int | None:
    """The most tiles of any tiled block of ``plan``, or None when no block is tiled."""
    return max((b.tiles for b in plan.blocks if b.tiles is not None), default=None)


def reorders_sums(plan: Plan, compile: str | None) -> bool:
    """Whether the planned model computes the same function with its sums in another order: a
    chunked head, fused activations, tiled blocks or the compiler (NOTE [ Gradient floor ] in
    :mod:`memfit.verification.gradients`)."""
    return (
        plan.head is not None or plan.activations is not None or compile is not None or largest_tiles(plan) is not None
    )


def grad_tolerance(plan: Plan, compile: str | None, dtype: torch.dtype, islands: IslandReport) -> tuple[float, str]:
    """The relative tolerance gradients are judged at (``VerifyResult.grad_rtol``) and why."""
    rtol = grad_compare.grad_rtol(dtype, reordered=reorders_sums(plan, compile))
    why = grad_rtol_reason(plan, compile, largest_tiles(plan), rtol, str(dtype).removeprefix("torch."))
    if islands.kept:  # NOTE [ float32 islands ]: what could not run in float64 is judged as float32
        rtol = max(rtol, grad_compare.grad_rtol(torch.float32, reordered=True))
        why = "float32 sums in another order: the model computes in float32 where memfit cannot promote it"
    return rtol, why


def grad_rtol_reason(plan: Plan, compile: str | None, tiles: int | None, rtol: float, dtype: str) -> str:
    """Why the gradients are judged at ``rtol`` (``VerifyResult.grad_rtol_reason``)."""
    why = []
    if tiles is not None:
        why.append(
            f"tiled blocks (up to {tiles} tiles) sum each parameter's gradient over the tiles, the same terms "
            f"as one sum over the sequence in another order: up to {tiles} more roundings at {dtype}'s unit "
            f"roundoff, well within {rtol:.0e} (NOTE [ Tiled gradients ] in memfit.apply.tiling)"
        )
    if plan.head is not None:
        why.append("the chunked head sums the loss's gradients over chunks")
    if plan.activations is not None:
        why.append("fused activations compute the same function in another order")
    if compile is not None:
        why.append("the compiler fuses and reorders")
    if not why:
        return "replayed ops: recomputation runs the forward's ops again in the same order"
    return "reordered sums: " + "; ".join(why)


def peak_tolerance(plan: Plan, compile: str | None, dtype: str) -> tuple[float | None, str]:
    """How far the measured peak may exceed the plan's predicted peak (a fraction; None: not
    checked) and why. The tolerance is the cost model's safety margin, the one the planner adds to
    every prediction before comparing it with the budget: a plan measured within it stays within
    the budget it was made for."""
    if plan.predicted_peak_bytes is None:
        return None, "not checked: the plan carries no predicted peak (a policy plan made without a profile)"
    if compile is not None:
        return None, "not checked: the prediction is of the eager step, the compiled step's peak is the compiler's"
    if plan.parallel is not None:
        return None, "not checked: the prediction is one rank's of a data-parallel job, this check runs one process"
    planned = ((plan.fingerprint or {}).get("model") or {}).get("dtype")
    if planned is not None and planned != dtype:
        return None, f"not checked: the plan was predicted for {planned} parameters, this check ran {dtype}"
    margin = plan.margin if plan.margin is not None else DEFAULT_MARGIN
    why = f"the cost model's safety margin ({margin:.0%}), which the planner adds to a prediction before comparing it with a budget"
    return margin, why


def verify_notes(
    plan: Plan,
    *,
    islands: IslandReport,
    peak_bytes: int,
    store_all_bytes: int,
    rtol: float,
    rtol_reason: str,
    dropouts_changed: int,
    memfit_graph_breaks: Sequence[str],
) -> tuple[str, ...]:
    """The notes ``memfit verify`` prints besides its verdict: float32 islands, a plan that saves
    nothing, the tolerance of tiled blocks, dropout turned off inside tiles (``dropouts_changed``
    modules of the two models together, the same in each) and graph breaks in memfit's own code."""
    notes = []
    if islands.note():
        notes.append(islands.note())
    changes = any(b.option is not Option.KEEP for b in plan.blocks) or bool(plan.segments)
    if changes and peak_bytes >= store_all_bytes:
        notes.append(no_saving_note(peak_bytes, store_all_bytes))
    if largest_tiles(plan) is not None:
        notes.append(f"tolerance {rtol:.0e}: {rtol_reason}")
    if dropouts_changed:
        notes.append(
            f"dropout off in the {dropouts_changed // 2} dropout module(s) inside tiled submodules, in both runs: "
            "tiling draws each tile's mask on its own (replayed exactly in its backward), as random as one mask "
            "over the sequence but not the same numbers (NOTE [ Tiled gradients ] in memfit.apply.tiling)"
        )
    if memfit_graph_breaks:
        notes.append(
            f"{len(memfit_graph_breaks)} graph breaks in memfit's code (torch.compile falls back to eager there): "
            f"{memfit_graph_breaks[0]}"
        )
    return tuple(notes)


def no_saving_note(peak_bytes: int, store_all_bytes: int) -> str:
    """The warning for a plan that recomputes blocks and yet peaks at or above keeping everything."""
    return (
        f"the plan's peak ({format_bytes(peak_bytes)}) is not below keeping every activation "
        f"({format_bytes(store_all_bytes)}): it recomputes without saving memory here (the peak lies "
        "outside the blocks, or the blocks are not what holds the activations; check `memfit profile`, "
        "or name the blocks with memfit.set_blocks(model, *paths))"
    )


def failure_reason(
    grads: grad_compare.GradComparison,
    rtol: float,
    *,
    ref_loss: float,
    dtype: str,
    unequal_buffers: Sequence[str] = (),
    over_budget: tuple[int, int] | None = None,
    over_prediction: tuple[int, int, float] | None = None,
    after_steps: StepsComparison | None = None,
) -> str:
    """Why a verification failed, first the reasons that are not memfit's (one sentence)."""
    if not math.isfinite(ref_loss) or not grads.ref_finite:
        what = f"loss is {ref_loss}" if not math.isfinite(ref_loss) else "gradients are not finite"
        return (
            f"the unmodified model's own {what} in {dtype}, without memfit: the comparison is meaningless "
            "and this is not memfit's doing. Verify in a wider dtype (--dtype float32 or float64), or fix "
            "the model's numerics in this dtype first."
        )
    if grads.missing:
        return f"parameter {grads.missing[0]} has a gradient in one run only ({len(grads.missing)} such)"
    if grads.max_rel_err > rtol:
        return f"gradients differ: {grads.worst_param} by {grads.max_rel_err:.3g} relative (tolerance {rtol:.0e})"
    if unequal_buffers:
        return f"buffers differ: {', '.join(list(unequal_buffers)[:3])}"
    if over_budget is not None:
        return f"the measured peak {format_bytes(over_budget[0])} is over the budget {format_bytes(over_budget[1])}"
    if over_prediction is not None:
        measured, predicted, tol = over_prediction
        return (
            f"the measured peak {format_bytes(measured)} is {measured / predicted - 1:.1%} over the plan's predicted "
            f"{format_bytes(predicted)}, beyond the {tol:.0%} tolerance (the cost model's safety margin): the plan's "
            "budget does not hold for this model. Plan again with a larger --margin, and check `memfit profile`'s chain"
        )
    if after_steps is not None and not after_steps.params_ok:
        a = after_steps
        absolute = a.params_tolerance_kind == "absolute"
        err = a.params_after_steps_max_abs_err if absolute else a.params_after_steps_max_rel_err
        return (
            f"parameters or optimizer state differ from plain training after {a.optimizer_steps} optimizer steps: "
            f"{err:.3g} ({a.params_tolerance_kind}, tolerance {a.params_tolerance:.0e}); check with --states device"
        )
    return "unknown"
