"""Measure several ways of running one workload side by side, in one process.

Each *setup* changes the model (applies a plan, enables HF gradient checkpointing, ...) and returns
a function that undoes the change. Memory is measured once per setup with the live-tensor tracker;
time as medians of interleaved steps (setup A, B, C, A, B, C, ...), so that machine noise hits all
setups alike and the reported ratios are fair.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from memfit.apply import apply_plan, remove_plan
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.step import StepSpec, measure_step, step_optimizer, training_step, warm_up
from memfit.capture.tracker import MemoryTracker
from memfit.errors import SpecError
from memfit.optim.states import ModelStates
from memfit.plan.policies import KeepAll, RecomputeAll, policy_plan
from memfit.plan.types import Plan
from memfit.workload import Workload, cast_batch

Setup = Callable[[nn.Module], Callable[[], None]]


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of ``a``'s time over ``b``'s in the same round (interleaved rounds): a
    round the machine slowed slows both, so it cancels where a ratio of medians would not."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def plan_setup(plan: Plan) -> Setup:
    """A setup that applies a memfit plan."""

    def setup(model: nn.Module) -> Callable[[], None]:
        apply_plan(model, plan)
        return lambda: remove_plan(model)

    return setup


def hf_gradient_checkpointing_setup(model: nn.Module) -> Callable[[], None]:
    """HF transformers' own ``gradient_checkpointing_enable()`` (non-reentrant).

    transformers 5 renamed it ``activation_checkpointing_enable`` (the old name is an alias that
    warns); the newer name is used where it exists.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return model.activation_checkpointing_disable
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.gradient_checkpointing_disable


@dataclass(frozen=True, kw_only=True, slots=True)
class SetupResult:
    """One setup's measured peak (bytes) and step time (median seconds, and ratio to the first)."""

    name: str
    peak_bytes: int
    activations_peak_bytes: int
    step_s: float
    step_s_samples: tuple[float, ...]
    time_ratio: float
    peak_ratio: float
    loss: float

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


