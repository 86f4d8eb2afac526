"""The planned and the unmodified model stepped side by side, for :func:`memfit.verification.plans.verify`.

The unmodified reference is a copy of the model that runs eagerly (NOTE [ Blocks compiled in place ]);
both take their first step from the same weights (:func:`first_step`: the gradients compared), then
steady-state steps whose peaks are measured (:func:`steady_peaks`) and timed (:func:`timed_steps`).
Dropout inside tiled submodules is turned off in both (:func:`tiled_dropout_off`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import memfit.verification.gradients as grad_compare
from memfit.apply.compiled import compile_applied
from memfit.capture.compiled import GraphBreaks, profiled_step_peak_bytes
from memfit.capture.step import measure_step, step_runner, time_steps, training_step, warm_up
from memfit.capture.tracker import MemoryTracker
from memfit.plan.types import Plan
from memfit.verification.islands import Float32Islands, IslandReport, LowPrecisionOps
from memfit.workload import Batch


def compare_buffers(model: nn.Module, ref: nn.Module) -> tuple[str, ...]:
    """Names of buffers that are not exactly equal."""
    ref_bufs = dict(ref.named_buffers())
    return tuple(n for n, b in model.named_buffers() if not torch.equal(b, ref_bufs[n]))


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstStep:
    """Both models' first step from the same weights, before any optimizer step (an Adam step turns
    a last-bit difference in a near-zero gradient into a full learning-rate one)."""

    ref_loss: float
    grads: grad_compare.GradComparison
    unequal_buffers: tuple[str, ...]
    islands: IslandReport  # the float32 islands a float64 check promoted and kept
    compile_s: float | None  # with ``compile``: the first compiled call, which compiles


@contextmanager
def compiling(
    model: nn.Module, compile: str | None, backend: str | Callable[..., Any], *, in_place: bool
) -> Iterator[None]:
    """The context the planned model runs in: with ``compile``, the model compiled (undone on
    exit); compiled or compiled in place, inductor's dropout drawn from torch's generator, the eager
    masks (NOTE [ Blocks compiled in place ])."""
    with ExitStack() as compiled:
        if compile is not None or in_place:
            # Deferred: importing the compiler takes seconds, paid only by a compiled check.
            from torch._inductor import config as inductor_config

            compiled.enter_context(inductor_config.patch(fallback_random=True))  # the eager dropout masks
        if compile is not None:
            compiled.callback(compile_applied(model, compile, backend=backend))
        yield


def first_step(
    model: nn.Module,
    ref: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    *,
    seed: int,
    dtype: torch.dtype,
    breaks: GraphBreaks,
    compile: str | None,
) -> FirstStep:
    """The gradients and buffers of both models after one step from the same weights; gradients
    zeroed afterwards. A float64 check (``dtype``, not compiled) runs the model's float32 islands in
    float64, in both runs (NOTE [ float32 islands ])."""
    promote = dtype is torch.float64 and compile is None
    islands = IslandReport()
    with (
        Float32Islands() if promote else ExitStack() as promoted,
        LowPrecisionOps() if promote else ExitStack() as narrow,
    ):
        ref_loss = training_step(ref, batch, loss_fn, None, seed=seed + 2)
    if promote:
        islands = IslandReport(promoted=promoted.sites, kept=narrow.sites)
    t0 = time.perf_counter()
    with (
        breaks if compile is not None else ExitStack(),
        Float32Islands(record=False) if promote else ExitStack(),
    ):  # the first compiled call compiles
        training_step(model, batch, loss_fn, None, seed=seed + 2)
    compile_s = time.perf_counter() - t0 if compile is not None else None
    grads = grad_compare.compare_gradients(grad_compare.model_grads(model), grad_compare.model_grads(ref))
    unequal = compare_buffers(model, ref)
    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return FirstStep(ref_loss=ref_loss, grads=grads, unequal_buffers=unequal, islands=islands, compile_s=compile_s)


def steady_peaks(
    model: nn.Module,
    ref: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    *,
    seed: int,
    compile: str | None,
    device: torch.device,
    on_allocations: Callable[[list[tuple[int, int]]], None] | None,
) -> tuple[int, int]:
    """The peaks of one steady-state step of the unmodified and of the planned model (bytes), after
    a warm-up step of each: the tracker's, or with ``compile`` the profiler's (the tracker would run
    the compiled model eagerly, :mod:`memfit.capture.compiled`). ``opts``: the planned model's
    optimizer, then the reference's."""
    opt, opt_ref = opts
    warm_up(ref, batch, loss_fn, opt_ref, seed=seed + 1)
    warm_up(model, batch, loss_fn, opt, seed=seed + 1)
    if compile is not None:
        base_peak = profiled_step_peak_bytes(ref, batch, loss_fn, opt_ref, seed=seed + 2)
        plan_peak = profiled_step_peak_bytes(model, batch, loss_fn, opt, seed=seed + 2)
        return base_peak, plan_peak
    base_peak = measure_step(ref, batch, loss_fn, opt_ref, seed=seed + 2).device_peak_bytes
    tracker = MemoryTracker(device=device, record_allocations=on_allocations is not None)
    plan_peak = measure_step(model, batch, loss_fn, opt, seed=seed + 2, tracker=tracker).device_peak_bytes
    if on_allocations is not None:
        on_allocations(tracker.allocations)
    return base_peak, plan_peak


