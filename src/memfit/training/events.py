"""What :func:`memfit.training.train` tells its ``progress`` callback while it runs.

The callback receives one event at a time, on rank 0 only, except :class:`Warned` and
:class:`Signalled`, which every rank sends (a warning about a rank's own measurement is that
rank's). The events arrive in this order: :class:`FitStarted`, :class:`FitProgress`...,
:class:`FitDone` (with a budget only), :class:`RunStarted`, then :class:`StepDone` and
:class:`Warned` as the windows run, :class:`LoopEnded`, then the run's last warnings. ``memfit
train`` draws its spinner, progress bar and header from them; a Python user may log them.

A :class:`Signalled` event is sent from inside the process's SIGINT/SIGTERM handler: its callback
should only write a line (no locks, no waiting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memfit.accumulate import StepResult
from memfit.fitting import FitResult


class TrainEvent:
    """Base class of the events :func:`memfit.training.train` sends."""

    __slots__ = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class FitStarted(TrainEvent):
    """The auto-fit for ``budget_bytes`` starts (rank 0 runs it for every rank)."""

    budget_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class FitProgress(TrainEvent):
    """A line of the auto-fit's progress."""

    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class FitDone(TrainEvent):
    """The auto-fit chose micro-batch and plan for ``budget_bytes``."""

    fit: FitResult
    budget_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStarted(TrainEvent):
    """Training starts: how a window is split, and where it starts (bytes, samples).

    Attributes:
        model: the workload's name.
        world_size: ranks.
        global_batch: samples per optimizer step over all ranks.
        share: this rank's samples per step.
        micro_batch: samples per micro-step.
        accumulation_steps: micro-steps per window.
        policy: the applied plan's policy (None: no plan).
        start_step: windows already done (a resumed run).
        steps: the optimizer steps asked for.
        resumed: the run continues a saved state.
        lr_saved: the resumed state's learning rate, when the config's ``lr`` replaces it.
        lr: the learning rate the run uses.
        guard_limit_bytes: the tracker's limit on every step (``guard``), else None.
    """

    model: str
    world_size: int
    global_batch: int
    share: int
    micro_batch: int
    accumulation_steps: int
    policy: str | None
    start_step: int
    steps: int
    resumed: bool
    lr_saved: float | None
    lr: float
    guard_limit_bytes: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class StepDone(TrainEvent):
    """A window finished (stepped or skipped).

    Attributes:
        step: windows done, counting a resumed run's (1-based index of this window).
        steps: the optimizer steps asked for.
        result: the window's :class:`~memfit.accumulate.StepResult`.
        samples_per_s: the run's median speed so far (None until a step was timed).
        peak_bytes: the highest peak measured so far (None: not measured yet).
        skipped_steps: windows skipped so far.
        replans: out-of-memory replans so far.
    """

    step: int
    steps: int
    result: StepResult
    samples_per_s: float | None
    peak_bytes: int | None
    skipped_steps: int
    replans: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Warned(TrainEvent):
    """A warning (drift, replan, skipped window); also in :attr:`TrainResult.warnings`."""

    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Signalled(TrainEvent):
    """A first SIGINT/SIGTERM: the run finishes the current window, saves and stops."""

    signum: int
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopEnded(TrainEvent):
    """The training loop is over (the final save done); ``aborted``: left at once by a second signal."""

    aborted: bool


Progress = Callable[[TrainEvent], None]
"""``progress(event)``: what :func:`memfit.training.train` calls with each event."""
