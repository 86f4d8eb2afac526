"""BatchNorm under accumulation: the modes, the momentum correction, GroupNorm conversion, the warning,
and the smallest micro-batch BatchNorm accepts.

BatchNorm in train mode normalises each micro-batch with its own statistics (ghost batch norm) and
moves its running statistics once per micro-step: no accumulation scheme can equal the big batch
there. :class:`BatchNormMode` names the ways out; :class:`BatchNormSwitch` puts the chosen one in
place for the length of a window and undoes it afterwards. :func:`smallest_micro_batch` finds the
smallest micro-batch a model runs in train mode (a BatchNorm that sees one value per channel, as
``BatchNorm1d`` on a ``(1, C)`` input, refuses it), where an auto-fit starts.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from enum import StrEnum

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from memfit.errors import SpecError

__all__ = [
    "BatchNormAccumulationWarning",
    "BatchNormMode",
    "BatchNormSwitch",
    "convert_batchnorm_to_groupnorm",
    "corrected_bn_momentum",
    "is_batchnorm_size_error",
    "smallest_micro_batch",
]

BATCHNORM_SIZE_ERROR = "Expected more than 1 value per channel when training"
"""The start of the ``ValueError`` torch's ``F.batch_norm`` raises in train mode for one value per channel."""


class BatchNormAccumulationWarning(UserWarning):
    """BatchNorm in train mode sees micro-batches, not the global batch."""


class BatchNormMode(StrEnum):
    """What to do about BatchNorm layers in train mode when a window has several micro-steps.

    ``FREEZE``: normalise with the running statistics and leave them unchanged (BatchNorm layers
    run in eval mode during each window); the gradient then equals the big batch's under the same
    frozen statistics. ``MOMENTUM``: momentum ``m`` becomes ``1-(1-m)^(1/k)`` during a window of
    ``k`` micro-steps, so old running statistics decay once per optimizer step as with the big batch.
    ``GROUPNORM``: replace every BatchNorm by a GroupNorm sharing its affine parameters (done once,
    at construction). ``GHOST``: accept per-micro-batch statistics (ghost batch norm) silently.
    """

    FREEZE = "freeze"
    MOMENTUM = "momentum"
    GROUPNORM = "groupnorm"
    GHOST = "ghost"


def corrected_bn_momentum(momentum: float, micro_steps: int) -> float:
    """BatchNorm momentum that moves running statistics once per ``micro_steps`` updates.

    After ``k`` updates with momentum ``m'`` old statistics keep the weight ``(1 - m')^k``; choosing
    ``m' = 1 - (1 - m)^(1/k)`` makes that ``1 - m``, what one big-batch update keeps.

    >>> round(corrected_bn_momentum(0.1, 4), 6)
    0.025996
    """
    if not 0.0 <= momentum <= 1.0 or micro_steps < 1:
        raise SpecError(
            f"memfit.accumulate: momentum {momentum} must be in [0, 1] and micro_steps {micro_steps} at least 1."
        )
    return 1.0 - (1.0 - momentum) ** (1.0 / micro_steps)


