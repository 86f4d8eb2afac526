"""``calibrate_mfu``: the roofline's utilisation fitted to steps measured on this machine.

Estimated stats (:mod:`memfit.estimation.stats`) give a block's seconds as its FLOPs over
``peak x mfu`` with an assumed ``mfu`` (0.4 by default, ``--mfu``). Where the device planned for
*is* the machine memfit runs on, the assumption can be replaced by a measurement: run real
training steps of the model at a small micro-batch (median of repeats after a warm-up, the
model left as it was), and choose the ``mfu`` with which the roofline's step equals the measured
one. The optimizer's bandwidth term is kept as the table gives it; the fit scales the FLOP term
only, so ``predicted_step_s_after == measured_step_s`` up to rounding whenever the measured step
is longer than the optimizer term.

NOTE [ The CPU as a device ]
The table's ``cpu`` entry has no peak FLOP/s or bandwidth (memfit does not guess them). To
calibrate on a CPU host, :func:`host_device` measures both here: the peak as the median rate of a
square fp32 matmul (so ``mfu`` is relative to this machine's own matmul rate, and the stated
peak is an *assumption* of this module, not a published number), the bandwidth as the median
rate of a large tensor copy (bytes read plus written). The spec it returns says so in ``source``.

The steps measured are bounded like every measurement of a search (NOTE [ Bounded measurement ] in
:mod:`memfit.fitting.bounded`): the step is predicted first (the same fake-tensor estimate, its peak),
the micro-batch halved while that prediction is over the budget or the memory this machine has free,
and the step run under the guard; a step predicted over the free memory at micro-batch 1 is not run.

Known limitations:
    - One utilisation for the whole step: no per-block factors (the profile's per-block times
      would give them; the step-level fit is what a budget plan's choices and tokens/s use).
    - Only the machine's first CUDA device, or its CPU; ``--device`` must name that device.
    - The model must fit this machine at the micro-batch calibrated with.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from memfit.capture.snapshot import leave_unchanged
from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec, make_optimizer, step_runner, time_steps, warm_up
from memfit.errors import SpecError
from memfit.estimation.devices import DEFAULT_MFU, DEVICES, DeviceSpec, get_device
from memfit.estimation.stats import estimate_stats
from memfit.fitting.bounded import MeasurementGuardError, available_bytes, guarded
from memfit.models.registry import load_workload
from memfit.units import format_bytes
from memfit.workload import Workload, cast_batch

__all__ = ["TimeCalibration", "calibrate_mfu", "host_device"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeCalibration:
    """The utilisation fitted to measured steps (:func:`calibrate_mfu`).

    Attributes:
        device: the device spec the fit is for (on a CPU host: with the measured peak and
            bandwidth, NOTE [ The CPU as a device ]); pass it on as ``device`` with ``mfu``.
        mfu: the fitted fraction of ``device``'s peak FLOP/s.
        mfu_before: the assumed one the prediction before used.
        batch_size: the micro-batch measured.
        measured_step_s: median seconds of the measured steps.
        predicted_step_s_before: the roofline's step at ``mfu_before``.
        predicted_step_s_after: the roofline's step at ``mfu``.
        repeats: measured steps (after the warm-up ones).
        predicted_peak_bytes: the measured step's peak as estimated before it ran.
        asked_batch_size: the micro-batch asked for, where a smaller one was measured (its step was
            predicted over the budget or the free memory); None where it was measured.
    """

    device: DeviceSpec
    mfu: float
    mfu_before: float
    batch_size: int
    measured_step_s: float
    predicted_step_s_before: float
    predicted_step_s_after: float
    repeats: int
    predicted_peak_bytes: int | None = None
    asked_batch_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON: the fields, the device by name."""
        return asdict(self) | {"device": self.device.name}


def host_device() -> DeviceSpec:
    """The table entry of the accelerator memfit runs on (the first CUDA device), else a ``cpu``
    spec with this machine's measured matmul rate and copy bandwidth (NOTE [ The CPU as a device ]).

    Raises:
        SpecError: a CUDA device the table does not list (the message names it).
    """
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        for spec in DEVICES.values():
            if spec.name != "cpu" and _same_gpu(name, spec):
                return spec
        raise SpecError(
            f"memfit.estimate: this machine's GPU {name!r} is not in memfit's device table, so its steps cannot "
            f"calibrate a table entry; set the utilisation with --mfu instead (e.g. --mfu {DEFAULT_MFU})."
        )
    return _measured_cpu()


