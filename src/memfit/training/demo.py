"""The library side of ``memfit demo``: the plain step it starts from and the training run.

``memfit demo`` (:mod:`memfit.cli.demo`) measures one plain step of the whole global batch
(:func:`baseline_peak_bytes`), auto-fits to a budget (:func:`memfit.fitting.autofit`), verifies the
plan (:func:`memfit.verification.plans.verify`), then trains from fresh weights with the fitted plan and exact
accumulation (:func:`train_fitted`); the CLI prints, :func:`memfit.report.demo.demo_plot` draws.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from memfit.accumulate import Accumulator
from memfit.apply import apply_plan, remove_plan
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.step import make_optimizer, measure_step, warm_up
from memfit.capture.tracker import MemoryTracker
from memfit.models.registry import load_workload
from memfit.plan.types import Plan
from memfit.training.config import DemoRun
from memfit.workload import Workload, iter_tensors

__all__ = ["any_batch", "baseline_peak_bytes", "train_fitted"]

StepCallback = Callable[[int, float, float], None]
"""Called after every optimizer step with ``(step, loss, samples_per_s)`` (median so far; 0 before
the first timed step)."""


def any_batch(plan: Plan) -> Plan:
    """``plan`` without its batch fingerprint: a fit's plan serves every micro-batch size."""
    return plan.with_(fingerprint={**plan.fingerprint, "batch": None})


def baseline_peak_bytes(workload: Workload, global_batch: int, *, seed: int = 0) -> int:
    """Measured peak of one plain step of the whole global batch (no memfit, AdamW).

    The model is left as it was built (the run then starts from those weights).
    """
    with leave_unchanged(workload.model) as model:
        opt = make_optimizer(model, "adamw", lr=1e-6)
        torch.manual_seed(seed)
        batch = workload.make_batch(global_batch)
        warm_up(model, batch, workload.loss_fn, opt, seed=seed)
        mem = measure_step(model, batch, workload.loss_fn, opt, seed=seed)
    return mem.peak_bytes


def train_fitted(
    spec: str,
    plan: Plan,
    *,
    micro_batch: int,
    global_batch: int,
    steps: int,
    lr: float,
    seed: int = 0,
    on_step: StepCallback | None = None,
) -> DemoRun:
    """Train a freshly built ``spec`` with ``plan`` and exact accumulation (AdamW, one-cycle LR).

    Step 1 (a steady-state window) runs under the memory tracker; the others are timed. The plan
    is removed from the model afterwards.

    Args:
        spec: the workload spec (built anew with ``seed``: the fit's and verify's runs do not leak in).
        plan: the fitted plan (applied for any batch size).
        micro_batch: samples per micro-step.
        global_batch: samples per optimizer step.
        steps: optimizer steps (at least 2, so that one is timed).
        lr: peak learning rate.
        seed: seed of the build and (plus 100) of the batches.
        on_step: called after every step (progress).

    Returns:
        The :class:`DemoRun`.
    """
    wl = load_workload(spec, seed=seed)
    model = apply_plan(wl.model, any_batch(plan))
    opt = make_optimizer(model, "adamw", lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    acc = Accumulator(model, opt, micro_batch=micro_batch, scheduler=sched)
    torch.manual_seed(seed + 100)
    losses: list[float] = []
    step_times: list[float] = []
    train_peak = None
    try:
        for step in range(steps):
            batch = wl.make_batch(global_batch)
            t0 = time.perf_counter()
            if step == 1:  # measure the peak of a steady-state window (optimizer state exists)
                tracker = MemoryTracker(device="cpu").track(model, opt, iter_tensors(batch))
                with tracker:
                    res = acc.step(batch, wl.loss_fn, count_fn=wl.count_fn)
                train_peak = tracker.peak_bytes
            else:
                res = acc.step(batch, wl.loss_fn, count_fn=wl.count_fn)
                step_times.append(time.perf_counter() - t0)
            losses.append(res.loss)
            if on_step is not None:
                on_step(step, res.loss, global_batch / statistics.median(step_times) if step_times else 0.0)
    finally:
        remove_plan(model)
    return DemoRun(
        global_batch=global_batch, losses=tuple(losses), step_s=tuple(step_times), measured_peak_bytes=train_peak
    )
