"""One training step, run plainly, measured (memory) or timed; shared by profile, plan and verify.

A *step* is what the budget covers (DESIGN.md): forward, backward and optimizer step, starting
from parameters and optimizer state as they are in steady training (gradients set to None by the
previous ``zero_grad``). Memory is measured with :class:`memfit.capture.tracker.MemoryTracker`;
time without it (the tracker costs tens of microseconds per op), as medians of interleaved repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.capture.snapshot import seed_generators
from memfit.capture.tracker import MemoryTracker
from memfit.errors import SpecError
from memfit.optim.build import OPTIMIZERS, build_optimizer, check_states
from memfit.optim.in_backward import release_optimizer
from memfit.optim.states import ModelStates
from memfit.workload import Batch, iter_tensors, mean_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSpec:
    """The training step a measuring verb runs: one value shared by :func:`memfit.profile`,
    :func:`memfit.plan_for_budget`, :func:`memfit.plan_for_policy`, :func:`memfit.plan_compiled`,
    :func:`memfit.autofit`, :func:`memfit.verify`, :func:`memfit.explain`, :func:`memfit.estimate` and
    :func:`memfit.verify_accumulation` (``step=``).

    Attributes:
        batch_size: samples per step; None: the workload's default (:func:`memfit.autofit` chooses
            its own micro-batches and takes None only).
        dtype: measure a copy of the model and the batch cast to this dtype; None: as it is.
        optimizer: the step's optimizer, one of :data:`OPTIMIZERS`.
        seed: seed for the data and dropout, so that set-ups draw the same masks.
        repeats: timed repeats (medians); None: the verb's own default (3; :func:`memfit.autofit`: 2);
            0 skips timing where the verb allows it (:func:`memfit.verify`).
        device: run on this device (a copy of the model is moved there); None: where the model is.
        states: where the model states live and when the optimizer steps
            (:class:`memfit.optim.ModelStates`; a name such as ``"step-in-backward"`` is taken too).

    Example:
        >>> import memfit
        >>> memfit.StepSpec(batch_size=8, optimizer="sgd", repeats=1).optimizer
        'sgd'
    """

    batch_size: int | None = None
    dtype: torch.dtype | None = None
    optimizer: str = "adamw"
    seed: int = 0
    repeats: int | None = None
    device: torch.device | str | None = None
    states: ModelStates = ModelStates.DEVICE

    def __post_init__(self) -> None:
        object.__setattr__(self, "states", check_states(self.states))
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"memfit: unknown optimizer {self.optimizer!r}. Use one of: {', '.join(OPTIMIZERS)}.")
        for name, least in (("batch_size", 1), ("repeats", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise SpecError(
                    f"memfit: StepSpec {name} must be an integer of at least {least} or None, got {value!r}."
                )

    def repeats_or(self, default: int) -> int:
        """``repeats``, or the verb's ``default`` when it is None."""
        return default if self.repeats is None else self.repeats


