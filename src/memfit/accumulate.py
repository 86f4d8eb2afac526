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

NOTE [ Skipped windows ]
A window takes no optimizer step, and its gradients are dropped, when (checked in this order at
its boundary) it has no valid tokens (``tokens`` normalisation with a global count of 0: the
gradient is zero, yet AdamW's weight decay and step counter would still move), or, without a
``GradScaler`` and with ``check_finite`` (the default), its loss or its total gradient norm is NaN
or infinite, or a ``GradScaler`` found an inf/NaN gradient (it also lowers its scale). A skipped
window leaves parameters, optimizer state, scheduler and scaler as they were; it is counted in
``skipped_steps`` with its :class:`SkipReason` in :attr:`StepResult.skip_reason`, and
``consecutive_skips`` counts the skipped windows since the last step (no-token windows neither add
nor reset), so a caller can stop a run that keeps diverging (``memfit train --max-skips``). The
finiteness check costs one pass over the gradients when ``max_grad_norm`` is not set (the norm is
computed for clipping anyway when it is). Under data parallelism the decision is the same on every
rank: the count and the gradient norm are global, and the loss is only looked at when it is too
(one process, or ``sync_loss=True``).

NOTE [ Gradient sync ]
Under DDP the first ``k - 1`` micro-steps run inside ``model.no_sync()`` (forward and backward);
under FSDP2 (``fully_shard``) ``model.set_requires_gradient_sync(False)`` is set for them and
``True`` for the last. Gradients are therefore reduced once per bucket (DDP) or once per FSDP
parameter group (FSDP2) per optimizer step. Only public APIs are used.

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

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import asdict, dataclass
from enum import Enum, StrEnum
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from memfit.errors import MemfitError, SpecError
from memfit.workload import Batch, LossOutput, batch_size_of, reduce_loss, split_batch

__all__ = [
    "AccumulationError",
    "Accumulator",
    "BatchNormAccumulationWarning",
    "BatchNormMode",
    "MicroStep",
    "Normalize",
    "SkipReason",
    "StepResult",
    "Window",
    "convert_batchnorm_to_groupnorm",
    "corrected_bn_momentum",
    "disable_dropout",
    "micro_batch_sizes",
    "scale_lr",
]

_STATE_FORMAT = "memfit.accumulate/1"


def __getattr__(name: str) -> Any:
    # verify_accumulation lives in memfit.verify_accumulate (it imports this module); re-exported
    # lazily so that `from memfit.accumulate import verify_accumulation` works without a cycle.
    if name == "verify_accumulation":
        from memfit.verify_accumulate import verify_accumulation

        return verify_accumulation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class AccumulationError(MemfitError):
    """The accumulation loop was used in a way that would give a wrong gradient."""


class BatchNormAccumulationWarning(UserWarning):
    """BatchNorm in train mode sees micro-batches, not the global batch."""


class Normalize(StrEnum):
    """How the loss of a window is normalised (see NOTE [ Normalisation ])."""

    AUTO = "auto"
    TOKENS = "tokens"
    MEAN = "mean"
    SUM = "sum"


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


class SkipReason(StrEnum):
    """Why a window took no optimizer step (see NOTE [ Skipped windows ])."""

    GRAD_SCALER = "grad_scaler_overflow"
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad_norm"
    NO_TOKENS = "no_tokens"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one window (one optimizer step over a global batch) did.

    Attributes:
        loss: the normalised loss of this rank's share of the global batch (of the whole global
            batch on one process or with ``sync_loss=True``): ``sum(loss_sum) / tokens`` for ``tokens``, the sample mean for
            ``mean``, the sum for ``sum``.
        count: the normaliser over all ranks: valid tokens (``tokens``), samples (``mean``), or
            ``1.0`` (``sum``).
        samples: samples this rank processed in the window.
        micro_steps: micro-steps this rank ran.
        skipped: True when the whole window was dropped (no optimizer or scheduler step, gradients
            discarded): see ``skip_reason`` and NOTE [ Skipped windows ].
        grad_norm: total gradient norm before clipping (unscaled); None without ``max_grad_norm``
            unless it was computed for the finiteness check.
        lr: learning rate of the first parameter group used for this step (None without optimizer).
        step: optimizer steps taken so far, this one included.
        skip_reason: why the window was skipped (None when it stepped).
    """

    loss: float
    count: float
    samples: int
    micro_steps: int
    skipped: bool
    grad_norm: float | None
    lr: float | None
    step: int
    skip_reason: SkipReason | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def micro_batch_sizes(batch_size: int, micro_batch: int) -> list[int]:
    """Split ``batch_size`` samples into micro-batches of ``micro_batch``, the last one smaller.

    >>> micro_batch_sizes(10, 4)
    [4, 4, 2]
    """
    if batch_size < 1 or micro_batch < 1:
        raise SpecError(
            f"memfit.accumulate: batch size {batch_size} and micro-batch {micro_batch} must both be "
            "at least 1."
        )
    k = math.ceil(batch_size / micro_batch)
    return [micro_batch] * (k - 1) + [batch_size - micro_batch * (k - 1)]


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


def corrected_bn_momentum(momentum: float, micro_steps: int) -> float:
    """BatchNorm momentum that moves running statistics once per ``micro_steps`` updates.

    After ``k`` updates with momentum ``m'`` old statistics keep the weight ``(1 - m')^k``; choosing
    ``m' = 1 - (1 - m)^(1/k)`` makes that ``1 - m``, what one big-batch update keeps.

    >>> round(corrected_bn_momentum(0.1, 4), 6)
    0.025996
    """
    if not 0.0 <= momentum <= 1.0 or micro_steps < 1:
        raise SpecError(
            f"memfit.accumulate: momentum {momentum} must be in [0, 1] and micro_steps "
            f"{micro_steps} at least 1."
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


_RANDOM_DROP_NAMES = ("dropout", "pdrop", "drop_prob", "drop_path", "layerdrop")


def disable_dropout(module: nn.Module) -> int:
    """Turn dropout off everywhere in ``module`` while keeping train mode; return how many changed.

    Sets ``p = 0`` on every ``nn.Dropout``-like module, and 0.0 on float attributes whose name
    contains ``dropout`` or ``pdrop`` on modules and on their ``config`` (HF attention computes
    its dropout from such attributes, not from a module), and on those of stochastic depth and
    layer drop (``drop_prob`` of HF's and timm's ``DropPath``, ``drop_path_rate``, ``layerdrop``):
    they drop whole samples or layers at random, as dropout drops units (BEiT, Swin and SegFormer
    default to ``drop_path_rate=0.1``; left on, their float64 accumulation check differed by 0.5-1.6).
    """
    changed = 0
    seen: set[int] = set()
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p != 0:
            m.p = 0.0
            changed += 1
        for target in (m, getattr(m, "config", None)):
            if target is None or id(target) in seen or not hasattr(target, "__dict__"):
                continue
            seen.add(id(target))
            for key, value in list(vars(target).items()):
                low = key.lower()
                if any(w in low for w in _RANDOM_DROP_NAMES) and isinstance(value, float) and value != 0.0:
                    setattr(target, key, 0.0)
                    changed += 1
    return changed


class MicroStep:
    """One micro-step of a window: its batch, whether it syncs gradients, and its backward.

    Attributes:
        index: 0-based position in the window.
        micro_steps: micro-steps in the window (``k``).
        batch: this micro-batch (a slice of the global batch on dim 0).
        size: samples in this micro-batch.
        sync_gradients: True on the last micro-step, the only one whose backward reduces gradients
            across ranks (and after which the optimizer steps).
    """

    __slots__ = ("index", "micro_steps", "batch", "size", "sync_gradients", "_window", "_done")

    def __init__(self, window: Window, index: int, micro_steps: int, batch: Batch, size: int) -> None:
        self.index = index
        self.micro_steps = micro_steps
        self.batch = batch
        self.size = size
        self.sync_gradients = index == micro_steps - 1
        self._window = window
        self._done = False

    def backward(self, out: LossOutput) -> None:
        """Backpropagate this micro-batch's loss, scaled for the window (and the GradScaler).

        Args:
            out: what ``loss_fn(model, micro.batch)`` returned: a scalar mean loss or a
                ``(loss_sum, count)`` pair.

        Raises:
            AccumulationError: called twice, or the loss kind does not fit the normalisation.
        """
        if self._done:
            raise AccumulationError(
                f"memfit.accumulate: micro-step {self.index} was already backpropagated; call "
                "micro.backward(...) once per micro-step."
            )
        self._done = True
        self._window._backward(self, out)


class Window:
    """An iterable over the micro-steps of one global batch; steps the optimizer after the last.

    Made by :meth:`Accumulator.window`. Iterate it once; :attr:`result` is set after the loop.
    """

    def __init__(self, acc: Accumulator, batch: Batch, count_fn: Callable[[Batch], Any] | None) -> None:
        self._acc = acc
        self._batch = batch
        self._count_fn = count_fn
        self._used = False
        self.result: StepResult | None = None
        # Filled while running.
        self._norm = acc.normalize
        self._scale: float | None = None  # tokens with count_fn: W / global count
        self._global_samples = 0.0
        self._global_count: float | None = None
        self._pre_count_local: float | None = None
        # Detached per-micro-step numerators and counts, summed once at the boundary (no host sync
        # and one op per micro-step).
        self._nums: list[torch.Tensor] = []
        self._counts: list[torch.Tensor] = []
        self._samples_sum = 0.0  # mean/sum: samples backpropagated (this rank)
        self._samples_local = 0

    def __iter__(self) -> Generator[MicroStep, None, None]:
        if self._used:
            raise AccumulationError("memfit.accumulate: a window can be iterated only once.")
        self._used = True
        acc = self._acc
        if acc._active is not None:
            # A window abandoned half-way (an exception in its loop, a break): close it so that its
            # sync/BatchNorm settings are restored. Its partial gradients stay in .grad and are
            # cleared by the next window when there is an optimizer.
            acc._active.close()
        gen = self._run()
        acc._active = gen
        return gen

    # The generator: sets up counts, yields each micro-step inside its sync/autocast context, and
    # runs the optimizer boundary after the last one.
    def _run(self) -> Generator[MicroStep, None, None]:
        acc = self._acc
        acc._open = True
        try:
            total = batch_size_of(self._batch)
            sizes = micro_batch_sizes(total, acc.micro_batch)
            self._samples_local = total
            k_max = self._prepare_counts(self._batch, sizes)
            if k_max > len(sizes):
                sizes = _equal_sizes(total, k_max, acc.rank)
            pieces = split_batch(self._batch, sizes)
            k = len(sizes)
            if acc.optimizer is not None:  # a window starts from zero (stale .grad would be added)
                acc._clear_grads()
            with acc._batchnorm_window(k):
                for i, (piece, size) in enumerate(zip(pieces, sizes, strict=True)):
                    micro = MicroStep(self, i, k, piece, size)
                    with acc._sync_context(micro.sync_gradients), acc._autocast():
                        yield micro
                    if not micro._done:
                        raise AccumulationError(
                            f"memfit.accumulate: micro-step {i} of {k} ended without "
                            "micro.backward(...). Call micro.backward(loss_fn(model, micro.batch)) "
                            "in every iteration."
                        )
            self.result = acc._boundary(self, k)
            acc.last_result = self.result
        finally:
            acc._open = False
            acc._active = None
            acc._restore_sync()

    def _prepare_counts(self, batch: Batch, sizes: list[int]) -> int:
        """Global samples and (with count_fn) tokens, before the first backward; return max k."""
        acc = self._acc
        local_count = 0.0
        if self._count_fn is not None and self._norm in (Normalize.AUTO, Normalize.TOKENS):
            self._norm = Normalize.TOKENS
            # count_fn is linear in the batch: count the whole share at once, not per micro-batch.
            local_count = float(self._count_fn(batch))
            self._pre_count_local = local_count
        # One all-reduce: [samples, tokens, k of rank 0, ..., k of rank W-1] summed over ranks.
        glob = acc._all_reduce_host([float(sum(sizes)), local_count, *acc._one_hot(len(sizes))])
        self._global_samples = glob[0]
        if self._pre_count_local is not None:
            self._global_count = glob[1]
            n = max(glob[1], 1.0)  # a window without valid tokens has a zero gradient
            self._scale = acc.dp_world_size / n
        return int(max(glob[2:])) if acc._kind == "fsdp2" else len(sizes)

    def _backward(self, micro: MicroStep, out: LossOutput) -> None:
        acc = self._acc
        loss, count = reduce_loss(out)
        if self._norm is Normalize.AUTO:
            self._norm = Normalize.TOKENS if count is not None else Normalize.MEAN
        w = acc.dp_world_size
        if self._norm is Normalize.TOKENS:
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
            self._samples_sum += micro.size
            if self._norm is Normalize.MEAN:
                mean = loss if count is None else loss / count.to(device=loss.device, dtype=loss.dtype)
                numer = mean * micro.size
                scaled = numer * (w / self._global_samples)
            else:  # SUM: the sum over samples (or tokens) of the per-item losses
                numer = loss * micro.size if count is None else loss
                scaled = numer * w
        self._nums.append(numer.detach())
        to_backward = acc.scaler.scale(scaled) if acc.scaler is not None else scaled
        with acc._no_autocast():
            to_backward.backward()


class Accumulator:
    """Runs k micro-steps per global batch and one optimizer step, with the big batch's gradient.

    Args:
        model: the model as called by ``loss_fn``: a plain module (with or without a memfit plan
            applied), a ``DistributedDataParallel``, or an FSDP2 (``fully_shard``) module.
        optimizer: steps at each window's boundary; gradients are set to None when a window
            starts and after its step. ``None`` accumulates gradients into ``.grad`` (added to
            what is there) and leaves them (no step, no zero_grad: for verification; with a
            ``scaler`` they are left multiplied by its scale).
        micro_batch: samples per micro-step; the last micro-step of a window takes the rest.
        normalize: ``auto`` (default), ``tokens``, ``mean`` or ``sum``; see NOTE [ Normalisation ].
        scheduler: an LR scheduler stepped after each optimizer step that was not skipped.
        scaler: a ``torch.amp.GradScaler``; an inf/NaN in any micro-step skips the whole window.
        max_grad_norm: clip the total gradient norm to this at the boundary (after unscaling).
        check_finite: without a ``scaler``, skip a window whose loss or gradient norm is NaN or
            infinite (NOTE [ Skipped windows ]).
        autocast_dtype: run forwards under ``torch.autocast(device_type, dtype)`` (backward
            outside it); device type taken from the model's parameters.
        bn: ``freeze``, ``momentum``, ``groupnorm``, ``ghost`` or None (warn once when BatchNorm in
            train mode meets k > 1); see :class:`BatchNormMode`.
        process_group: the group data parallelism runs over (default: DDP's group, or the default
            group for FSDP2).
        sync_loss: make ``StepResult.loss`` the loss of the whole global batch over all ranks (one
            more all-reduce of two numbers per window); by default it is this rank's share.

    Attributes:
        optimizer_steps: optimizer steps taken (skipped windows not counted).
        skipped_steps: windows dropped (inf/NaN loss or gradient, no valid tokens).
        consecutive_skips: windows skipped for an inf/NaN loss or gradient since the last
            optimizer step.
        windows: global batches consumed (the data position to resume from).
        samples_seen: samples consumed over all ranks.
        last_result: the :class:`StepResult` of the last finished window.

    Raises:
        SpecError: a bad ``micro_batch``, ``normalize`` or ``bn`` value.

    Known limitations:
        The model's parameters and BatchNorm layers are looked up once, here: build the
        Accumulator after ``fully_shard``/DDP wrapping, plan application and any conversion.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        micro_batch: int,
        normalize: Normalize | str = Normalize.AUTO,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        max_grad_norm: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        bn: BatchNormMode | str | None = None,
        process_group: Any = None,
        sync_loss: bool = False,
        check_finite: bool = True,
    ) -> None:
        if not isinstance(micro_batch, int) or micro_batch < 1:
            raise SpecError(f"memfit.accumulate: micro_batch must be a positive int, got {micro_batch!r}.")
        if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise SpecError(
                f"memfit.accumulate: max_grad_norm must be a finite number > 0, got {max_grad_norm!r} "
                "(a negative norm flips the gradient, 0 freezes training). Pass e.g. 1.0, or None to not clip."
            )
        self.model = model
        self.optimizer = optimizer
        self.micro_batch = micro_batch
        self.normalize = _enum(Normalize, normalize, "normalize")
        self.scheduler = scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.max_grad_norm = max_grad_norm
        self.autocast_dtype = autocast_dtype
        self.sync_loss = sync_loss
        self.check_finite = check_finite
        self.bn = None if bn is None else _enum(BatchNormMode, bn, "bn")
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.windows = 0
        self.samples_seen = 0
        self.last_result: StepResult | None = None
        self._open = False
        self._active: Generator[MicroStep, None, None] | None = None  # the generator of the open window
        self._warned_bn = False

        self._kind, self._group = _data_parallel_kind(model, process_group)
        self.dp_world_size = _group_size(self._group) if self._kind != "local" else 1
        self.rank = _group_rank(self._group) if self._kind != "local" else 0
        # Cached once: walking the module tree every window costs ~0.3 ms on small models.
        self._params = list(model.parameters())
        self._batchnorms: list[_BatchNorm] = []
        first = self._params[0] if self._params else None
        self._device = first.device if first is not None else torch.device("cpu")
        if self.bn is BatchNormMode.GROUPNORM:
            if self._kind != "local":
                raise SpecError(
                    "memfit.accumulate: bn='groupnorm' converts modules, which must happen before "
                    "wrapping with DDP/FSDP. Call memfit.accumulate.convert_batchnorm_to_groupnorm("
                    "model) first, then wrap, then build the Accumulator with bn=None."
                )
            convert_batchnorm_to_groupnorm(model)
        self._batchnorms = [m for m in model.modules() if isinstance(m, _BatchNorm)]

    # -- public API ------------------------------------------------------------------------------

    def window(self, batch: Batch, count_fn: Callable[[Batch], Any] | None = None) -> Window:
        """The micro-steps of one global batch (this rank's share under data parallelism).

        Iterate it and call ``micro.backward(loss_fn(model, micro.batch))`` for each micro-step;
        after the loop the optimizer has stepped and ``window.result`` is set.

        Args:
            batch: the global batch (this rank's part of it), batch on dim 0.
            count_fn: ``batch -> count`` of valid tokens, so ``tokens`` normalisation knows the
                global count before the first backward.
        """
        return Window(self, batch, count_fn)

    def step(
        self,
        batch: Batch,
        loss_fn: Callable[[nn.Module, Batch], LossOutput],
        count_fn: Callable[[Batch], Any] | None = None,
    ) -> StepResult:
        """One optimizer step over ``batch``: ``loss_fn(self.model, micro_batch)`` per micro-step."""
        w = self.window(batch, count_fn)
        micro_steps = iter(w)
        try:
            for micro in micro_steps:
                micro.backward(loss_fn(self.model, micro.batch))
        finally:
            micro_steps.close()  # after an exception (e.g. out of memory): restore sync/BN state
        assert w.result is not None
        return w.result

    def state_dict(self, *, include_model: bool = True, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The training state at an optimizer-step boundary, for an exact resume.

        Holds the model (unless ``include_model=False``; the inner module's keys under DDP, so a
        state saved by N processes loads into 1), optimizer, scheduler and scaler states,
        the step counters and data position (``windows``, ``samples_seen``), the RNG states (torch
        CPU and CUDA, Python ``random``, NumPy) and ``extra``. Save it with ``torch.save``; it loads
        with ``torch.load(..., weights_only=True)``.

        Raises:
            AccumulationError: called while a window is open (not at a boundary).

        Known limitations:
            Under FSDP2 the model state is this rank's shards (DTensors); use
            ``torch.distributed.checkpoint`` for the model and ``include_model=False`` here.
        """
        if self._open:
            raise AccumulationError(
                "memfit.accumulate: state_dict() was called inside a window; the state is only "
                "consistent at an optimizer-step boundary. Call it after the window's loop."
            )
        state: dict[str, Any] = {
            "format": _STATE_FORMAT,
            "config": {"micro_batch": self.micro_batch, "normalize": self.normalize.value},
            "counters": {
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips,
                "windows": self.windows,
                "samples_seen": self.samples_seen,
            },
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": _rng_state(),
            "extra": dict(extra or {}),
        }
        if include_model:
            state["model"] = self._unwrapped().state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Restore what :meth:`state_dict` saved; return its ``extra`` mapping.

        Raises:
            AccumulationError: not a memfit accumulation state, or a part is missing here
                (e.g. the state has a scheduler and this Accumulator has none).
        """
        if state.get("format") != _STATE_FORMAT:
            raise AccumulationError(
                f"memfit.accumulate: not an Accumulator state (format {state.get('format')!r}, "
                f"expected {_STATE_FORMAT!r}). Save it with torch.save(acc.state_dict(), path)."
            )
        for part, obj in (("optimizer", self.optimizer), ("scheduler", self.scheduler), ("scaler", self.scaler)):
            if (state.get(part) is None) != (obj is None):
                have = "has" if state.get(part) is not None else "has no"
                raise AccumulationError(
                    f"memfit.accumulate: the saved state {have} {part} state but this Accumulator "
                    f"{'has no' if obj is None else 'has a'} {part}. Build it with the same parts."
                )
        cfg = state.get("config", {})
        if cfg.get("micro_batch") != self.micro_batch:
            warnings.warn(
                f"memfit.accumulate: resuming with micro_batch={self.micro_batch}, saved with "
                f"{cfg.get('micro_batch')}: gradients are equal up to rounding, not bitwise.",
                stacklevel=2,
            )
        if "model" in state:
            self._unwrapped().load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        counters = state["counters"]
        self.optimizer_steps = int(counters["optimizer_steps"])
        self.skipped_steps = int(counters["skipped_steps"])
        self.consecutive_skips = int(counters.get("consecutive_skips", 0))
        self.windows = int(counters["windows"])
        self.samples_seen = int(counters["samples_seen"])
        _set_rng_state(state["rng"])
        return dict(state.get("extra", {}))

    # -- machinery -------------------------------------------------------------------------------

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def _unwrapped(self) -> nn.Module:
        # DDP's state_dict keys start with "module."; saving the inner module's makes a state
        # loadable by a single process and by any world size.
        return self.model.module if self._kind == "ddp" else self.model  # type: ignore[return-value]

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        if self._kind == "ddp" and not sync:
            return self.model.no_sync()  # type: ignore[operator]
        if self._kind == "fsdp2":
            self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        return contextlib.nullcontext()

    def _restore_sync(self) -> None:
        if self._kind == "fsdp2":
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device.type, dtype=self.autocast_dtype)

    def _no_autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device.type, enabled=False)

    def _one_hot(self, value: int) -> list[float]:
        out = [0.0] * self.dp_world_size
        out[self.rank] = float(value)
        return out

    def _all_reduce_host(self, values: list[float]) -> list[float]:
        """Sum small host numbers over the data-parallel group (no-op on one process)."""
        if self._kind == "local":
            return values
        import torch.distributed as dist

        dev = self._device if _backend(self._group) != "gloo" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, group=self._group)
        return t.tolist()

    @contextlib.contextmanager
    def _batchnorm_window(self, k: int) -> Iterator[None]:
        bns = [m for m in self._batchnorms if m.training]
        if not bns:
            yield
            return
        if self.bn is None:
            if k > 1 and not self._warned_bn:
                self._warned_bn = True
                warnings.warn(_bn_message(len(bns), k, self.micro_batch), BatchNormAccumulationWarning, stacklevel=3)
            yield
        elif self.bn is BatchNormMode.FREEZE:
            for m in bns:
                m.eval()
            try:
                yield
            finally:
                for m in bns:
                    m.train()
        elif self.bn is BatchNormMode.MOMENTUM:
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

    def _boundary(self, w: Window, k: int) -> StepResult:
        norm = w._norm
        # One host sync per window: the loss and the count check (or the deferred count).
        local_num = _total(w._nums)
        if norm is Normalize.TOKENS:
            local_den = _total(w._counts)
            if w._pre_count_local is not None and local_den != w._pre_count_local:
                raise AccumulationError(
                    f"memfit.accumulate: count_fn counted {w._pre_count_local:g} tokens in "
                    f"this window but loss_fn returned counts adding up to {local_den:g}; the "
                    f"gradient would be scaled by {local_den / max(w._pre_count_local, 1):.4f}. "
                    "Make count_fn count exactly the tokens loss_fn sums over (for causal LMs: "
                    "the shifted labels)."
                )
        else:
            local_den = w._samples_sum
        deferred = norm is Normalize.TOKENS and w._pre_count_local is None
        # One all-reduce of [count, loss] when the count was deferred or the loss is to be global.
        if self._kind != "local" and (deferred or self.sync_loss):
            glob_den, glob_num = self._all_reduce_host([local_den, local_num])
        else:
            glob_den, glob_num = local_den, local_num
        if norm is Normalize.TOKENS:
            if deferred:
                count = glob_den
                factor = 1.0 / max(count, 1.0)
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(factor)
            else:
                assert w._global_count is not None
                count = w._global_count
        elif norm is Normalize.MEAN:
            count = w._global_samples
        else:
            count = 1.0
        num, den = (glob_num, glob_den) if self.sync_loss else (local_num, local_den)
        loss = num if norm is Normalize.SUM else num / max(den, 1.0)
        self.windows += 1
        self.samples_seen += int(w._global_samples)
        grad_norm: float | None = None
        reason: SkipReason | None = None
        lr: float | None = None
        if self.optimizer is not None:
            lr = float(self.optimizer.param_groups[0]["lr"])
            # NOTE [ Skipped windows ]: the checks, in order; each decision is the same on every rank.
            check = self.check_finite and self.scaler is None
            if norm is Normalize.TOKENS and count == 0:
                reason = SkipReason.NO_TOKENS
            elif check and (self._kind == "local" or self.sync_loss) and not math.isfinite(loss):
                reason = SkipReason.NONFINITE_LOSS
            if reason is None:
                if self.max_grad_norm is not None:
                    if self.scaler is not None:
                        self.scaler.unscale_(self.optimizer)
                    grad_norm = self._grad_norm(clip=True)
                elif check:
                    grad_norm = self._grad_norm(clip=False)
                if check and grad_norm is not None and not math.isfinite(grad_norm):
                    reason = SkipReason.NONFINITE_GRAD
            if reason is None:
                if self.scaler is not None:
                    scale_before = self.scaler.get_scale()
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                    # GradScaler backs off (scale * backoff_factor < scale) exactly when it found inf/NaN.
                    if self.scaler.get_scale() < scale_before:
                        reason = SkipReason.GRAD_SCALER
                else:
                    self.optimizer.step()
            if reason is not None:
                self.skipped_steps += 1
                if reason is not SkipReason.NO_TOKENS:
                    self.consecutive_skips += 1
            else:
                self.optimizer_steps += 1
                self.consecutive_skips = 0
                if self.scheduler is not None:
                    self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._clear_grads()
        elif self.max_grad_norm is not None:
            grad_norm = self._grad_norm(clip=True)
        return StepResult(
            loss=loss,
            count=count,
            samples=w._samples_local,
            micro_steps=k,
            skipped=reason is not None,
            grad_norm=grad_norm,
            lr=lr,
            step=self.optimizer_steps,
            skip_reason=reason,
        )

    def _grad_norm(self, *, clip: bool) -> float:
        """Total 2-norm of the gradients (global under FSDP2); clipped to ``max_grad_norm`` if ``clip``."""
        grads = [p for p in self._params if p.grad is not None]
        if clip:
            total = torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in grads])
        if hasattr(total, "full_tensor"):  # DTensor under FSDP2
            total = total.full_tensor()
        return float(total)