def calibrate_mfu(
    workload: str | Workload,
    device: str | DeviceSpec,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    mfu_before: float = DEFAULT_MFU,
    repeats: int = 7,
    warmup: int = 3,
    seed: int = 0,
    budget_bytes: int | None = None,
) -> TimeCalibration:
    """Fit the roofline's ``mfu`` so that its step equals real steps measured on this machine.

    Args:
        workload: a ``--model`` spec (built for real here) or a real workload (its model is left
            as it was: :func:`~memfit.capture.snapshot.leave_unchanged`).
        device: the device planned for; it must be this machine's (:func:`host_device`).
        batch_size: the micro-batch measured (small: the model has to fit here).
        seq_len: tokens per row (specs only).
        dtype: the training dtype (default: the model's).
        optimizer: ``adamw``, ``adam`` or ``sgd``.
        mfu_before: the utilisation the prediction before assumes.
        repeats: measured steps; their median is the measured step.
        warmup: steps run first and not measured.
        seed: seed for building, the batch and the steps.
        budget_bytes: the budget planned for: the micro-batch is halved while its step is predicted
            over it (and over the memory free here), and the step runs under the guard.

    Returns:
        :class:`TimeCalibration`.

    Raises:
        SpecError: ``device`` is not this machine (the fix: ``--mfu``), the step at micro-batch 1 is
            predicted over the memory free here or was stopped by the guard, or the measured step is
            not longer than the optimizer's bandwidth term (nothing to fit).

    Example:
        >>> cal = calibrate_mfu("demo?n_layer=2", "cpu", repeats=3)
        >>> 0 < cal.mfu <= 1
        True
    """
    host, target = _this_machine(device)
    if repeats < 1 or batch_size < 1:
        raise SpecError(f"memfit.estimate: repeats={repeats} and batch_size={batch_size} must be at least 1.")
    wl = load_workload(workload, seq_len=seq_len, dtype=dtype, seed=seed) if isinstance(workload, str) else workload

    def estimate(b: int) -> Stats:
        return estimate_stats(wl, device=host, options=("keep",), mfu=mfu_before, heads=False,
                              step=StepSpec(batch_size=b, dtype=dtype, optimizer=optimizer, seed=seed))  # fmt: skip

    asked = batch_size
    batch_size, before = _bounded_batch(estimate, batch_size, budget_bytes, target)
    measured_s = _guarded_step_s(
        wl, batch_size, guard_bytes=max(budget_bytes or 0, before.peak_bytes), dtype=dtype, optimizer=optimizer,
        repeats=repeats, warmup=warmup, seed=seed, device=target,
    )  # fmt: skip
    opt_s = before.calibration.estimated.optimizer_s if before.calibration.estimated else 0.0
    compute_before_s = before.step_s - opt_s
    if measured_s <= opt_s or compute_before_s <= 0:
        raise SpecError(
            f"memfit.estimate: the measured step ({measured_s * 1e3:.3g} ms) is not longer than the optimizer's bandwidth "
            f"term ({opt_s * 1e3:.3g} ms), so no FLOP rate can be fitted; use a larger --batch-size or set --mfu."
        )
    mfu = min(1.0, mfu_before * compute_before_s / (measured_s - opt_s))
    return TimeCalibration(
        device=host,
        mfu=mfu,
        mfu_before=mfu_before,
        batch_size=batch_size,
        measured_step_s=measured_s,
        predicted_step_s_before=before.step_s,
        predicted_step_s_after=compute_before_s * mfu_before / mfu + opt_s,
        repeats=repeats,
        predicted_peak_bytes=before.peak_bytes,
        asked_batch_size=asked if asked != batch_size else None,
    )


def _this_machine(device: str | DeviceSpec) -> tuple[DeviceSpec, torch.device]:
    """This machine's spec and torch device, when ``device`` is this machine's; else refused."""
    want = device if isinstance(device, DeviceSpec) else get_device(device)
    # Every machine has its CPU: "cpu" is measured there also on a GPU host.
    host = _measured_cpu() if want.name == "cpu" else host_device()
    target = torch.device("cpu") if host.name == "cpu" else torch.device("cuda")
    if want.name != host.name:
        raise SpecError(
            f"memfit.estimate: cannot calibrate {want.name}: this machine is {host.name}, so no step can be measured "
            f"on {want.name}; set its utilisation with --mfu instead (e.g. --mfu {DEFAULT_MFU})."
        )
    return host, target


