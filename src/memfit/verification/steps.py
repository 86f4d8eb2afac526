"""Parameters and optimizer state after optimizer steps: the planned run against plain training.

``memfit verify`` compares gradients after one step from the same weights
(:mod:`memfit.verification.gradients`); a placement of the model states (:mod:`memfit.optim`) changes
where and when the optimizer steps, which gradients alone cannot show. So after the verify's steps
(the same number on both models, the same batches and dropout masks) the planned model's parameters
and optimizer state are compared with the unmodified model's, stepped by the plain optimizer.

NOTE [ Tolerance after steps ]
Where the gradients are bitwise equal (a plan that replays the same ops, on the CPU) the step inside
the backward runs torch's own single-tensor kernels, the ones plain training runs on the CPU:
parameters and state are judged at the gradients' tolerance (they come out bitwise equal). Where the
gradients differ by rounding (a plan that reorders sums: the chunked head, fused activations, tiles;
CUDA, where plain training runs the multi-tensor kernels), an AdamW step moves each element by about
``lr`` whatever its gradient's size, so a last-bit difference in a near-zero gradient can turn one
element's step around: after ``k`` steps an element may differ by up to ``2 k lr``. Parameters are
then judged by that absolute bound, and the state's difference is reported, not judged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.verification.gradients import compare_gradients


@dataclass(frozen=True, kw_only=True, slots=True)
class StepsComparison:
    """The planned run's parameters and optimizer state after ``optimizer_steps`` steps, against
    plain training's (NOTE [ Tolerance after steps ]); the field names are ``memfit verify``'s JSON.

    Attributes:
        optimizer_steps: optimizer steps each model took from the same weights.
        params_after_steps_max_rel_err: largest per-parameter ``max|p - p_ref| / max|p_ref|`` (with
            the gradient comparison's floor).
        params_after_steps_max_abs_err: largest ``|p - p_ref|`` of any element.
        states_after_steps_max_rel_err: the same relative error over the optimizer state's tensors.
        states_compared: the optimizer state's entries compared (``exp_avg``, ``momentum_buffer``, ...).
        params_tolerance: the bound the parameters are judged by.
        params_tolerance_kind: ``relative`` (judges the relative errors, state included) or
            ``absolute`` (judges ``params_after_steps_max_abs_err``).
        params_tolerance_reason: why that bound.
        params_ok: within it.
    """

    optimizer_steps: int
    params_after_steps_max_rel_err: float
    params_after_steps_max_abs_err: float
    states_after_steps_max_rel_err: float
    states_compared: tuple[str, ...]
    params_tolerance: float
    params_tolerance_kind: str
    params_tolerance_reason: str
    params_ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


def compare_after_steps(
    model: nn.Module,
    ref: nn.Module,
    opt: torch.optim.Optimizer,
    opt_ref: torch.optim.Optimizer,
    *,
    steps: int,
    exact: bool,
    grad_rtol: float,
) -> StepsComparison:
    """Compare ``model`` and its optimizer with the reference after ``steps`` steps each.

    Args:
        exact: the gradients are expected bitwise equal (NOTE [ Tolerance after steps ]): judge
            parameters and state at ``grad_rtol``; else parameters by ``2 steps lr``.
        grad_rtol: the gradients' tolerance.
    """
    params = compare_gradients(_params(model), _params(ref))
    states = compare_gradients(dict(_state(opt)), dict(_state(opt_ref)))
    abs_err = max(
        (
            float((p - q).detach().abs().max())
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
            if p.numel()
        ),
        default=0.0,
    )
    names = tuple(sorted({key.rsplit(".", 1)[-1] for key, _ in _state(opt_ref)}))
    if exact:
        tol, kind = grad_rtol, "relative"
        why = (
            "the gradients are bitwise equal (replayed ops) and the optimizer runs torch's own single-tensor "
            "kernels on both sides: parameters and optimizer state at the gradients' tolerance"
        )
        ok = params.max_rel_err <= tol and states.max_rel_err <= tol and not states.missing
    else:
        lr = max(float(g["lr"]) for g in opt_ref.param_groups)
        tol, kind = 2 * steps * lr, "absolute"
        why = (
            f"the gradients differ by rounding (reordered sums), and an AdamW step moves an element by about lr "
            f"whatever its gradient's size: after {steps} steps an element may differ by up to 2 x {steps} x lr"
        )
        ok = abs_err <= tol
    return StepsComparison(
        optimizer_steps=steps,
        params_after_steps_max_rel_err=params.max_rel_err,
        params_after_steps_max_abs_err=abs_err,
        states_after_steps_max_rel_err=states.max_rel_err,
        states_compared=names,
        params_tolerance=tol,
        params_tolerance_kind=kind,
        params_tolerance_reason=why,
        params_ok=bool(ok and not params.missing),
    )


def _params(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.detach() for n, p in model.named_parameters()}


def _state(opt: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """``(index.key, tensor)`` of every floating tensor in the optimizer's state, by the parameter's
    position (both models list their parameters in the same order)."""
    for i, group_params in enumerate(p for g in opt.param_groups for p in g["params"]):
        for key, value in opt.state.get(group_params, {}).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                yield f"{i}.{key}", value
