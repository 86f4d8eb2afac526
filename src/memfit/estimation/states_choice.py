"""Where the model states live, chosen for a budget (``--states auto`` on plan, fit and train).

NOTE [ Choosing the model states' placement ]
Every placement of :class:`~memfit.optim.ModelStates` trains to the same parameters; they differ in
the device memory the model states take and in the time the step loses to the host. The choice is
the fastest placement whose step fits the device budget, under the host budget:

1. The placements the context cannot run are left out, with their refusal
   (:func:`memfit.optim.in_backward.placement_refusal`: the step inside the backward under
   accumulation, clipping, a GradScaler or data parallelism; the host optimizer under data
   parallelism), and so are those the caller cannot build (``host-params`` on measured steps).
2. The others are ordered fastest first by :func:`memfit.estimation.states.placed_step_s` (the host
   link's and the host optimizer's seconds on top of the step's; ``device`` before
   ``step-in-backward`` at equal time: plain training).
3. In that order, a placement whose host part exceeds the host budget, or whose model states alone
   (with the buffers) exceed the device budget, is passed over without running anything
   (:func:`memfit.estimation.states.place`); the first other one is tried (profiled and planned by
   the caller's ``attempt``), and the first that fits is the choice. A placement that does not fit
   raises :class:`~memfit.errors.BudgetInfeasibleError` in ``attempt`` with its least budget, and the
   next one is tried; so is one whose every window the fit measured over the budget
   (:class:`~memfit.fitting.search.WindowOverBudgetError`).

So ``device`` is chosen whenever it fits: for a model whose states fit, ``auto`` plans what
``--states device`` plans. When none fits, the error names each placement and why.

On the CPU the host is the device: a host placement's bytes sit in this machine's memory too. The
budget there means the step's tracked device bytes (what a GPU would hold); the host-placed bytes
are counted apart (``host_scope``, ``StepMemory.host_peak_bytes``) and held to the host budget,
which is this machine's available memory less a margin by default.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from memfit.errors import BudgetInfeasibleError
from memfit.estimation.states import (
    HOST_OPTIMIZER_BYTES_PER_S,
    Placed,
    StateSizes,
    place,
    placed_step_s,
)
from memfit.fitting.search import WindowOverBudgetError
from memfit.optim.in_backward import placement_refusal
from memfit.optim.states import ModelStates
from memfit.units import format_bytes

__all__ = [
    "AUTO",
    "Considered",
    "StatesChoice",
    "StatesContext",
    "choose_states",
    "model_states_parts",
    "ordered_placements",
    "resolve_states",
]

AUTO = "auto"
"""The ``states`` value that asks for the choice (:func:`choose_states`)."""

R = TypeVar("R")


@dataclass(frozen=True, kw_only=True, slots=True)
class StatesContext:
    """What the step runs with that a placement may not support.

    Attributes:
        micro_steps: micro-steps per window (None: the fit chooses; the step inside the backward then
            takes the whole batch in one micro-step or is refused by the fit).
        max_grad_norm: clipping by the global norm, if any.
        scaler: fp16 autocast with a GradScaler.
        parallel: ``local``, ``ddp`` or ``fsdp2``.
        buildable: the placements the caller can plan (measured steps: not ``host-params``; fake-tensor
            steps: ``device`` and ``step-in-backward``).
        unbuildable_reason: why the others cannot be used there, in a few words (default: not planned
            in this version, priced by ``memfit estimate --states``).
    """

    micro_steps: int | None = 1
    max_grad_norm: float | None = None
    scaler: bool = False
    parallel: str = "local"
    buildable: tuple[ModelStates, ...] = tuple(ModelStates)
    unbuildable_reason: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Considered:
    """One placement as the choice saw it.

    Attributes:
        states: the placement.
        outcome: ``chosen``, ``not tried`` (a faster one fits), ``unusable``
            (the context refuses it), ``host`` (over the host budget), ``states`` (model states alone
            over the device budget) or ``over`` (tried: no plan fits).
        reason: one sentence.
        device_states_bytes: its model states on the device at the step's peak.
        host_bytes: its model states on the host.
        min_budget_bytes: the least device budget it was found to need, when known.
        refusal: for a placement tried and refused, the planner's own message (what it needs and the fix).
    """

    states: ModelStates
    outcome: str
    reason: str
    device_states_bytes: int
    host_bytes: int
    min_budget_bytes: int | None = None
    refusal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "states": self.states.value,
            "outcome": self.outcome,
            "reason": self.reason,
            "device_states_bytes": self.device_states_bytes,
            "host_bytes": self.host_bytes,
            "min_budget_bytes": self.min_budget_bytes,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class StatesChoice:
    """The placement chosen and why (:func:`choose_states`).

    Attributes:
        states: the placement chosen.
        reason: why, in one sentence (for the text output and ``states_reason``).
        considered: every placement in the order they were considered.
    """

    states: ModelStates
    reason: str
    considered: tuple[Considered, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "states": self.states.value,
            "states_reason": self.reason,
            "states_considered": [c.to_dict() for c in self.considered],
        }


def ordered_placements(
    sizes: StateSizes,
    *,
    compute_s: float = 0.0,
    backward_s: float = 0.0,
    host_link_bytes_per_s: float | None = None,
    host_optimizer_bytes_per_s: float = HOST_OPTIMIZER_BYTES_PER_S,
) -> list[Placed]:
    """Every placement, fastest first by :func:`~memfit.estimation.states.placed_step_s` (a host
    placement without a known link rate after those that need none; ties in
    :class:`~memfit.optim.ModelStates`' order)."""
    order = {m: i for i, m in enumerate(ModelStates)}

    def key(p: Placed) -> tuple[float, int]:
        s = placed_step_s(
            p, compute_s=compute_s, backward_s=backward_s, device_optimizer_s=0.0,
            host_link_bytes_per_s=host_link_bytes_per_s, host_optimizer_bytes_per_s=host_optimizer_bytes_per_s,
        )  # fmt: skip
        return (float("inf") if s is None else s, order[p.states])

    return sorted((place(sizes, m) for m in ModelStates), key=key)


def choose_states(
    attempt: Callable[[ModelStates], R],
    sizes: StateSizes,
    *,
    budget_bytes: int,
    host_budget_bytes: int | None,
    context: StatesContext | None = None,
    subsystem: str = "memfit",
    **pricing: Any,
) -> tuple[R, StatesChoice]:
    """The fastest placement whose step fits (NOTE [ Choosing the model states' placement ]).

    Args:
        attempt: plans (or fits) with one placement; raises
            :class:`~memfit.errors.BudgetInfeasibleError` when nothing fits with it.
        sizes: the model's :func:`~memfit.estimation.states.state_sizes`.
        budget_bytes: the device budget.
        host_budget_bytes: the host budget (None: not checked).
        context: what the step runs with (default: one process, one micro-step, no clipping).
        subsystem: the error's first words.
        **pricing: :func:`ordered_placements`' rates (``compute_s``, ``host_link_bytes_per_s``, ...).

    Returns:
        ``attempt``'s result for the chosen placement, and the choice.

    Raises:
        BudgetInfeasibleError: no placement fits; the message names each and why.
    """
    ctx = context or StatesContext()
    considered: list[Considered] = []
    result: Any = None
    chosen: Placed | None = None
    for p in ordered_placements(sizes, **pricing):
        why = _passes(p, sizes, budget_bytes, host_budget_bytes, ctx)
        if why is not None:
            considered.append(_seen(p, *why))
            continue
        if chosen is not None:
            considered.append(_seen(p, "not tried", "a faster placement fits"))
            continue
        try:
            result = attempt(p.states)
        except BudgetInfeasibleError as err:
            least = err.min_budget_bytes
            text = f"no plan fits {format_bytes(budget_bytes)}" + (
                f" (it needs at least {format_bytes(least)})" if least is not None else ""
            )
            considered.append(dataclasses.replace(_seen(p, "over", text, least), refusal=str(err)))
            continue
        except WindowOverBudgetError as err:  # predicted within the budget, every window measured over it
            least = err.measured_peak_bytes
            text = f"every window measured over {format_bytes(budget_bytes)}" + (
                f" (the least at {format_bytes(least)})" if least is not None else ""
            )
            considered.append(_seen(p, "over", text, least))
            continue
        chosen = p
        considered.append(_seen(p, "chosen", "fits"))
    if chosen is None:
        raise BudgetInfeasibleError(
            _none_fits(subsystem, considered, budget_bytes), min_budget_bytes=_least(considered)
        )
    return result, StatesChoice(states=chosen.states, reason=_reason(chosen, considered), considered=tuple(considered))


def resolve_states(
    states: ModelStates | str,
    attempt: Callable[[ModelStates], R],
    sizes: Callable[[], StateSizes],
    *,
    budget_bytes: int | None,
    host_budget_bytes: int | None,
    context: StatesContext | None = None,
    subsystem: str = "memfit",
    host_link_bytes_per_s: float | None = None,
    host_on_device: bool = False,
    names: tuple[str, str, str] = ("--states", "--budget", "--host-budget"),
) -> tuple[R, StatesChoice]:
    """``attempt`` with the placement ``states`` names, or with the one ``auto`` chooses: the one
    rule of ``memfit plan``, ``fit``, ``train``, the Python verbs and the integrations.

    ``auto`` is ``device`` without a budget (nothing to fit) and under data parallelism (the other
    placements step before the gradients are reduced); otherwise :func:`choose_states`
    (NOTE [ Choosing the model states' placement ]).

    Args:
        states: a placement, or ``"auto"``.
        attempt: plans (or fits, or trains) with one placement; raises
            :class:`~memfit.errors.BudgetInfeasibleError` when nothing fits with it.
        sizes: the model's :func:`~memfit.estimation.states.state_sizes`, made only when ``auto`` chooses.
        budget_bytes: the device budget (None: nothing to fit).
        host_budget_bytes: the host budget (None: not checked).
        context: what the step runs with (default: one process, one micro-step, no clipping).
        subsystem: the error's first words.
        host_link_bytes_per_s: the host link's rate, when known (orders the host placements by time).
        host_on_device: the host is this machine's memory (a CPU run): the reason says where the host
            bytes are counted.
        names: how the caller names the placement, the budget and the host budget (the CLI's options,
            or the Python verbs' parameters), for the reason.

    Returns:
        ``attempt``'s result and the choice.

    Raises:
        BudgetInfeasibleError: with ``auto``, no placement fits; the message names each and why.
    """
    ctx = context or StatesContext()
    if states != AUTO:
        m = ModelStates.parse(states)
        return attempt(m), StatesChoice(states=m, reason=f"{m.value}: as {names[0]} asked", considered=())
    why_device = (
        f"no {names[1]} to fit"
        if budget_bytes is None
        else "the only placement under data parallelism"
        if ctx.parallel != "local"
        else None
    )
    if why_device is not None:
        return attempt(ModelStates.DEVICE), StatesChoice(
            states=ModelStates.DEVICE, reason=f"device: {why_device}", considered=()
        )
    result, choice = choose_states(
        attempt, sizes(), budget_bytes=budget_bytes, host_budget_bytes=host_budget_bytes, context=ctx,
        subsystem=subsystem, host_link_bytes_per_s=host_link_bytes_per_s,
    )  # fmt: skip
    if choice.states is ModelStates.HOST_OPTIMIZER and host_on_device:
        note = (
            f"; on the CPU the host is this machine: those bytes are in the same memory, counted apart from "
            f"{names[1]} (the step's tracked device bytes) and held to {names[2]}"
        )
        choice = StatesChoice(states=choice.states, reason=choice.reason + note, considered=choice.considered)
    return result, choice


def model_states_parts(sizes: StateSizes, states: ModelStates | str) -> dict[str, dict[str, int]]:
    """Where every part of the model states lives under ``states``, in bytes at the step's peak:
    ``{"parameters": {"device_bytes", "host_bytes"}, "gradients": ..., "optimizer_state": ...}``
    (the step's temporaries on the device count with the optimizer state)."""
    p = place(sizes, states)
    return {
        "parameters": {"device_bytes": p.device_params_bytes, "host_bytes": p.host_params_bytes},
        "gradients": {"device_bytes": p.device_grads_bytes, "host_bytes": p.host_grads_bytes},
        "optimizer_state": {
            "device_bytes": p.device_optimizer_bytes + p.step_temp_bytes,
            "host_bytes": p.host_optimizer_bytes,
        },
    }


# ---------------------------------------------------------------- private machinery


def _seen(p: Placed, outcome: str, reason: str, least: int | None = None) -> Considered:
    return Considered(
        states=p.states,
        outcome=outcome,
        reason=reason,
        device_states_bytes=p.device_states_bytes,
        host_bytes=p.host_bytes,
        min_budget_bytes=least,
    )


def _passes(
    p: Placed, sizes: StateSizes, budget: int, host_budget: int | None, ctx: StatesContext
) -> tuple[str, str, int | None] | None:
    """None when ``p`` may be tried; else (outcome, reason, least budget)."""
    if p.states not in ctx.buildable:
        return (
            "unusable",
            ctx.unbuildable_reason
            or f"not planned here in this version (`memfit estimate --states {p.states.value}` prices it)",
            None,
        )
    refusal = placement_refusal(
        p.states.value, micro_steps=ctx.micro_steps or 1, max_grad_norm=ctx.max_grad_norm, scaler=ctx.scaler,
        parallel=ctx.parallel,
    )  # fmt: skip
    if refusal is not None:
        return ("unusable", refusal.removeprefix("memfit.optim: ").split(". ")[0], None)
    if host_budget is not None and p.host_bytes > host_budget:
        return (
            "host",
            f"its host part {format_bytes(p.host_bytes)} is over the host budget {format_bytes(host_budget)}",
            None,
        )
    need = p.device_states_bytes + sizes.buffers_bytes
    if need > budget:
        return ("states", f"model states alone need {format_bytes(need)} on the device", need)
    return None


def _reason(chosen: Placed, considered: Sequence[Considered]) -> str:
    chosen_at = next(i for i, c in enumerate(considered) if c.outcome == "chosen")
    before = considered[:chosen_at]
    if not before:
        return (
            f"{chosen.states.value}: the fastest placement, and it fits"
            if chosen.states is not ModelStates.DEVICE
            else "device: every model state fits on the device"
        )
    passed = "; ".join(f"{c.states.value}: {c.reason}" for c in before)
    host = f", {format_bytes(chosen.host_bytes)} of model states on the host" if chosen.host_bytes else ""
    return f"{chosen.states.value}: the fastest placement that fits ({passed}){host}"


def _none_fits(subsystem: str, considered: Sequence[Considered], budget: int) -> str:
    parts = "; ".join(f"{c.states.value}: {c.reason}" for c in considered)
    least = _least(considered)
    raise_to = f"Raise the budget to at least {format_bytes(least)}, " if least is not None else "Raise the budget, "
    host = any(c.outcome == "host" for c in considered)
    refused = [c for c in considered if c.refusal is not None]
    if refused:  # the planner's own words for the placement that needs least: its minimum and its fix
        best = min(refused, key=lambda c: (c.min_budget_bytes is None, c.min_budget_bytes or 0, -considered.index(c)))
        detail = re.sub(r"^memfit[\w. ]*: ", "", best.refusal or "")
        return (
            f"{subsystem}: no placement of the model states fits {format_bytes(budget)} ({parts}). "
            f"With {best.states.value}, the placement that needs least: {detail}"
            + (" Or raise --host-budget." if host else "")
        )
    return (
        f"{subsystem}: no placement of the model states fits {format_bytes(budget)} ({parts}). "
        f"{raise_to}{'lower the batch, or raise --host-budget.' if host else 'or lower the batch.'}"
    )


def _least(considered: Sequence[Considered]) -> int | None:
    known = [c.min_budget_bytes for c in considered if c.min_budget_bytes is not None]
    return min(known, default=None)