# -- helpers -------------------------------------------------------------------------------------


def _enum(cls: type[Enum], value: Any, what: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)  # type: ignore[attr-defined]
        raise SpecError(f"memfit.accumulate: unknown {what}={value!r}. Use one of {allowed}.") from None


def _data_parallel_kind(model: nn.Module, group: Any) -> tuple[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp", group if group is not None else model.process_group
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        FSDPModule = ()  # type: ignore[assignment]  # noqa: N806
    if FSDPModule and isinstance(model, FSDPModule):
        return "fsdp2", group
    return "local", None


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _total(values: list[torch.Tensor]) -> float:
    """Sum of scalar tensors as a float64 host number (one host sync)."""
    return float(torch.stack(values).sum(dtype=torch.float64))


def _group_rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _equal_sizes(total: int, k: int, rank: int) -> list[int]:
    """``total`` samples in ``k`` near-equal micro-batches (FSDP2 needs the same k on every rank)."""
    if total < k:
        raise AccumulationError(
            f"memfit.accumulate: rank {rank} has {total} samples but another rank runs {k} "
            "micro-steps; under FSDP2 every rank must run the same number of forwards (each one "
            f"all-gathers parameters). Give every rank at least {k} samples, or equal shares."
        )
    base, rem = divmod(total, k)
    return [base + 1] * rem + [base] * (k - rem)


def _backend(group: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group)).lower()


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


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "name": str(name),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def _python_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": list(internal), "gauss_next": gauss}


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state(
            (s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
