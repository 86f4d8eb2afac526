"""memfit: train deeper models and bigger batches in the memory you have.

Measure, plan, apply and verify activation checkpointing and gradient accumulation for PyTorch.
Everything a user calls is here, in ``memfit``; the subpackages hold the rest:

- verbs: :func:`profile`, :func:`plan_for_budget`, :func:`plan_for_policy`, :func:`plan_compiled`,
  :func:`autofit`, :func:`verify`, :func:`verify_accumulation`, :func:`explain`, :func:`estimate`,
  :func:`train`, :func:`apply_plan`, :func:`remove_plan`, :func:`set_blocks`, :func:`load_workload`,
  :func:`policy_plan`;
- what a user holds: :class:`Workload`, :class:`StepSpec`, :class:`Plan`, :class:`Stats`, :class:`Accumulator`,
  :class:`TrainConfig`, :class:`OutOfMemoryGuard`, :class:`ModelStates` (where parameters, gradients and
  optimizer state live; :func:`autofit` and :func:`plan_for_budget` also take ``states="auto"``);
- policies: :class:`KeepAll`, :class:`RecomputeAll`, :class:`EveryNth`, :class:`Sqrt`,
  :class:`Selective`, :class:`Offload` (all :class:`Policy`);
- errors: :class:`MemfitError` and its subclasses.

A name is imported from its subpackage when it is first used: ``import memfit`` itself takes
milliseconds and imports torch only once a name needs it.

Example:
    >>> import memfit
    >>> wl = memfit.load_workload("demo?n_layer=2&n_embd=32&seq_len=32")
    >>> plan = memfit.policy_plan(wl.model, memfit.RecomputeAll())
    >>> [b.option.value for b in plan.blocks]
    ['recompute', 'recompute']
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memfit._version import __version__
from memfit.errors import (
    BudgetInfeasibleError,
    MemfitError,
    PlanFileError,
    PlanMismatchError,
    SpecError,
    UnsupportedModelError,
    VerificationError,
    WorkloadError,
)

if TYPE_CHECKING:  # what _WHERE names, for type checkers and editors
    from memfit.accumulate import Accumulator
    from memfit.apply import apply_plan, remove_plan
    from memfit.capture.chain import set_blocks
    from memfit.capture.stats import Stats
    from memfit.capture.step import StepSpec
    from memfit.estimation import estimate
    from memfit.estimation.placed import autofit, plan_for_budget
    from memfit.fitting import plan_compiled, plan_for_policy
    from memfit.models.registry import load_workload
    from memfit.optim import ModelStates
    from memfit.plan import (
        EveryNth,
        KeepAll,
        Offload,
        Plan,
        Policy,
        RecomputeAll,
        Selective,
        Sqrt,
        policy_plan,
    )
    from memfit.profiling import explain, profile
    from memfit.training import TrainConfig, train
    from memfit.training.guard import OutOfMemoryGuard
    from memfit.units import parse_size
    from memfit.verification import verify, verify_accumulation
    from memfit.workload import Workload

# The module that defines each name, imported on the name's first use (PEP 562): ``import memfit``
# imports torch only when a name needs it, so `memfit --version` and `memfit --help` answer without
# it (tests/test_startup.py checks this table against the imports above).
_WHERE = {
    "Accumulator": "memfit.accumulate",
    "apply_plan": "memfit.apply",
    "remove_plan": "memfit.apply",
    "set_blocks": "memfit.capture.chain",
    "Stats": "memfit.capture.stats",
    "StepSpec": "memfit.capture.step",
    "estimate": "memfit.estimation",
    "autofit": "memfit.estimation.placed",
    "plan_compiled": "memfit.fitting",
    "plan_for_budget": "memfit.estimation.placed",
    "plan_for_policy": "memfit.fitting",
    "load_workload": "memfit.models.registry",
    "ModelStates": "memfit.optim",
    **dict.fromkeys(
        ["EveryNth", "KeepAll", "Offload", "Plan", "Policy", "RecomputeAll", "Selective", "Sqrt", "policy_plan"],
        "memfit.plan",
    ),
    "explain": "memfit.profiling",
    "profile": "memfit.profiling",
    "TrainConfig": "memfit.training",
    "train": "memfit.training",
    "OutOfMemoryGuard": "memfit.training.guard",
    "parse_size": "memfit.units",
    "verify": "memfit.verification",
    "verify_accumulation": "memfit.verification",
    "Workload": "memfit.workload",
}

__all__ = [
    "__version__",
    # verbs
    "apply_plan",
    "autofit",
    "estimate",
    "explain",
    "load_workload",
    "parse_size",
    "plan_compiled",
    "plan_for_budget",
    "plan_for_policy",
    "policy_plan",
    "profile",
    "remove_plan",
    "set_blocks",
    "train",
    "verify",
    "verify_accumulation",
    # what a user holds
    "Accumulator",
    "ModelStates",
    "OutOfMemoryGuard",
    "Plan",
    "Stats",
    "StepSpec",
    "TrainConfig",
    "Workload",
    # policies
    "EveryNth",
    "KeepAll",
    "Offload",
    "Policy",
    "RecomputeAll",
    "Selective",
    "Sqrt",
    # errors
    "BudgetInfeasibleError",
    "MemfitError",
    "PlanFileError",
    "PlanMismatchError",
    "SpecError",
    "UnsupportedModelError",
    "VerificationError",
    "WorkloadError",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use (then cached here)."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
