"""Estimation: memory and time of a training step for models far larger than this machine.

One file per stage: :mod:`~memfit.estimate.static` (parameters, gradients, optimizer state by
arithmetic), :mod:`~memfit.estimate.fake` (one whole step on fake tensors: activation and step
peaks, FLOPs; :mod:`~memfit.estimate.kernels`: what it counts besides bytes),
:mod:`~memfit.estimate.devices` (GPU peaks and the time model) and
:mod:`~memfit.estimate.estimator` (:func:`estimate`, which puts them together) and :mod:`~memfit.estimate.stats` (the planner's
per-block stats from fake steps: :func:`estimate_stats`); :mod:`~memfit.estimate.calibrate_time` fits the
roofline's ``mfu`` to steps measured where the device is this machine (:func:`calibrate_mfu`).
"""

from memfit.estimate.calibrate_time import TimeCalibration, calibrate_mfu
from memfit.estimate.devices import DEFAULT_MFU, DEVICES, DeviceSpec, get_device, step_seconds
from memfit.estimate.estimator import Estimate, estimate
from memfit.estimate.static import StaticBytes, static_bytes
from memfit.estimate.stats import estimate_stats, estimated_device, load_fake_workload, stats_fn

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
