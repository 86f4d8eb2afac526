"""Model states placed: where parameters, gradients and optimizer state live, in bytes and seconds.

Pure functions over the sizes read off a model (:func:`state_sizes`, shapes only: fake tensors do).
``memfit estimate --states`` prices each :class:`~memfit.optim.ModelStates` placement with them and
``fit``/``plan --estimate`` refuse at once when model states alone cannot fit (:func:`states_floor`).

NOTE [ Model states by placement ]
With P the parameters' bytes (training dtype), G the trainable parameters' gradients (their dtype),
O the optimizer's bytes (AdamW: 2 tensors per parameter in the parameter's dtype, as torch's
``zeros_like(param)`` keeps them: a bf16 model has bf16 moments; plus fp32 master weights and fp32 state
with master weights; NOTE [ Precision convention ] in :mod:`memfit.estimation.static`), ``p1`` the
largest trainable parameter, ``R`` the parameters outside the blocks (embeddings, head, final norm) and
``U`` the largest block's parameters, what each placement holds at the step's peak:

============================  ==================  ===========  ==========  ==========================
placement                     device params       device grads device opt  host (params, grads, opt)
============================  ==================  ===========  ==========  ==========================
``device``                    P                   G            O           0, 0, 0
``step-in-backward``          P                   p1 (+p1)     O           0, 0, 0
``host-optimizer``            P                   p1           0           P (or 0 with masters), G, O
``host-params``               R + 2 U             R + U        0           P, G, O
============================  ==================  ===========  ==========  ==========================

- ``step-in-backward``: each parameter is stepped (and its gradient freed) as soon as its gradient is
  complete, so one gradient is held at a time, plus AdamW's one parameter-sized temporary of the
  per-parameter step (``denom``; SGD has none). Gradients still being summed count as activations in
  the fake step, as in the device step.
- ``host-optimizer``: each gradient is copied to the host as it completes and freed; the host keeps the
  gradients (accumulated over a window), the optimizer state and the copy of the parameters the CPU
  step updates (the fp32 masters with master weights, counted in O), and copies them back.
- ``host-params`` (FSDP2 ``CPUOffloadPolicy`` at world size 1, one unit per block): the root's
  parameters stay gathered for the step and its gradients until the backward ends; a block's
  parameters are gathered for its forward and again for its backward, one in use and one prefetched;
  one block's gradients are on the device until they are copied out.

The device peak of a placement other than ``device`` comes from the device step's fake run: its start
(parameters, buffers, optimizer state, batch) less the states the placement does not hold there, plus
the activations' peak (gradients excluded), plus the gradients the placement holds. ``device`` keeps
the fake step's own peak, which may be in the optimizer step. For ``step-in-backward`` this is an upper
bound (the hooks fire where fewer activations may be live); a fake step run with memfit.optim's wrapper
(``estimate(..., states="step-in-backward")``) gives its peak exactly, which ``memfit estimate`` runs when
the bound leaves the answer open.

Time (seconds per step), with ``C`` the compute, ``B`` its backward part, ``L`` the host link's rate
per direction (:class:`~memfit.estimation.devices.DeviceSpec` ``host_bytes_per_s``), ``H`` the host
optimizer's rate in bytes of parameters stepped per second (:func:`host_optimizer_rate`) and ``S``
the device optimizer's seconds at memory bandwidth:

- ``device``, ``step-in-backward``: ``C + S`` (the same work, inside or after the backward);
- ``host-optimizer``: ``C + max(0, G/L - B) + P/H + P/L``: the gradients' copies overlap the
  backward, the CPU step and the copy back of the parameters do not;
- ``host-params``: ``max(C, (2P + G)/L) + P/H``: the gathers (forward and backward) and the
  gradients' copies overlap compute (prefetch), the CPU step does not.

:data:`HOST_OPTIMIZER_BYTES_PER_S` was measured on the machine memfit is developed on (2 cores of an
AMD EPYC, torch 2.13 CPU, shared with other jobs): torch's ``AdamW`` stepping 4 bf16 parameters of
4096 x 4096 per parameter (``foreach=False``) ran at 1.98e8 bytes/s (9.9e7 parameters/s), its
``foreach`` path at 1.19e8; fp32 1.8e8 and 3.1e8 bytes/s. A host with more cores steps faster:
:func:`host_optimizer_rate` measures the machine it runs on, and the rate can be passed in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memfit.errors import BudgetInfeasibleError
from memfit.estimation.static import OPTIMIZER_STATES, static_bytes, unique_parameters
from memfit.optim.states import ModelStates
from memfit.units import format_bytes

__all__ = [
    "HOST_MARGIN_FRACTION",
    "HOST_OPTIMIZER_BYTES_PER_S",
    "Placed",
    "StateSizes",
    "available_host_bytes",
    "host_optimizer_rate",
    "place",
    "placed_peak_bytes",
    "placed_step_s",
    "state_sizes",
    "states_floor",
]

HOST_OPTIMIZER_BYTES_PER_S: float = 1.98e8
"""torch's CPU AdamW, bytes of bf16 parameters stepped per second, measured here (NOTE [ Model states by placement ])."""

