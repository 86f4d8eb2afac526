"""Estimation: memory and time of a training step for models far larger than this machine.

One file per stage: :mod:`~memfit.estimation.static` (parameters, gradients, optimizer state by
arithmetic), :mod:`~memfit.estimation.fake` (one whole step on fake tensors: activation and step
peaks, FLOPs; :mod:`~memfit.estimation.kernels`: what it counts besides bytes),
:mod:`~memfit.estimation.devices` (GPU peaks and the time model) and
:mod:`~memfit.estimation.estimator` (:func:`estimate`, which puts them together) and :mod:`~memfit.estimation.stats` (the planner's
per-block stats from fake steps: :func:`estimate_stats`); :mod:`~memfit.estimation.calibrate_time` fits the
roofline's ``mfu`` to steps measured where the device is this machine (:func:`calibrate_mfu`).
"""

from memfit.estimation.calibrate_time import TimeCalibration, calibrate_mfu
from memfit.estimation.devices import DEFAULT_MFU, DEVICES, DeviceSpec, get_device, step_seconds
from memfit.estimation.estimator import Estimate, estimate
from memfit.estimation.static import StaticBytes, static_bytes
from memfit.estimation.stats import estimate_stats, estimated_device, load_fake_workload, stats_fn

__all__ = [
    "DEFAULT_MFU",
    "DEVICES",
    "DeviceSpec",
    "Estimate",
    "StaticBytes",
    "TimeCalibration",
    "calibrate_mfu",
    "estimate",
    "estimate_stats",
    "estimated_device",
    "get_device",
    "load_fake_workload",
    "static_bytes",
    "step_seconds",
    "stats_fn",
]
