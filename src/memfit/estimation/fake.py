"""A whole training step on fake tensors: memory and FLOPs of models that do not fit here.

Under ``FakeTensorMode`` every op computes only its output's shape, dtype, strides and device;
no memory is allocated. The workload is *built* under the mode, so a 7B-parameter model's
weights are shape-only tensors from the start (building it for real would take 27 GB), its batch
is made for real (a few token ids) and lifted to fake tensors, and one steady-state step
(forward, backward, optimizer step) runs with memfit's :class:`MemoryTracker` and a FLOP counter
entered inside the fake mode. The tracker counts the fake storages' bytes, which are exactly
what the real step would allocate.

NOTE [ Why build under FakeTensorMode rather than on the meta device ]
``with torch.device("meta")`` would also build the model without memory, but ops on meta tensors
run meta kernels: ``scaled_dot_product_attention`` then takes the math path and materialises the
``(B, heads, T, T)`` attention matrix, which no GPU kernel keeps. Fake tensors keep a real device
(``cpu`` here), so the step takes the same kernels as a real CPU step (flash attention for
CPU, whose saved tensors, output and log-sum-exp, are those of the CUDA flash/efficient
kernels), and a small model's fake peak equals its real tracked peak.

NOTE [ Steady state ]
A measured step (:func:`memfit.capture.step.measure_step`) starts with the optimizer state
already allocated and no gradients, as in the middle of training. The fake step does the same:
it creates the state with one optimizer step on zero gradients before the tracker starts.

Known limitations:
    - A model whose forward depends on tensor *values* (``.item()``, ``nonzero``, boolean-mask
      indexing, data-dependent control flow) cannot run under fake tensors; the error says so.
      Code that checks values only when not tracing (transformers' attention-mask helpers) takes
      its tracing path, which can differ from the eager one (a padding mask is then always
      materialised).
    - A file workload that cannot be *built* under the fake mode is built for real (and must then
      fit in this machine's memory); the result says ``built: "real"``.
    - Kernel workspaces (cuBLAS, cuDNN, flash-attention scratch) and allocator rounding and
      fragmentation are not tensors and are not counted (see :class:`MemoryTracker`).
    - The optimizer runs as it would on the target: ``foreach`` (one multi-tensor pass with
      whole-model temporaries, torch's CUDA default) or a per-parameter loop (torch's CPU default).

Size: about 560 lines, over the ~500 of other modules: building fake, lifting tensors and the fake step are
one concern; the step is one private function per phase (the optimizer's state, what exists at the start,
the phases, the activations' peak).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.autograd.variable import Variable

from memfit.capture.step import make_optimizer
from memfit.capture.tracker import MemoryTracker
from memfit.errors import MemfitError, UnsupportedModelError, WorkloadError
from memfit.estimation.kernels import CudaKernels, FlopCounter
from memfit.estimation.static import unique_parameters
from memfit.models.registry import load_workload
from memfit.optim.in_backward import release_optimizer
from memfit.workload import (
    Batch,
    Workload,
    cast_batch,
    iter_tensors,
    map_tensors,
    mean_loss,
)

__all__ = [
    "FakeStep",
    "build_fake_workload",
    "fake_batch",
    "fake_mode",
    "fake_parameters",
    "run_fake_step",
    "swap_fake_tensors",
]

_aten = torch.ops.aten


def fake_mode() -> FakeTensorMode:
    """A fresh fake mode that lifts stray real tensors (constants, RNG state) to fake ones."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def build_fake_workload(
    spec: str, *, mode: FakeTensorMode, seq_len: int | None = None, seed: int = 0
) -> tuple[Workload, str]:
    """Build the workload a spec names with fake parameters (nothing allocated).

    Args:
        spec: a ``--model`` spec (``demo``, ``hf:TYPE?...``, ``file.py:NAME``).
        mode: the fake mode to build under.
        seq_len: tokens per row for the built-in token workloads.
        seed: weight-initialisation seed (fake weights have no values; kept for the RNG state).

    Returns:
        ``(workload, built)`` where ``built`` is ``"fake"``, or ``"real"`` when a file workload
        could not be built under the fake mode and was built normally (its parameters are then
        lifted to fake tensors by :func:`fake_parameters`).

    Raises:
        SpecError: the spec is malformed (from :func:`memfit.models.registry.load_workload`).
    """
    try:
        with mode:
            return load_workload(spec, seq_len=seq_len, seed=seed), "fake"
    except WorkloadError as err:  # the file or NAME() raised (fake tensors, or a plain bug)
        if err.stage not in ("import", "builder") or spec.startswith(("hf:", "demo")):
            raise
    except MemfitError:
        raise
    except Exception:
        if spec.startswith(("hf:", "demo")):
            raise
    # A user's NAME() did something fake tensors cannot (read tensor values, call numpy):
    # build it for real; it is the user's own model, presumably one that fits here.
    return load_workload(spec, seq_len=seq_len, seed=seed), "real"


