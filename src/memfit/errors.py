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


class WorkloadError(MemfitError):
    """The user's own workload code raised: importing its file, its builder, ``make_batch``,
    ``loss_fn``, ``count_fn`` or the model's forward, or it returned something memfit cannot train
    (a loss without gradient, a model without trainable parameters).

    Attributes:
        stage: what memfit was calling: ``import``, ``builder``, ``make_batch``, ``loss_fn``,
            ``count_fn`` or ``check`` (memfit's own checks of what the workload returned).
        original: the exception the workload raised (also the ``__cause__``), or None.
        where: ``(file, line, function)`` of the innermost frame of the user's code, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        original: BaseException | None = None,
        where: tuple[str, int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.original = original
        self.where = where


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while memfit's command line ran: its signal handlers raise this
    (a ``KeyboardInterrupt``, so that no ``except Exception`` swallows it). A plain
    ``KeyboardInterrupt`` under those handlers was raised by code, not by a signal.

    Attributes:
        signum: the signal.
        message: the line that says what the interruption left (None: the command says
            ``interrupted by SIGNAME``).
    """

    def __init__(self, signum: int, message: str | None = None) -> None:
        super().__init__(message or f"signal {signum}")
        self.signum = signum
        self.message = message