def timed_steps(
    model: nn.Module,
    ref: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    *,
    seed: int,
    repeats: int,
) -> dict[str, float]:
    """Median step seconds of ``"baseline"`` and ``"plan"``, interleaved; empty with ``repeats`` 0.
    ``opts``: the planned model's optimizer, then the reference's; their gradients are zeroed first."""
    opt, opt_ref = opts
    opt_ref.zero_grad(set_to_none=True)  # the timed steps start from zero, as training does (a
    opt.zero_grad(set_to_none=True)  # step-in-backward optimizer frees its gradients in the backward)
    if repeats <= 0:
        return {}
    return time_steps(
        {
            "baseline": step_runner(ref, batch, loss_fn, opt_ref, seed=seed + 3),
            "plan": step_runner(model, batch, loss_fn, opt, seed=seed + 3),
        },
        repeats=repeats,
    )


def tiled_dropout_off(plan: Plan, model: nn.Module, ref: nn.Module) -> list[tuple[nn.Module, float]]:
    """Dropout modules inside the plan's tiled submodules set to ``p = 0`` in both models (restored
    by the caller from the returned ``(module, p)`` pairs)."""
    names = {f"{b.name}.{t}" for b in plan.blocks if b.tiles is not None for t in b.tiled}
    changed = []
    for m in (model, ref):
        for name, sub in m.named_modules():
            if not any(name == n or name.startswith(f"{n}.") for n in names):
                continue
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.training and sub.p != 0:
                changed.append((sub, sub.p))
                sub.p = 0.0
    return changed


# NOTE [ Blocks compiled in place ]
# A user's ``block.compile()`` (or ``model.compile()``) stays on the model verify checks, while its
# copy, the unmodified reference, runs eagerly (``copy.deepcopy`` leaves the compiled call out).
# Inductor draws dropout masks from its own generator (a seed per call of a compiled graph), not as
# eager dropout does: the planned model's compiled blocks drew other masks than the reference, and
# the first verify of a plan found gradients 0.67 apart (a repeat of the same call passed). The planned
# model therefore runs with ``fallback_random`` (torch's generator, the eager masks), as
# ``verify(compile=...)`` does; its recompute wrappers are new code, compiled on their first call,
# under that setting. Graphs compiled before verify without ``fallback_random`` may be reused by
# dynamo (inductor's settings are not in its guards) and would draw other masks.


def compiled_in_place(model: nn.Module) -> bool:
    """Whether any module of ``model`` is compiled in place (``Module.compile``)."""
    return any(m.__dict__.get("_compiled_call_impl") is not None for m in model.modules())


def run_eagerly(model: nn.Module) -> None:
    """Drop the compiled calls of ``model``'s modules compiled in place, so that it runs eagerly (a
    copy made by ``copy.deepcopy`` has none in torch 2.13; NOTE [ Blocks compiled in place ])."""
    for m in model.modules():
        if m.__dict__.get("_compiled_call_impl") is not None:
            m.__dict__.pop("_compiled_call_impl")
