"""Normalising a window's loss so that the accumulated gradient is the big batch's.

NOTE [ Normalisation ]
``tokens``: every micro-step backpropagates ``loss_sum_i * W / N`` where ``N`` is the number of
valid tokens of the whole window on all ``W`` data-parallel ranks (DDP and FSDP2 average gradients
over ranks, hence ``W``). The sum over micro-steps and ranks is ``sum(loss_sum) / N``: the big
batch's loss. ``N`` comes from ``count_fn`` before the first backward (one all-reduce of two
numbers per window). Without ``count_fn`` the count is known only after each forward, so memfit
backpropagates ``loss_sum_i * W`` and divides the accumulated gradients by ``N`` at the boundary
(after an all-reduce of the count): the same gradient up to rounding, at the cost of one pass over
the gradients; fp16 without a ``GradScaler`` may overflow sooner because unnormalised sums are
larger. ``mean``: micro-step ``i`` of ``b_i`` samples backpropagates ``mean_i * b_i * W / B``
(``B`` = samples of the window on all ranks), exact for losses that are means over samples.
``sum``: ``loss_sum_i * W`` (or ``mean_i * b_i * W``), the unnormalised sum over every sample or
token of the global batch. ``auto`` is ``tokens`` when ``count_fn`` is given or ``loss_fn`` returns
``(loss_sum, count)``, else ``mean``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from memfit.accumulate.parallel import DataParallel
from memfit.accumulate.types import AccumulationError
from memfit.workload import Batch, LossOutput, reduce_loss

__all__ = ["LossTally", "Normalize", "WindowTotals"]


class Normalize(StrEnum):
    """How the loss of a window is normalised (see NOTE [ Normalisation ])."""

    AUTO = "auto"
    TOKENS = "tokens"
    MEAN = "mean"
    SUM = "sum"


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowTotals:
    """A window's loss and normaliser, summed over its micro-steps (and ranks where needed).

    Attributes:
        normalize: the normalisation the window ran (``auto`` resolved).
        loss: the normalised loss of this rank's share (of the global batch with ``sync_loss``).
        count: the normaliser over all ranks: valid tokens, samples, or 1.0 (``sum``).
        global_samples: samples of the window over all ranks.
    """

    normalize: Normalize
    loss: float
    count: float
    global_samples: float


class LossTally:
    """One window's normalisation (NOTE [ Normalisation ]): counts before the first backward, the
    scale of each micro-step's loss, and the totals at the boundary.

    Args:
        normalize: the Accumulator's normalisation (``auto`` is resolved by ``count_fn`` or by the
            first loss).
        parallel: the data-parallel set-up (counts and losses are all-reduced over it).
    """

    def __init__(self, normalize: Normalize, parallel: DataParallel) -> None:
        self.normalize = normalize
        self._dp = parallel
        self._scale: float | None = None  # tokens with count_fn: W / global count
        self._global_samples = 0.0
        self._global_count: float | None = None
        self._pre_count_local: float | None = None
        # Detached per-micro-step numerators and counts, summed once at the boundary (no host sync
        # and one op per micro-step).
        self._nums: list[torch.Tensor] = []
        self._counts: list[torch.Tensor] = []
        self._samples_sum = 0.0  # mean/sum: samples backpropagated (this rank)

    def prepare(self, batch: Batch, sizes: list[int], count_fn: Callable[[Batch], Any] | None) -> int:
        """Global samples and (with count_fn) tokens, before the first backward; return max k."""
        dp = self._dp
        local_count = 0.0
        if count_fn is not None and self.normalize in (Normalize.AUTO, Normalize.TOKENS):
            self.normalize = Normalize.TOKENS
            # count_fn is linear in the batch: count the whole share at once, not per micro-batch.
            local_count = float(count_fn(batch))
            self._pre_count_local = local_count
        # One all-reduce: [samples, tokens, k of rank 0, ..., k of rank W-1] summed over ranks.
        glob = dp.all_reduce([float(sum(sizes)), local_count, *dp.one_hot(len(sizes))])
        self._global_samples = glob[0]
        if self._pre_count_local is not None:
            self._global_count = glob[1]
            n = max(glob[1], 1.0)  # a window without valid tokens has a zero gradient
            self._scale = dp.world_size / n
        return int(max(glob[2:])) if dp.kind == "fsdp2" else len(sizes)

    def scaled_loss(self, out: LossOutput, size: int) -> torch.Tensor:
        """The loss a micro-step of ``size`` samples backpropagates (before a GradScaler's scale)."""
        loss, count = reduce_loss(out)
        if self.normalize is Normalize.AUTO:
            self.normalize = Normalize.TOKENS if count is not None else Normalize.MEAN
        w = self._dp.world_size
        if self.normalize is Normalize.TOKENS:
            if count is None:
                raise AccumulationError(
                    "memfit.accumulate: normalize='tokens' needs loss_fn to return (loss_sum, count); "
                    "it returned a scalar. Return the summed token loss and the number of valid "
                    "tokens, or use normalize='mean'."
                )
            numer = loss
            self._counts.append(count)
            # deferred (no count_fn): gradients are divided by the global count at the boundary
            scaled = loss * (self._scale if self._scale is not None else w)
        else:
            self._samples_sum += size
            if self.normalize is Normalize.MEAN:
                mean = loss if count is None else loss / count.to(device=loss.device, dtype=loss.dtype)
                numer = mean * size
                scaled = numer * (w / self._global_samples)
            else:  # SUM: the sum over samples (or tokens) of the per-item losses
                numer = loss * size if count is None else loss
                scaled = numer * w
        self._nums.append(numer.detach())
        return scaled

    def totals(self, params: list[nn.Parameter], *, sync_loss: bool) -> WindowTotals:
        """The window's loss and normaliser; divides the gradients of ``params`` by a deferred count.

        One host sync per window (the loss and the count check, or the deferred count), and one
        all-reduce of ``[count, loss]`` when the count was deferred or the loss is to be global.
        """
        norm = self.normalize
        local_num = _total(self._nums)
        if norm is Normalize.TOKENS:
            local_den = _total(self._counts)
            if self._pre_count_local is not None and local_den != self._pre_count_local:
                raise AccumulationError(
                    f"memfit.accumulate: count_fn counted {self._pre_count_local:g} tokens in "
                    f"this window but loss_fn returned counts adding up to {local_den:g}; the "
                    f"gradient would be scaled by {local_den / max(self._pre_count_local, 1):.4f}. "
                    "Make count_fn count exactly the tokens loss_fn sums over (for causal LMs: "
                    "the shifted labels)."
                )
        else:
            local_den = self._samples_sum
        deferred = norm is Normalize.TOKENS and self._pre_count_local is None
        if self._dp.kind != "local" and (deferred or sync_loss):
            glob_den, glob_num = self._dp.all_reduce([local_den, local_num])
        else:
            glob_den, glob_num = local_den, local_num
        if norm is Normalize.TOKENS:
            if deferred:
                count = glob_den
                factor = 1.0 / max(count, 1.0)
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(factor)
            else:
                assert self._global_count is not None
                count = self._global_count
        elif norm is Normalize.MEAN:
            count = self._global_samples
        else:
            count = 1.0
        num, den = (glob_num, glob_den) if sync_loss else (local_num, local_den)
        loss = num if norm is Normalize.SUM else num / max(den, 1.0)
        return WindowTotals(normalize=norm, loss=loss, count=count, global_samples=self._global_samples)


def _total(values: list[torch.Tensor]) -> float:
    """Sum of scalar tensors as a float64 host number (one host sync)."""
    return float(torch.stack(values).sum(dtype=torch.float64))
