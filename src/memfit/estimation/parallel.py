"""``memfit estimate --world-size N --parallel ddp|fsdp2``: one rank's step, estimated.

Composes :func:`memfit.estimation.stats.estimate_stats` (one process's per-block bytes from fake
steps) with :func:`memfit.plan.parallel.rank_stats` (NOTE [ Per-rank accounting ]) and walks a
plan or policy through the cost model, as ``memfit plan --estimate --parallel`` does for a budget.
"""

from __future__ import annotations

import torch

from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec
from memfit.errors import SpecError
from memfit.estimation.allocator import (
    AllocatorPrediction,
    allocator_model,
    collective_pool_bytes,
    rank_allocator_model,
)
from memfit.estimation.devices import DeviceSpec, get_device
from memfit.estimation.estimator import estimate
from memfit.estimation.stats import estimate_stats, load_fake_workload
from memfit.plan.costmodel import ChainCosts, Prediction, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import Parallel, rank_param_table, rank_stats
from memfit.plan.policies import Offload, Policy, Selective, parse_policy, policy_plan
from memfit.plan.types import Option, Plan
from memfit.workload import Workload

__all__ = ["estimate_plan_allocator", "estimate_rank", "estimate_rank_allocator"]


def estimate_rank(
    spec: str,
    *,
    parallel: Parallel,
    device: str | DeviceSpec,
    plan: Plan | None = None,
    policy: str | Policy = "none",
    batch_size: int | None = None,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    mfu: float | None = None,
    seed: int = 0,
    rank: int = 0,
) -> tuple[Stats, Plan, Prediction]:
    """Rank ``rank``'s predicted step under a plan (or a block policy), from fake-tensor steps.

    Args:
        spec: a ``--model`` spec (built with fake parameters: nothing of its size is allocated).
        parallel: the data-parallel layout.
        device: the GPU (per-block seconds come from its roofline).
        plan: a plan file's plan; else ``policy`` (``none``, ``all``, ``sqrt``, ``every:K``,
            ``selective:PRESET`` such as ``selective:torchtitan``, ``selective:save:OP,...``).
        batch_size: samples per rank per step.
        seq_len, mfu: as :func:`memfit.estimation.estimate_stats`; dtype, optimizer, seed: as its ``step``; under
            ``parallel.param_dtype`` ``dtype`` is the parameters' own (e.g. float32).
        rank: the rank (0 holds the most under FSDP2).

    Returns:
        ``(stats, plan, prediction)``: the rank's Stats (:func:`memfit.plan.parallel.rank_report`
        reads them), the plan, and its predicted peak and step time.

    Raises:
        SpecError: an unknown device, policy or option (see :func:`estimate_stats`), or offload.
        PlanMismatchError: the plan was made for another chain.
    """
    wl = load_fake_workload(spec, seq_len=seq_len, dtype=dtype, seed=seed)
    # Under a MixedPrecisionPolicy the blocks run in param_dtype; the model keeps its own dtype.
    step_dtype = getattr(torch, parallel.param_dtype) if parallel.param_dtype else None
    policy = parse_policy(policy)
    if isinstance(policy, Offload) or (plan is not None and any(b.option is Option.OFFLOAD for b in plan.blocks)):
        raise SpecError(
            "memfit.estimate: offloaded blocks cannot be estimated (fake tensors have no host memory to copy to); "
            "estimate policy none, all, sqrt, every:K or selective:... per rank."
        )
    # a selective plan's blocks are estimated under their own policy (one fake step per policy)
    selective = sorted({f"selective:{b.policy}" for b in plan.blocks if b.option is Option.SELECTIVE}) if plan else []
    if plan is None and isinstance(policy, Selective):
        selective = [str(policy)]
    options = (*BASE_OPTIONS, *selective)
    stats = estimate_stats(
        wl,
        device=device,
        mfu=mfu,
        activations=False,
        options=options,
        step=StepSpec(batch_size=batch_size, optimizer=optimizer, seed=seed, dtype=step_dtype),
        heads=False,  # the policy's or plan's own options only (each more is one more fake step)
        tiling=False,
        host_inputs=False,
    )
    rs = rank_stats(stats, rank_param_table(wl.model, stats, parallel), parallel, rank)
    if plan is None:
        plan = policy_plan(wl.model, policy)
    pred = predict(ChainCosts.from_stats(rs), plan)
    plan = plan.with_(
        predicted_peak_bytes=pred.peak_bytes,
        predicted_step_s=pred.step_s,
        peak_event=pred.peak_event,
    )
    return rs, plan, pred


