"""A memory timeline of one training step, split into parameters, gradients, optimizer state and
activations.

Library tier: :mod:`memfit.report` draws the :class:`StepTimeline` this module records.

The step runs under :class:`~memfit.capture.tracker.MemoryTracker` with ``record_timeline=True``,
which gives the live bytes after every change, with the op count, the phase and the time (seconds
from the step's start; the tracker's bookkeeping slows every op, so the step reads longer than it
runs untracked, and each op by about the same amount). The split:

- **parameters** (and buffers) and **optimizer state** are constant through the step: their bytes
  are measured before it (the optimizer state exists from a warm-up step on);
- **gradients** are tracked exactly: a post-accumulate-grad hook on every parameter records the op
  count at which its gradient first exists, with its bytes. A gradient buffer is counted as a
  gradient from the op that allocated it on (at most the ops between its allocation and the hook
  show it among the temporaries);
- **activations** are the rest: saved activations, temporaries of forward, backward and the
  optimizer step, and the batch.

The timeline stops when ``optimizer.step()`` returns, before gradients are set to None.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from memfit.accumulate import Accumulator, micro_batch_sizes
from memfit.apply import plan_applied, remove_plan
from memfit.capture.snapshot import preserved_state
from memfit.capture.step import make_optimizer, optimizer_tensors, tensor_bytes
from memfit.capture.tracker import MemoryTracker
from memfit.plan.types import Plan
from memfit.profiling.types import StepTimeline
from memfit.workload import Workload, cast_batch, iter_tensors, map_tensors

__all__ = ["record_timeline"]


def record_timeline(
    workload: Workload,
    plan: Plan | None,
    *,
    batch_size: int,
    micro_batch: int | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
) -> StepTimeline:
    """Run one warm-up step and one recorded step of the workload with ``plan`` applied.

    With ``micro_batch`` smaller than ``batch_size`` the step is a window of gradient accumulation
    (:class:`~memfit.accumulate.Accumulator`): forward and backward per micro-batch, one optimizer
    step. The model's weights, RNG state and applied plan are put back afterwards.

    Args:
        workload: the workload (its model is used and restored).
        plan: the plan to apply (None: no plan).
        batch_size: samples in the step.
        micro_batch: samples per micro-step (default: ``batch_size``).
        optimizer: ``adamw``, ``adam`` or ``sgd``.
        seed: seed for the batch and dropout.

    Returns:
        The :class:`StepTimeline`.
    """
    model = workload.model
    micro = min(micro_batch or batch_size, batch_size)
    k = len(micro_batch_sizes(batch_size, micro))
    with preserved_state(model):
        remove_plan(model)
        model.zero_grad(set_to_none=True)
        dev = next(model.parameters()).device
        batch = _step_batch(workload, batch_size, seed=seed)
        opt = make_optimizer(model, optimizer)
        with plan_applied(model, plan) if plan is not None else contextlib.nullcontext():
            acc = Accumulator(model, opt, micro_batch=micro, bn="ghost")
            acc.step(batch, workload.loss_fn, count_fn=workload.count_fn)  # optimizer state exists now
            params_bytes = tensor_bytes([*model.parameters(), *model.buffers()])
            optimizer_bytes = tensor_bytes(list(optimizer_tensors(opt)))
            tracker = MemoryTracker(device=dev, record_timeline=True)
            tracker.track(model, opt, iter_tensors(batch))
            start = len(tracker.timeline)  # samples recorded by track(): not part of the step
            grad_events: list[tuple[int, int]] = []  # (op count, bytes) when a gradient first exists
            end: list[int] = []
            with _grad_hooks(model, tracker, grad_events), _mark_step_end(opt, tracker, end), tracker:
                t0 = time.perf_counter()
                micro_steps = iter(acc.window(batch, workload.count_fn))
                for _ in range(k):
                    m = next(micro_steps)
                    with tracker.phase("forward"):
                        out = workload.loss_fn(model, m.batch)
                    with tracker.phase("backward"):
                        m.backward(out)
                        del out
                with tracker.phase("optimizer"):
                    next(micro_steps, None)  # the boundary: clipping, optimizer step, grads to None
    samples = tracker.timeline[start : end[0] if end else None]
    times_s = tracker.timeline_times_s[start : start + len(samples)]
    grads = _grads_bytes(samples, grad_events)
    return StepTimeline(
        op_index=tuple(s.op_index for s in samples),
        time_s=tuple(t - t0 for t in times_s),
        live_bytes=tuple(s.current_bytes for s in samples),
        phase=tuple(s.phase or "" for s in samples),
        grads_bytes=tuple(grads),
        params_bytes=params_bytes,
        optimizer_bytes=optimizer_bytes,
        peak_bytes=tracker.peak_bytes,
        batch_size=batch_size,
        micro_batch=micro,
        micro_steps=k,
    )


def _step_batch(workload: Workload, batch_size: int, *, seed: int) -> Any:
    """The workload's batch drawn after seeding with ``seed``, on the model's device; floating
    inputs in the model's dtype."""
    first = next(workload.model.parameters())
    dev, dtype = first.device, first.dtype if first.is_floating_point() else None
    torch.manual_seed(seed)
    batch = cast_batch(workload.make_batch(batch_size), device=dev)
    if dtype is not None:  # floating inputs follow the model's dtype
        batch = map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)
    return batch


def _grads_bytes(samples: list[Any], grad_events: list[tuple[int, int]]) -> list[int]:
    """At each timeline sample, the bytes of the gradients that exist by its op count."""
    grad_events = sorted(grad_events)
    grads: list[int] = []
    j = total = 0
    for s in samples:
        while j < len(grad_events) and grad_events[j][0] <= s.op_index:
            total += grad_events[j][1]
            j += 1
        grads.append(total)
    return grads


@contextlib.contextmanager
def _grad_hooks(model: torch.nn.Module, tracker: MemoryTracker, events: list[tuple[int, int]]) -> Iterator[None]:
    seen: set[int] = set()

    def hook(p: torch.Tensor) -> None:
        if id(p) not in seen and p.grad is not None:
            seen.add(id(p))
            events.append((tracker.op_count, p.grad.untyped_storage().nbytes()))

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _mark_step_end(opt: torch.optim.Optimizer, tracker: MemoryTracker, end: list[int]) -> Iterator[None]:
    """Record how many timeline samples exist when ``opt.step()`` returns."""

    def post_hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
        end.append(len(tracker.timeline))

    handle = opt.register_step_post_hook(post_hook)
    try:
        yield
    finally:
        handle.remove()
