"""Fused activations: the same activation function in one kernel, with one saved tensor.

NOTE [ Fused activations ]
Several transformers activation modules write their function out of elementary ops:
``NewGELUActivation`` (GPT-2's ``gelu_new``) is ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 *
x**3)))``, eight tensor ops, and autograd saves four intermediate tensors of the activation's size
for its backward (``tanh``'s output, ``x**3``'s input and two products). The same function exists
as one torch kernel, ``F.gelu(x, approximate="tanh")``, that saves only its input: on hf:gpt2
(d=256, 4x256 tokens, fp32) 16 MiB less per block, 144 MiB of the model's 603 MiB of activations,
and 0.90x the step time (anchor ``none +fused act`` of ``benchmarks/selective_frontier.py``). It is
free memory: no recompute, nothing moved, and never slower (one kernel in place of several).

``install_fused_activations`` replaces the ``forward`` of every module that is *exactly* one of
the classes below (not a subclass, no ``forward`` of its own on the instance) with the fused
kernel; the module tree, parameters and hooks are unchanged, and ``remove_fused_activations``
restores the modules. The planner profiles a model with them installed when it has any
(:func:`memfit.profiling.blocks.profile`, ``activations=True``), after checking on random inputs
that each fused function equals the module's own (:func:`activation_mismatch`); plans then say
``"activations": "fused"`` and :func:`memfit.apply.apply_plan` installs them.

=======================  ==========================================  ===============================
module (transformers)    its forward                                 fused kernel
=======================  ==========================================  ===============================
NewGELUActivation        0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))     F.gelu(x, approximate="tanh")
FastGELUActivation       0.5x(1+tanh(0.7978845608x(1+0.044715x^2)))  F.gelu(x, approximate="tanh")
AccurateGELUActivation   0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))     F.gelu(x, approximate="tanh")
GELUTanh (python path)   as NewGELUActivation                        F.gelu(x, approximate="tanh")
GELUActivation (python)  0.5x(1+erf(x/sqrt 2))                       F.gelu(x)
MishActivation (python)  x tanh(softplus(x))                         F.mish(x)
=======================  ==========================================  ===============================

Known limitations:
- The fused kernel computes in a different order (and in fp32 internally for bf16/fp16 inputs):
  outputs and gradients agree with the module's own to rounding, not bit for bit. ``memfit
  verify`` compares plans that fuse activations with its reordered-sum tolerance.
- ``QuickGELUActivation`` (``x * sigmoid(1.702 x)``) has no fused kernel in torch; it is left alone.
- Activations written inline in a user's forward (not as a module) cannot be found.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import PlanMismatchError
from memfit.plan.types import ACTIVATION_OPTIONS

_ATTR = "_memfit_fused_activation"  # marks a module whose forward memfit replaced

_gelu_tanh = functools.partial(F.gelu, approximate="tanh")


def _fused_for(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fused kernel equal to ``module``'s forward, or None when memfit knows of none."""
    cls = type(module)
    if cls.__module__ != "transformers.activations" or "forward" in module.__dict__:
        return None
    name = cls.__name__
    if name in ("NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation"):
        return _gelu_tanh
    act = getattr(getattr(module, "act", None), "__func__", None)  # the python paths are bound methods
    if name == "GELUTanh" and act is getattr(cls, "_gelu_tanh_python", None):
        return _gelu_tanh
    if name == "GELUActivation" and act is getattr(cls, "_gelu_python", None):
        return F.gelu
    if name == "MishActivation" and act is getattr(cls, "_mish_python", None):
        return F.mish
    return None


def fusable_activations(model: nn.Module) -> dict[str, nn.Module]:
    """The activation modules of ``model`` that have a fused kernel (qualified name -> module)."""
    return {name: m for name, m in model.named_modules() if _fused_for(m) is not None}


