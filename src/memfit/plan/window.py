"""A rank's peak over a window of micro-steps (gradient accumulation) under DDP or FSDP2: a pure
function over rank Stats (:func:`memfit.plan.parallel.rank_stats`) and a plan.

``memfit plan --world-size N --parallel ... --accumulation-steps K`` prints it and writes it into
the plan file (``Plan.accumulation_window``), where ``memfit train --plan`` finds the peak to compare
each rank's measured one with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from memfit.capture.stats import Stats
from memfit.errors import SpecError
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.parallel import ParallelKind
from memfit.plan.types import Plan

__all__ = ["window_costs", "window_peak_bytes"]


def window_peak_bytes(stats: Stats, plan: Plan, accumulation_steps: int) -> int:
    """A plan's predicted peak of one rank over a window of ``accumulation_steps`` micro-steps,
    gradient sync off on all but the last (``no_sync`` / ``set_requires_gradient_sync(False)``):
    the plan walked through :func:`window_costs`."""
    return predict(window_costs(stats, accumulation_steps), plan).peak_bytes


def window_costs(stats: Stats, accumulation_steps: int, costs: ChainCosts | None = None) -> ChainCosts:
    """The cost model of one rank's window of ``accumulation_steps`` micro-steps: what the solver
    plans under (``memfit plan --accumulation-steps K``, ``memfit fit`` with ``--parallel``) and
    :func:`window_peak_bytes` predicts with.

    ``stats``: rank Stats (:func:`rank_stats`); ``costs``: their cost model (default
    ``ChainCosts.from_stats(stats)``; pass it to keep a margin or a head option). DDP keeps every
    gradient whole between micro-steps, as one process does. FSDP2 keeps each unit's gradients
    unsharded (``unsharded_accumulated_grad``) until the last micro-step reduce-scatters them; with
    ``G_u`` a unit's gradient bytes and ``S_u`` its padded shard:

    - micro-step 1: no reduce-scatter: block ``i``'s backward base holds ``G_j`` instead of ``S_j``
      for the later blocks, and no reduce-scatter input; the end of backward holds every ``G``;
    - micro-steps 2..k-1: every ``G`` from the start; a unit's new gradients are added into it;
    - micro-step k: every ``G`` from the start; a unit's ``G`` becomes ``S`` at its reduce-scatter;
      the root's accumulated gradients are held until its own.

    The micro-steps differ only by constants per event (the bytes held from the start, each block's
    backward base and peak, the peak after the blocks), never by the plan, so one cost model whose
    every event is the largest of the micro-steps' predicts the window's peak of every plan exactly
    (a segment's recompute, which adds its last block's backward base to forward events, at most
    the largest micro-step's trailing gradients above it).
    """
    cal = stats.calibration.parallel
    if cal is None:
        raise SpecError(
            "memfit.plan: these stats are one process's; make a rank's with memfit.plan.parallel.rank_stats."
        )
    costs = costs if costs is not None else ChainCosts.from_stats(stats)
    if accumulation_steps <= 1:
        return costs
    return _merged(costs, _micro_steps(stats, costs, accumulation_steps))


@dataclass(frozen=True, kw_only=True, slots=True)
class _Shift:
    """One micro-step against the single step's costs: ``start`` more bytes from the start, block
    ``i``'s backward base moved by ``base[i]`` and its peak by ``peak[i]``, ``post`` the peak after
    the blocks (None: unchanged)."""

    start: int
    base: Sequence[int]
    peak: Sequence[int] | None = None
    post: int | None = None


def _micro_steps(stats: Stats, costs: ChainCosts, accumulation_steps: int) -> list[_Shift]:
    cal = stats.calibration.parallel
    assert cal is not None
    grads, shards = cal.unit_grad_bytes, cal.unit_grad_shard_bytes
    n = len(stats.blocks)
    total = sum(grads)
    later_g = [sum(grads[i + 1 : n]) for i in range(n)]
    if cal.layout["kind"] == ParallelKind.DDP.value:
        return [_Shift(start=0, base=[0] * n), _Shift(start=total, base=[-x for x in later_g])]
    later_s = [sum(shards[i + 1 : n]) for i in range(n)]
    gathered = cal.memory["unit_unsharded_bytes"]
    rs_kept = [-(gathered[i + 1] if i + 1 < n else 0) for i in range(n)]
    overhead = costs.post_peak_bytes - stats.post_peak_bytes  # the device's, on each absolute event
    bwd_end = (cal.backward_end_bytes if cal.backward_end_bytes is not None else stats.post_peak_bytes) + overhead
    opt = stats.peak_bytes_by_phase.get("optimizer", stats.post_peak_bytes) + overhead
    rs_end = max(gathered[0] if n else 0, shards[n])
    unsynced_end = bwd_end - rs_end + sum(grads[:n]) - sum(shards[:n])
    head = cal.head_grad_bytes  # in every block's measured backward base, and accumulated in place
    steps = [
        _Shift(start=0, base=[g - sh for g, sh in zip(later_g, later_s, strict=True)], peak=rs_kept, post=unsynced_end),
        _Shift(start=total, base=[-g - head for g in later_g], post=max(bwd_end + grads[n], opt)),
    ]
    if accumulation_steps > 2:
        steps.append(_Shift(start=total, base=[-x - head for x in later_s], peak=rs_kept, post=unsynced_end + grads[n]))
    return steps


def _merged(costs: ChainCosts, steps: Sequence[_Shift]) -> ChainCosts:
    """``costs`` with every event the largest over ``steps``: the start by the largest ``start``,
    block ``i``'s backward base so that start + base is the largest of the steps', its peak so that
    start + base + peak is (a block's backward event adds all three), the peak after the blocks the
    largest ``post``."""
    start = max(s.start for s in steps)
    n = len(costs.options)
    base = [max(s.start + s.base[i] for s in steps) for i in range(n)]
    both = [max(s.start + s.base[i] + (s.peak[i] if s.peak else 0) for s in steps) for i in range(n)]
    post = max(costs.post_peak_bytes if s.post is None else s.post for s in steps)
    return _window_costs(
        costs,
        start=start,
        base=[b - start for b in base],
        peak=[x - b for x, b in zip(both, base, strict=True)],
        post=post,
    )


def _window_costs(
    costs: ChainCosts, *, start: int, base: Sequence[int], peak: Sequence[int] | None = None, post: int | None = None
) -> ChainCosts:
    """``costs`` with ``start`` more bytes from the start, block ``i``'s backward base moved by
    ``base[i]`` and its backward peak by ``peak[i]``, and ``post`` as the peak after the blocks."""
    options = tuple(
        {
            k: replace(
                o, bwd_base_bytes=o.bwd_base_bytes + base[i], bwd_peak_bytes=o.bwd_peak_bytes + (peak[i] if peak else 0)
            )
            for k, o in opts.items()
        }
        for i, opts in enumerate(costs.options)
    )
    return replace(
        costs, options=options, start_bytes=costs.start_bytes + start, pre_peak_bytes=costs.pre_peak_bytes + start,
        post_peak_bytes=costs.post_peak_bytes if post is None else post,
    )  # fmt: skip
