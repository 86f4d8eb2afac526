"""memfit: train deeper models and bigger batches in the memory you have.

Measure, plan, apply and verify activation checkpointing and gradient accumulation for PyTorch.
"""

from memfit.errors import (
    BudgetInfeasibleError,
    MemfitError,
    PlanFileError,
    PlanMismatchError,
    SpecError,
    UnsupportedModelError,
    VerificationError,
)
from memfit.units import format_bytes, parse_size
from memfit.workload import Workload, load_workload

__version__ = "0.1.0"

__all__ = [
    "BudgetInfeasibleError",
    "MemfitError",
    "PlanFileError",
    "PlanMismatchError",
    "SpecError",
    "UnsupportedModelError",
    "VerificationError",
    "Workload",
    "format_bytes",
    "load_workload",
    "parse_size",
]