def estimate_rank_allocator(
    spec: str,
    *,
    rank: Stats,
    plan: Plan,
    peak_bytes: int,
    device: str | DeviceSpec,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
) -> AllocatorPrediction:
    """The CUDA allocator's numbers for a rank (NOTE [ A rank's reserved memory ] in
    :mod:`memfit.estimation.allocator`): its peak, plus what one process running ``plan`` at the
    rank's micro-batch caches (one more fake step, replayed with the model states at a rank's
    shard of them under FSDP2), plus the collectives' stream pools.

    Args:
        spec: the ``--model`` spec :func:`estimate_rank` was given.
        rank: the rank's Stats (``estimate_rank``'s first value).
        plan: the plan (``estimate_rank``'s second value).
        peak_bytes: the rank's predicted peak.
        device: the GPU.
        seq_len, dtype, optimizer, seed: as :func:`estimate_rank` (under ``param_dtype`` the
            one-process step runs in it).
    """
    dev = device if isinstance(device, DeviceSpec) else get_device(device)
    info = rank.calibration.parallel
    layout = info.layout if info is not None else {}
    step_dtype = getattr(torch, layout["param_dtype"]) if layout.get("param_dtype") else dtype
    # FSDP2 shards the model states: the replay runs what one rank of them holds and steps
    shards = int(layout.get("world_size", 1)) if layout.get("kind") == "fsdp2" else 1
    one = estimate(
        spec, device=dev, plan=plan, seq_len=seq_len, states_shards=shards,
        step=StepSpec(batch_size=rank.batch_size, dtype=step_dtype, optimizer=optimizer, seed=seed),
    )  # fmt: skip
    single = AllocatorPrediction(
        tensor_peak_bytes=one.peak_bytes,
        workspace_bytes=0,
        predicted_allocated_bytes=one.predicted_allocated_bytes or one.peak_bytes,
        predicted_reserved_bytes=one.predicted_reserved_bytes or one.peak_bytes,
        method="replay",
    )
    memory = info.memory if info is not None else {}
    pools = collective_pool_bytes(
        layout.get("kind", ""), list(memory.get("unit_unsharded_bytes", [])), int(memory.get("grads_bytes", 0))
    )
    return rank_allocator_model(peak_bytes, dev, single=single, collective_pool_bytes=pools)


def estimate_plan_allocator(
    spec: str,
    workload: Workload,
    stats: Stats,
    plan: Plan,
    device: str | DeviceSpec,
    *,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
) -> AllocatorPrediction:
    """The CUDA allocator model of a plan made from estimated stats: one more fake step of it,
    replayed (:func:`memfit.estimation.allocator.allocator_model`); for a rank's stats,
    :func:`estimate_rank_allocator`. On the CPU: the live-tensor peak.

    Args:
        spec: the ``--model`` spec (a rank's one-process step is built from it).
        workload: the fake-built workload the plan was made for.
        stats: the stats the plan was made from (one process's or a rank's).
        plan: the plan, with its predicted peak.
        device: the GPU.
        seq_len, dtype, optimizer, seed: as the estimate was made.
    """
    dev = device if isinstance(device, DeviceSpec) else get_device(device)
    peak = plan.predicted_peak_bytes or 0
    if dev.name == "cpu":
        return allocator_model(peak, dev)
    if stats.calibration.parallel is not None:
        return estimate_rank_allocator(
            spec, rank=stats, plan=plan, peak_bytes=peak, device=dev, seq_len=seq_len, dtype=dtype,
            optimizer=optimizer, seed=seed,
        )  # fmt: skip
    one = estimate(workload, plan=plan, device=dev,
                   step=StepSpec(batch_size=stats.batch_size, dtype=dtype, optimizer=optimizer, seed=seed))  # fmt: skip
    bound = allocator_model(one.peak_bytes, dev)
    return AllocatorPrediction(
        tensor_peak_bytes=one.peak_bytes,
        workspace_bytes=bound.workspace_bytes,
        predicted_allocated_bytes=one.predicted_allocated_bytes or bound.predicted_allocated_bytes,
        predicted_reserved_bytes=one.predicted_reserved_bytes or bound.predicted_reserved_bytes,
        method="replay",
    )
