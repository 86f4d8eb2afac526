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

Size: about 515 lines, over the ~500 of other modules: ``verify`` and the one step it runs on two models
side by side, with the NOTE on blocks a user compiled in place beside the code that handles them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memfit.verification.gradients as grad_compare
from memfit.apply.compiled import compile_applied
from memfit.apply.engine import apply_plan, remove_plan
from memfit.capture.compiled import GraphBreaks, profiled_step_peak_bytes
from memfit.capture.snapshot import copy_model, leave_unchanged
from memfit.capture.step import (
    StepSpec,
    make_optimizer,
    measure_step,
    step_runner,
    time_steps,
    training_step,
    warm_up,
)
from memfit.capture.tracker import MemoryTracker
from memfit.errors import MemfitError, SpecError
from memfit.optim import ModelStates, release_optimizer
from memfit.plan.costmodel import DEFAULT_MARGIN
from memfit.plan.types import Option, Plan
from memfit.units import format_bytes
from memfit.verification.islands import Float32Islands, IslandReport, LowPrecisionOps
from memfit.verification.steps import StepsComparison, compare_after_steps
from memfit.workload import Workload, cast_batch

# Gradient tolerances by dtype (NOTE [ Gradient floor ] in memfit.verification.gradients): recomputation
# replays the same ops, so on CPU gradients are normally bitwise equal; a head option (the chunked
# loss, memfit.apply.head) and fused activations (memfit.apply.activations) compute the same function
# in another order (float32: about 1e-6 relative, not bitwise; float64 keeps the 1e-10 bar).
_MEMFIT_SOURCE = str(
    Path(__file__).parent
)  # where memfit's own graph breaks are (GraphBreaks reasons start with the file)
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