@contextlib.contextmanager
def fake_parameters(model: nn.Module, mode: FakeTensorMode, *, dtype: torch.dtype | None = None) -> Iterator[nn.Module]:
    """Temporarily give ``model`` fake parameters and buffers, converted to ``dtype``.

    Real tensors are lifted with ``mode.from_tensor`` (no copy of their data); floating
    parameters and buffers are converted to ``dtype`` as ``model.to(dtype)`` would. A parameter
    shared by several modules (tied weights) stays shared. The original tensors are put back on
    exit, so a user's model is left as it was.

    Args:
        model: the model (real, or already fake under ``mode``).
        mode: the fake mode of the step.
        dtype: floating dtype to train in; None keeps each tensor's dtype.

    Yields:
        ``model``, now holding fake tensors.
    """
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        swap_fake_tensors(model, mode, dtype=dtype, swapped=swapped)
        yield model
    finally:
        for table, name, original in reversed(swapped):
            table[name] = original


def swap_fake_tensors(
    model: nn.Module,
    mode: FakeTensorMode,
    *,
    dtype: torch.dtype | None = None,
    swapped: list[tuple[dict[str, Any], str, Any]] | None = None,
) -> nn.Module:
    """Give ``model`` fake parameters and buffers of ``mode``, floating ones converted to ``dtype``
    (for good: :func:`fake_parameters` puts the originals back). Tied parameters stay tied.
    ``swapped`` collects ``(table, name, original)`` for each tensor replaced."""
    memo: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        fake = t if isinstance(t, FakeTensor) and t.fake_mode is mode else mode.from_tensor(t)
        if dtype is not None and fake.is_floating_point() and fake.dtype != dtype:
            with mode:
                fake = fake.detach().to(dtype)
        return fake

    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                new = memo.get(id(t))
                if new is None:
                    new = convert(t.detach() if is_param else t)
                    if is_param:
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    memo[id(t)] = new
                if swapped is not None:
                    swapped.append((table, name, t))
                table[name] = new
    return model


