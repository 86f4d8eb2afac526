"""Verification: a changed training step against the unmodified one, from the same weights and data.

:mod:`~memfit.verification.plans` (:func:`verify`: a checkpoint plan's gradients, buffers and peak),
:mod:`~memfit.verification.accumulation` (:func:`verify_accumulation`: micro-batches against one big
batch) and :mod:`~memfit.verification.gradients` (the one gradient comparison both use, NOTE
[ Gradient floor ]).
"""

from memfit.verification.accumulation import verify_accumulation
from memfit.verification.gradients import GradComparison, compare_gradients
from memfit.verification.plans import VerifyResult, verify

__all__ = ["GradComparison", "VerifyResult", "compare_gradients", "verify", "verify_accumulation"]
