"""memfit: train deeper models and bigger batches in the memory you have.

Measure, plan, apply and verify activation checkpointing and gradient accumulation for PyTorch.
``memfit.verify.verify`` and ``memfit.autofit.autofit`` stay in their modules (a package attribute
of the same name as a submodule would hide the module).
"""

from memfit._version import __version__
from memfit.accumulate import Accumulator
from memfit.apply import apply_plan, remove_plan
from memfit.capture.chain import discover_chain, set_blocks
from memfit.errors import (
    BudgetInfeasibleError,
    MemfitError,
    PlanFileError,
    PlanMismatchError,
    SpecError,
    UnsupportedModelError,
    VerificationError,
)
from memfit.models.registry import load_workload
from memfit.plan import (
    EveryNth,
    KeepAll,
    Offload,
    Plan,
    Policy,
    RecomputeAll,
    Selective,
    Sqrt,
    parse_policy,
    policy_plan,
)
from memfit.planning import plan_for_budget
from memfit.profiling import profile
from memfit.units import format_bytes, parse_size
from memfit.workload import Workload

__all__ = [
    "__version__",
    "Accumulator",
    "BudgetInfeasibleError",
    "MemfitError",
    "PlanFileError",
    "PlanMismatchError",
    "SpecError",
    "UnsupportedModelError",
    "VerificationError",
    "Plan",
    "Policy",
    "KeepAll",
    "RecomputeAll",
    "EveryNth",
    "Sqrt",
    "Selective",
    "Offload",
    "Workload",
    "apply_plan",
    "discover_chain",
    "format_bytes",
    "load_workload",
    "parse_policy",
    "parse_size",
    "plan_for_budget",
    "policy_plan",
    "profile",
    "remove_plan",
    "set_blocks",
]
