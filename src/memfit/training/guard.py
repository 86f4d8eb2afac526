"""Never lose a run to out-of-memory: replan with a tighter budget and redo the window.

:class:`OutOfMemoryGuard` runs the windows (optimizer steps) of an
:class:`~memfit.accumulate.Accumulator`. When a window runs out of memory (``torch.OutOfMemoryError``
on a GPU, or :class:`~memfit.capture.tracker.BudgetExceededError` from the tracker's budget guard,
the CPU stand-in), it puts the training state back where the window started, asks a *replanner*
for a micro-batch and plan under a tighter budget, applies them and runs the same window again.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from memfit.accumulate import Accumulator
    >>> model = nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> acc = Accumulator(model, opt, micro_batch=4)
    >>> def replan(budget_bytes: int) -> Choice:  # e.g. memfit.fitting under the new budget
    ...     return Choice(micro_batch=2, plan=None)
    >>> guard = OutOfMemoryGuard(acc, model=model, budget_bytes=2**20, replan=replan)
    >>> result = guard.step((torch.randn(8, 4), torch.randn(8, 1)), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    >>> result.samples, guard.replans
    (8, [])

NOTE [ Redo after out-of-memory ]
The rule for the next budget: ``min(0.9 * B, B - overflow)``, where ``B`` is the planning budget
the failed window ran under and ``overflow`` the bytes by which live memory went over the limit
when the error was raised (known for the tracker's guard: ``live_bytes - budget_bytes``; unknown,
so 0, for a CUDA out-of-memory). The *limit* (the device, or the tracker's ``limit_bytes``) never
changes; only the budget the planner aims at shrinks, by at least 10 % per failure. Without a
planning budget (a fixed micro-batch), ``B`` is the peak the failed window reached (the tracker's
peak, or ``torch.cuda.max_memory_allocated`` since the window started).

What a redo guarantees, relative to the same training run without the failure:

- **Same data**: the window's batch (this rank's share) is the same object; nothing is drawn again.
- **No sample lost or counted twice**: the gradients of the failed window are discarded
  (``.grad = None``), and the Accumulator's counters (``optimizer_steps``, ``skipped_steps``,
  ``windows``, ``samples_seen``, ``last_result``) are put back, so a window counts once, when it
  succeeds.
- **Optimizer, scheduler and GradScaler untouched**: they only change at the window's boundary,
  after the last micro-step. A failure inside ``optimizer.step()`` itself is detected (version
  counters of the parameters and of the optimizer's state tensors) and, when the step had already
  changed something, raises :class:`~memfit.errors.MemfitError` instead of redoing: a half-applied
  update cannot be undone without a copy of the whole state. State the optimizer created lazily in
  the failed window (its first step) is removed, since nothing had used it yet.
- **Same random numbers**: the torch CPU RNG, the CUDA RNGs (when CUDA is initialised), Python's
  ``random`` and NumPy's are restored, so the redo draws the same dropout masks *when the micro-batch
  size is unchanged* (a plan change alone keeps them: checkpoint recomputes replay the saved RNG
  state). With another micro-batch size the masks are drawn in other shapes: the gradient is an
  equally valid sample, not the same numbers, and the run's later random draws differ too.
- **Same running statistics**: the buffers of normalisation layers that track running statistics
  (BatchNorm, InstanceNorm with ``track_running_stats``) are copied before each window (a few
  floats per channel) and restored. Other buffers that the failed window changed cannot be
  restored; they are reported in :attr:`Replan.changed_buffers` with a warning.

So when the replan keeps the micro-batch size, the run's parameters equal those of a run without
the failure (tests/test_guard.py compares them in float64, with and without dropout); with a new
micro-batch size they equal it up to the rounding of the accumulation (1e-15 relative in float64)
when there is no dropout.

Known limitations:
    - One process only: under DDP an out-of-memory error on one rank leaves the others waiting in
      the gradient all-reduce. ``memfit train`` turns replanning off when ``WORLD_SIZE > 1``.
    - Memory held by the failed window is freed by dropping the exception and running the garbage
      collector (and ``torch.cuda.empty_cache()``): code that keeps a reference to the exception or
      to its traceback keeps the window's tensors alive.
    - A failure between ``scaler.unscale_`` and ``scaler.step`` (clipping under a GradScaler) resets
      the scaler's per-optimizer bookkeeping through its private ``_per_optimizer_states``
      (:meth:`~memfit.accumulate.Accumulator.discard_gradients`).

Size: one module of about 540 lines, on purpose: the guard, the failure record and the window state it
puts back are one mechanism, and half of the file is the contract above and the docstrings.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from memfit.accumulate import Accumulator, Mark, StepResult
from memfit.apply import applied_plan, apply_plan, remove_plan
from memfit.capture.tracker import BudgetExceededError, MemoryTracker
from memfit.errors import BudgetInfeasibleError, MemfitError
from memfit.plan.types import Plan
from memfit.units import format_bytes
from memfit.workload import Batch, LossOutput, iter_tensors

__all__ = [
    "OUT_OF_MEMORY_ERRORS",
    "REPLAN_FACTOR",
    "Choice",
    "OutOfMemoryGuard",
    "Replan",
    "WindowFailure",
    "is_out_of_memory",
    "tighter_budget",
]

OUT_OF_MEMORY_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, BudgetExceededError)
"""What counts as running out of memory (``torch.cuda.OutOfMemoryError`` is ``torch.OutOfMemoryError``)."""

REPLAN_FACTOR = 0.9
"""Each failure lowers the planning budget to at most this fraction of the failed one."""


def is_out_of_memory(err: BaseException) -> bool:
    """True for a device out-of-memory error or the tracker's budget guard."""
    return isinstance(err, OUT_OF_MEMORY_ERRORS)