def _guarded_step_s(
    wl: Workload,
    batch_size: int,
    *,
    guard_bytes: int,
    dtype: torch.dtype | None,
    optimizer: str,
    repeats: int,
    warmup: int,
    seed: int,
    device: torch.device,
) -> float:
    """The median measured step at ``batch_size``, run under the guard at ``guard_bytes``; a step
    the guard stops is refused with the fix (``--mfu``)."""
    what = f"the calibration step at micro-batch {batch_size}"
    try:
        with guarded(guard_bytes, what, device=device):
            return measure_step_s(
                wl, batch_size=batch_size, dtype=dtype, optimizer=optimizer, repeats=repeats, warmup=warmup, seed=seed,
                device=device,
            )  # fmt: skip
    except MeasurementGuardError as err:
        raise SpecError(
            f"memfit.estimate: {what} was stopped ({str(err).partition(': ')[2]}); set the utilisation with --mfu "
            f"instead (e.g. --mfu {DEFAULT_MFU})."
        ) from None


def _bounded_batch(
    estimate: Callable[[int], Stats], batch_size: int, budget_bytes: int | None, device: torch.device
) -> tuple[int, Stats]:
    """The micro-batch to calibrate at and its estimate: ``batch_size`` halved while its step is
    predicted over the budget or the memory free on ``device`` (NOTE [ Bounded measurement ]).

    Raises:
        SpecError: the step at micro-batch 1 is predicted over the memory free on ``device``.
    """
    free = available_bytes(device)
    limits = [x for x in (budget_bytes, free) if x is not None]
    before = estimate(batch_size)
    while limits and before.peak_bytes > min(limits) and batch_size > 1:
        batch_size //= 2
        before = estimate(batch_size)
    if free is not None and before.peak_bytes > free:
        raise SpecError(
            f"memfit.estimate: the calibration step at micro-batch {batch_size} is predicted at "
            f"{format_bytes(before.peak_bytes)}, over the {format_bytes(free)} free on {device.type}, so it is not run; "
            f"set the utilisation with --mfu instead (e.g. --mfu {DEFAULT_MFU})."
        )
    return batch_size, before


def measure_step_s(
    workload: Workload,
    *,
    batch_size: int,
    dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    repeats: int = 7,
    warmup: int = 3,
    seed: int = 0,
    device: torch.device | None = None,
) -> float:
    """Median seconds of a plain training step of ``workload`` on ``device`` (default: this
    machine's accelerator, CUDA if present), after ``warmup`` steps; the model is left as it was."""
    target = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with leave_unchanged(workload.model, device=target, dtype=dtype) as model:
        torch.manual_seed(seed)
        batch = cast_batch(workload.make_batch(batch_size), device=target)
        opt = make_optimizer(model, optimizer)
        model.train()
        warm_up(model, batch, workload.loss_fn, opt, seed=seed)
        run = step_runner(model, batch, workload.loss_fn, opt, seed=seed)
        return time_steps({"step": run}, repeats=repeats, warmup=max(0, warmup - 1))["step"]


def _same_gpu(cuda_name: str, spec: DeviceSpec) -> bool:
    """``torch.cuda.get_device_name`` (e.g. "NVIDIA H200", "NVIDIA A100-SXM4-80GB") names the table
    entry ``spec``: the chip's word (``h200``, ``a100``, ``4090``) is one of the name's words, and
    the words that tell entries of one chip apart (PCIe, memory size) do not contradict."""
    words = re.findall(r"[a-z0-9]+", cuda_name.lower())
    spec_words = [
        w for w in re.findall(r"[a-z0-9]+", spec.description.lower()) if w not in ("nvidia", "geforce", "rtx")
    ]
    if not spec_words or spec_words[0] not in words:
        return False
    return all((v in words) == (v in spec_words) for v in ("pcie", "40gb", "80gb") if v in words or v == "pcie")


_CPU_SPEC: DeviceSpec | None = None


def _measured_cpu(n: int = 512, repeats: int = 5) -> DeviceSpec:
    """The table's ``cpu`` entry with this host's fp32 matmul rate and copy bandwidth, measured once
    per process (NOTE [ The CPU as a device ])."""
    global _CPU_SPEC
    if _CPU_SPEC is None:
        a, b = torch.randn(n, n), torch.randn(n, n)
        src = torch.empty(2**24, dtype=torch.uint8)  # 16 MiB: past the caches
        dst = torch.empty_like(src)
        matmul_s, copy_s = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            torch.mm(a, b)
            matmul_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src)
            copy_s.append(time.perf_counter() - t0)
        flops_per_s = 2 * n**3 / statistics.median(matmul_s[1:])
        bytes_per_s = 2 * src.numel() / statistics.median(copy_s[1:])
        _CPU_SPEC = replace(
            DEVICES["cpu"],
            description="CPU (this machine; peak = measured fp32 matmul rate, bandwidth = measured copy rate)",
            fp32_flops_per_s=flops_per_s,
            memory_bandwidth_bytes_per_s=bytes_per_s,
            source=f"measured here: {n}x{n} fp32 matmul, 16 MiB copy, median of {repeats}",
        )
    return _CPU_SPEC