def convert_batchnorm_to_groupnorm(module: nn.Module, num_groups: int | None = None) -> nn.Module:
    """Replace every BatchNorm in ``module`` by a GroupNorm, in place; return the (new) module.

    The GroupNorm shares the BatchNorm's ``weight`` and ``bias`` Parameter objects, so an optimizer
    built before the conversion keeps training them. GroupNorm's statistics are per sample, so
    accumulation over micro-batches is exact. It is a different normalisation: retrain (or
    fine-tune) rather than expecting the converted model to reproduce BatchNorm's outputs.

    Args:
        module: a model; converted in place (a BatchNorm passed directly is returned converted).
        num_groups: groups per layer; default the largest divisor of the channel count that is at
            most 32 (Wu & He 2018 use 32) and leaves at least 2 channels per group (a group of one
            channel of a ``(N, C)`` input has a single value to normalise).

    Known limitations:
        Convert before wrapping with DDP/FSDP (they keep references to the module's buffers).
    """
    if isinstance(module, _BatchNorm):
        channels = module.num_features
        limit = max(1, min(32, channels // 2))  # >= 2 channels per group: (N, C) inputs need it
        groups = num_groups or max(g for g in range(1, limit + 1) if channels % g == 0)
        if channels % groups:
            raise SpecError(
                f"memfit.accumulate: num_groups={groups} does not divide {channels} channels of "
                f"{type(module).__name__}. Pass a divisor of {channels}."
            )
        gn = nn.GroupNorm(groups, channels, eps=module.eps, affine=module.affine)
        if module.affine:
            gn.weight = module.weight
            gn.bias = module.bias
        gn.train(module.training)
        return gn
    for name, child in list(module.named_children()):
        new = convert_batchnorm_to_groupnorm(child, num_groups)
        if new is not child:
            setattr(module, name, new)
    return module


class BatchNormSwitch:
    """Puts a :class:`BatchNormMode` in place on BatchNorm layers for the length of one window.

    Args:
        layers: the model's BatchNorm layers (looked up once; those in train mode are switched).
        mode: the mode, or None: warn once (:class:`BatchNormAccumulationWarning`) when BatchNorm
            in train mode meets a window of more than one micro-step, and change nothing.
    """

    def __init__(self, layers: list[_BatchNorm], mode: BatchNormMode | None) -> None:
        self.layers = layers
        self.mode = mode
        self._warned = False

    @contextlib.contextmanager
    def window(self, k: int, micro_batch: int) -> Iterator[None]:
        """The mode in effect during a window of ``k`` micro-steps of up to ``micro_batch`` samples."""
        bns = [m for m in self.layers if m.training]
        if not bns:
            yield
            return
        if self.mode is None:
            if k > 1 and not self._warned:
                self._warned = True
                warnings.warn(_bn_message(len(bns), k, micro_batch), BatchNormAccumulationWarning, stacklevel=3)
            yield
        elif self.mode is BatchNormMode.FREEZE:
            for m in bns:
                m.eval()
            try:
                yield
            finally:
                for m in bns:
                    m.train()
        elif self.mode is BatchNormMode.MOMENTUM:
            saved = [m.momentum for m in bns]
            for m in bns:
                if m.momentum is not None:  # None = cumulative average: nothing to correct
                    m.momentum = corrected_bn_momentum(m.momentum, k)
            try:
                yield
            finally:
                for m, mom in zip(bns, saved, strict=True):
                    m.momentum = mom
        else:
            yield


def _bn_message(n: int, k: int, micro_batch: int) -> str:
    return (
        f"memfit.accumulate: the model has {n} BatchNorm layer(s) in train mode and this window runs "
        f"{k} micro-steps of up to {micro_batch} samples: BatchNorm normalises each micro-batch with "
        f"its own statistics (ghost batch norm over {micro_batch} samples, not the global batch) and "
        f"moves its running statistics {k} times per optimizer step. Choose one with "
        "Accumulator(..., bn=...): 'freeze' (normalise with the running statistics and keep them), "
        "'momentum' (momentum m -> 1-(1-m)^(1/k), so running statistics move as much as one big-batch "
        "update), 'groupnorm' (convert to GroupNorm; or call "
        "memfit.accumulate.convert_batchnorm_to_groupnorm(model) before wrapping), or 'ghost' to "
        "accept per-micro-batch statistics and silence this warning."
    )


def is_batchnorm_size_error(err: BaseException) -> bool:
    """Whether ``err`` is BatchNorm refusing a batch with one value per channel in train mode, or
    an error raised from it (a workload's ``WorkloadError`` wraps what the user's code raised)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, ValueError) and str(e).startswith(BATCHNORM_SIZE_ERROR):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def smallest_micro_batch(runs: Callable[[int], object], *, cap: int) -> int:
    """The smallest micro-batch ``b`` in ``1 .. cap`` for which ``runs(b)`` does not raise BatchNorm's
    batch-size error (``ValueError: Expected more than 1 value per channel when training``).

    Tries 1, then 2, ... while that error (or an error raised from it) is raised; any other error
    propagates. ``runs`` is a
    forward of a micro-batch of ``b`` samples in train mode (no backward is needed: the error is
    raised in the forward, with or without gradients).

    Args:
        runs: ``runs(b)`` runs the model's forward on ``b`` samples.
        cap: the largest micro-batch to try.

    Returns:
        ``b``, or ``cap + 1`` when every size up to ``cap`` raised the error.

    Example:
        >>> import torch
        >>> bn = torch.nn.BatchNorm1d(4)
        >>> smallest_micro_batch(lambda b: bn(torch.randn(b, 4)), cap=8)
        2
    """
    for b in range(1, cap + 1):
        try:
            runs(b)
        except Exception as err:
            if not is_batchnorm_size_error(err):
                raise
            continue
        return b
    return cap + 1
