"""The optimizer a step uses, for a placement of the model states (:func:`build_optimizer`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memfit.errors import SpecError
from memfit.optim.host import HostOptimizer
from memfit.optim.in_backward import StepInBackward
from memfit.optim.states import ModelStates

OPTIMIZERS = ("adamw", "adam", "sgd")
"""The optimizers memfit's measured steps and ``memfit train`` use (``sgd`` has momentum 0.9)."""

_Builder = Callable[[list[torch.nn.Parameter], type[torch.optim.Optimizer], dict[str, Any]], torch.optim.Optimizer]

BUILDERS: dict[ModelStates, _Builder] = {
    ModelStates.DEVICE: lambda params, cls, kwargs: cls(params, **kwargs),
    ModelStates.STEP_IN_BACKWARD: lambda params, cls, kwargs: StepInBackward(params, cls, **kwargs),
    ModelStates.HOST_OPTIMIZER: lambda params, cls, kwargs: HostOptimizer(params, cls, **kwargs),
}
"""The placements that have an implementation, and how each wraps torch's optimizer."""


def implemented_states() -> tuple[str, ...]:
    """The placements :func:`build_optimizer` can build (``--states`` accepts these)."""
    return tuple(m.value for m in ModelStates if m in BUILDERS)


def optimizer_class(name: str, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Torch's optimizer class for ``name`` and its keyword arguments."""
    if name == "adamw":
        return torch.optim.AdamW, {"lr": lr}
    if name == "adam":
        return torch.optim.Adam, {"lr": lr}
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": 0.9}
    raise SpecError(f"memfit: unknown optimizer {name!r}. Use one of: {', '.join(OPTIMIZERS)}.")


def check_states(states: ModelStates | str) -> ModelStates:
    """``states`` as a placement that has an implementation, or a :class:`~memfit.errors.SpecError`."""
    placement = ModelStates.parse(states)
    if placement not in BUILDERS:
        raise SpecError(
            f"memfit: the model-states placement {placement.value!r} is not available in this version. "
            f"Use one of: {', '.join(implemented_states())}."
        )
    return placement


def build_optimizer(
    params: list[torch.nn.Parameter], name: str, lr: float, states: ModelStates | str = ModelStates.DEVICE
) -> torch.optim.Optimizer:
    """Optimizer ``name`` at ``lr`` over ``params``, placed as ``states`` says."""
    cls, kwargs = optimizer_class(name, lr)
    return BUILDERS[check_states(states)](params, cls, kwargs)
