"""The Accumulator: k micro-steps per global batch, one optimizer step, the big batch's gradient.

The overview, an example and the known limitations are in :mod:`memfit.accumulate`; how each
micro-step's loss is scaled in :mod:`memfit.accumulate.normalize` (NOTE [ Normalisation ]), how
gradient sync is switched in :mod:`memfit.accumulate.parallel` (NOTE [ Gradient sync ]).

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
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Generator, Mapping
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from memfit.accumulate.batchnorm import BatchNormMode, BatchNormSwitch, convert_batchnorm_to_groupnorm
from memfit.accumulate.normalize import LossTally, Normalize, WindowTotals
from memfit.accumulate.parallel import DataParallel, equal_sizes
from memfit.accumulate.types import (
    AccumulationError,
    Counters,
    Mark,
    SkipReason,
    StepResult,
    WindowProgress,
)
from memfit.accumulate.window import MicroStep, Window, micro_batch_sizes
from memfit.capture.snapshot import RngSnapshot
from memfit.errors import SpecError
from memfit.optim.in_backward import refuse_in_accumulator, refuse_window
from memfit.workload import Batch, LossOutput, batch_size_of, split_batch

__all__ = ["STATE_FORMAT", "Accumulator"]

STATE_FORMAT = "memfit.accumulate/1"
"""The ``format`` field of :meth:`Accumulator.state_dict`."""


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
        dp_world_size: processes data parallelism runs over (1 on one process).
        rank: this process's rank among them.

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
        self._active: Generator[MicroStep, None, None] | None = None  # the loop of the open window
        self._at: tuple[int, int, int] | None = None  # (window, backpropagated, k): WindowProgress's fields

        # Cached once: walking the module tree every window costs ~0.3 ms on small models.
        self._params = list(model.parameters())
        first = self._params[0] if self._params else None
        self._device = first.device if first is not None else torch.device("cpu")
        self._dp = DataParallel(model, process_group, device=self._device)
        refuse_in_accumulator(optimizer, max_grad_norm, self.scaler, self._dp.kind)  # step-in-backward's limits
        self.dp_world_size = self._dp.world_size
        self.rank = self._dp.rank
        if self.bn is BatchNormMode.GROUPNORM:
            if self._dp.kind != "local":
                raise SpecError(
                    "memfit.accumulate: bn='groupnorm' converts modules, which must happen before "
                    "wrapping with DDP/FSDP. Call memfit.accumulate.convert_batchnorm_to_groupnorm("
                    "model) first, then wrap, then build the Accumulator with bn=None."
                )
            convert_batchnorm_to_groupnorm(model)
        self._batchnorm = BatchNormSwitch([m for m in model.modules() if isinstance(m, _BatchNorm)], self.bn)

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
        return Window(functools.partial(self._start_window, batch, count_fn))

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

    @property
    def progress(self) -> WindowProgress | None:
        """How far the open (or last) window got; None before its first micro-step started.

        A caller that catches an error from a window (out of memory, say) reads here where it
        happened: in micro-step ``i`` of ``k`` or at the optimizer boundary.
        """
        return (
            None
            if self._at is None
            else WindowProgress(window=self._at[0], backpropagated=self._at[1], micro_steps=self._at[2])
        )

    @property
    def counters(self) -> Counters:
        """The step counters and data position (NOTE [ Skipped windows ] for the skip counts)."""
        return Counters(
            optimizer_steps=self.optimizer_steps,
            skipped_steps=self.skipped_steps,
            consecutive_skips=self.consecutive_skips,
            windows=self.windows,
            samples_seen=self.samples_seen,
        )

    def mark(self) -> Mark:
        """What :meth:`rewind` puts back: counters, last result and RNG states, taken at a boundary."""
        return Mark(counters=self.counters, last_result=self.last_result, rng=RngSnapshot.take())

    def rewind(self, mark: Mark) -> None:
        """Undo a window that did not finish: as if it had not started.

        Drops its gradients (:meth:`discard_gradients`), and puts back the counters, the last result
        and the RNG states of ``mark``, so that the same window can run again on the same data with
        the same random numbers. Parameters, optimizer, scheduler and scaler change only at a
        window's boundary, after the last micro-step; a window that failed inside
        ``optimizer.step()`` may have changed them, which the caller must check (:mod:`memfit.training.guard`
        does, with version counters).
        """
        self.discard_gradients()
        self._set_counters(mark.counters)
        self.last_result = mark.last_result
        self._at = None
        mark.rng.restore()

    def discard_gradients(self) -> None:
        """Set every gradient to None, and forget a GradScaler's ``unscale_`` of the current window.

        Without an optimizer (verification) gradients are otherwise left in ``.grad``; with one,
        every window starts from zero anyway. The scaler's per-optimizer record of an ``unscale_``
        (made when clipping) is reset through its private ``_per_optimizer_states``: the next
        window's ``unscale_`` would raise otherwise.
        """
        self._clear_grads()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None and hasattr(self.scaler, "_per_optimizer_states"):
            self.scaler._per_optimizer_states.clear()  # a defaultdict: entries come back fresh

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
            "format": STATE_FORMAT,
            "config": {"micro_batch": self.micro_batch, "normalize": self.normalize.value},
            "counters": self.counters.to_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": RngSnapshot.take().to_dict(),
            "extra": dict(extra or {}),
        }
        if include_model:
            state["model"] = self._dp.unwrapped().state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Restore what :meth:`state_dict` saved; return its ``extra`` mapping.

        Raises:
            AccumulationError: not a memfit accumulation state, or a part is missing here
                (e.g. the state has a scheduler and this Accumulator has none).
        """
        if state.get("format") != STATE_FORMAT:
            raise AccumulationError(
                f"memfit.accumulate: not an Accumulator state (format {state.get('format')!r}, "
                f"expected {STATE_FORMAT!r}). Save it with torch.save(acc.state_dict(), path)."
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
            self._dp.unwrapped().load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._set_counters(Counters.from_dict(state["counters"]))
        RngSnapshot.from_dict(state["rng"]).restore()
        return dict(state.get("extra", {}))

    # -- machinery -------------------------------------------------------------------------------

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def _grad_owners(self) -> list[Any]:  # memfit.optim.HostOptimizer holds the gradients on host copies
        return getattr(self.optimizer, "host_parameters", lambda: self._params)()

    def _set_counters(self, c: Counters) -> None:
        self.optimizer_steps, self.skipped_steps, self.consecutive_skips = (
            c.optimizer_steps,
            c.skipped_steps,
            c.consecutive_skips,
        )
        self.windows, self.samples_seen = c.windows, c.samples_seen

    def _start_window(
        self, batch: Batch, count_fn: Callable[[Batch], Any] | None, window: Window
    ) -> Generator[MicroStep, None, None]:
        """The loop of a window whose iteration begins now (what :class:`Window` runs)."""
        if self._active is not None:
            # A window abandoned half-way (an exception in its loop, a break): close it so that its
            # sync/BatchNorm settings are restored. Its partial gradients stay in .grad and are
            # cleared by the next window when there is an optimizer.
            self._active.close()
        steps = self._micro_steps(batch, count_fn, window)
        self._active = steps
        return steps

    # The loop: sets up counts, yields each micro-step inside its sync/autocast context, and runs
    # the optimizer boundary after the last one.
    def _micro_steps(
        self, batch: Batch, count_fn: Callable[[Batch], Any] | None, w: Window
    ) -> Generator[MicroStep, None, None]:
        self._open = True
        self._at = None
        window = self.windows
        try:
            total = batch_size_of(batch)
            sizes = micro_batch_sizes(total, self.micro_batch)
            tally = LossTally(self.normalize, self._dp)
            k_max = tally.prepare(batch, sizes, count_fn)
            if k_max > len(sizes):
                sizes = equal_sizes(total, k_max, self.rank)
            pieces = split_batch(batch, sizes)
            k = len(sizes)
            refuse_window(self.optimizer, k, count_fn is not None or tally.normalize in (Normalize.MEAN, Normalize.SUM))
            if self.optimizer is not None:  # a window starts from zero (stale gradients would be added)
                self.discard_gradients()
            backward = functools.partial(self._backward, tally)
            with self._batchnorm.window(k, self.micro_batch):
                for i, (piece, size) in enumerate(zip(pieces, sizes, strict=True)):
                    micro = MicroStep(i, k, piece, size, backward)
                    self._at = (window, i, k)
                    with self._dp.sync(micro.sync_gradients), self._autocast():
                        yield micro
                    if not micro.done:
                        raise AccumulationError(
                            f"memfit.accumulate: micro-step {i} of {k} ended without "
                            "micro.backward(...). Call micro.backward(loss_fn(model, micro.batch)) "
                            "in every iteration."
                        )
            w.result = self._boundary(tally.totals(self._grad_owners(), sync_loss=self.sync_loss), total, k)
            self.last_result = w.result
        finally:
            self._open = False
            self._active = None
            self._dp.restore_sync()

    def _backward(self, tally: LossTally, micro: MicroStep, out: LossOutput) -> None:
        """``micro.backward(out)``: the loss scaled for the window (and the GradScaler), outside autocast."""
        scaled = tally.scaled_loss(out, micro.size)
        to_backward = self.scaler.scale(scaled) if self.scaler is not None else scaled
        with self._no_autocast():
            to_backward.backward()
        window = self._at[0] if self._at is not None else self.windows
        self._at = (window, micro.index + 1, micro.micro_steps)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device.type, dtype=self.autocast_dtype)

    def _no_autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device.type, enabled=False)

    def _boundary(self, totals: WindowTotals, samples: int, k: int) -> StepResult:
        """The optimizer step of a window (NOTE [ Skipped windows ]) and its result."""
        norm, loss, count = totals.normalize, totals.loss, totals.count
        self.windows += 1
        self.samples_seen += int(totals.global_samples)
        grad_norm: float | None = None
        reason: SkipReason | None = None
        lr: float | None = None
        if self.optimizer is not None:
            lr = float(self.optimizer.param_groups[0]["lr"])
            # NOTE [ Skipped windows ]: the checks, in order; each decision is the same on every rank.
            check = self.check_finite and self.scaler is None
            if norm is Normalize.TOKENS and count == 0:
                reason = SkipReason.NO_TOKENS
            elif check and (self._dp.kind == "local" or self.sync_loss) and not math.isfinite(loss):
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
            samples=samples,
            micro_steps=k,
            skipped=reason is not None,
            grad_norm=grad_norm,
            lr=lr,
            step=self.optimizer_steps,
            skip_reason=reason,
        )

    def _grad_norm(self, *, clip: bool) -> float:
        """Total 2-norm of the gradients (global under FSDP2); clipped to ``max_grad_norm`` if ``clip``."""
        grads = [p for p in self._grad_owners() if p.grad is not None]
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
