"""Auto-fit where only one micro-batch can be profiled within the budget (NOTE [ Bounded measurement ]
in memfit.fitting.bounded, step 2): larger micro-batches are scaled on the line through the one
profile and the model states (:func:`memfit.fitting.bounded.states_point`), offered where their plan
fits (the chosen one's window is then measured under the guard, as every candidate's).

References: profiles made at the larger micro-batches (the scaled needs must not be below theirs).
The gloo ranks' measured windows (tests/test_parallel_window.py) check predictions from two profiles
to 3 %; a line from one profile errs high by more, so they are not run on scaled candidates."""

from __future__ import annotations

import pytest
import torch

from memfit import StepSpec
from memfit.fitting import autofit
from memfit.fitting.bounded import states_bytes, states_point
from memfit.fitting.candidates import accumulation_costs, gradient_bytes, stats_at
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import Parallel, ParallelKind
from memfit.plan.solve import min_budget
from memfit.profiling.blocks import profile

SPEC = "demo?n_layer=4&n_embd=63&n_head=3&dropout=0&seq_len=32"


@pytest.fixture(scope="module")
def workload():
    torch.set_num_threads(1)
    return load_workload(SPEC, dtype=torch.float64)


@pytest.fixture(scope="module")
def profiles(workload):
    return {
        b: profile(
            workload, step=StepSpec(batch_size=b, repeats=1), options=BASE_OPTIONS, heads=False, activations=False
        )
        for b in (1, 2, 4)
    }


def _need(st, k: int, grads: int, later: list[int]) -> int:
    costs = ChainCosts.from_stats(st, margin=0.02)
    if k > 1:
        costs = accumulation_costs(costs, grads_bytes=grads, later_grads_bytes=later)
    return min_budget(costs)[0]


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_scaled_needs_are_never_below_the_profiled_ones(workload, profiles) -> None:
    grads, later = gradient_bytes(workload.model, workload.blocks)
    zero = states_point(profiles[1], later)
    assert zero.batch_size == 0 and states_bytes(zero) == states_bytes(profiles[1])
    for b in (2, 4):
        for k in (1, 3):
            scaled = _need(stats_at([zero, profiles[1]], b), k, grads, later)
            profiled = _need(profiles[b], k, grads, later)
            assert scaled >= profiled, (b, k, scaled, profiled)
            assert scaled < 1.2 * profiled, (b, k, scaled, profiled)  # and not so far above that nothing fits


def test_a_ddp_rank_at_11_mib_is_offered_micro_batches_above_1_with_recompute(workload) -> None:
    """The case auto-fit left out: a DDP rank of 12 samples at 11 MiB, whose micro-batch 2 and 4
    profiles (every block kept) are over the budget, was offered 1 x 12 only."""
    par = Parallel(kind=ParallelKind.DDP, world_size=2, bucket_cap_bytes=2**18)
    res = autofit(
        workload, 11 * 2**20, 12, parallel=par, measure=False, heads=False, activations=False,
        step=StepSpec(repeats=1), max_micro_batch=6,
    )  # fmt: skip
    assert res.profiled_batch_sizes == (1,)
    larger = [c for c in res.candidates if c.feasible and c.micro_batch > 1]
    assert larger and any(c.recomputed_blocks for c in larger)
    assert all(c.predicted_peak_bytes * (1 + res.margin) <= res.budget_bytes for c in larger)
    # the result predicts again from the same points (a replan after an OOM resolves on them)
    again = res.resolve(res.budget_bytes, max_micro_batch=6)
    assert [c.micro_batch for c in again.candidates if c.feasible] == [
        c.micro_batch for c in res.candidates if c.feasible
    ]
