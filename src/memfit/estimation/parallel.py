"""``memfit estimate --world-size N --parallel ddp|fsdp2``: one rank's step, estimated.

Composes :func:`memfit.estimation.stats.estimate_stats` (one process's per-block bytes from fake
steps) with :func:`memfit.plan.parallel.rank_stats` (NOTE [ Per-rank accounting ]) and walks a
plan or policy through the cost model, as ``memfit plan --estimate --parallel`` does for a budget.
"""

from __future__ import annotations

import torch

from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec
from memfit.estimation.devices import DEFAULT_MFU, DeviceSpec
from memfit.estimation.stats import estimate_stats, load_fake_workload
from memfit.plan.costmodel import ChainCosts, Prediction, predict
from memfit.plan.parallel import Parallel, rank_param_table, rank_stats
from memfit.plan.policies import Policy, policy_plan
from memfit.plan.types import Plan

__all__ = ["estimate_rank"]


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
    mfu: float = DEFAULT_MFU,
    seed: int = 0,
    rank: int = 0,
) -> tuple[Stats, Plan, Prediction]:
    """Rank ``rank``'s predicted step under a plan (or a block policy), from fake-tensor steps.

    Args:
        spec: a ``--model`` spec (built with fake parameters: nothing of its size is allocated).
        parallel: the data-parallel layout.
        device: the GPU (per-block seconds come from its roofline).
        plan: a plan file's plan; else ``policy`` (``none``, ``all``, ``sqrt``, ``every:K``).
        batch_size: samples per rank per step.
        seq_len, mfu: as :func:`memfit.estimation.estimate_stats`; dtype, optimizer, seed: as its ``step``; under
            ``parallel.param_dtype`` ``dtype`` is the parameters' own (e.g. float32).
        rank: the rank (0 holds the most under FSDP2).

    Returns:
        ``(stats, plan, prediction)``: the rank's Stats (:func:`memfit.plan.parallel.rank_report`
        reads them), the plan, and its predicted peak and step time.

    Raises:
        SpecError: an unknown device, policy or option (see :func:`estimate_stats`).
        PlanMismatchError: the plan was made for another chain.
    """
    wl = load_fake_workload(spec, seq_len=seq_len, dtype=dtype, seed=seed)
    # Under a MixedPrecisionPolicy the blocks run in param_dtype; the model keeps its own dtype.
    step_dtype = getattr(torch, parallel.param_dtype) if parallel.param_dtype else None
    stats = estimate_stats(
        wl,
        device=device,
        mfu=mfu,
        activations=False,
        step=StepSpec(batch_size=batch_size, optimizer=optimizer, seed=seed, dtype=step_dtype),
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
