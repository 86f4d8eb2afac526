"""memfit in an accelerate loop: a plan applied before ``prepare``, and exact accumulation.

accelerate's ``with accelerator.accumulate(model):`` divides each micro-batch's loss by
``gradient_accumulation_steps``: with token-level losses and uneven lengths the gradient is off by
23-77 % against the big batch, and a short last window is scaled by 0.25 (``benchmarks/reports/accumulation_gpt2-demo_cpu_2026-12-01.md``). This module replaces that context with memfit's
:class:`memfit.Accumulator` and keeps the rest of the accelerate loop as it is::

    accelerator = Accelerator(mixed_precision="bf16")             # gradient_accumulation_steps=1
    fit = memfit_accelerate.fit(accelerator, model, "20GiB", global_batch=32,
                                make_batch=make_batch, loss_fn=loss_fn)   # plans, applies
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    acc = memfit_accelerate.ExactAccumulation(accelerator, model, micro_batch=fit.micro_batch)
    for batch in loader:                                          # global batches (per process)
        for micro in acc.window(batch, count_fn=count_tokens):
            micro.backward(loss_fn(model, micro.batch))           # instead of accelerator.backward
        accelerator.clip_grad_norm_(model.parameters(), 1.0)      # optional, as before
        optimizer.step(); scheduler.step(); optimizer.zero_grad()  # once per global batch

NOTE [ What ExactAccumulation normalises ]
The loader yields global batches (this process's share; with ``split_batches=True`` the loader's
batch is the global batch and accelerate splits it over processes). Each window splits its batch
into micro-batches of ``micro_batch`` samples (the last one smaller) and backpropagates micro-step
``i`` as ``loss_sum_i * W / N``, where ``N`` is the number of valid tokens of the whole window on all
``W`` processes (memfit's NOTE [ Normalisation ] in :mod:`memfit.accumulate`). With ``count_fn``
the count is all-reduced before the first backward; without it the gradients are divided by ``N``
after the last backward (the same gradient up to rounding). The sum over micro-steps and processes
is the big batch's ``sum(loss_sum) / N``, so it is exact for any lengths and for a short last
window. A token batch of a transformers model (``labels`` of shape ``(B, T)``) needs no
``count_fn``: a scalar loss such as ``model(**micro.batch).loss`` is read as the mean over the
tokens the model's loss averages over and weighted by them (NOTE [ Counting a token batch ] in
:mod:`memfit.integrations._tokens`; for another model the first backward refuses and asks for
``count_fn``). Other losses that are means (a plain tensor from ``loss_fn``) are weighted by
micro-batch size (``normalize="mean"``: exact for means over samples).

How it fits accelerate:
- mixed precision: accelerate runs the prepared model's forward under autocast; backward runs
  outside it, as with ``accelerator.backward``. With fp16 the loss is scaled by
  ``accelerator.scaler`` and accelerate's optimizer unscales and skips a non-finite step itself.
- ``no_sync`` / ``sync_gradients``: the first ``k - 1`` micro-steps run inside the DDP model's
  ``no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``); ``accelerator.sync_gradients`` is
  False during them and True on the last micro-step and after the window, so accelerate's
  optimizer, scheduler and ``zero_grad`` act once per window, after the loop.
- The optimizer step, scheduler, clipping and ``zero_grad`` stay the user's accelerate calls.

Known limitations:
    - DeepSpeed, Megatron-LM and XLA (their engines own backward and accumulation) and FSDP
      version 1 (memfit drives FSDP2's gradient sync) are refused with the fix.
    - FSDP2 under accelerate is used through memfit's FSDP2 path (``fully_shard`` modules); it was
      tested with memfit's own FSDP2 tests, not through ``accelerate launch`` (no GPU here).
    - :func:`fit` plans the step ``prepare`` will run: ``loss_fn`` under the accelerator's
      autocast (its mixed precision), and under several processes one DDP rank, its gradient
      buckets included (``bucket_cap_mb`` of the accelerator's ``DistributedDataParallelKwargs``;
      NOTE [ Per-rank accounting ] in :mod:`memfit.plan.parallel`). The run that checks the choice
      (``measured_peak_bytes``) is rank 0's step without DDP, so without its buckets. FSDP is planned
      as one process.
    - Without ``count_fn``, a micro-batch whose labels are all ``-100`` makes the model's mean loss
      0/0 (NaN), as it does without memfit: pass ``count_fn`` and return ``(loss_sum, count)``
      for such data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.accumulate import AccumulationError, Accumulator, BatchNormMode, MicroStep, Normalize, StepResult
from memfit.errors import MemfitError, SpecError
from memfit.integrations._fit import ddp_layout, fit_and_apply
from memfit.integrations._tokens import is_token_batch, loss_shifts_labels, token_counter
from memfit.plan.policies import Policy
from memfit.workload import Batch, LossOutput

__all__ = ["ExactAccumulation", "fit"]


def _require_accelerate() -> Any:
    try:
        import accelerate
    except ImportError:
        raise MemfitError(
            "memfit.integrations.accelerate: accelerate is not installed. Install it with "
            "`pip install memfit[accelerate]`."
        ) from None
    return accelerate


def fit(
    accelerator: Any,
    model: nn.Module,
    budget: int | str,
    *,
    global_batch: int,
    make_batch: Callable[[int], Batch],
    loss_fn: Callable[[nn.Module, Batch], LossOutput],
    count_fn: Callable[[Batch], Any] | None = None,
    blocks: str | None = None,
    max_micro_batch: int | None = None,
    min_micro_batch: int | None = None,
    optimizer: str = "adamw",
    policy: Policy | str | None = None,
    states: str = "auto",
) -> Any:
    """Choose micro-batch and checkpoint plan for a budget and apply the plan; call before ``prepare``.

    Measures ``model`` on ``accelerator.device`` (a copy there when the model is elsewhere; its
    weights, buffers and RNGs are left bitwise as they were), auto-fits
    (:func:`memfit.fitting.autofit`) and applies the chosen plan to ``model`` in place (forwards
    only: parameter names and ``state_dict`` keys unchanged).
    With several processes the main process measures and every process applies its choice (all
    run the same micro-batch and plan); call it on every process. The step planned is the one
    ``prepare`` makes: ``loss_fn`` under the accelerator's autocast, and with several processes one
    DDP rank with its gradient buckets (``budget`` is per process).

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the plain model, before ``accelerator.prepare``.
        budget: peak memory of a training step per process: bytes or a size such as ``"20GiB"``.
        global_batch: samples per optimizer step on this process (the loader's batch per process).
        make_batch: ``batch_size -> batch`` of representative samples (lengths as in training).
        loss_fn: ``(model, batch) -> (loss_sum, count)`` or a mean loss, as used in the loop.
        count_fn: ``batch -> valid tokens`` (optional; as for :meth:`ExactAccumulation.window`).
        blocks: dotted path of the module list holding the blocks (default: discovered).
        max_micro_batch: largest micro-batch considered.
        min_micro_batch: smallest micro-batch considered (default: the smallest the model runs in
            train mode; BatchNorm refuses 1).
        optimizer: optimizer whose state the budget holds (``adamw``, ``adam``, ``sgd``).
        policy: keep this checkpoint policy's plan (``"all"``, ``"every:2"``, ``Sqrt()``, ...:
            :mod:`memfit.plan.policies`) and fit only micro-batch and accumulation steps to the budget.
        states: ``"auto"`` (default) or ``"device"``: the model states stay on the device, where your
            optimizer, ``accelerator.clip_grad_norm_`` and the GradScaler read them; when they do not fit
            the refusal names every placement and why this loop cannot use it
            (NOTE [ Model states in a framework's loop ] in :mod:`memfit.integrations._fit`).

    Returns:
        The :class:`memfit.fitting.FitResult`: ``micro_batch`` for :class:`ExactAccumulation`,
        ``plan`` (applied), predicted and measured peaks.

    Raises:
        MemfitError: the model was already prepared, accelerate is missing, or no plan fits
            (:class:`memfit.errors.BudgetInfeasibleError`, with the minimum).
    """
    _require_accelerate()
    if _is_wrapped(model):
        raise MemfitError(
            f"memfit.integrations.accelerate: fit() got a prepared model ({type(model).__name__}); "
            "plan the plain model before accelerator.prepare(...): "
            "fit(accelerator, model, ...) then model, ... = accelerator.prepare(model, ...)."
        )
    # Under several processes the main process measures and broadcasts its result (_fit).
    return fit_and_apply(
        model,
        budget,
        global_batch=global_batch,
        make_batch=make_batch,
        loss_fn=_under_autocast(accelerator, loss_fn),
        count_fn=count_fn,
        blocks=blocks,
        device=accelerator.device,
        max_micro_batch=max_micro_batch,
        min_micro_batch=min_micro_batch,
        optimizer=optimizer,
        policy=policy,
        parallel=ddp_layout(accelerator),
        states=states,
        framework=(
            "memfit.integrations.accelerate",
            "the loop steps your optimizer after the backward, and accelerator.clip_grad_norm_ reads the device "
            "gradients",
        ),
    )


def _under_autocast(accelerator: Any, loss_fn: Callable[[nn.Module, Batch], LossOutput]) -> Callable[..., LossOutput]:
    """``loss_fn`` with the forward under accelerate's autocast, as ``prepare`` will run the model's forward."""

    def loss(model: nn.Module, batch: Batch) -> LossOutput:
        with accelerator.autocast():
            return loss_fn(model, batch)

    return loss


class ExactAccumulation:
    """Exact gradient accumulation for an accelerate loop (NOTE [ What ExactAccumulation normalises ]).

    Args:
        accelerator: the ``accelerate.Accelerator`` (``gradient_accumulation_steps=1``: this
            replaces ``accelerator.accumulate``).
        model: the model returned by ``accelerator.prepare`` (DDP, FSDP2 or plain).
        micro_batch: samples per micro-step (e.g. ``fit(...).micro_batch``).
        normalize: ``auto``, ``tokens``, ``mean`` or ``sum`` (:class:`memfit.accumulate.Normalize`).
        bn: what to do about BatchNorm in train mode (:class:`memfit.accumulate.BatchNormMode`).

    Attributes:
        last_result: the :class:`memfit.accumulate.StepResult` of the last finished window (loss
            of this process's share, token count over all processes, micro-steps); its ``step``
            and ``lr`` are not tracked here (accelerate's optimizer steps).

    A window adds to what ``.grad`` holds, as ``accelerator.backward`` does: zero the gradients after
    each optimizer step (``optimizer.zero_grad()``), as accelerate's loop does.

    Raises:
        MemfitError: a distributed type whose engine owns backward (DeepSpeed, Megatron-LM, XLA),
            FSDP version 1, or ``gradient_accumulation_steps`` other than 1.
    """

    def __init__(
        self,
        accelerator: Any,
        model: nn.Module,
        *,
        micro_batch: int,
        normalize: Normalize | str = Normalize.AUTO,
        bn: BatchNormMode | str | None = None,
    ) -> None:
        _require_accelerate()
        _check_accelerator(accelerator)
        self.accelerator = accelerator
        self.model = model
        # optimizer=None: the Accumulator backpropagates and leaves the gradients; accelerate's
        # optimizer (which unscales, skips non-finite steps and steps the scheduler) steps them.
        self._acc = Accumulator(
            model, None, micro_batch=micro_batch, normalize=normalize, scaler=accelerator.scaler, bn=bn
        )
        self.last_result: StepResult | None = None

    @property
    def micro_batch(self) -> int:
        return self._acc.micro_batch

    def window(self, batch: Batch, count_fn: Callable[[Batch], Any] | None = None) -> Iterator[MicroStep]:
        """The micro-steps of one global batch; call ``micro.backward(loss_fn(model, micro.batch))``.

        After the loop the gradients are the big batch's: step the optimizer (and scheduler) and
        zero the gradients there, once per window.

        A token batch (``labels`` of shape ``(B, T)``) needs no ``count_fn`` with a transformers
        model: ``micro.backward(model(**micro.batch).loss)`` reads the model's mean loss as the
        mean over the tokens its loss function averages over (NOTE [ Counting a token batch ] in
        :mod:`memfit.integrations._tokens`) and the window is normalised by their total.

        Args:
            batch: this process's global batch (batch on dim 0), as the prepared loader yields it.
            count_fn: ``batch -> valid tokens`` (what ``loss_fn``'s count adds up to), so the
                window's global count is known before the first backward; a scalar loss is then
                read as the mean over these tokens.

        Raises:
            AccumulationError: (at the first ``micro.backward``) a scalar loss for a token batch of
                a model that is not a transformers model, without ``count_fn``: its mean cannot be
                weighted by its tokens.
        """
        acc = self.accelerator
        tokens = self._acc.normalize in (Normalize.AUTO, Normalize.TOKENS) and (
            count_fn is not None or is_token_batch(batch)
        )
        counter = count_fn
        if tokens and counter is None:
            shifts = loss_shifts_labels(self.model)
            counter = token_counter(shifts) if shifts is not None else None
        # The derived counter converts scalar losses only: a (loss_sum, count) pair keeps its own
        # count (the window then divides by the total at the end, NOTE [ Normalisation ]).
        w = self._acc.window(batch, count_fn)
        steps = iter(w)
        try:
            for micro in steps:
                acc.sync_gradients = micro.sync_gradients
                yield _TokenMeanStep(micro, counter, type(self.model).__name__) if tokens else micro
        finally:
            steps.close()
            acc.sync_gradients = True
        self.last_result = w.result


class _TokenMeanStep:
    """A :class:`~memfit.accumulate.MicroStep` whose ``backward`` takes a token batch's mean loss.

    ``mean * count`` is the micro-batch's summed loss (NOTE [ Counting a token batch ]); the pair
    goes to the micro-step, which normalises it by the window's tokens over all processes.
    """

    __slots__ = ("_counter", "_micro", "_model_name")

    def __init__(self, micro: MicroStep, counter: Callable[[Batch], Any] | None, model_name: str) -> None:
        self._micro = micro
        self._counter = counter
        self._model_name = model_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._micro, name)

    def backward(self, out: LossOutput) -> None:
        """As :meth:`memfit.accumulate.MicroStep.backward`; a scalar is the mean over the batch's tokens."""
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            if self._counter is None:
                raise AccumulationError(
                    f"memfit.integrations.accelerate: the batch has token labels (labels of shape (B, T)) and "
                    f"loss_fn returned a scalar, but {self._model_name} is not a transformers model, so memfit "
                    "cannot tell which tokens that mean is over; averaging micro-batch means weights tokens "
                    "unevenly. Pass count_fn= to acc.window(...) (the tokens the mean is over: for next-token "
                    "prediction (labels[:, 1:] != -100).sum()), or return (loss_sum, count) from loss_fn, or "
                    "ExactAccumulation(..., normalize='mean') for a mean over samples."
                )
            n = torch.as_tensor(self._counter(self._micro.batch), device=out.device)
            out = (out * n.to(out.dtype), n)
        self._micro.backward(out)


def _is_wrapped(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel) or type(model).__name__ == "FullyShardedDataParallel"


def _check_accelerator(accelerator: Any) -> None:
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise MemfitError(
            f"memfit.integrations.accelerate: distributed type {kind.value} runs backward and "
            "accumulation in its own engine, which ExactAccumulation cannot drive. Use DDP or FSDP2 "
            "(fsdp_version=2), or that engine's own accumulation."
        )
    if kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
        raise MemfitError(
            "memfit.integrations.accelerate: FSDP version 1 is not supported (memfit drives FSDP2's "
            "gradient sync). Set fsdp_version=2 in the FSDP plugin (FullyShardedDataParallelPlugin"
            "(fsdp_version=2) or `fsdp_version: 2` in the accelerate config)."
        )
    steps = accelerator.gradient_accumulation_steps
    if steps != 1:
        raise SpecError(
            f"memfit.integrations.accelerate: the Accelerator has gradient_accumulation_steps={steps}; "
            "ExactAccumulation replaces accelerator.accumulate() and splits each global batch itself. "
            "Build Accelerator(gradient_accumulation_steps=1) and give the loader the global batch."
        )