def make_optimizer(
    model: nn.Module, name: str = "adamw", lr: float = 1e-3, states: ModelStates | str = ModelStates.DEVICE
) -> torch.optim.Optimizer:
    """The optimizer a measured step uses (``adamw``, ``adam`` or ``sgd`` with momentum), placed as
    ``states`` says (``step-in-backward``: it steps inside the backward; take its hooks off with
    :func:`memfit.optim.in_backward.release_optimizer` when done)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return build_optimizer(params, name, lr, states)


@contextmanager
def step_optimizer(
    model: nn.Module, name: str = "adamw", lr: float = 1e-3, states: ModelStates | str = ModelStates.DEVICE
) -> Iterator[torch.optim.Optimizer]:
    """:func:`make_optimizer` for the block: a ``step-in-backward`` optimizer's hooks leave the
    model when it ends (measuring leaves the model as it was)."""
    opt = make_optimizer(model, name, lr, states)
    try:
        yield opt
    finally:
        release_optimizer(opt)


def training_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    optimizer: torch.optim.Optimizer | None,
    *,
    seed: int | None = None,
    phase: Callable[[str], Any] | None = None,
) -> float:
    """Forward, backward and (when ``optimizer``) step; returns the loss. Leaves ``.grad`` set.

    Args:
        seed: when given, the generators (torch's, Python's ``random``, NumPy's) are seeded right
            before the forward, so that two models run with the same seed draw the same dropout
            masks (and the same NumPy masks: Wav2Vec2's SpecAugment).
        phase: ``phase(name)`` returns a context manager entered around each phase
            ('forward', 'backward', 'optimizer'), e.g. ``MemoryTracker.phase``.
    """
    ctx = phase or (lambda _name: nullcontext())
    if seed is not None:
        seed_generators(seed)
    with ctx("forward"):
        loss = mean_loss(loss_fn(model, batch))
    with ctx("backward"):
        loss.backward()
    value = float(loss.detach())
    del loss
    if optimizer is not None:
        with ctx("optimizer"):
            optimizer.step()
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMemory:
    """Measured memory of one steady-state training step (bytes).

    Attributes:
        peak_bytes: peak of live tensor bytes over the whole step (the budget's quantity).
        params_bytes: parameters and buffers.
        grads_bytes: gradients once backward is done.
        optimizer_bytes: optimizer state.
        peak_bytes_by_phase: peak within 'forward', 'backward' and 'optimizer'.
        activations_peak_bytes: ``peak_bytes`` minus what exists at the start of the step.
        loss: the step's loss.
        timeline: ``(op_index, live_bytes, phase)`` samples when asked for.
        allocator_peak_bytes: on CUDA, ``torch.cuda.max_memory_allocated`` over the step: what a
            GPU's memory is compared with. It exceeds ``peak_bytes`` by memory no tensor owns
            (cuBLAS workspaces: 32 MiB per handle on an H200, one for the forward thread and one
            for the backward's; kernel workspaces). None elsewhere.
        host_peak_bytes: the peak of host-placed bytes (the ``host-optimizer`` placement's copies,
            gradients and state, and its step's temporaries), counted apart from ``peak_bytes``
            even when the host is the device (the CPU): 0 for placements that keep all on the device.
    """

    peak_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    peak_bytes_by_phase: Mapping[str, int]
    activations_peak_bytes: int
    loss: float
    timeline: tuple[tuple[int, int, str], ...] = field(default_factory=tuple)
    allocator_peak_bytes: int | None = None
    host_peak_bytes: int = 0

    @property
    def device_peak_bytes(self) -> int:
        """The allocator's peak on CUDA, else the tracker's."""
        return self.allocator_peak_bytes if self.allocator_peak_bytes is not None else self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "peak_bytes": self.peak_bytes,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_peak_bytes": self.activations_peak_bytes,
            "peak_bytes_by_phase": dict(self.peak_bytes_by_phase),
            "host_peak_bytes": self.host_peak_bytes,
        }


def tensor_bytes(tensors: Any) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def warm_up(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    optimizer: torch.optim.Optimizer,
    *,
    seed: int,
) -> float:
    """One plain step so that the optimizer state exists, then gradients set to None."""
    loss = training_step(model, batch, loss_fn, optimizer, seed=seed)
    optimizer.zero_grad(set_to_none=True)
    return loss


def measure_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    optimizer: torch.optim.Optimizer,
    *,
    seed: int,
    timeline: bool = False,
    tracker: Any = None,
    on_phase: Callable[[str, str], None] | None = None,
) -> StepMemory:
    """Measure one training step's memory with the live-tensor tracker.

    The optimizer should already hold its state (see :func:`warm_up`): the measured step is a
    steady-state one. Gradients are left set afterwards (for comparisons).

    Args:
        timeline: keep the tracker's ``(op_index, live_bytes, phase)`` samples.
        tracker: a fresh :class:`~memfit.capture.tracker.MemoryTracker` to use (so that the
            caller can read it during the step); by default one is made.
        on_phase: called as ``on_phase("start" | "end", phase_name)`` at phase boundaries.
    """
    optimizer.zero_grad(set_to_none=True)
    params_bytes = tensor_bytes([*model.parameters(), *model.buffers()])
    opt_bytes_before = tensor_bytes(list(optimizer_tensors(optimizer)))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if tracker is None:
        tracker = MemoryTracker(device=device, record_timeline=timeline)
    tracker.track(model, optimizer, iter_tensors(batch))  # the batch is on the device too
    start_bytes = tracker.current_bytes

    @contextmanager
    def phase(name: str) -> Iterator[None]:
        with tracker.phase(name):
            if on_phase:
                on_phase("start", name)
            yield
            if on_phase:
                on_phase("end", name)

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with tracker:
        loss = training_step(model, batch, loss_fn, optimizer, seed=seed, phase=phase)
    allocator_peak = None
    if cuda:
        torch.cuda.synchronize(device)
        allocator_peak = torch.cuda.max_memory_allocated(device)
    grads_bytes = tensor_bytes([p.grad for p in model.parameters() if p.grad is not None])
    return StepMemory(
        peak_bytes=tracker.peak_bytes,
        params_bytes=params_bytes,
        grads_bytes=grads_bytes,
        optimizer_bytes=max(opt_bytes_before, tensor_bytes(list(optimizer_tensors(optimizer)))),
        peak_bytes_by_phase=dict(tracker.peak_bytes_by_phase),
        activations_peak_bytes=tracker.peak_bytes - start_bytes,
        loss=loss,
        timeline=tuple(getattr(tracker, "timeline", ()) or ()),
        allocator_peak_bytes=allocator_peak,
        host_peak_bytes=getattr(tracker, "peak_host_bytes", 0),  # a MemoryTracker (others count no host bytes)
    )


@contextmanager
def _sync(device: torch.device) -> Iterator[None]:
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(runs: Mapping[str, Callable[[], Any]], *, repeats: int = 3, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each callable, run interleaved (A B A B ...) so that machine noise hits
    all of them alike. Returns ``{name: median_s}``."""
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def step_runner(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    optimizer: torch.optim.Optimizer,
    *,
    seed: int,
) -> Callable[[], float]:
    """A zero-argument callable running one full step (then zero_grad), for :func:`time_steps`."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def run() -> float:
        with _sync(device):
            loss = training_step(model, batch, loss_fn, optimizer, seed=seed)
            optimizer.zero_grad(set_to_none=True)
        return loss

    return run
