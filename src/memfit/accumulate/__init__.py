"""Gradient accumulation whose gradient equals the big batch's, on one process and under DDP/FSDP2.

One optimizer step over a global batch of ``B`` samples runs ``k = ceil(B / micro_batch)``
micro-steps (the last one may be smaller) and adds their gradients. Done naively, the result is
not the big batch's gradient: averaging each micro-batch's own token mean weights tokens unevenly
(8 % off with random lengths, 69 % with length-sorted batches), a short last window is scaled
wrongly, and DDP/FSDP2 average over ranks. :class:`Accumulator` scales every micro-step by the
global normaliser of the whole window, counted before the first backward, so the accumulated
gradient *is* the big batch's (to 1e-15 in float64).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> acc = Accumulator(model, opt, micro_batch=3, normalize="mean")
    >>> def loss_fn(m, batch):
    ...     x, y = batch
    ...     return ((m(x) - y) ** 2).mean()
    >>> batch = (torch.randn(8, 4), torch.randn(8, 1))
    >>> result = acc.step(batch, loss_fn)          # 3 micro-steps of 3, 3 and 2 samples, 1 step
    >>> result.micro_steps, result.skipped, acc.optimizer_steps
    (3, False, 1)

The lower-level loop gives the same result and lets the caller do more per micro-step:

    >>> for micro in acc.window(batch):            # no_sync / autocast handled here
    ...     out = loss_fn(model, micro.batch)      # micro.sync_gradients: True on the last
    ...     micro.backward(out)                    # scaled by the window's global normaliser
    >>> acc.last_result.micro_steps
    3

The package, one concern per module: :mod:`~memfit.accumulate.accumulator` (the loop and the
optimizer boundary, NOTE [ Skipped windows ]), :mod:`~memfit.accumulate.window` (what the caller
holds: :class:`Window`, :class:`MicroStep`), :mod:`~memfit.accumulate.normalize` (NOTE
[ Normalisation ]), :mod:`~memfit.accumulate.parallel` (DDP/FSDP2, NOTE [ Gradient sync ]),
:mod:`~memfit.accumulate.batchnorm`, :mod:`~memfit.accumulate.dropout`,
:mod:`~memfit.accumulate.lr` (``scale_lr``) and :mod:`~memfit.accumulate.types` (results, counters).
The check of accumulated gradients against one big batch is
:func:`memfit.verification.verify_accumulation`.

Known limitations:
    - Data parallelism is recognised when ``model`` itself is a ``DistributedDataParallel`` or an
      FSDP2 module; counts are all-reduced over the DDP process group, or the default group for
      FSDP2 (pass ``process_group=`` for HSDP or tensor parallel meshes). A plain model under an
      initialised process group is treated as single-process (its gradients are not reduced by
      memfit).
    - DDP/FSDP2 are assumed to *average* gradients over ranks (their defaults); a custom comm hook
      or ``set_gradient_divide_factor`` that sums instead makes gradients ``W`` times too large.
    - ``StepResult.loss`` is the loss of this rank's share of the global batch (equal to the global
      loss on one process) unless ``sync_loss=True``.
    - Breaking out of a :meth:`Accumulator.window` loop early (or an exception in it) leaves the
      accumulated gradients in place and takes no optimizer step; the next window (or
      ``Accumulator.step``'s own cleanup) closes it and restores sync and BatchNorm settings.
    - BatchNorm in train mode normalises each micro-batch with its own statistics (ghost batch
      norm): no accumulation scheme can equal the big batch there; see ``bn=``.
"""

from memfit.accumulate.accumulator import STATE_FORMAT, Accumulator
from memfit.accumulate.batchnorm import (
    BatchNormAccumulationWarning,
    BatchNormMode,
    convert_batchnorm_to_groupnorm,
    corrected_bn_momentum,
)
from memfit.accumulate.dropout import disable_dropout
from memfit.accumulate.lr import scale_lr
from memfit.accumulate.normalize import Normalize
from memfit.accumulate.types import (
    AccumulationError,
    Counters,
    Mark,
    SkipReason,
    StepResult,
    WindowProgress,
)
from memfit.accumulate.window import MicroStep, Window, micro_batch_sizes

__all__ = [
    "STATE_FORMAT",
    "AccumulationError",
    "Accumulator",
    "BatchNormAccumulationWarning",
    "BatchNormMode",
    "Counters",
    "Mark",
    "MicroStep",
    "Normalize",
    "SkipReason",
    "StepResult",
    "Window",
    "WindowProgress",
    "convert_batchnorm_to_groupnorm",
    "corrected_bn_momentum",
    "disable_dropout",
    "micro_batch_sizes",
    "scale_lr",
]
