"""verify: show that a plan changes memory and time, not training.

The planned model and the unmodified model start from the same weights, see the same batch and
draw the same dropout masks; their gradients and buffers after one steady-state step are compared,
and their peaks and step times are measured side by side in one process.

With ``compile="block"`` or ``"model"`` the planned model is compiled after the plan is applied
(:func:`memfit.apply.compiled.compile_applied`) and checked against the unmodified model run
eagerly: the check covers the plan and the compiler together. Graph breaks are counted while it
compiles (:class:`memfit.capture.compiled.GraphBreaks`), those in memfit's own code apart. Inductor
draws dropout masks from its own generator, so the compiled run uses
``torch._inductor.config.fallback_random`` (torch's generator, the eager masks); gradients are
judged with the tolerance of reordered sums (the compiler fuses and reorders). Peaks of both runs
are then measured with the profiler (:func:`memfit.capture.compiled.profiled_step_peak_bytes`):
the live-tensor tracker cannot see compiled code.

The steps both models take side by side are :mod:`memfit.verification.runs`'s; the
tolerances, notes and the reason a check failed are :mod:`memfit.verification.verdict`'s.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memfit.verification.gradients as grad_compare
from memfit.apply.engine import apply_plan, remove_plan
from memfit.capture.compiled import GraphBreaks
from memfit.capture.snapshot import copy_model, leave_unchanged
from memfit.capture.step import (
    StepSpec,
    make_optimizer,
)
from memfit.errors import MemfitError, SpecError
from memfit.optim import ModelStates, release_optimizer
from memfit.plan.types import Plan
from memfit.verification.runs import (
    FirstStep,
    compare_buffers,
    compiled_in_place,
    compiling,
    first_step,
    run_eagerly,
    steady_peaks,
    tiled_dropout_off,
    timed_steps,
)
from memfit.verification.steps import StepsComparison, compare_after_steps
from memfit.verification.verdict import (
    failure_reason,
    grad_tolerance,
    peak_tolerance,
    reorders_sums,
    verify_notes,
)
from memfit.verification.verdict import no_saving_note as no_saving_note  # memfit plan's warning, from here
from memfit.workload import Batch, Workload, cast_batch

# Gradient tolerances by dtype (NOTE [ Gradient floor ] in memfit.verification.gradients): recomputation
# replays the same ops, so on CPU gradients are normally bitwise equal; a head option (the chunked
# loss, memfit.apply.head) and fused activations (memfit.apply.activations) compute the same function
# in another order (float32: about 1e-6 relative, not bitwise; float64 keeps the 1e-10 bar).
# Where memfit's own graph breaks are (GraphBreaks reasons start with the file): the whole package,
# the plan's wrappers in memfit.apply included.
_MEMFIT_SOURCE = str(Path(__file__).resolve().parents[1]) + os.sep
GRAD_RTOL = grad_compare.GRAD_RTOL
GRAD_RTOL_REORDERED = grad_compare.GRAD_RTOL_REORDERED


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyResult:
    """What ``memfit verify`` reports (field names are the JSON contract)."""

    ok: bool
    max_grad_rel_err: float
    grad_rtol: float
    buffers_equal: bool
    measured_peak_bytes: int
    baseline_peak_bytes: int
    budget_bytes: int | None
    measured_step_s: float | None
    baseline_step_s: float | None
    policy: str
    batch_size: int
    dtype: str
    worst_param: str | None
    unequal_buffers: tuple[str, ...]
    reason: str | None = None
    notes: tuple[str, ...] = ()
    compile: str | None = None
    graph_breaks: int | None = None
    memfit_graph_breaks: int | None = None
    graph_break_reasons: tuple[str, ...] = ()
    compile_s: float | None = None
    peak_method: str = "tracker"
    grad_rtol_reason: str = "replayed ops: recomputation runs the forward's ops again in the same order"
    float32_islands: tuple[dict[str, Any], ...] = ()
    float32_kept: tuple[dict[str, Any], ...] = ()
    predicted_peak_bytes: int | None = None
    peak_rtol: float | None = None
    peak_rtol_reason: str = ""
    states: str = "device"  # the planned model's model-states placement (memfit.optim.ModelStates)
    after_steps: dict[str, Any] | None = None  # with a placement: StepsComparison.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


def compare_grads(model: nn.Module, ref: nn.Module) -> tuple[float, str | None]:
    """Max over parameters of ``max|g - g_ref| / max(max|g_ref|, 1e-3 G)`` and the worst
    parameter's name, where ``G`` is the largest reference gradient of any parameter
    (:func:`memfit.verification.gradients.compare_gradients`, NOTE [ Gradient floor ]). A parameter with a
    gradient in one model and none in the other counts as error ``inf``.
    """
    res = grad_compare.compare_gradients(grad_compare.model_grads(model), grad_compare.model_grads(ref))
    return res.max_rel_err, res.worst_param


def verify(
    workload: Workload,
    plan: Plan,
    *,
    step: StepSpec | None = None,
    budget_bytes: int | None = None,
    compile: str | None = None,
    compile_backend: str | Callable[..., Any] = "inductor",
    on_allocations: Callable[[list[tuple[int, int]]], None] | None = None,
) -> VerifyResult:
    """Run the planned and the unmodified model side by side and compare them.

    Measuring never changes the model: both runs take optimizer steps and draw random numbers, and
    afterwards the workload's model has its parameters, buffers, gradients, flags, applied plan and
    the RNGs back bitwise, also when the check raises; the step's ``dtype`` and ``device`` run on a cast copy
    (NOTE [ Measuring leaves the model as it was ] in :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload; a plan applied to its model is lifted while checking.
        plan: the plan to check (from a policy, the planner or a file).
        step: the step checked (:class:`~memfit.capture.step.StepSpec`; ``dtype`` float64 for the
            tightest comparison; ``repeats``: interleaved timing repeats, default 3, 0 skips timing).
        budget_bytes: when given, ``ok`` also requires the measured peak to be within it.
        compile: ``"block"`` or ``"model"``: compile the planned model after applying the plan
            (each block, in torchtitan's order, or the whole model) and check it against the
            unmodified model run eagerly; the result then reports the graph breaks and the
            compile time, and both peaks are measured with the profiler. None: no compiling.
        compile_backend: the ``torch.compile`` backend with ``compile`` (a name or a callable).
        on_allocations: called with the planned model's measured step as the tracker recorded it
            (:attr:`~memfit.capture.tracker.MemoryTracker.allocations`; ``memfit verify --snapshot``):
            replayed, its peak is ``measured_peak_bytes`` (the tracker's; on CUDA the result reports
            the allocator's). Not called with ``compile`` (the profiler measures compiled steps).

    Returns:
        A :class:`VerifyResult`; ``ok`` is True when gradients agree within ``grad_rtol``, all
        buffers are equal, and the peak is within the budget (when one is given).
    """
    step = step or StepSpec()
    with leave_unchanged(workload.model, device=step.device, dtype=step.dtype) as model:
        if model is not workload.model:
            workload = dataclasses.replace(workload, model=model)
        return _verify(
            workload,
            plan,
            batch_size=step.batch_size,
            dtype=step.dtype,
            budget_bytes=budget_bytes,
            optimizer=step.optimizer,
            seed=step.seed,
            repeats=step.repeats_or(3),
            device=step.device,
            compile=compile,
            compile_backend=compile_backend,
            states=placement_of(plan, step),
            on_allocations=on_allocations,
        )


def placement_of(plan: Plan, step: StepSpec) -> ModelStates:
    """The placement a plan is checked with: the plan's own, else the step's; two that differ are refused."""
    if plan.states != ModelStates.DEVICE and step.states not in (ModelStates.DEVICE, plan.states):
        raise SpecError(
            f"memfit.verify: the plan was made for the model states placed {plan.states!r} and the step asks "
            f"for {str(step.states)!r}. Leave out --states, or plan again with --states {step.states}."
        )
    return ModelStates(plan.states) if plan.states != ModelStates.DEVICE else step.states


def _verify(
    workload: Workload,
    plan: Plan,
    *,
    batch_size: int | None,
    dtype: torch.dtype | None,
    budget_bytes: int | None,
    optimizer: str,
    seed: int,
    repeats: int,
    device: torch.device | str | None,
    compile: str | None = None,
    compile_backend: str | Callable[..., Any] = "inductor",
    states: ModelStates = ModelStates.DEVICE,
    on_allocations: Callable[[list[tuple[int, int]]], None] | None = None,
) -> VerifyResult:
    """:func:`verify` on the model as it is (moved and cast already, inside the snapshot); the
    planned model's optimizer placed as ``states`` says, the unmodified model's plain."""
    bs = batch_size or workload.default_batch_size
    model, batch = _placed(workload, device=device, dtype=dtype, batch_size=bs, seed=seed)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    eff_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    remove_plan(model)
    model.zero_grad(set_to_none=True)  # deepcopy does not copy .grad: start both without
    in_place = compiled_in_place(model)  # NOTE [ Blocks compiled in place ]
    ref = copy_model(model)
    run_eagerly(ref)
    apply_plan(model, plan, batch=batch)
    dropouts = tiled_dropout_off(plan, model, ref)  # restored in the finally below
    breaks = GraphBreaks()
    opt = opt_ref = None
    steps: list[int] = []  # the reference's optimizer steps, counted by a hook
    loss_fn = workload.loss_fn
    try:
        with compiling(model, compile, compile_backend, in_place=in_place):
            first = first_step(model, ref, batch, loss_fn, seed=seed, dtype=eff_dtype, breaks=breaks, compile=compile)
            opt_ref = make_optimizer(ref, optimizer)
            opt_ref.register_step_post_hook(lambda *_: steps.append(1))
            opt = make_optimizer(model, optimizer, states=states)
            peaks = steady_peaks(
                model,
                ref,
                batch,
                loss_fn,
                (opt, opt_ref),
                seed=seed,
                compile=compile,
                device=dev,
                on_allocations=on_allocations,
            )
            unequal = first.unequal_buffers or compare_buffers(model, ref)
            times = timed_steps(model, ref, batch, loss_fn, (opt, opt_ref), seed=seed, repeats=repeats)
    except torch.utils.checkpoint.CheckpointError as e:
        raise _recompute_mismatch(e, compile) from e
    finally:
        release_optimizer(opt)
        remove_plan(model)
        for m, p in dropouts:
            m.p = p
    rtol, why_rtol = grad_tolerance(plan, compile, eff_dtype, first.islands)
    after = None
    if states != ModelStates.DEVICE:  # NOTE [ Tolerance after steps ] in memfit.verification.steps
        exact = not reorders_sums(plan, compile) and dev.type == "cpu" and not first.islands.kept
        after = compare_after_steps(model, ref, opt, opt_ref, steps=len(steps), exact=exact, grad_rtol=rtol)
    runs = _Runs(
        first=first,
        dtype=eff_dtype,
        batch_size=bs,
        grad_rtol=rtol,
        grad_rtol_reason=why_rtol,
        unequal_buffers=unequal,
        base_peak_bytes=peaks[0],
        plan_peak_bytes=peaks[1],
        times=times,
        graph_breaks=breaks,
        dropouts_changed=len(dropouts),
        after=after,
    )
    return _verdict(plan, runs, compile=compile, budget_bytes=budget_bytes, states=states)


def _placed(
    workload: Workload, *, device: torch.device | str | None, dtype: torch.dtype | None, batch_size: int, seed: int
) -> tuple[nn.Module, Batch]:
    """The workload's model moved to ``device`` and cast to ``dtype`` (when given), and a batch of
    ``batch_size`` drawn after seeding with ``seed``, cast alike."""
    model = workload.model
    if device is not None:
        model.to(device)
    if dtype is not None:
        model.to(dtype=dtype)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    torch.manual_seed(seed)
    batch = cast_batch(workload.make_batch(batch_size), dtype=dtype, device=dev)
    return model, batch


@dataclass(frozen=True, kw_only=True, slots=True)
class _Runs:
    """What the side-by-side steps measured, and the gradient tolerance they are judged at, for
    :func:`_verdict`."""

    first: FirstStep
    dtype: torch.dtype  # the parameters' dtype the check ran
    batch_size: int
    grad_rtol: float
    grad_rtol_reason: str
    unequal_buffers: tuple[str, ...]
    base_peak_bytes: int
    plan_peak_bytes: int
    times: dict[str, float]  # median step seconds by "baseline" and "plan"; empty when not timed
    graph_breaks: GraphBreaks
    dropouts_changed: int  # dropout modules set to p = 0 inside tiles, of both models together
    after: StepsComparison | None  # with a placement of the model states: after the optimizer steps


def _recompute_mismatch(e: torch.utils.checkpoint.CheckpointError, compile: str | None) -> MemfitError:
    """The error for a recompute that did not match its forward, with the way out."""
    cause = (
        "Compiled, a block whose compiled forward recompiled between its forward and its recompute "
        "(pytorch/pytorch#166926) does this: compile the whole model (--compile model), or keep that block (option 'keep')."
        if compile is not None
        else "The block's forward is not deterministic in what it saves; keep that block (option 'keep')."
    )
    return MemfitError(f"memfit.verify: the recompute of a block did not match its forward ({e}). {cause}")


def _verdict(
    plan: Plan, runs: _Runs, *, compile: str | None, budget_bytes: int | None, states: ModelStates
) -> VerifyResult:
    """The check's result: gradients within the tolerance, buffers equal, the peak within the
    budget and the plan's prediction, the parameters after steps (with a placement), and the notes."""
    rtol = runs.grad_rtol
    first, plan_peak, after = runs.first, runs.plan_peak_bytes, runs.after
    dtype_name = str(runs.dtype).removeprefix("torch.")
    within = budget_bytes is None or plan_peak <= budget_bytes
    peak_rtol, why_peak = peak_tolerance(plan, compile, dtype_name)
    predicted = plan.predicted_peak_bytes
    over_prediction = peak_rtol is not None and predicted is not None and plan_peak > predicted * (1 + peak_rtol)
    ok = bool(
        first.grads.ok(rtol)
        and not runs.unequal_buffers
        and within
        and not over_prediction
        and (after is None or after.params_ok)
    )
    breaks = runs.graph_breaks
    ours = tuple(r for r in breaks.reasons if r.startswith(_MEMFIT_SOURCE))
    reason = None
    if not ok:
        reason = failure_reason(
            first.grads,
            rtol,
            ref_loss=first.ref_loss,
            dtype=dtype_name,
            unequal_buffers=runs.unequal_buffers,
            over_budget=None if within else (plan_peak, budget_bytes),
            over_prediction=(plan_peak, predicted, peak_rtol) if over_prediction else None,
            after_steps=after,
        )
    notes = verify_notes(
        plan,
        islands=first.islands,
        peak_bytes=plan_peak,
        store_all_bytes=runs.base_peak_bytes,
        rtol=rtol,
        rtol_reason=runs.grad_rtol_reason,
        dropouts_changed=runs.dropouts_changed,
        memfit_graph_breaks=ours,
    )
    return VerifyResult(
        ok=ok,
        reason=reason,
        notes=notes,
        max_grad_rel_err=first.grads.max_rel_err,
        grad_rtol=rtol,
        buffers_equal=not runs.unequal_buffers,
        measured_peak_bytes=plan_peak,
        baseline_peak_bytes=runs.base_peak_bytes,
        budget_bytes=budget_bytes,
        measured_step_s=runs.times.get("plan"),
        baseline_step_s=runs.times.get("baseline"),
        policy=plan.policy,
        batch_size=runs.batch_size,
        dtype=dtype_name,
        worst_param=first.grads.worst_param,
        unequal_buffers=runs.unequal_buffers,
        compile=compile,
        graph_breaks=breaks.count if compile is not None else None,
        memfit_graph_breaks=len(ours) if compile is not None else None,
        graph_break_reasons=tuple(breaks.reasons),
        compile_s=first.compile_s,
        peak_method="tracker" if compile is None else "profiler",
        grad_rtol_reason=runs.grad_rtol_reason,
        predicted_peak_bytes=predicted,
        peak_rtol=peak_rtol,
        peak_rtol_reason=why_peak,
        float32_islands=tuple(first.islands.promoted_json()),
        float32_kept=tuple(first.islands.kept_json()),
        states=str(states),
        after_steps=after.to_dict() if after is not None else None,
    )
