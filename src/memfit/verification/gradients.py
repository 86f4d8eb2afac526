"""One gradient comparison for every check that memfit's gradients equal plain training's.

``memfit verify`` (checkpoint plans, :mod:`memfit.verification.plans`), accumulation over micro-batches
(:mod:`memfit.verification.accumulation`) and the distributed checks of the test suite all judge gradients
with :func:`compare_gradients` and call a result ``ok`` with :meth:`GradComparison.ok`: every
parameter's gradient within ``rtol`` of the reference (relative, with the floor below), and no
parameter with a gradient in one run only.

NOTE [ Gradient floor ]
Each parameter's error is ``max|g - g_ref| / max(max|g_ref|, FLOOR * G)``, where ``G`` is the largest
reference gradient of any parameter. A gradient that is zero in exact arithmetic (an attention key
bias: softmax ignores a shift of every score in a row) is rounding noise in both runs; judged
against itself, a correct run shows an error of order 1 (Qwen2's ``k_proj.bias`` at 1.5e-7 in
float64 accumulation, BERT's key bias in float32). Judged against ``1e-3`` of the largest gradient,
that noise is at rounding level, while a real error of 1e-3 relative in any parameter that matters
still shows (it is at least 1e-3 relative to ``G`` wherever that parameter's gradient is at least
the floor).

Tolerances by dtype: ``GRAD_RTOL`` for runs that replay the same ops in the same order
(recomputation: bitwise on CPU, the bar leaves room for nondeterministic GPU kernels) and
``GRAD_RTOL_REORDERED`` for runs that compute the same sums in another order (accumulation over
micro-batches, the chunked head, fused activations).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

GRAD_FLOOR = 1e-3
"""Each parameter is judged against at least this share of the largest reference gradient."""
GRAD_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 1e-2,
}
GRAD_RTOL_REORDERED: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 1e-2,
}

Grads = Mapping[str, torch.Tensor | None] | Sequence[torch.Tensor | None]


def grad_rtol(dtype: torch.dtype, *, reordered: bool = False) -> float:
    """The tolerance on :attr:`GradComparison.max_rel_err` for runs in ``dtype``."""
    return (GRAD_RTOL_REORDERED if reordered else GRAD_RTOL).get(dtype, 1e-4 if reordered else 1e-5)


@dataclass(frozen=True, kw_only=True, slots=True)
class GradComparison:
    """Gradients of a run against a reference run (NOTE [ Gradient floor ]).

    Attributes:
        max_rel_err: the largest per-parameter error (``inf`` when a gradient is missing or not finite).
        worst_param: the parameter with that error (None when nothing was compared).
        errors: per parameter, ``max|g - g_ref| / max(max|g_ref|, floor_abs)``.
        missing: parameters with a gradient in one run only.
        floor_abs: the floor, ``GRAD_FLOOR`` times the largest reference gradient.
        ref_finite: every reference gradient is finite (when not, the reference run itself is
            broken in this dtype, whatever the run under test does).
    """

    max_rel_err: float
    worst_param: str | None
    errors: dict[str, float]
    missing: tuple[str, ...]
    floor_abs: float
    ref_finite: bool

    def ok(self, rtol: float) -> bool:
        """Every gradient within ``rtol`` and none missing."""
        return not self.missing and self.max_rel_err <= rtol


def compare_gradients(grads: Grads, ref_grads: Grads) -> GradComparison:
    """Compare gradients with reference gradients, parameter by parameter.

    Args:
        grads: gradients of the run under test, by parameter name (or in a list, named by index).
            DTensor gradients (FSDP2) are compared as full tensors.
        ref_grads: the reference run's, with the same names.

    Returns:
        A :class:`GradComparison`.

    Example:
        >>> g = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3e-17])}
        >>> ref = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([-2e-17])}
        >>> compare_gradients(g, ref).ok(1e-10)   # b is zero in exact arithmetic: rounding noise
        True
    """
    got, want = _named(grads), _named(ref_grads)
    floor = GRAD_FLOOR * max(
        (m for r in want.values() if r is not None and math.isfinite(m := _absmax(r))), default=0.0
    )
    errors: dict[str, float] = {}
    missing: list[str] = []
    ref_finite = all(r is None or bool(torch.isfinite(_full(r)).all()) for r in want.values())
    for name in dict.fromkeys([*want, *got]):
        g, r = got.get(name), want.get(name)
        if g is None and r is None:
            continue
        if g is None or r is None:
            missing.append(name)
            continue
        g, r = _full(g), _full(r)
        if r.numel() == 0:
            errors[name] = 0.0
            continue
        scale = max(_absmax(r), floor, 1e-300)
        diff = float((g.to(r.dtype) - r).abs().max())
        errors[name] = diff / scale if math.isfinite(diff) else math.inf
    worst = max(errors, key=errors.__getitem__) if errors else None
    max_err = errors[worst] if worst is not None else 0.0
    if missing:
        max_err, worst = math.inf, missing[0]
    return GradComparison(
        max_rel_err=max_err,
        worst_param=worst,
        errors=errors,
        missing=tuple(missing),
        floor_abs=floor,
        ref_finite=ref_finite,
    )


def model_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """``{name: param.grad}`` of a model (what :func:`compare_gradients` takes)."""
    return {n: p.grad for n, p in model.named_parameters()}


def _named(grads: Grads) -> dict[str, torch.Tensor | None]:
    if isinstance(grads, Mapping):
        return dict(grads)
    return {str(i): g for i, g in enumerate(grads)}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _absmax(t: torch.Tensor) -> float:
    t = _full(t)
    return float(t.abs().max()) if t.numel() else 0.0