def fake_batch(
    workload: Workload,
    batch_size: int,
    mode: FakeTensorMode,
    *,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Batch:
    """One batch of fake tensors with the shapes and dtypes ``make_batch(batch_size)`` gives.

    The batch is made for real outside the fake mode (token ids are small: 8 bytes a token),
    seeded, its floating tensors converted to ``dtype``, then lifted to fake tensors on the model's device. A
    ``make_batch`` that fails outside the mode (it closes over fake tensors) is called under it.
    """
    torch.manual_seed(seed)
    try:
        batch = workload.make_batch(batch_size)
    except Exception as err:
        if isinstance(err, MemfitError) and not (isinstance(err, WorkloadError) and err.stage == "make_batch"):
            raise
        torch.manual_seed(seed)
        with mode:
            batch = workload.make_batch(batch_size)
    batch = cast_batch(batch, dtype=dtype)
    # a model on a GPU (a user's, estimated as it is) takes its batch there, as the step would move it
    on = next((p.device for p in workload.model.parameters()), None)

    def lift(t: torch.Tensor) -> torch.Tensor:
        fake = t if isinstance(t, FakeTensor) and t.fake_mode is mode else mode.from_tensor(t)
        if on is not None and on.type != "cpu" and fake.device.type == "cpu":
            with mode:
                fake = fake.to(on)
        return fake

    return map_tensors(batch, lift)


@dataclass(frozen=True, kw_only=True, slots=True)
class FakeStep:
    """What one fake training step measured (bytes, FLOPs).

    Attributes:
        start_bytes: live at the start of the step: parameters, buffers, optimizer state (and
            master weights), the batch.
        peak_bytes: the tracker's peak over the whole step.
        peak_bytes_by_phase: peak within ``forward``, ``backward`` and ``optimizer``.
        peak_phase: the phase where ``peak_bytes`` was reached.
        activations_bytes: the highest live bytes during forward and backward above
            ``start_bytes``, not counting the gradients already produced at that moment:
            activations kept for backward plus temporaries.
        grads_bytes: gradients live once backward is done.
        optimizer_state_bytes: optimizer state tensors live at the start (master weights
            included; Adam's 0-dim ``step`` counters excluded).
        optimizer_temp_bytes: the optimizer phase's peak above ``start_bytes + grads_bytes``
            (``foreach`` temporaries; fp32 gradient copies under master weights).
        batch_bytes: the batch's tensors.
        flops: FLOPs of forward and backward (matmuls, convolutions, attention), recompute
            included, by ``torch.utils.flop_counter``'s formulas.
        forward_flops: the forward's share of ``flops``.
        flops_by_op: ``flops`` by op name (``mm``, ``addmm``, attention kernels, ...).
        op_count: ops the tracker saw.
        allocations: the ordered allocations and frees the tracker recorded, ``(key, bytes)``
            with negative bytes for a free (empty when the caller's tracker did not record them);
            :func:`memfit.estimation.allocator.replay_step` replays them.
        step_start: the index in ``allocations`` where the step starts (before it: parameters,
            buffers, optimizer state, the batch).
        states_end: the index in ``allocations`` where the batch starts (before it: the model
            states, parameters, buffers and optimizer state).
        optimizer_start: the index in ``allocations`` where the optimizer phase starts.
    """

    start_bytes: int
    peak_bytes: int
    peak_bytes_by_phase: dict[str, int]
    peak_phase: str
    activations_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    optimizer_temp_bytes: int
    batch_bytes: int
    flops: int
    forward_flops: int
    flops_by_op: dict[str, int]
    op_count: int
    allocations: tuple[tuple[int, int], ...] = ()
    step_start: int = 0
    states_end: int = 0
    optimizer_start: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON: the fields, the allocation stream as its length."""
        return asdict(self) | {"allocations": len(self.allocations)}


def run_fake_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    *,
    mode: FakeTensorMode,
    optimizer: str = "adamw",
    master_weights: bool = False,
    foreach: bool | None = None,
    gpu_kernels: bool = True,
    tracker: MemoryTracker | None = None,
    on_phase: Callable[[str, str], None] | None = None,
    flop_log: list[tuple[int, int]] | None = None,
    states: str = "device",
) -> FakeStep:
    """Run one steady-state training step of a fake model and measure it.

    Args:
        model: a model whose parameters are fake tensors of ``mode`` (see
            :func:`fake_parameters`), with any checkpoint plan already applied.
        batch: a fake batch (see :func:`fake_batch`).
        loss_fn: ``(model, batch) -> loss`` or ``(loss_sum, count)``.
        mode: the fake mode.
        optimizer: ``adamw``, ``adam`` or ``sgd`` (with momentum), as
            :func:`memfit.capture.step.make_optimizer` builds them.
        master_weights: the optimizer updates fp32 copies of the parameters: gradients are
            converted to fp32 one by one (each low-precision gradient released as its copy is
            made), the optimizer steps the copies, the model's parameters are copied back.
        foreach: torch's multi-tensor optimizer (True: whole-model temporaries, the CUDA
            default), its per-parameter loop (False) or torch's choice for the fake device
            (None: the loop, on CPU).
        gpu_kernels: keep the tensors CUDA's dropout and attention kernels keep, rather than
            the CPU's (NOTE [ CUDA kernels on a fake CPU device ] in :mod:`memfit.estimation.kernels`).
        tracker: a fresh tracker (``record_timeline=True``) to measure with, so that the caller
            can read it during the step (per-block hooks); by default one is made.
        on_phase: called as ``on_phase("start" | "end", phase)`` at the boundaries of
            ``forward``, ``backward`` and ``optimizer``, as
            :func:`memfit.capture.step.measure_step` calls it.
        flop_log: when given, ``(tracker.op_count, FLOPs so far)`` is appended after every op
            that has FLOPs, so that FLOPs between two op counts can be read off.
        states: where the model states live (:class:`~memfit.optim.ModelStates`), as
            :func:`memfit.capture.step.make_optimizer` builds its optimizer: ``step-in-backward`` steps
            each parameter and frees its gradient inside the backward.

    Returns:
        The step's :class:`FakeStep`.

    Raises:
        UnsupportedModelError: the step needs tensor values (data-dependent ops).
    """
    params = [p for p in unique_parameters(model) if p.requires_grad]
    masters, opt = _steady_optimizer(model, params, mode, optimizer, master_weights, foreach, states)
    if tracker is None:
        tracker = MemoryTracker(record_timeline=True, record_allocations=True)
    start = _track_start(tracker, model, opt, masters, batch)
    grads = _GradientLog(tracker, params)
    flop_counter = FlopCounter(log=flop_log, tracker=tracker)
    try:
        run = _run_phases(model, batch, loss_fn, mode, tracker, flop_counter, opt, params, masters,
                          grads, gpu_kernels=gpu_kernels, on_phase=on_phase)  # fmt: skip
    finally:
        grads.remove()
        release_optimizer(opt)

    by_phase = dict(tracker.peak_bytes_by_phase)
    return FakeStep(
        start_bytes=start.start_bytes,
        peak_bytes=tracker.peak_bytes,
        peak_bytes_by_phase=by_phase,
        peak_phase=max(by_phase, key=lambda k: by_phase[k]) if by_phase else "forward",
        activations_bytes=_activations_bytes(tracker, grads.events, start.start_bytes),
        grads_bytes=run.grads_bytes,
        optimizer_state_bytes=start.optimizer_state_bytes,
        optimizer_temp_bytes=max(0, by_phase.get("optimizer", 0) - start.start_bytes - run.grads_bytes),
        batch_bytes=start.batch_bytes,
        flops=flop_counter.flops,
        forward_flops=run.forward_flops,
        flops_by_op=dict(flop_counter.by_op),
        op_count=tracker.op_count,
        allocations=tuple(tracker.allocations),
        step_start=start.step_start,
        states_end=start.states_end,
        optimizer_start=run.optimizer_start,
    )


# ---------------------------------------------------------------- private machinery


def _steady_optimizer(
    model: nn.Module,
    params: list[nn.Parameter],
    mode: FakeTensorMode,
    optimizer: str,
    master_weights: bool,
    foreach: bool | None,
    states: str,
) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    """The step's optimizer with its state allocated (NOTE [ Steady state ]), and the fp32 master
    copies it steps under ``master_weights`` (else none); every gradient cleared."""
    for p in params:
        p.grad = None
    with mode:
        masters = [nn.Parameter(p.detach().float()) for p in params] if master_weights else []
        # states: the placement's own optimizer (``step-in-backward``: memfit.optim's wrapper steps each
        # parameter in its gradient hook and frees the gradient, in this fake backward too)
        opt = make_optimizer(nn.ParameterList(masters) if master_weights else model, optimizer, states=states)
        if foreach is not None:
            for group in opt.param_groups:
                group["foreach"] = foreach
        _allocate_optimizer_state(opt)
    return masters, opt


@dataclass(frozen=True, kw_only=True, slots=True)
class _Start:
    """What is live when the step starts, in bytes, and where in the allocation stream."""

    optimizer_state_bytes: int
    batch_bytes: int
    start_bytes: int
    states_end: int
    step_start: int


def _track_start(
    tracker: MemoryTracker, model: nn.Module, opt: torch.optim.Optimizer, masters: list[nn.Parameter], batch: Batch
) -> _Start:
    """Track what exists before the step: the model states first, then the batch."""
    tracker.track(model)  # parameters and buffers
    model_bytes = tracker.current_bytes
    # Adam's 0-dim `step` counters stay on the CPU for CUDA parameters: not device memory.
    state = [v for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor) and k != "step"]
    tracker.track(state, masters)
    optimizer_state_bytes = tracker.current_bytes - model_bytes
    states_end = tracker.allocation_count
    tracker.track(iter_tensors(batch))
    return _Start(
        optimizer_state_bytes=optimizer_state_bytes,
        batch_bytes=tracker.current_bytes - model_bytes - optimizer_state_bytes,
        start_bytes=tracker.current_bytes,
        states_end=states_end,
        step_start=tracker.allocation_count,
    )


class _GradientLog:
    """Gradient bytes live after each op, ``(op_index, bytes)``, to tell activations from gradients
    in the timeline (a post-accumulate-grad hook on every parameter; :meth:`remove` takes them off)."""

    def __init__(self, tracker: MemoryTracker, params: list[nn.Parameter]) -> None:
        self.events: list[tuple[int, int]] = []
        self.total_bytes = 0
        self._tracker = tracker
        self._live: dict[int, int] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: torch.Tensor) -> None:
        nbytes = p.grad.untyped_storage().nbytes() if p.grad is not None else 0
        self.total_bytes += nbytes - self._live.get(id(p), 0)
        self._live[id(p)] = nbytes
        self.events.append((self._tracker.op_count, self.total_bytes))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass(frozen=True, kw_only=True, slots=True)
class _Phases:
    forward_flops: int
    grads_bytes: int
    optimizer_start: int


def _run_phases(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    mode: FakeTensorMode,
    tracker: MemoryTracker,
    flop_counter: FlopCounter,
    opt: torch.optim.Optimizer,
    params: list[nn.Parameter],
    masters: list[nn.Parameter],
    grads: _GradientLog,
    *,
    gpu_kernels: bool,
    on_phase: Callable[[str, str], None] | None,
) -> _Phases:
    """Forward, backward and the optimizer step under the tracker, each a named phase; a step that
    reads tensor values is refused with the fix."""

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        with tracker.phase(name):
            if on_phase:
                on_phase("start", name)
            yield
            if on_phase:
                on_phase("end", name)

    try:
        kernels = CudaKernels() if gpu_kernels else contextlib.nullcontext()
        with mode, tracker:
            with flop_counter:
                with phase("forward"), kernels:
                    loss = mean_loss(loss_fn(model, batch))
                forward_flops = flop_counter.flops
                with phase("backward"), kernels:
                    _backward(loss)
                del loss
            optimizer_start = tracker.allocation_count
            with phase("optimizer"):
                _optimizer_step(opt, params, masters)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise UnsupportedModelError(
            f"memfit.estimate: the training step reads tensor values ({type(exc).__name__}: "
            f"{first_line}), which fake tensors do not have, so it cannot be estimated without "
            "running it. Remove data-dependent ops (.item(), nonzero, boolean-mask indexing) "
            "from the forward and loss, or measure a real step with `memfit profile`."
        ) from exc
    return _Phases(forward_flops=forward_flops, grads_bytes=grads.total_bytes, optimizer_start=optimizer_start)


def _optimizer_step(opt: torch.optim.Optimizer, params: list[nn.Parameter], masters: list[nn.Parameter]) -> None:
    """The optimizer step; with master weights, the gradients move to the fp32 copies one by one
    first and the stepped copies are written back."""
    if masters:
        for p, q in zip(params, masters, strict=True):
            q.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
    opt.step()
    if masters:
        with torch.no_grad():
            for p, q in zip(params, masters, strict=True):
                p.copy_(q)


def _activations_bytes(tracker: MemoryTracker, grad_events: list[tuple[int, int]], start_bytes: int) -> int:
    """The highest live bytes in forward and backward above ``start_bytes``, less the gradients live
    at that op."""
    activations = 0
    j = grads_now = 0
    for sample in tracker.timeline:
        if sample.phase not in ("forward", "backward"):
            continue
        while j < len(grad_events) and grad_events[j][0] <= sample.op_index:
            grads_now = grad_events[j][1]
            j += 1
        activations = max(activations, sample.current_bytes - start_bytes - grads_now)
    return activations


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()``, run by the autograd engine directly.

    ``Tensor.backward`` and ``torch.autograd.backward`` go through ``__torch_function__``, and a
    function mode is switched off while it handles a call: under :class:`~memfit.estimation.kernels.CudaKernels` the engine, and
    with it the recompute of checkpointed blocks, would run without the mode, and the recompute
    would save other tensors than the forward (``CheckpointError``). Calling the engine keeps the
    mode active. The seed gradient is created as ``loss.backward()`` creates it.
    """
    grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(  # (tensors, grads, keep_graph, create_graph,
        (loss,),
        (grad,),
        False,
        False,
        (),
        True,
        True,  # inputs, allow_unreachable, accumulate)
    )


def _allocate_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """One step on zero gradients, so that the state exists (NOTE [ Steady state ])."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