def tighter_budget(budget_bytes: int, overflow_bytes: int | None = None, *, factor: float = REPLAN_FACTOR) -> int:
    """The planning budget after a failure: ``min(factor * budget, budget - overflow)``.

    >>> tighter_budget(1000)
    900
    >>> tighter_budget(1000, overflow_bytes=250)
    750
    """
    by_factor = int(budget_bytes * factor)
    by_overflow = budget_bytes - max(0, overflow_bytes or 0)
    return max(0, min(by_factor, by_overflow))


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """What a replanner answers: the micro-batch size and plan to run, with their predictions.

    Attributes:
        micro_batch: samples per micro-step.
        plan: the checkpoint plan (None: no plan).
        predicted_peak_bytes: the predicted whole-window peak, if known.
        predicted_window_s: the predicted seconds of one window (optimizer step), if known.
    """

    micro_batch: int
    plan: Plan | None
    predicted_peak_bytes: int | None = None
    predicted_window_s: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowFailure:
    """The plain facts of one out-of-memory failure (no reference to the exception or its tensors).

    The fields :class:`Replan` shares have its meanings; ``peak_bytes`` is the peak the failed
    window reached (the tracker's, or on CUDA ``torch.cuda.max_memory_allocated`` since the window
    started), None when unmeasured.
    """

    window: int
    error_type: str
    failed_at: str
    live_bytes: int | None
    limit_bytes: int | None
    overflow_bytes: int | None
    peak_bytes: int | None


