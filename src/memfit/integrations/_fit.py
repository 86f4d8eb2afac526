"""Auto-fit on a copy of a framework's model, then apply the plan to the model itself.

Shared by the framework adapters: measuring runs on ``copy.deepcopy(model)`` (moved to
``device``), so the user's weights, buffers, ``.grad`` and forwards stay as they were until the
plan is applied; applying changes forwards only (``state_dict`` keys unchanged).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.apply import apply_plan
from memfit.errors import SpecError
from memfit.units import parse_size
from memfit.workload import Batch, LossOutput, Workload


def budget_to_bytes(budget: int | str) -> int:
    """``300MiB``, ``2GiB`` or a number of bytes, as bytes."""
    if isinstance(budget, bool):
        raise SpecError(f"memfit.integrations: budget {budget!r} is not a size. Pass e.g. '300MiB' or a number of bytes.")
    return budget if isinstance(budget, int) else parse_size(budget)


def fit_on_copy(
    model: nn.Module,
    budget: int | str,
    *,
    global_batch: int,
    make_batch: Callable[[int], Batch],
    loss_fn: Callable[[nn.Module, Batch], LossOutput],
    count_fn: Callable[[Batch], Any] | None = None,
    blocks: str | None = None,
    device: torch.device | str | None = None,
    max_micro_batch: int | None = None,
    optimizer: str = "adamw",
    measure: bool = True,
    apply: bool = True,
) -> Any:
    """Auto-fit micro-batch, accumulation steps and plan on a copy of ``model``; apply the plan.

    Returns:
        The :class:`memfit.autofit.FitResult` (its ``plan`` is applied to ``model`` when ``apply``).
    """
    from memfit.autofit import autofit

    budget_bytes = budget_to_bytes(budget)
    probe = copy.deepcopy(model)
    if device is not None:
        probe.to(device)
    workload = Workload(
        name=type(model).__name__,
        model=probe,
        make_batch=make_batch,
        loss_fn=loss_fn,
        count_fn=count_fn,
        blocks=blocks,
    )
    fit = autofit(
        workload,
        budget_bytes,
        global_batch,
        optimizer=optimizer,
        measure=measure,
        max_micro_batch=max_micro_batch,
    )
    del probe, workload
    if apply:
        apply_plan(model, fit.plan)
    return fit
