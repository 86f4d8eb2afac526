"""Learning rate for another batch size: the usual scaling rules."""

from __future__ import annotations

import math

from memfit.errors import SpecError

__all__ = ["scale_lr"]


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: str = "linear") -> float:
    """Learning rate for ``batch`` samples per step, given ``base_lr`` tuned at ``base_batch``.

    Rules: ``linear`` multiplies by ``batch / base_batch`` (Goyal et al. 2017, for SGD with
    warm-up); ``sqrt`` by ``sqrt(batch / base_batch)`` (Krizhevsky 2014; a common choice for Adam).

    >>> scale_lr(0.1, 256, 1024)
    0.4
    >>> scale_lr(1e-3, 32, 128, rule="sqrt")
    0.002

    Raises:
        SpecError: a non-positive number or an unknown rule.
    """
    if not (base_lr > 0 and base_batch > 0 and batch > 0):
        raise SpecError(
            f"memfit.accumulate: scale_lr needs positive numbers (base_lr={base_lr}, "
            f"base_batch={base_batch}, batch={batch})."
        )
    ratio = batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise SpecError(f"memfit.accumulate: unknown LR scaling rule {rule!r}. Use 'linear' or 'sqrt'.")