def measure_setups(
    workload: Workload,
    setups: Mapping[str, Setup],
    *,
    batch_size: int | None = None,
    dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    repeats: int = 5,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    states: ModelStates | str = ModelStates.DEVICE,
    on_allocations: Callable[[str, list[tuple[int, int]]], None] | None = None,
) -> list[SetupResult]:
    """Measure each setup's peak and step time; ratios are relative to the first setup.

    Measuring never changes the model: its state, applied plan and the RNGs are restored bitwise
    afterwards, and ``dtype`` measures a cast copy (NOTE [ Measuring leaves the model as it was ]
    in :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload; each setup is undone after it ran.
        setups: name -> setup, in report order; put the reference (no checkpointing) first.
        batch_size: samples per step (default: the workload's).
        dtype: measure a copy of the model (and the batch) in this dtype.
        optimizer: the step's optimizer.
        states: where its model states live (:class:`memfit.optim.ModelStates`).
        repeats: interleaved timed rounds (medians).
        seed: seed for data and dropout.
        progress: called with a short text as the work advances.
        on_allocations: called with each setup's name and its tracked step's allocations and frees
            (:attr:`~memfit.capture.tracker.MemoryTracker.allocations`).
    """
    with leave_unchanged(workload.model, dtype=dtype) as model:
        if model is not workload.model:
            workload = replace(workload, model=model)
        return _measure_setups(
            workload,
            setups,
            batch_size=batch_size,
            dtype=dtype,
            optimizer=optimizer,
            repeats=repeats,
            seed=seed,
            progress=progress,
            states=states,
            on_allocations=on_allocations,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanMeasurement:
    """A plan measured beside no checkpointing and policy ``all`` in one run (:func:`measure_plan`).

    Attributes:
        measured_peak_bytes: the plan's measured step peak.
        measured_step_s: the plan's median step time.
        baseline_peak_bytes: the peak without checkpointing.
        baseline_step_s: the step time without checkpointing.
        all_peak_bytes: the peak with every block recomputed (policy ``all``).
        all_step_s: the step time with every block recomputed.
        within_budget: whether the plan's measured peak fits the budget; None without one.
        prediction_error: (measured - predicted) / measured peak, a fraction; None when the plan
            predicts no peak.
    """

    measured_peak_bytes: int
    measured_step_s: float
    baseline_peak_bytes: int
    baseline_step_s: float
    all_peak_bytes: int
    all_step_s: float
    within_budget: bool | None
    prediction_error: float | None

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


def measure_plan(
    workload: Workload,
    plan: Plan,
    *,
    step: StepSpec | None = None,
    budget_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
    on_allocations: Callable[[list[tuple[int, int]]], None] | None = None,
) -> PlanMeasurement:
    """Measure ``plan`` beside no checkpointing and policy ``all``, round by round in one run
    (:func:`measure_setups`), and compare its peak with its prediction and ``budget_bytes``.

    Args:
        workload: the workload, left unchanged.
        plan: the plan to measure (``memfit plan --measure``'s).
        step: the step (:class:`~memfit.capture.step.StepSpec`; ``repeats``: interleaved timed
            rounds, default 5; the model is measured where it is: no ``device``).

    Raises:
        SpecError: a step with a device.
        budget_bytes: the budget it was planned for, if any.
        progress: as :func:`measure_setups`.
        on_allocations: called with the plan's tracked step as the tracker recorded it
            (``memfit plan --measure --snapshot``): replayed, its peak is ``measured_peak_bytes``
            on the CPU (on CUDA that is the allocator's).
    """
    step = step or StepSpec()
    if step.device is not None:
        raise SpecError(
            f"memfit.profiling: measure_plan measures the model where it is; move it (model.to({str(step.device)!r})) "
            "and give a StepSpec without device."
        )
    rows = measure_setups(
        workload,
        {
            "none": plan_setup(policy_plan(workload.model, KeepAll())),
            "memfit": plan_setup(plan),
            "all": plan_setup(policy_plan(workload.model, RecomputeAll())),
        },
        batch_size=step.batch_size,
        dtype=step.dtype,
        optimizer=step.optimizer,
        repeats=step.repeats_or(5),
        seed=step.seed,
        progress=progress,
        states=plan.states if plan.states != ModelStates.DEVICE else step.states,
        on_allocations=None
        if on_allocations is None
        else (lambda name, a: on_allocations(a) if name == "memfit" else None),
    )
    by = {r.name: r for r in rows}
    peak = by["memfit"].peak_bytes
    return PlanMeasurement(
        measured_peak_bytes=peak,
        measured_step_s=by["memfit"].step_s,
        baseline_peak_bytes=by["none"].peak_bytes,
        baseline_step_s=by["none"].step_s,
        all_peak_bytes=by["all"].peak_bytes,
        all_step_s=by["all"].step_s,
        within_budget=None if budget_bytes is None else peak <= budget_bytes,
        prediction_error=None
        if plan.predicted_peak_bytes is None
        else (peak - plan.predicted_peak_bytes) / max(1, peak),
    )


def _measure_setups(
    workload: Workload,
    setups: Mapping[str, Setup],
    *,
    batch_size: int | None,
    dtype: torch.dtype | None,
    optimizer: str,
    repeats: int,
    seed: int,
    progress: Callable[[str], None] | None,
    states: ModelStates | str,
    on_allocations: Callable[[str, list[tuple[int, int]]], None] | None = None,
) -> list[SetupResult]:
    """:func:`measure_setups` on the model as it is (cast already, inside the snapshot)."""
    say = progress or (lambda _s: None)
    model = workload.model
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    torch.manual_seed(seed)
    batch = cast_batch(workload.make_batch(batch_size or workload.default_batch_size), dtype=dtype, device=dev)
    with step_optimizer(model, optimizer, lr=1e-6, states=states) as opt:
        return _measure_with(
            workload, setups, model, batch, opt, repeats=repeats, seed=seed, say=say, on_allocations=on_allocations
        )


def _measure_with(
    workload: Workload,
    setups: Mapping[str, Setup],
    model: nn.Module,
    batch: Any,
    opt: Any,
    *,
    repeats: int,
    seed: int,
    say: Callable[[str], None],
    on_allocations: Callable[[str, list[tuple[int, int]]], None] | None = None,
) -> list[SetupResult]:
    """Warm up ``opt``, then each setup's tracked step and the interleaved timed rounds;
    ``on_allocations(name, allocations)`` gets each tracked step's stream when given."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    warm_up(model, batch, workload.loss_fn, opt, seed=seed)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    mems: dict[str, Any] = {}
    for name, setup in setups.items():
        say(f"memory: {name}")
        undo = setup(model)
        try:
            tracker = MemoryTracker(device=dev, record_allocations=on_allocations is not None)
            mems[name] = measure_step(model, batch, workload.loss_fn, opt, seed=seed, tracker=tracker)
            if on_allocations is not None:
                on_allocations(name, tracker.allocations)
        finally:
            opt.zero_grad(set_to_none=True)
            undo()

    samples: dict[str, list[float]] = {name: [] for name in setups}
    for r in range(repeats + 1):  # round 0 warms up every setup
        for name, setup in setups.items():
            say(f"time: round {r}/{repeats}, {name}")
            undo = setup(model)
            try:
                sync()
                t0 = time.perf_counter()
                training_step(model, batch, workload.loss_fn, opt, seed=seed)
                opt.zero_grad(set_to_none=True)
                sync()
                if r > 0:
                    samples[name].append(time.perf_counter() - t0)
            finally:
                undo()

    first = next(iter(setups))
    ref_t = statistics.median(samples[first])
    ref_m = mems[first].device_peak_bytes
    return [
        SetupResult(
            name=name,
            peak_bytes=mems[name].device_peak_bytes,
            activations_peak_bytes=mems[name].activations_peak_bytes,
            step_s=statistics.median(samples[name]),
            step_s_samples=tuple(samples[name]),
            time_ratio=statistics.median(samples[name]) / ref_t,
            peak_ratio=mems[name].device_peak_bytes / ref_m,
            loss=mems[name].loss,
        )
        for name in setups
    ]