HOST_MARGIN_FRACTION: float = 0.1
"""The default host budget keeps this fraction of the available memory free (for the process itself)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateSizes:
    """The sizes a placement's bytes come from, read off a model (shapes only).

    Attributes:
        params_bytes: every parameter (tied ones once), in the training dtype.
        trainable_bytes: the trainable parameters' bytes.
        grads_bytes: their gradients.
        optimizer_bytes: optimizer state plus fp32 master weights when used.
        master_weights_bytes: the fp32 master weights (0 without them).
        buffers_bytes: the model's buffers.
        largest_param_bytes: the largest trainable parameter.
        root_params_bytes: parameters outside the blocks (embeddings, head, final norm).
        root_trainable_bytes: the trainable ones among them.
        largest_unit_bytes: the parameters of the largest block.
        adam: the optimizer is Adam or AdamW (a parameter-sized temporary in a per-parameter step).
        step_counters_bytes: Adam's and AdamW's step counters (one float32 scalar per trainable
            parameter, kept on the CPU by torch unless ``capturable``/``fused``): part of the host
            placements' optimizer state.
    """

    params_bytes: int
    trainable_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    master_weights_bytes: int
    buffers_bytes: int
    largest_param_bytes: int
    root_params_bytes: int
    root_trainable_bytes: int
    largest_unit_bytes: int
    adam: bool
    step_counters_bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Placed:
    """Where one placement keeps parameters, gradients and optimizer state (bytes), and what moves.

    Attributes:
        states: the placement.
        device_params_bytes, device_grads_bytes, device_optimizer_bytes: held on the device at the peak.
        step_temp_bytes: the optimizer step's temporaries on the device at the peak (step-in-backward).
        host_params_bytes, host_grads_bytes, host_optimizer_bytes: held on the host.
        link_bytes: bytes crossing the host link per step, both directions together.
        host_step_bytes: bytes of parameters the host's optimizer steps per step.
    """

    states: ModelStates
    device_params_bytes: int
    device_grads_bytes: int
    device_optimizer_bytes: int
    step_temp_bytes: int
    host_params_bytes: int
    host_grads_bytes: int
    host_optimizer_bytes: int
    link_bytes: int
    host_step_bytes: int

    @property
    def device_states_bytes(self) -> int:
        """Model states on the device (with the step's temporaries)."""
        return self.device_params_bytes + self.device_grads_bytes + self.device_optimizer_bytes + self.step_temp_bytes

    @property
    def host_bytes(self) -> int:
        """Model states on the host."""
        return self.host_params_bytes + self.host_grads_bytes + self.host_optimizer_bytes


def state_sizes(
    model: nn.Module, *, optimizer: str, master_weights: bool = False, blocks: Sequence[nn.Module] = ()
) -> StateSizes:
    """The sizes of ``model``'s states (meta or fake tensors do: only shapes and dtypes are read).

    Args:
        model: the model in its training dtype.
        optimizer: ``sgd``, ``adam`` or ``adamw``.
        master_weights: fp32 master weights and state.
        blocks: the chain's blocks (the units ``host-params`` gathers); none: every parameter is root.

    Example:
        >>> s = state_sizes(nn.Linear(10, 10), optimizer="adamw")
        >>> s.params_bytes, s.largest_param_bytes
        (440, 400)
    """
    static = static_bytes(model, optimizer=optimizer, master_weights=master_weights)
    params = unique_parameters(model)
    in_blocks: set[int] = set()
    units = []
    for b in blocks:
        own = [p for p in b.parameters() if id(p) not in in_blocks]
        in_blocks.update(id(p) for p in own)
        units.append(sum(_nbytes(p) for p in own))
    root = [p for p in params if id(p) not in in_blocks]
    trainable = [p for p in params if p.requires_grad]
    return StateSizes(
        params_bytes=static.params_bytes,
        trainable_bytes=sum(_nbytes(p) for p in trainable),
        grads_bytes=static.grads_bytes,
        optimizer_bytes=static.optimizer_bytes,
        master_weights_bytes=static.master_weights_bytes,
        buffers_bytes=static.buffers_bytes,
        largest_param_bytes=max((_nbytes(p) for p in trainable), default=0),
        root_params_bytes=sum(_nbytes(p) for p in root),
        root_trainable_bytes=sum(_nbytes(p) for p in root if p.requires_grad),
        largest_unit_bytes=max(units, default=0),
        adam=OPTIMIZER_STATES.get(optimizer) == 2,
        step_counters_bytes=4 * len(trainable) if OPTIMIZER_STATES.get(optimizer) == 2 else 0,
    )


def place(sizes: StateSizes, states: ModelStates | str) -> Placed:
    """The bytes of each model state on the device and on the host under ``states``
    (NOTE [ Model states by placement ]).

    Example:
        >>> s = state_sizes(nn.Linear(10, 10), optimizer="adamw")
        >>> place(s, "host-optimizer").device_optimizer_bytes, place(s, "host-optimizer").host_optimizer_bytes
        (0, 888)
    """
    states = ModelStates.parse(states)
    s = sizes
    if states is ModelStates.DEVICE:
        return _placed(states, s.params_bytes, s.grads_bytes, s.optimizer_bytes)
    if states is ModelStates.STEP_IN_BACKWARD:
        temp = s.largest_param_bytes if s.adam else 0
        return _placed(states, s.params_bytes, s.largest_param_bytes, s.optimizer_bytes, temp=temp)
    host_copy = 0 if s.master_weights_bytes else s.trainable_bytes
    step_bytes = s.master_weights_bytes or s.trainable_bytes
    if states is ModelStates.HOST_OPTIMIZER:
        return _placed(
            states, s.params_bytes, s.largest_param_bytes, 0,
            host=(host_copy, s.grads_bytes, s.optimizer_bytes + s.step_counters_bytes),
            link=s.grads_bytes + s.trainable_bytes, step=step_bytes,
        )  # fmt: skip
    unit = min(s.largest_unit_bytes, s.params_bytes - s.root_params_bytes)
    blocks_bytes = s.params_bytes - s.root_params_bytes
    return _placed(
        states, s.root_params_bytes + min(2 * unit, blocks_bytes), s.root_trainable_bytes + unit, 0,
        host=(s.params_bytes, s.grads_bytes, s.optimizer_bytes + s.step_counters_bytes),
        link=2 * s.params_bytes + s.grads_bytes, step=step_bytes,
    )  # fmt: skip


def placed_peak_bytes(
    placed: Placed, sizes: StateSizes, *, device_peak_bytes: int, start_bytes: int, activations_bytes: int
) -> int:
    """The device peak of a step under ``placed``, from the device step's fake run: its peak, its start
    (parameters, buffers, optimizer state, batch) and its activations' peak (gradients excluded)."""
    if placed.states is ModelStates.DEVICE:
        return device_peak_bytes
    other = start_bytes - sizes.params_bytes - sizes.optimizer_bytes  # buffers, batch
    return other + placed.device_states_bytes + activations_bytes


def placed_step_s(
    placed: Placed,
    *,
    compute_s: float,
    backward_s: float,
    device_optimizer_s: float,
    host_link_bytes_per_s: float | None,
    host_optimizer_bytes_per_s: float = HOST_OPTIMIZER_BYTES_PER_S,
) -> float | None:
    """Seconds per step under ``placed`` (NOTE [ Model states by placement ]); None when the
    placement crosses a host link of unknown rate."""
    if placed.states in (ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD):
        return compute_s + device_optimizer_s
    if not host_link_bytes_per_s:
        return None
    host_step_s = placed.host_step_bytes / host_optimizer_bytes_per_s
    if placed.states is ModelStates.HOST_OPTIMIZER:
        grads_s = placed.host_grads_bytes / host_link_bytes_per_s
        back_s = (placed.link_bytes - placed.host_grads_bytes) / host_link_bytes_per_s
        return compute_s + max(0.0, grads_s - backward_s) + host_step_s + back_s
    return max(compute_s, placed.link_bytes / host_link_bytes_per_s) + host_step_s


def states_floor(
    sizes: StateSizes,
    *,
    budget_bytes: int,
    host_budget_bytes: int | None,
    placements: Sequence[ModelStates],
    subsystem: str,
    hint: str = "",
) -> Placed:
    """The placement (of ``placements``) whose model states alone take the least device memory, or
    :class:`~memfit.errors.BudgetInfeasibleError` when even it does not fit: model states, buffers and
    step temporaries above ``budget_bytes``, or its host part above ``host_budget_bytes``. Nothing
    runs: this is the check before any fake step.

    Args:
        sizes: the model's :func:`state_sizes`.
        budget_bytes: the device budget.
        host_budget_bytes: the host budget (None: not checked).
        placements: those the caller can run.
        subsystem: the message's first words (``memfit fit``).
        hint: a sentence for the message's end (a placement to try).
    """
    placed = [place(sizes, p) for p in placements]
    ok = [p for p in placed if host_budget_bytes is None or p.host_bytes <= host_budget_bytes]
    if not ok:
        least = min(placed, key=lambda p: p.host_bytes)
        raise BudgetInfeasibleError(
            f"{subsystem}: the model states need {format_bytes(least.host_bytes)} of host memory with placement "
            f"{least.states.value} ({_parts(least, host=True)}), over the host budget of "
            f"{format_bytes(host_budget_bytes or 0)}. Raise --host-budget or keep the states on the device. {hint}".rstrip()
        )
    best = min(ok, key=lambda p: p.device_states_bytes)
    need = best.device_states_bytes + sizes.buffers_bytes
    if need > budget_bytes:
        left_out = [p for p in placed if p not in ok]
        host_note = (
            f" Placements {', '.join(p.states.value for p in left_out)} need at least "
            f"{format_bytes(min(p.host_bytes for p in left_out))} of host memory, over the host budget of "
            f"{format_bytes(host_budget_bytes or 0)} (--host-budget SIZE sets it)."
            if left_out
            else ""
        )
        raise BudgetInfeasibleError(
            f"{subsystem}: model states alone need {format_bytes(need)} on the device with placement "
            f"{best.states.value} ({_parts(best, host=False)}, buffers {format_bytes(sizes.buffers_bytes)}), over the "
            f"budget of {format_bytes(budget_bytes)} before any activation: no batch fits.{host_note} {hint}".rstrip(),
            min_budget_bytes=need,
        )
    return best


def available_host_bytes(margin_fraction: float = HOST_MARGIN_FRACTION) -> int | None:
    """This machine's available memory (``MemAvailable`` of ``/proc/meminfo``, else free pages) less
    ``margin_fraction`` of it; None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * (1 - margin_fraction))
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * (1 - margin_fraction))
    except (ValueError, OSError, AttributeError):
        return None


def host_optimizer_rate(
    *, dtype: torch.dtype = torch.bfloat16, numel: int = 1 << 24, tensors: int = 4, repeats: int = 3
) -> float:
    """Measure torch's CPU AdamW on this machine: bytes of parameters stepped per second (the best of
    ``repeats`` steps of ``tensors`` parameters of ``numel`` elements, per-parameter as torch runs it on
    the CPU). Pass the result as ``host_optimizer_bytes_per_s``."""
    params = [nn.Parameter(torch.zeros(numel, dtype=dtype)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    opt.step()  # the state is allocated in the first step
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return sum(_nbytes(p) for p in params) / best


def parts_text(placed: Placed, *, host: bool) -> str:
    """``parameters X, gradients Y, optimizer state Z`` on the device (or the host)."""
    return _parts(placed, host=host)


# ---------------------------------------------------------------- private machinery


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _placed(
    states: ModelStates,
    params: int,
    grads: int,
    optimizer: int,
    *,
    temp: int = 0,
    host: tuple[int, int, int] = (0, 0, 0),
    link: int = 0,
    step: int = 0,
) -> Placed:
    return Placed(
        states=states,
        device_params_bytes=params,
        device_grads_bytes=grads,
        device_optimizer_bytes=optimizer,
        step_temp_bytes=temp,
        host_params_bytes=host[0],
        host_grads_bytes=host[1],
        host_optimizer_bytes=host[2],
        link_bytes=link,
        host_step_bytes=step,
    )


def _parts(p: Placed, *, host: bool) -> str:
    values = (
        (p.host_params_bytes, p.host_grads_bytes, p.host_optimizer_bytes)
        if host
        else (p.device_params_bytes, p.device_grads_bytes, p.device_optimizer_bytes)
    )
    text = ", ".join(
        f"{n} {format_bytes(v)}" for n, v in zip(("parameters", "gradients", "optimizer state"), values, strict=True)
    )
    return text + ("" if host or not p.step_temp_bytes else f", step temporaries {format_bytes(p.step_temp_bytes)}")
