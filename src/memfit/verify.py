"""verify: show that a plan changes memory and time, not training.

The planned model and the unmodified model start from the same weights, see the same batch and
draw the same dropout masks; their gradients and buffers after one steady-state step are compared,
and their peaks and step times are measured side by side in one process.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.apply.engine import apply_plan, remove_plan
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.step import (
    make_optimizer,
    measure_step,
    step_runner,
    time_steps,
    training_step,
    warm_up,
)
from memfit.errors import MemfitError
from memfit.plan.types import Plan
from memfit.workload import Workload, cast_batch

# Gradient tolerance by dtype: recomputation replays the same ops, so on CPU gradients are
# normally bitwise equal; the tolerance leaves room for nondeterministic kernels on GPUs.
GRAD_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# A head option (the chunked loss, memfit.apply.head) and fused activations
# (memfit.apply.activations) compute the same function in another order: in float32 gradients then agree to about 1e-6 relative, not bitwise; float64 keeps the 1e-10 bar.
GRAD_RTOL_REORDERED = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


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

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


def compare_grads(model: nn.Module, ref: nn.Module) -> tuple[float, str | None]:
    """Max over parameters of ``max|g - g_ref| / max(max|g_ref|, 1e-3 G)`` and the worst
    parameter's name, where ``G`` is the largest reference gradient of any parameter.

    The floor ``1e-3 G`` keeps a gradient that is zero in exact arithmetic (BERT's attention key
    bias: softmax ignores a shift of every score in a row) from turning rounding-level differences
    of a reordered computation into a relative error of order 1.
    A parameter with a gradient in one model and none in the other counts as error ``inf``.
    """
    worst, worst_name = 0.0, None
    ref_params = dict(ref.named_parameters())
    floor = 1e-3 * max((r.grad.abs().max().item() for r in ref_params.values() if r.grad is not None and r.grad.numel()), default=0.0)
    for name, p in model.named_parameters():
        r = ref_params[name]
        if p.grad is None and r.grad is None:
            continue
        if p.grad is None or r.grad is None:
            return float("inf"), name
        scale = max(r.grad.abs().max().item(), floor)
        err = (p.grad - r.grad).abs().max().item() / max(scale, 1e-30)
        if err > worst or worst_name is None:
            worst, worst_name = err, name
    return worst, worst_name


def compare_buffers(model: nn.Module, ref: nn.Module) -> tuple[str, ...]:
    """Names of buffers that are not exactly equal."""
    ref_bufs = dict(ref.named_buffers())
    return tuple(n for n, b in model.named_buffers() if not torch.equal(b, ref_bufs[n]))


def verify(
    workload: Workload,
    plan: Plan,
    *,
    batch_size: int | None = None,
    dtype: torch.dtype | None = None,
    budget_bytes: int | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
    repeats: int = 3,
    device: torch.device | str | None = None,
) -> VerifyResult:
    """Run the planned and the unmodified model side by side and compare them.

    Measuring never changes the model: both runs take optimizer steps and draw random numbers, and
    afterwards the workload's model has its parameters, buffers, gradients, flags, applied plan and
    the RNGs back bitwise, also when the check raises; ``dtype`` and ``device`` run on a cast copy
    (NOTE [ Measuring leaves the model as it was ] in :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload; a plan applied to its model is lifted while checking.
        plan: the plan to check (from a policy, the planner or a file).
        batch_size: samples in the batch (default: the workload's).
        dtype: check a copy of the model in this dtype (float64 for the tightest comparison).
        budget_bytes: when given, ``ok`` also requires the measured peak to be within it.
        optimizer: optimizer of the measured step.
        seed: seed for data and dropout.
        repeats: interleaved timing repeats (0 to skip timing).
        device: check a copy of the model on this device (default: the model where it is).

    Returns:
        A :class:`VerifyResult`; ``ok`` is True when gradients agree within ``grad_rtol``, all
        buffers are equal, and the peak is within the budget (when one is given).
    """
    with leave_unchanged(workload.model, device=device, dtype=dtype) as model:
        if model is not workload.model:
            workload = dataclasses.replace(workload, model=model)
        return _verify(
            workload, plan, batch_size=batch_size, dtype=dtype, budget_bytes=budget_bytes,
            optimizer=optimizer, seed=seed, repeats=repeats, device=device,
        )


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
) -> VerifyResult:
    """:func:`verify` on the model as it is (moved and cast already, inside the snapshot)."""
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
    ref = copy.deepcopy(model)
    apply_plan(model, plan, batch=batch)
    try:
        # Gradients from the same weights: the first step, before any optimizer step (an Adam
        # step turns a last-bit difference in a near-zero gradient into a full learning-rate one).
        training_step(ref, batch, workload.loss_fn, None, seed=seed + 2)
        training_step(model, batch, workload.loss_fn, None, seed=seed + 2)
        err, worst = compare_grads(model, ref)
        unequal = compare_buffers(model, ref)
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        opt_ref = make_optimizer(ref, optimizer)
        opt = make_optimizer(model, optimizer)
        warm_up(ref, batch, workload.loss_fn, opt_ref, seed=seed + 1)
        warm_up(model, batch, workload.loss_fn, opt, seed=seed + 1)
        base_mem = measure_step(ref, batch, workload.loss_fn, opt_ref, seed=seed + 2)
        plan_mem = measure_step(model, batch, workload.loss_fn, opt, seed=seed + 2)
        unequal = unequal or compare_buffers(model, ref)
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
        raise MemfitError(
            f"memfit.verify: the recompute of a block did not match its forward ({e}). The block's "
            "forward is not deterministic in what it saves; keep that block (action 'keep')."
        ) from e
    finally:
        remove_plan(model)
    rtol = (GRAD_RTOL_REORDERED if plan.head is not None or plan.activations is not None else GRAD_RTOL).get(eff_dtype, 1e-5)
    within = budget_bytes is None or plan_mem.device_peak_bytes <= budget_bytes
    return VerifyResult(
        ok=bool(err <= rtol and not unequal and within),
        max_grad_rel_err=err,
        grad_rtol=rtol,
        buffers_equal=not unequal,
        measured_peak_bytes=plan_mem.device_peak_bytes,
        baseline_peak_bytes=base_mem.device_peak_bytes,
        budget_bytes=budget_bytes,
        measured_step_s=times.get("plan"),
        baseline_step_s=times.get("baseline"),
        policy=plan.policy,
        batch_size=bs,
        dtype=str(eff_dtype).removeprefix("torch."),
        worst_param=worst,
        unequal_buffers=unequal,
    )
