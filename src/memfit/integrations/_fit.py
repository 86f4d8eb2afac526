"""Auto-fit a framework's model, then apply the plan to the model itself.

Shared by the framework adapters. :func:`memfit.fitting.autofit` measures on the model itself and
leaves it as it was, bitwise (weights, buffers, ``.grad``, flags, RNGs: NOTE [ Measuring leaves the
model as it was ] in :mod:`memfit.capture.snapshot`), so no copy is made unless ``device`` is not
where the model is (then a copy on ``device``: :func:`memfit.capture.snapshot.cast_copy`); applying
the plan changes forwards only (``state_dict`` keys unchanged).

NOTE [ Model states in a framework's loop ]
``memfit plan``, ``fit`` and ``train`` place the model states where the step fits (NOTE [ Choosing the
model states' placement ] in :mod:`memfit.estimation.states_choice`): the step inside the backward or
the optimizer on the host replace the optimizer. In Trainer, accelerate and Lightning the framework
(or the user's loop) builds, clips and steps its own optimizer, on the device gradients, after the
backward: a placement memfit chose would not be the one that runs, and clipping or a GradScaler would
read gradients that are gone. So the adapters run the same choice with ``device`` the only placement
they can use, and when the device floor does not fit, the refusal names every placement and why it is
not used there (``states="device"`` skips the choice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memfit.apply import apply_plan
from memfit.capture.snapshot import cast_copy
from memfit.capture.step import StepSpec
from memfit.errors import SpecError
from memfit.estimation.placed import autofit_placed
from memfit.estimation.states_choice import AUTO, StatesContext
from memfit.optim.states import ModelStates
from memfit.plan.parallel import DDP_BUCKET_CAP_BYTES, Parallel, ParallelKind
from memfit.plan.policies import Policy, parse_policy
from memfit.units import parse_size
from memfit.workload import Batch, LossOutput, Workload


def budget_to_bytes(budget: int | str) -> int:
    """``300MiB``, ``2GiB`` or a number of bytes, as bytes."""
    if isinstance(budget, bool):
        raise SpecError(
            f"memfit.integrations: budget {budget!r} is not a size. Pass e.g. '300MiB' or a number of bytes."
        )
    return budget if isinstance(budget, int) else parse_size(budget)


def fit_and_apply(
    model: nn.Module,
    budget: int | str,
    *,
    global_batch: int,
    make_batch: Callable[[int], Batch],
    loss_fn: Callable[[nn.Module, Batch], LossOutput],
    count_fn: Callable[[Batch], Any] | None = None,
    blocks: str | None = None,
    device: torch.device | str | None = None,
    apply: bool = True,
    name: str | None = None,
    policy: Policy | str | None = None,
    states: str = AUTO,
    framework: tuple[str, str] = ("memfit.integrations", "the framework steps its own optimizer"),
    **autofit_kw: Any,
) -> Any:
    """Auto-fit micro-batch, accumulation steps and plan for ``model`` (left unchanged); apply the plan.

    Measures ``model`` itself when it is on ``device`` (or ``device`` is None), else a copy of it
    on ``device``; either way its weights, buffers and gradients are bitwise as before. Under
    several processes (``torch.distributed`` initialised) rank 0 measures and broadcasts its
    result, so that every rank runs the same micro-batch, steps and plan (the choice depends on
    measured times, which differ between ranks); call it on every rank.

    Args:
        policy: keep this checkpoint policy's plan (a :class:`~memfit.plan.policies.Policy` or its
            text, ``"all"``, ``"every:2"``, ...) and fit only micro-batch and accumulation steps.
        states: ``"auto"`` (default) or ``"device"`` (the opt-out): where the model states live
            (NOTE [ Model states in a framework's loop ]).
        framework: the adapter's subsystem and why the framework's loop cannot use the other
            placements, for the refusals.
        autofit_kw: passed to :func:`memfit.fitting.autofit` (``step``, ``measure``,
            ``max_micro_batch``, ``margin``, ``even``, ``heads``, ...); ``optimizer``, ``seed`` and
            ``repeats`` go into its ``step`` (:class:`~memfit.capture.step.StepSpec`).

    Returns:
        The :class:`memfit.fitting.FitResult` (its ``plan`` is applied to ``model`` when ``apply``).
    """
    budget_bytes = budget_to_bytes(budget)
    subsystem, why_not = framework
    if states not in (AUTO, ModelStates.DEVICE.value):
        raise SpecError(f"{subsystem}: states={states!r} is not used here: {why_not}; pass states='auto' or 'device'.")
    policy = parse_policy(policy) if policy is not None else None  # a bad text fails on every rank, before any work
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    result = None
    if not multi or dist.get_rank() == 0:
        probe = cast_copy(model, device=device)  # the model itself unless it must move
        workload = Workload(
            name=name or type(model).__name__,
            model=probe,
            make_batch=make_batch,
            loss_fn=loss_fn,
            count_fn=count_fn,
            blocks=blocks,
        )
        step_kw = {k: autofit_kw.pop(k) for k in ("optimizer", "seed", "repeats") if k in autofit_kw}
        if step_kw:
            autofit_kw["step"] = dataclasses.replace(autofit_kw.get("step") or StepSpec(), **step_kw)
        parallel = autofit_kw.get("parallel")
        context = StatesContext(  # NOTE [ Model states in a framework's loop ]
            parallel=parallel.kind.value if parallel is not None else "local",
            buildable=(ModelStates.DEVICE,),
            unbuildable_reason=why_not,
        )
        result, _ = autofit_placed(
            workload, budget_bytes, global_batch, states=states, context=context, subsystem=subsystem, policy=policy,
            **autofit_kw,
        )  # fmt: skip
        del probe, workload
    if multi:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if apply:
        apply_plan(model, result.plan)
    return result


def ddp_layout(accelerator: Any) -> Parallel | None:
    """The DDP layout accelerate will wrap the model in (one per process), or None with one process.

    accelerate (and Trainer, which runs on it) wraps the model in ``DistributedDataParallel`` for
    every multi-process kind but DeepSpeed, FSDP, Megatron-LM and XLA, with the bucket cap of its
    ``DistributedDataParallelKwargs`` (Trainer's ``ddp_bucket_cap_mb``). The fit then plans one
    rank's memory, DDP's gradient buckets included (NOTE [ Per-rank accounting ] in
    :mod:`memfit.plan.parallel`), as ``memfit plan --parallel ddp`` does.
    """
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", ""))
    world = int(getattr(accelerator, "num_processes", 1))
    if world < 2 or not kind.startswith("MULTI_"):
        return None
    handler = getattr(accelerator, "ddp_handler", None)
    cap_mb = getattr(handler, "bucket_cap_mb", None)
    cap = int(cap_mb * 2**20) if cap_mb else DDP_BUCKET_CAP_BYTES
    return Parallel(kind=ParallelKind.DDP, world_size=world, bucket_cap_bytes=cap)