def activation_mismatch(model: nn.Module, *, n: int = 4096, seed: int = 0) -> str | None:
    """Compare each fusable activation class's fused kernel with the class's own forward on ``n``
    random inputs in the model's dtype and device; None when all agree, else what differs.

    Output and input gradient are measured against the module's own function evaluated in fp64
    (the exact values): the kernel passes when its error is within the dtype's tolerance or no
    more than twice the module's own error (in bf16 the op-by-op module rounds after every op and
    is the less accurate of the two). The check behind offering fused activations
    (:func:`memfit.profiling.blocks.profile`).
    """
    seen: set[type] = set()
    gen = torch.Generator().manual_seed(seed)
    p = next(model.parameters(), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    device = p.device if p is not None else torch.device("cpu")
    tol = {torch.float64: 1e-9, torch.float32: 1e-5}.get(dtype, 2e-2)
    for name, m in fusable_activations(model).items():
        if type(m) in seen:
            continue
        seen.add(type(m))
        fused = _fused_for(m)
        assert fused is not None
        x64 = torch.randn(n, generator=gen, dtype=torch.float64) * 3
        g64 = torch.randn(n, generator=gen, dtype=torch.float64)
        x0 = x64.to(dtype=dtype, device=device)
        g = g64.to(dtype=dtype, device=device)

        def run(
            fn: Callable[[torch.Tensor], torch.Tensor], x_in: torch.Tensor, g_in: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            x = x_in.clone().requires_grad_(True)
            y = fn(x)
            (gx,) = torch.autograd.grad(y, x, g_in)
            return y.detach().double().cpu(), gx.double().cpu()

        exact = run(m.forward, x0.double().cpu(), g.double().cpu())  # the same rounded inputs, in fp64
        # In fp64 the kernel must be the same function; in the model's dtype, as accurate.
        checks = [("float64", 1e-9, exact, run(fused, x0.double().cpu(), g.double().cpu()))]
        if dtype != torch.float64:
            checks.append((str(dtype).removeprefix("torch."), tol, run(m.forward, x0, g), run(fused, x0, g)))
        for dt_name, t, own, fast in checks:
            for k, what in enumerate(("output", "input gradient")):
                e_fast = ((fast[k] - exact[k]).abs() / (1 + exact[k].abs())).max().item()
                e_own = ((own[k] - exact[k]).abs() / (1 + exact[k].abs())).max().item()
                if not e_fast <= max(t, 2 * e_own):
                    return (
                        f"{type(m).__name__} ({name}): in {dt_name} the fused kernel's {what} is off by {e_fast:.3g} "
                        f"(the module's own by {e_own:.3g}; tolerance {t:g})"
                    )
    return None


def install_fused_activations(model: nn.Module) -> int:
    """Give every fusable activation module of ``model`` its fused kernel (NOTE [ Fused
    activations ]); returns how many modules were changed (0 when there are none or they already
    have it)."""
    found = fusable_activations(model).values()
    for m in found:
        m.__dict__["forward"] = _fused_for(m)
        m.__dict__[_ATTR] = True
    return len(found)


def remove_fused_activations(model: nn.Module) -> None:
    """Undo :func:`install_fused_activations` (a no-op where it is not installed)."""
    for m in model.modules():
        if m.__dict__.pop(_ATTR, None) is not None:
            m.__dict__.pop("forward", None)


def fused_activations_installed(model: nn.Module) -> bool:
    """True when any module of ``model`` runs a fused kernel installed by memfit."""
    return any(_ATTR in m.__dict__ for m in model.modules())


def check_activations_option(model: nn.Module, option: str) -> None:
    """Raise :class:`PlanMismatchError` when a plan's ``activations`` option cannot apply to ``model``."""
    if option not in ACTIVATION_OPTIONS:
        raise PlanMismatchError(
            f"memfit.apply: unknown activations option {option!r}; valid: {', '.join(ACTIVATION_OPTIONS)}."
        )
    if not fusable_activations(model) and not fused_activations_installed(model):
        raise PlanMismatchError(
            f"memfit.apply: the plan fuses activations, but {type(model).__name__} has no activation module "
            "with a fused kernel (NOTE [ Fused activations ] in memfit.apply.activations lists them). Make a "
            "plan for this model (`memfit plan`), which fuses activations only where it can."
        )


__all__ = [
    "activation_mismatch",
    "check_activations_option",
    "fusable_activations",
    "fused_activations_installed",
    "install_fused_activations",
    "remove_fused_activations",
]
