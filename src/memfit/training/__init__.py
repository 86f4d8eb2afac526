"""Training with exact gradient accumulation, out-of-memory replans and drift checks: ``memfit train``'s library.

:func:`train` runs a workload for a number of optimizer steps as :class:`TrainConfig` says (global
batch, micro-batch or a memory budget to fit, optimizer, saving and resuming, also under
``torchrun``) and returns a :class:`TrainResult`. :func:`autofit_replanner` is the replanner it
gives :class:`memfit.training.guard.OutOfMemoryGuard`, for Python users who run their own loop.

Modules, in the order a run uses them: :mod:`~memfit.training.config` (what to run, what it
reports), :mod:`~memfit.training.distributed` (ranks under torchrun), :mod:`~memfit.training.replan`
(micro-batch and plan, and again after out-of-memory), :mod:`~memfit.training.saving` (save and
resume), :mod:`~memfit.training.signals` (SIGINT/SIGTERM, why a run stopped),
:mod:`~memfit.training.watch` (measured against predicted), :mod:`~memfit.training.loop` (the loop)
and :mod:`~memfit.training.events` (what ``progress`` receives).

Example:
    >>> from memfit.training import TrainConfig, train
    >>> res = train("demo?n_layer=2&n_embd=32&seq_len=32", TrainConfig(global_batch=8, micro_batch=4, steps=2, device="cpu"))
    >>> res.optimizer_steps, res.micro_batch, res.accumulation_steps
    (2, 4, 2)
"""

from memfit.training.config import TrainConfig, TrainResult
from memfit.training.events import (
    FitDone,
    FitProgress,
    FitStarted,
    LoopEnded,
    Progress,
    RunStarted,
    Signalled,
    StepDone,
    TrainEvent,
    Warned,
)
from memfit.training.loop import train
from memfit.training.replan import autofit_replanner, fit_choice

__all__ = [
    "FitDone",
    "FitProgress",
    "FitStarted",
    "LoopEnded",
    "Progress",
    "RunStarted",
    "Signalled",
    "StepDone",
    "TrainConfig",
    "TrainEvent",
    "TrainResult",
    "Warned",
    "autofit_replanner",
    "fit_choice",
    "train",
]