def compare_buffers(model: nn.Module, ref: nn.Module) -> tuple[str, ...]:
    """Names of buffers that are not exactly equal."""
    ref_bufs = dict(ref.named_buffers())
    return tuple(n for n, b in model.named_buffers() if not torch.equal(b, ref_bufs[n]))


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
    model = workload.model
    if device is not None:
        model.to(device)
    if dtype is not None:
        model.to(dtype=dtype)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    eff_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    bs = batch_size or workload.default_batch_size
    torch.manual_seed(seed)
    batch = cast_batch(workload.make_batch(bs), dtype=dtype, device=dev)

    remove_plan(model)
    model.zero_grad(set_to_none=True)  # deepcopy does not copy .grad: start both without
    in_place = _compiled_in_place(model)  # NOTE [ Blocks compiled in place ]
    ref = copy_model(model)
    _run_eagerly(ref)
    apply_plan(model, plan, batch=batch)
    dropouts = _tiled_dropout_off(plan, model, ref)  # restored in the finally below
    breaks = GraphBreaks()
    compile_s = None
    islands = IslandReport()
    opt = opt_ref = None
    steps: list[int] = []  # the reference's optimizer steps, counted by a hook
    try:
        with ExitStack() as compiled:
            if compile is not None or in_place:
                # Deferred: importing the compiler takes seconds, paid only by a compiled check.
                from torch._inductor import config as inductor_config

                compiled.enter_context(inductor_config.patch(fallback_random=True))  # the eager dropout masks
            if compile is not None:
                compiled.callback(compile_applied(model, compile, backend=compile_backend))
            # Gradients from the same weights: the first step, before any optimizer step (an Adam
            # step turns a last-bit difference in a near-zero gradient into a full learning-rate one).
            # A float64 check runs the model's float32 islands in float64, in both runs (NOTE [ float32 islands ]).
            promote = eff_dtype is torch.float64 and compile is None
            with (
                Float32Islands() if promote else ExitStack() as promoted,
                LowPrecisionOps() if promote else ExitStack() as narrow,
            ):
                ref_loss = training_step(ref, batch, workload.loss_fn, None, seed=seed + 2)
            if promote:
                islands = IslandReport(promoted=promoted.sites, kept=narrow.sites)
            t0 = time.perf_counter()
            with (
                breaks if compile is not None else ExitStack(),
                Float32Islands(record=False) if promote else ExitStack(),
            ):  # the first compiled call compiles
                training_step(model, batch, workload.loss_fn, None, seed=seed + 2)
            compile_s = time.perf_counter() - t0 if compile is not None else None
            grads = grad_compare.compare_gradients(grad_compare.model_grads(model), grad_compare.model_grads(ref))
            err, worst = grads.max_rel_err, grads.worst_param
            unequal = compare_buffers(model, ref)
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            opt_ref = make_optimizer(ref, optimizer)
            opt_ref.register_step_post_hook(lambda *_: steps.append(1))
            opt = make_optimizer(model, optimizer, states=states)
            warm_up(ref, batch, workload.loss_fn, opt_ref, seed=seed + 1)
            warm_up(model, batch, workload.loss_fn, opt, seed=seed + 1)
            if compile is None:
                base_peak = measure_step(ref, batch, workload.loss_fn, opt_ref, seed=seed + 2).device_peak_bytes
                tracker = MemoryTracker(device=dev, record_allocations=on_allocations is not None)
                plan_peak = measure_step(
                    model, batch, workload.loss_fn, opt, seed=seed + 2, tracker=tracker
                ).device_peak_bytes
                if on_allocations is not None:
                    on_allocations(tracker.allocations)
            else:  # the tracker would run the compiled model eagerly (capture.compiled)
                base_peak = profiled_step_peak_bytes(ref, batch, workload.loss_fn, opt_ref, seed=seed + 2)
                plan_peak = profiled_step_peak_bytes(model, batch, workload.loss_fn, opt, seed=seed + 2)
            unequal = unequal or compare_buffers(model, ref)
            opt_ref.zero_grad(set_to_none=True)  # the timed steps start from zero, as training does (a
            opt.zero_grad(set_to_none=True)  # step-in-backward optimizer frees its gradients in the backward)
            if repeats > 0:
                times = time_steps(
                    {
                        "baseline": step_runner(ref, batch, workload.loss_fn, opt_ref, seed=seed + 3),
                        "plan": step_runner(model, batch, workload.loss_fn, opt, seed=seed + 3),
                    },
                    repeats=repeats,
                )
            else:
                times = {}
    except torch.utils.checkpoint.CheckpointError as e:
        cause = (
            "Compiled, a block whose compiled forward recompiled between its forward and its recompute "
            "(pytorch/pytorch#166926) does this: compile the whole model (--compile model), or keep that block (option 'keep')."
            if compile is not None
            else "The block's forward is not deterministic in what it saves; keep that block (option 'keep')."
        )
        raise MemfitError(f"memfit.verify: the recompute of a block did not match its forward ({e}). {cause}") from e
    finally:
        release_optimizer(opt)
        remove_plan(model)
        for m, p in dropouts:
            m.p = p
    tiles = max((b.tiles for b in plan.blocks if b.tiles is not None), default=None)
    reordered = plan.head is not None or plan.activations is not None or compile is not None or tiles is not None
    rtol = grad_compare.grad_rtol(eff_dtype, reordered=reordered)
    why_rtol = _rtol_reason(plan, compile, tiles, rtol, str(eff_dtype).removeprefix("torch."))
    if islands.kept:  # NOTE [ float32 islands ]: what could not run in float64 is judged as float32
        rtol = max(rtol, grad_compare.grad_rtol(torch.float32, reordered=True))
        why_rtol = "float32 sums in another order: the model computes in float32 where memfit cannot promote it"
    within = budget_bytes is None or plan_peak <= budget_bytes
    peak_rtol, why_peak = peak_tolerance(plan, compile, str(eff_dtype).removeprefix("torch."))
    predicted = plan.predicted_peak_bytes
    over_prediction = peak_rtol is not None and predicted is not None and plan_peak > predicted * (1 + peak_rtol)
    after = None
    if states != ModelStates.DEVICE:  # NOTE [ Tolerance after steps ] in memfit.verification.steps
        exact = not reordered and dev.type == "cpu" and not islands.kept
        after = compare_after_steps(model, ref, opt, opt_ref, steps=len(steps), exact=exact, grad_rtol=rtol)
    ok = bool(grads.ok(rtol) and not unequal and within and not over_prediction and (after is None or after.params_ok))
    dtype_name = str(eff_dtype).removeprefix("torch.")
    notes = []
    if islands.note():
        notes.append(islands.note())
    changes = any(b.option is not Option.KEEP for b in plan.blocks) or bool(plan.segments)
    if changes and plan_peak >= base_peak:
        notes.append(no_saving_note(plan_peak, base_peak))
    if tiles is not None:
        notes.append(f"tolerance {rtol:.0e}: {why_rtol}")
    if dropouts:
        notes.append(
            f"dropout off in the {len(dropouts) // 2} dropout module(s) inside tiled submodules, in both runs: "
            "tiling draws each tile's mask on its own (replayed exactly in its backward), as random as one mask "
            "over the sequence but not the same numbers (NOTE [ Tiled gradients ] in memfit.apply.tiling)"
        )
    ours = tuple(r for r in breaks.reasons if r.startswith(_MEMFIT_SOURCE))
    if ours:
        notes.append(f"{len(ours)} graph breaks in memfit's code (torch.compile falls back to eager there): {ours[0]}")
    return VerifyResult(
        ok=ok,
        reason=None
        if ok
        else failure_reason(
            grads,
            rtol,
            ref_loss=ref_loss,
            dtype=dtype_name,
            unequal_buffers=unequal,
            over_budget=None if within else (plan_peak, budget_bytes),
            over_prediction=(plan_peak, predicted, peak_rtol) if over_prediction else None,
            after_steps=after,
        ),
        notes=tuple(notes),
        max_grad_rel_err=err,
        grad_rtol=rtol,
        buffers_equal=not unequal,
        measured_peak_bytes=plan_peak,
        baseline_peak_bytes=base_peak,
        budget_bytes=budget_bytes,
        measured_step_s=times.get("plan"),
        baseline_step_s=times.get("baseline"),
        policy=plan.policy,
        batch_size=bs,
        dtype=dtype_name,
        worst_param=worst,
        unequal_buffers=unequal,
        compile=compile,
        graph_breaks=breaks.count if compile is not None else None,
        memfit_graph_breaks=len(ours) if compile is not None else None,
        graph_break_reasons=tuple(breaks.reasons),
        compile_s=compile_s,
        peak_method="tracker" if compile is None else "profiler",
        grad_rtol_reason=why_rtol,
        predicted_peak_bytes=predicted,
        peak_rtol=peak_rtol,
        peak_rtol_reason=why_peak,
        float32_islands=tuple(islands.promoted_json()),
        float32_kept=tuple(islands.kept_json()),
        states=str(states),
        after_steps=after.to_dict() if after is not None else None,
    )


