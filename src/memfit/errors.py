"""Errors raised by memfit.

Every message follows one shape: the subsystem, the facts (with units), then the fix.
"""

from __future__ import annotations


class MemfitError(RuntimeError):
    """Base class of every error memfit raises on purpose."""


class SpecError(MemfitError, ValueError):
    """A workload spec, size, policy or option could not be understood."""


class UnsupportedModelError(MemfitError):
    """memfit cannot find or use the model's chain of blocks."""


class PlanMismatchError(MemfitError):
    """A plan does not fit the model (or batch shape) it is applied to."""


class PlanFileError(MemfitError):
    """A plan file is unreadable, corrupt or invalid."""


class BudgetInfeasibleError(MemfitError):
    """No plan fits the memory budget."""

    def __init__(self, message: str, *, min_budget_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


class VerificationError(MemfitError):
    """A verification run could not be carried out."""
