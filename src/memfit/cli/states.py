"""``--states`` on ``memfit plan``, ``fit`` and ``train``: a placement, or ``auto`` (the fastest that
fits: NOTE [ Choosing the model states' placement ] in :mod:`memfit.estimation.states_choice`), and where each
part of the model states lives in the text output, the JSON and the plan file."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from memfit.capture.chain import discover_chain
from memfit.cli.common import Output, mib
from memfit.cli.estimate_states import estimate_call, host_budget_of
from memfit.errors import SpecError
from memfit.estimation.devices import get_device
from memfit.estimation.states import StateSizes, state_sizes
from memfit.estimation.states_choice import AUTO, StatesChoice, StatesContext, model_states_parts, resolve_states
from memfit.optim.build import implemented_states
from memfit.optim.states import ModelStates
from memfit.workload import Workload

__all__ = [
    "ESTIMATED_STATES",
    "MEASURED_STATES",
    "placement_for",
    "refuse_host_params",
    "save_plan",
    "show_model_states",
    "sizes_for",
    "states_json",
    "with_states",
]

MEASURED_STATES = tuple(ModelStates(m) for m in implemented_states())
"""The placements plan, fit and train build (``host-params`` is priced by ``memfit estimate``)."""

ESTIMATED_STATES = (ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD)
"""The placements ``--estimate`` plans from fake-tensor steps (the host ones: ``memfit estimate --states``)."""

R = TypeVar("R")


def refuse_host_params(args: argparse.Namespace, *, command: str) -> None:
    """``--states host-params`` on a command that runs or plans steps: refused with the estimate that prices it.

    Raises:
        SpecError: ``--states host-params``.
    """
    if getattr(args, "states", None) != ModelStates.HOST_PARAMS.value:
        return
    call = estimate_call(argparse.Namespace(**{**vars(args), "target": _target(args)})).replace(
        "--states auto", "--states host-params"
    )
    raise SpecError(
        f"memfit {command}: --states host-params (parameters on the host between uses, FSDP2's offload) is "
        f"estimated only in this version, not planned or run; price it with `{call}`, or use --states "
        "host-optimizer."
    )


def with_states(args: argparse.Namespace, states: ModelStates | str) -> argparse.Namespace:
    """A copy of ``args`` with ``--states`` set to one placement."""
    return argparse.Namespace(**{**vars(args), "states": str(ModelStates.parse(states).value)})


def sizes_for(wl: Workload, optimizer: str) -> StateSizes:
    """The model states' sizes of ``wl`` (its chain's blocks as the units)."""
    return state_sizes(wl.model, optimizer=optimizer, blocks=discover_chain(wl.model, wl.blocks).blocks)


def placement_for(
    args: argparse.Namespace,
    attempt: Callable[[ModelStates], R],
    sizes: Callable[[], StateSizes],
    *,
    command: str,
    context: StatesContext,
) -> tuple[R, StatesChoice]:
    """``attempt`` with the placement ``--states`` names, or with the one ``auto`` (the default) chooses:
    :func:`memfit.estimation.states_choice.resolve_states`, the rule the Python verbs and the
    integrations follow too, under ``--host-budget`` (default: this machine's available memory less
    10 %), pricing the host link at ``--target``'s rate with ``--estimate``."""
    target = getattr(args, "target", None) if getattr(args, "estimate", False) else None
    return resolve_states(
        getattr(args, "states", AUTO), attempt, sizes, budget_bytes=getattr(args, "budget", None),
        host_budget_bytes=host_budget_of(args), context=context, subsystem=f"memfit {command}",
        host_link_bytes_per_s=get_device(target).host_bytes_per_s if target else None,
        host_on_device=target is None and _on_cpu(args),
    )  # fmt: skip


def states_json(choice: StatesChoice, sizes: StateSizes) -> dict[str, Any]:
    """``states``, ``states_reason``, ``states_considered`` and ``model_states`` (per part: device and host bytes)."""
    return choice.to_dict() | {"model_states": model_states_parts(sizes, choice.states)}


def show_model_states(
    out: Output, choice: StatesChoice, sizes: StateSizes, *, table: bool = False, line: bool = True
) -> None:
    """One line: the placement and why; with ``table``, where each part lives (AdamW's state for ``memfit explain``'s step)."""
    if line:
        out.print(f"model states: {choice.reason}")
    if table:
        parts = model_states_parts(sizes, choice.states)
        names = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state"}
        out.table(
            f"model states placed {choice.states.value} (bytes at the step's peak)",
            ["part", "device", "host"],
            [(names[k], mib(v["device_bytes"]), mib(v["host_bytes"])) for k, v in parts.items()],
        )


def save_plan(plan: Any, path: str, *, workload: str, model_states: dict[str, Any] | None) -> None:
    """Write ``plan`` to ``path`` with its workload and, when known, where its model states live
    (``"model_states"``: per part, device and host bytes; :meth:`memfit.plan.types.Plan.load` reads
    the plan and leaves this key to readers)."""
    data = plan.with_(workload=workload).to_dict()
    if model_states is not None:
        data["model_states"] = model_states
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def _on_cpu(args: argparse.Namespace) -> bool:
    """The measured step runs on the CPU (``--device``, else where the model is built: CUDA when available)."""
    device = getattr(args, "device", None)
    if device in (None, "auto"):
        return not torch.cuda.is_available()
    return torch.device(device).type == "cpu"


def _target(args: argparse.Namespace) -> str:
    """The GPU the refusal's estimate names: ``--target``, else the one people train on most."""
    return getattr(args, "target", None) or "h100-sxm"
