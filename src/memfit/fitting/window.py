"""A candidate's measured window (NOTE [ Auto-fit ] in :mod:`memfit.fitting.search`, step 3)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memfit.accumulate import Accumulator
from memfit.apply.engine import plan_applied
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.step import make_optimizer
from memfit.capture.tracker import MemoryTracker
from memfit.fitting.candidates import Candidate
from memfit.optim.in_backward import release_optimizer
from memfit.workload import Workload, cast_batch, iter_tensors

__all__ = ["Measurement", "measure_window"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """A candidate's measured window: whole-window peak (bytes) and time (seconds, median)."""

    micro_batch: int
    peak_bytes: int
    window_s: float
    samples_per_s: float
    within_budget: bool

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def measure_window(
    workload: Workload,
    candidate: Candidate,
    global_batch: int,
    *,
    optimizer: str = "adamw",
    seed: int = 0,
    repeats: int = 2,
    states: str = "device",
    on_allocations: Callable[[list[tuple[int, int]]], None] | None = None,
) -> Measurement:
    """Run one real window of the candidate (plan applied, accumulation) and measure it.

    Measuring never changes the model: the window's optimizer steps, gradients, buffers and random
    draws are undone bitwise afterwards (:func:`memfit.capture.snapshot.leave_unchanged`).

    Args:
        on_allocations: called with the tracked window's allocations and frees as the tracker
            recorded them (``(storage key, bytes)``, :mod:`memfit.report.memviz` writes them for
            PyTorch's viewer); the window whose peak is measured.
    """
    with leave_unchanged(workload.model):
        model = workload.model
        model.zero_grad(set_to_none=True)
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        opt = make_optimizer(model, optimizer, lr=1e-6, states=states)
        torch.manual_seed(seed)
        batch = cast_batch(workload.make_batch(global_batch), device=dev)
        assert candidate.plan is not None
        with plan_applied(model, candidate.plan):
            acc = Accumulator(model, opt, micro_batch=candidate.micro_batch)
            acc.step(batch, workload.loss_fn, count_fn=workload.count_fn)  # optimizer state exists now
            tracker = MemoryTracker(device=dev, record_allocations=on_allocations is not None)
            tracker.track(model, opt, iter_tensors(batch))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            with tracker:
                acc.step(batch, workload.loss_fn, count_fn=workload.count_fn)
            if on_allocations is not None:
                on_allocations(tracker.allocations)
            # On CUDA the allocator's peak is what the GPU's memory is compared with.
            peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else tracker.peak_bytes
            times = []
            for _ in range(max(1, repeats)):
                t0 = time.perf_counter()
                acc.step(batch, workload.loss_fn, count_fn=workload.count_fn)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        release_optimizer(opt)  # a step-in-backward optimizer's hooks leave the model
    window_s = statistics.median(times)
    return Measurement(
        micro_batch=candidate.micro_batch,
        peak_bytes=peak,
        window_s=window_s,
        samples_per_s=global_batch / window_s,
        within_budget=peak <= (candidate.plan.budget_bytes or 0),
    )