Replanner = Callable[[int], Choice]
"""``replan(budget_bytes) -> Choice``; may raise :class:`~memfit.errors.BudgetInfeasibleError`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Replan:
    """One out-of-memory failure and what the guard did about it.

    Attributes:
        window: index of the window that failed (``Accumulator.windows`` when it started).
        error_type: ``OutOfMemoryError`` or ``BudgetExceededError``.
        failed_at: ``"micro-step i of k"`` (1-based), ``"optimizer step"`` or ``"window set-up"``.
        live_bytes: live bytes when the error was raised (tracker guard only).
        limit_bytes: the limit that was hit (tracker guard only).
        overflow_bytes: ``live_bytes - limit_bytes`` (tracker guard only).
        failed_budget_bytes: the planning budget the window ran under.
        budget_bytes: the new planning budget (NOTE [ Redo after out-of-memory ]).
        micro_batch_before: micro-batch size of the failed window.
        micro_batch: micro-batch size of the redo.
        recomputed_before: blocks not kept (recompute, selective, offload) in the failed plan.
        recomputed: the same in the new plan.
        replan_s: seconds spent replanning.
        changed_buffers: buffers the failed window changed that could not be restored.
    """

    window: int
    error_type: str
    failed_at: str
    live_bytes: int | None
    limit_bytes: int | None
    overflow_bytes: int | None
    failed_budget_bytes: int
    budget_bytes: int
    micro_batch_before: int
    micro_batch: int
    recomputed_before: int | None
    recomputed: int | None
    replan_s: float
    changed_buffers: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) if f != "changed_buffers" else list(self.changed_buffers) for f in self.__slots__}  # type: ignore[attr-defined]

    def describe(self) -> str:
        over = (
            f", {format_bytes(self.overflow_bytes)} over the limit of {format_bytes(self.limit_bytes)}"
            if self.overflow_bytes is not None
            else ""
        )
        return (
            f"out of memory in window {self.window} at {self.failed_at} ({self.error_type}{over}); "
            f"replanned for {format_bytes(self.budget_bytes)} (was {format_bytes(self.failed_budget_bytes)}) in "
            f"{self.replan_s:.1f} s: micro-batch {self.micro_batch_before} -> {self.micro_batch}, "
            f"blocks not kept {_or_dash(self.recomputed_before)} -> {_or_dash(self.recomputed)}; the window is redone"
        )


class OutOfMemoryGuard:
    """Runs an Accumulator's windows; on out-of-memory, replans and redoes the window.

    Args:
        acc: the Accumulator (its optimizer, scheduler and scaler are left as they were when a
            window fails; see NOTE [ Redo after out-of-memory ]).
        model: the module plans are applied to (the unwrapped model; ``acc.model`` by default).
        budget_bytes: the planning budget the current micro-batch and plan were chosen for, or
            None (a fixed micro-batch).
        replan: ``budget_bytes -> Choice``; None re-raises out-of-memory errors (after restoring
            the state, so that the caller can save it).
        limit_bytes: run every window under :class:`~memfit.capture.tracker.MemoryTracker` with
            this budget: live tensor bytes above it raise ``BudgetExceededError`` (a simulated
            out-of-memory, e.g. on CPU). The tracker costs about 10-13 us per op on CPU (one
            thread): a window of a tiny GPT (2,537 small ops) ran 2.4x slower, one of 1,043 ops
            at width 128 and 128 tokens 1.1x slower.
        max_replans: failures allowed over the guard's life before giving up.
        on_replan: called with each :class:`Replan` after the new plan is applied.
        choice: the micro-batch and plan in effect, with their predictions (default: the
            Accumulator's micro-batch and the plan applied to ``model``).

    Attributes:
        replans: the failures so far, in order.
        budget_bytes: the current planning budget.
        last_peak_bytes: peak live bytes of the last window, when it was measured (under the
            tracker, or on CUDA from ``torch.cuda.max_memory_allocated``); else None.
        last_op_count: ops the tracker saw in the last window (None without tracker).
        last_choice: the micro-batch and plan in effect (updated by each replan).
    """

    def __init__(
        self,
        acc: Accumulator,
        *,
        model: nn.Module | None = None,
        budget_bytes: int | None = None,
        replan: Replanner | None = None,
        limit_bytes: int | None = None,
        max_replans: int = 3,
        on_replan: Callable[[Replan], None] | None = None,
        choice: Choice | None = None,
    ) -> None:
        self.acc = acc
        self.model = model if model is not None else acc.model
        self.budget_bytes = budget_bytes
        self.replan = replan
        self.limit_bytes = limit_bytes
        self.max_replans = max_replans
        self.on_replan = on_replan
        self.replans: list[Replan] = []
        self.last_peak_bytes: int | None = None
        self.last_op_count: int | None = None
        self.last_choice = choice or Choice(micro_batch=acc.micro_batch, plan=applied_plan(self.model))
        self._device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self._tracker: MemoryTracker | None = None

    def step(
        self,
        batch: Batch,
        loss_fn: Callable[[nn.Module, Batch], LossOutput],
        count_fn: Callable[[Batch], Any] | None = None,
        *,
        measure: bool = False,
    ) -> StepResult:
        """One window over ``batch`` (as :meth:`Accumulator.step`), redone after out-of-memory.

        Args:
            batch: the window's batch (this rank's share), batch on dim 0.
            loss_fn: ``(model, micro_batch) -> loss``, called with ``acc.model``.
            count_fn: as for :meth:`Accumulator.step`.
            measure: run the window under the tracker even without ``limit_bytes`` (its peak goes
                to :attr:`last_peak_bytes`).

        Raises:
            MemfitError: out of memory and no replanner, ``max_replans`` reached, no plan fits the
                tighter budget, or the failure happened after the optimizer had started updating.
        """
        while True:
            state = _WindowState(self.acc, self.model)
            window = self.acc.windows
            try:
                return self._run(batch, loss_fn, count_fn, measure)
            except BaseException as err:
                if not is_out_of_memory(err):
                    raise
                failure = self._failure(err, window)
                if self.replan is None or len(self.replans) >= self.max_replans:
                    state.restore()
                    why = (
                        "no replanner was given"
                        if self.replan is None
                        else f"{len(self.replans)} replans already (max_replans={self.max_replans})"
                    )
                    raise MemfitError(
                        f"memfit.guard: out of memory in window {window} at {failure.failed_at} "
                        f"({type(err).__name__}) and {why}. The training state is as it was before the "
                        "window. Lower the budget (--budget), or raise max_replans."
                    ) from err
            # Outside the except block: the exception, its traceback and the window's tensors are gone.
            changed = state.restore()
            _free_memory(self._device)
            self._replan_and_apply(failure, changed)

    # -- machinery -------------------------------------------------------------------------------

    def _run(
        self, batch: Batch, loss_fn: Callable[[nn.Module, Batch], LossOutput], count_fn: Any, measure: bool
    ) -> StepResult:
        self._tracker = None
        cuda = self._device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        tracker = None
        if self.limit_bytes is not None or measure:
            tracker = MemoryTracker(device=self._device, budget_bytes=self.limit_bytes)
            tracker.track(self.model, self.acc.optimizer, iter_tensors(batch))
            self._tracker = tracker
        with tracker if tracker is not None else contextlib.nullcontext():
            result = self.acc.step(batch, loss_fn, count_fn)
        if tracker is not None:
            self.last_peak_bytes, self.last_op_count = tracker.peak_bytes, tracker.op_count
        elif cuda:
            self.last_peak_bytes, self.last_op_count = torch.cuda.max_memory_allocated(self._device), None
        else:
            self.last_peak_bytes = self.last_op_count = None
        self._tracker = None
        return result

    def _failure(self, err: BaseException, window: int) -> WindowFailure:
        """Plain facts about a failure (no reference to the exception or its tensors)."""
        progress = self.acc.progress
        failed_at = progress.describe() if progress is not None and progress.window == window else "window set-up"
        live = limit = overflow = None
        if isinstance(err, BudgetExceededError):
            live, limit = err.live_bytes, err.budget_bytes
            overflow = live - limit
        peak = None
        if self._tracker is not None:
            peak = self._tracker.peak_bytes
        elif self._device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self._device)
        self._tracker = None
        return WindowFailure(
            window=window,
            error_type=type(err).__name__,
            failed_at=failed_at,
            live_bytes=live,
            limit_bytes=limit,
            overflow_bytes=overflow,
            peak_bytes=peak,
        )

    def _replan_and_apply(self, failure: WindowFailure, changed: tuple[str, ...]) -> None:
        assert self.replan is not None
        failed = self.budget_bytes if self.budget_bytes is not None else failure.peak_bytes
        if failed is None:
            raise MemfitError(
                f"memfit.guard: out of memory in window {failure.window} at {failure.failed_at}, "
                "and there is no budget to tighten (no planning budget and no measured peak). Give a "
                "budget (memfit train --budget SIZE)."
            )
        new_budget = tighter_budget(failed, failure.overflow_bytes)
        before = self.last_choice
        t0 = time.perf_counter()
        try:
            choice = self.replan(new_budget)
        except BudgetInfeasibleError as err:
            raise MemfitError(
                f"memfit.guard: out of memory in window {failure.window} at {failure.failed_at} "
                f"under a budget of {format_bytes(failed)}; no micro-batch and plan fit the tighter "
                f"budget of {format_bytes(new_budget)}: {err}"
            ) from err
        replan_s = time.perf_counter() - t0
        remove_plan(self.model)
        if choice.plan is not None:
            apply_plan(self.model, choice.plan)
        self.acc.micro_batch = choice.micro_batch
        self.budget_bytes = new_budget
        self.last_choice = choice
        event = Replan(
            window=failure.window,
            error_type=failure.error_type,
            failed_at=failure.failed_at,
            live_bytes=failure.live_bytes,
            limit_bytes=failure.limit_bytes,
            overflow_bytes=failure.overflow_bytes,
            failed_budget_bytes=failed,
            budget_bytes=new_budget,
            micro_batch_before=before.micro_batch,
            micro_batch=choice.micro_batch,
            recomputed_before=_not_kept(before.plan),
            recomputed=_not_kept(choice.plan),
            replan_s=replan_s,
            changed_buffers=changed,
        )
        self.replans.append(event)
        if self.on_replan is not None:
            self.on_replan(event)


# -- window state ----------------------------------------------------------------------------------


class _WindowState:
    """What a failed window may have changed, captured before it starts (NOTE [ Redo after out-of-memory ]).

    The Accumulator's own part (counters, last result, RNG states) is its :meth:`Accumulator.mark`;
    this adds what the Accumulator cannot put back itself: the optimizer's state and running
    statistics of normalisation layers.
    """

    def __init__(self, acc: Accumulator, model: nn.Module) -> None:
        self.acc = acc
        self.mark: Mark = acc.mark()
        self.params = list(acc.model.parameters())
        self.param_versions = [p._version for p in self.params]
        opt = acc.optimizer
        self.had_state = {id(p) for p in opt.state} if opt is not None else set()
        self.opt_versions = [(t, t._version) for t in _optimizer_tensors(opt)]
        # Running statistics of normalisation layers: small, and the one kind of buffer a forward
        # is known to change. Other buffers are only checked (version counters).
        self.norm_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        norm_ids: set[int] = set()
        for m in model.modules():
            if isinstance(m, _NormBase) and m.track_running_stats:
                for b in (m.running_mean, m.running_var, m.num_batches_tracked):
                    if b is not None:
                        self.norm_buffers.append((b, b.detach().clone()))
                        norm_ids.add(id(b))
        self.other_buffers = [(name, b, b._version) for name, b in model.named_buffers() if id(b) not in norm_ids]

    def restore(self) -> tuple[str, ...]:
        """Put the state back; return the names of buffers that changed and could not be restored.

        Raises:
            MemfitError: the optimizer had already changed parameters or its state.
        """
        acc = self.acc
        stepped = [i for i, p in enumerate(self.params) if p._version != self.param_versions[i]]
        touched = [t for t, v in self.opt_versions if t._version != v]
        acc.discard_gradients()  # the failed window's gradients first: they hold memory
        if stepped or touched:
            raise MemfitError(
                "memfit.guard: out of memory inside the optimizer step, after it had updated "
                f"{len(stepped)} parameter(s) and {len(touched)} optimizer state tensor(s); a half-applied "
                "update cannot be undone, so the window cannot be redone exactly. Resume from the last "
                "saved state (memfit train --save / --resume) with a lower --budget."
            )
        opt = acc.optimizer
        if opt is not None:
            for p in [p for p in opt.state if id(p) not in self.had_state]:
                del opt.state[p]  # created lazily by the failed first step; nothing used it yet
        with torch.no_grad():
            for b, saved in self.norm_buffers:
                b.copy_(saved)
        changed = tuple(name for name, b, v in self.other_buffers if b._version != v)
        if changed:
            warnings.warn(
                f"memfit.guard: the failed window changed buffer(s) {', '.join(changed)}, which cannot "
                "be restored; the redo starts from their changed values.",
                stacklevel=3,
            )
        acc.rewind(self.mark)  # counters, last result, RNG states
        return changed


def _optimizer_tensors(opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if opt is None:
        return []
    opt = getattr(opt, "host_optimizer", opt)  # memfit.optim.HostOptimizer: the state is on the host
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _free_memory(device: torch.device) -> None:
    gc.collect()  # tracebacks form cycles with their frames, which hold the window's tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _not_kept(plan: Plan | None) -> int | None:
    if plan is None:
        return None
    return sum(b.option.value != "keep" for b in plan.blocks)


def _or_dash(v: Any) -> str:
    return "-" if v is None else str(v)
