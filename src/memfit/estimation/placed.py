"""The planning verbs with the model states' placement chosen: :func:`autofit` and :func:`plan_for_budget`
(``memfit.autofit``, ``memfit.plan_for_budget``) take ``states="auto"``.

They are :func:`memfit.fitting.autofit` and :func:`memfit.fitting.plan_for_budget` with one more
parameter, ``states``: a placement (:class:`memfit.optim.ModelStates`), or ``"auto"`` for the one
``memfit plan`` and ``memfit fit`` choose by default, by the same function
(:func:`memfit.estimation.states_choice.resolve_states`, NOTE [ Choosing the model states' placement ]):
``device`` whenever the step fits the budget that way, else the fastest placement that fits, under the
host budget. They live here, above :mod:`memfit.fitting`, because the choice reads the model states'
sizes (:func:`memfit.estimation.states.state_sizes`).

Example:
    >>> import memfit
    >>> wl = memfit.load_workload("demo?n_layer=2&n_embd=16&seq_len=16")
    >>> res = memfit.plan_for_budget(wl, 64 * 2**20, step=memfit.StepSpec(batch_size=2, repeats=1), states="auto")
    >>> res.plan.states  # every model state fits on the device
    'device'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from memfit.capture.chain import discover_chain
from memfit.capture.step import StepSpec
from memfit.errors import SpecError
from memfit.estimation.states import StateSizes, available_host_bytes, state_sizes
from memfit.estimation.states_choice import AUTO, StatesChoice, StatesContext, resolve_states
from memfit.fitting import autofit as _autofit
from memfit.fitting import plan_for_budget as _plan_for_budget
from memfit.fitting.result import FitResult
from memfit.fitting.types import PlanResult
from memfit.optim.build import implemented_states
from memfit.optim.states import ModelStates
from memfit.plan.types import Plan
from memfit.workload import Workload

__all__ = ["autofit", "autofit_placed", "plan_for_budget", "plan_placed", "workload_state_sizes"]

_NAMES = ("states", "budget_bytes", "host_budget_bytes")  # the parameters the reason names
_MEASURED = tuple(ModelStates(m) for m in implemented_states())  # host-params is priced by memfit.estimate only


def autofit(
    workload: Workload,
    budget_bytes: int,
    global_batch: int,
    *,
    step: StepSpec | None = None,
    states: ModelStates | str | None = None,
    host_budget_bytes: int | None = None,
    **kwargs: Any,
) -> FitResult:
    """:func:`memfit.fitting.autofit` (NOTE [ Auto-fit ]) with the model states placed as ``states`` says.

    Args:
        workload, budget_bytes, global_batch, step: as :func:`memfit.fitting.autofit`.
        states: a placement (``"device"``, ``"step-in-backward"``, ``"host-optimizer"``), or ``"auto"``:
            ``device`` whenever the fit finds a candidate that way, else the fastest placement with one,
            never one the fit cannot use (the step inside the backward under accumulation: a
            ``max_micro_batch`` below ``global_batch``; every placement but ``device`` with ``parallel``).
            None: ``step.states``.
        host_budget_bytes: with ``"auto"``, the host memory the model states may use (default: this
            machine's available memory less 10 %).
        kwargs: the other parameters of :func:`memfit.fitting.autofit`.

    Returns:
        The fit; ``result.plan.states`` is the placement it was made with.

    Raises:
        BudgetInfeasibleError: with ``"auto"``, no placement fits: the message names each and why.
        SpecError: ``states`` and ``step.states`` name two placements.
    """
    return autofit_placed(
        workload, budget_bytes, global_batch, step=step, states=states, host_budget_bytes=host_budget_bytes, **kwargs
    )[0]


def autofit_placed(
    workload: Workload,
    budget_bytes: int,
    global_batch: int,
    *,
    step: StepSpec | None = None,
    states: ModelStates | str | None = None,
    host_budget_bytes: int | None = None,
    context: StatesContext | None = None,
    subsystem: str = "memfit.fit",
    **kwargs: Any,
) -> tuple[FitResult, StatesChoice]:
    """:func:`autofit`, and the choice (``reason``, every placement ``considered``); ``context`` narrows the
    placements (a framework's loop: :mod:`memfit.integrations`), ``subsystem`` starts the refusal."""
    if states is None:  # the step's own placement, the step passed on as it is
        res = _autofit(workload, budget_bytes, global_batch, step=step, **kwargs)
        return res, _as_asked(res.plan)
    step, wanted = _step_and_states(step, states)
    most = kwargs.get("max_micro_batch")
    parallel = kwargs.get("parallel")
    context = context or StatesContext(
        micro_steps=2 if most is not None and most < global_batch else None,
        parallel=parallel.kind.value if parallel is not None else "local",
        buildable=_MEASURED,
    )
    return resolve_states(
        wanted,
        lambda m: _autofit(workload, budget_bytes, global_batch, step=dataclasses.replace(step, states=m), **kwargs),
        lambda: workload_state_sizes(workload, step),
        budget_bytes=budget_bytes,
        host_budget_bytes=_host_budget(host_budget_bytes),
        context=context,
        subsystem=subsystem,
        host_on_device=_on_cpu(workload, step),
        names=_NAMES,
    )


def plan_for_budget(
    workload: Workload,
    budget_bytes: int,
    *,
    step: StepSpec | None = None,
    states: ModelStates | str | None = None,
    host_budget_bytes: int | None = None,
    **kwargs: Any,
) -> PlanResult:
    """:func:`memfit.fitting.plan_for_budget` with the model states placed as ``states`` says.

    Args:
        workload, budget_bytes, step: as :func:`memfit.fitting.plan_for_budget`.
        states: a placement, or ``"auto"``: ``device`` whenever a plan fits that way, else the fastest
            placement whose plan fits (the step is one micro-step: the step inside the backward is
            tried; with ``parallel`` only ``device``). None: ``step.states``.
        host_budget_bytes: with ``"auto"``, the host memory the model states may use (default: this
            machine's available memory less 10 %).
        kwargs: the other parameters of :func:`memfit.fitting.plan_for_budget` (not ``stats``: stats are
            measured with one placement).

    Returns:
        The plan; ``result.plan.states`` is the placement it was made for.

    Raises:
        BudgetInfeasibleError: with ``"auto"``, no placement fits: the message names each and why.
        SpecError: ``states`` and ``step.states`` name two placements, or ``"auto"`` with ``stats``.
    """
    return plan_placed(workload, budget_bytes, step=step, states=states, host_budget_bytes=host_budget_bytes, **kwargs)[
        0
    ]


def plan_placed(
    workload: Workload,
    budget_bytes: int,
    *,
    step: StepSpec | None = None,
    states: ModelStates | str | None = None,
    host_budget_bytes: int | None = None,
    **kwargs: Any,
) -> tuple[PlanResult, StatesChoice]:
    """:func:`plan_for_budget`, and the choice (``reason``, every placement ``considered``)."""
    if states is None:  # the step's (or the stats') own placement, the step passed on as it is
        res = _plan_for_budget(workload, budget_bytes, step=step, **kwargs)
        return res, _as_asked(res.plan)
    step, wanted = _step_and_states(step, states)
    if wanted == AUTO and kwargs.get("stats") is not None:
        raise SpecError(
            "memfit.plan: states='auto' measures each placement it tries, and the stats given were measured with "
            f"{kwargs['stats'].states!r}; leave out stats, or pass states={kwargs['stats'].states!r}."
        )
    parallel = kwargs.get("parallel")
    context = StatesContext(
        micro_steps=kwargs.get("accumulation_steps", 1),
        parallel=parallel.kind.value if parallel is not None else "local",
        buildable=(ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD) if kwargs.get("stats_fn") else _MEASURED,
    )
    return resolve_states(
        wanted,
        lambda m: _plan_for_budget(workload, budget_bytes, step=dataclasses.replace(step, states=m), **kwargs),
        lambda: workload_state_sizes(workload, step),
        budget_bytes=budget_bytes,
        host_budget_bytes=_host_budget(host_budget_bytes),
        context=context,
        subsystem="memfit.plan",
        host_on_device=kwargs.get("stats_fn") is None and _on_cpu(workload, step),
        names=_NAMES,
    )


def workload_state_sizes(workload: Workload, step: StepSpec | None = None) -> StateSizes:
    """The model states' sizes of ``workload`` (its chain's blocks as the units) for ``step``'s optimizer,
    in ``step.dtype`` when it casts the model (every floating-point part scaled by the element sizes)."""
    step = step or StepSpec()
    model = workload.model
    sizes = state_sizes(model, optimizer=step.optimizer, blocks=discover_chain(model, workload.blocks).blocks)
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if step.dtype is None or not floating or floating[0] == step.dtype:
        return sizes
    ratio = torch.empty((), dtype=step.dtype).element_size() / torch.empty((), dtype=floating[0]).element_size()
    scaled = {
        f.name: round(getattr(sizes, f.name) * ratio)
        for f in dataclasses.fields(sizes)
        if f.name.endswith("_bytes") and f.name != "step_counters_bytes"
    }
    return dataclasses.replace(sizes, **scaled)


# ---------------------------------------------------------------- private machinery


def _as_asked(plan: Plan) -> StatesChoice:
    m = ModelStates.parse(plan.states)
    return StatesChoice(states=m, reason=f"{m.value}: the step's placement", considered=())


def _step_and_states(step: StepSpec | None, states: ModelStates | str) -> tuple[StepSpec, str]:
    """The step, and the placement asked for."""
    step = step or StepSpec()
    wanted = AUTO if states == AUTO else str(ModelStates.parse(states).value)
    if step.states is not ModelStates.DEVICE and wanted != step.states.value:
        raise SpecError(
            f"memfit: states={wanted!r} and step=StepSpec(states={step.states.value!r}) name two placements; "
            "give one of them."
        )
    return step, wanted


def _host_budget(given: int | None) -> int | None:
    return given if given is not None else available_host_bytes()


def _on_cpu(workload: Workload, step: StepSpec) -> bool:
    """The measured step runs on the CPU (``step.device``, else where the model is)."""
    if step.device is not None:
        return torch.device(step.device).type == "cpu"
    first = next(workload.model.parameters(), None)
    return first is None or first.device.type == "cpu"