def _rtol_reason(plan: Plan, compile: str | None, tiles: int | None, rtol: float, dtype: str) -> str:
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


def _tiled_dropout_off(plan: Plan, model: nn.Module, ref: nn.Module) -> list[tuple[nn.Module, float]]:
    """Dropout modules inside the plan's tiled submodules set to ``p = 0`` in both models (restored
    by the caller from the returned ``(module, p)`` pairs)."""
    names = {f"{b.name}.{t}" for b in plan.blocks if b.tiles is not None for t in b.tiled}
    changed = []
    for m in (model, ref):
        for name, sub in m.named_modules():
            if not any(name == n or name.startswith(f"{n}.") for n in names):
                continue
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.training and sub.p != 0:
                changed.append((sub, sub.p))
                sub.p = 0.0
    return changed


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


# NOTE [ Blocks compiled in place ]
# A user's ``block.compile()`` (or ``model.compile()``) stays on the model verify checks, while its
# copy, the unmodified reference, runs eagerly (``copy.deepcopy`` leaves the compiled call out).
# Inductor draws dropout masks from its own generator (a seed per call of a compiled graph), not as
# eager dropout does: the planned model's compiled blocks drew other masks than the reference, and
# the first verify of a plan found gradients 0.67 apart (a repeat of the same call passed). The planned
# model therefore runs with ``fallback_random`` (torch's generator, the eager masks), as
# ``verify(compile=...)`` does; its recompute wrappers are new code, compiled on their first call,
# under that setting. Graphs compiled before verify without ``fallback_random`` may be reused by
# dynamo (inductor's settings are not in its guards) and would draw other masks.


def _compiled_in_place(model: nn.Module) -> bool:
    """Whether any module of ``model`` is compiled in place (``Module.compile``)."""
    return any(m.__dict__.get("_compiled_call_impl") is not None for m in model.modules())


def _run_eagerly(model: nn.Module) -> None:
    """Drop the compiled calls of ``model``'s modules compiled in place, so that it runs eagerly (a
    copy made by ``copy.deepcopy`` has none in torch 2.13; NOTE [ Blocks compiled in place ])."""
    for m in model.modules():
        if m.__dict__.get("_compiled_call_impl") is not None:
            m.__dict__.pop("_compiled_call_impl")
