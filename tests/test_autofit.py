"""Auto-fit: micro-batch x accumulation x plan, predicted then measured."""

from __future__ import annotations

import pytest
import torch
from test_engine import kw_workload
from tiny_models import profiler_step_peak_bytes

from memfit import StepSpec
from memfit.accumulate import Accumulator
from memfit.apply import apply_plan
from memfit.errors import BudgetInfeasibleError
from memfit.fitting import autofit, interpolate_stats, micro_batch_options, stats_at
from memfit.models.registry import load_workload
from memfit.plan import Plan
from memfit.plan.options import BASE_OPTIONS
from memfit.profiling.blocks import profile
from memfit.workload import iter_tensors

DEMO_SMALL = "demo?n_layer=4&n_embd=32&seq_len=32"


@pytest.mark.parametrize("g", [1, 7, 16, 64])
def test_micro_batch_options_cover_the_global_batch(g: int) -> None:
    opts = micro_batch_options(g)
    assert len({b for b, _ in opts}) == len(opts)
    assert {b for b, _ in opts} >= {1, g}
    for b, sizes in opts:
        assert sum(sizes) == g and max(sizes) == b and all(s > 0 for s in sizes)
        assert len(sizes) == -(-g // b)


def test_interpolation_reproduces_measured_points_and_is_linear() -> None:
    wl = kw_workload()
    s2 = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep", "recompute"))
    s6 = profile(wl, step=StepSpec(batch_size=6, repeats=1), options=("keep", "recompute"))
    at2 = interpolate_stats(s2, s6, 2)
    assert at2.blocks == s2.blocks and at2.peak_bytes == s2.peak_bytes
    assert [b.saved_bytes for b in interpolate_stats(s2, s6, 6).blocks] == [b.saved_bytes for b in s6.blocks]
    s4 = profile(wl, step=StepSpec(batch_size=4, repeats=1), options=("keep", "recompute"))
    mid = interpolate_stats(s2, s6, 4)
    assert abs(mid.peak_bytes - s4.peak_bytes) <= 0.02 * s4.peak_bytes
    assert interpolate_stats(s2, s6, 100).step_s >= 0
    # Piecewise over three profiles: measured sizes as measured, others from the two around them
    # (outside: the nearest two), whatever order the profiles come in.
    three = [s6, s2, s4]
    assert stats_at(three, 4) is s4
    assert stats_at(three, 5) == interpolate_stats(s4, s6, 5)
    assert stats_at(three, 3) == interpolate_stats(s2, s4, 3)
    assert stats_at(three, 1) == interpolate_stats(s2, s4, 1) and stats_at(three, 9) == interpolate_stats(s4, s6, 9)


def profiler_window_peak(spec: str, plan: Plan, micro_batch: int, global_batch: int) -> int:
    """Whole-window peak of a fit's choice, measured without memfit's tracker or fit code: a fresh
    model (same weights) with the plan applied runs a window of accumulation; the torch profiler's
    allocations during the second window (the optimizer state exists then) are added to the bytes
    live before it (parameters, gradients, optimizer state, batch)."""
    wl = load_workload(spec)
    apply_plan(wl.model, plan)
    opt = torch.optim.AdamW([p for p in wl.model.parameters() if p.requires_grad], lr=1e-6)
    torch.manual_seed(0)
    batch = wl.make_batch(global_batch)
    acc = Accumulator(wl.model, opt, micro_batch=micro_batch)
    acc.step(batch, wl.loss_fn, count_fn=wl.count_fn)
    live = [
        *wl.model.parameters(),
        *iter_tensors(batch),
        *(p.grad for p in wl.model.parameters() if p.grad is not None),
    ]
    live += [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    return profiler_step_peak_bytes(lambda: acc.step(batch, wl.loss_fn, count_fn=wl.count_fn), live)


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_fit_measured_peak_within_budget_and_close_to_prediction() -> None:
    """The fit's choice, run again by the profiler (not by the fit's own measuring), stays within
    the budget and agrees with the fit's measurement and prediction."""
    wl = load_workload(DEMO_SMALL)
    full = profile(wl, step=StepSpec(batch_size=16, repeats=1), options=("keep",)).peak_bytes
    budget = int(full * 0.6)
    res = autofit(wl, budget, 16, step=StepSpec(repeats=1), options=BASE_OPTIONS)
    assert res.micro_batch * (res.accumulation_steps - 1) < 16 <= res.micro_batch * res.accumulation_steps
    peak = profiler_window_peak(DEMO_SMALL, res.plan, res.micro_batch, 16)
    assert peak <= budget < full
    assert res.measured_peak_bytes is not None and abs(res.measured_peak_bytes - peak) <= 0.02 * peak
    assert abs(res.predicted_peak_bytes - peak) <= 0.10 * peak


def test_fit_infeasible_budget_says_the_minimum() -> None:
    wl = load_workload(DEMO_SMALL)
    with pytest.raises(BudgetInfeasibleError, match="micro-batch of 1"):
        autofit(wl, 10_000, 8, step=StepSpec(repeats=1), measure=False, options=BASE_OPTIONS)


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_resolve_replans_from_the_profiles_without_running_the_model() -> None:
    """A replan re-solves the fit's profiles: no forward runs, the tighter budget is respected by
    the prediction and by a measured window, and an impossible budget says the minimum."""
    wl = load_workload(DEMO_SMALL)
    full = profile(wl, step=StepSpec(batch_size=16, repeats=1), options=("keep",)).peak_bytes
    res = autofit(wl, int(full * 0.8), 16, step=StepSpec(repeats=1), options=BASE_OPTIONS, measure=False)
    assert sorted(res.profiles) == list(res.profiled_batch_sizes) and len(res.later_grads_bytes) == 4
    forwards = []
    handle = wl.model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        same = res.resolve(res.budget_bytes)
        # The fit's choice follows measured times (a loaded machine may pick a small micro-batch
        # already): the tightest of these budgets that some candidate still meets.
        for factor in (0.7, 0.8, 0.9, 0.95):
            tight_budget = int(res.predicted_peak_bytes * factor)
            try:
                tight = res.resolve(tight_budget, max_micro_batch=res.micro_batch)
                break
            except BudgetInfeasibleError:
                continue
        else:
            pytest.fail(
                f"no replan fits 95 % of the fit's {res.predicted_peak_bytes} B (micro-batch {res.micro_batch})"
            )
        with pytest.raises(BudgetInfeasibleError, match="micro-batch of 1"):
            res.resolve(10_000)
    finally:
        handle.remove()
    assert forwards == []
    assert (same.micro_batch, same.plan.blocks) == (res.micro_batch, res.plan.blocks)
    assert same.predicted_peak_bytes == res.predicted_peak_bytes
    assert tight.micro_batch <= res.micro_batch and tight.predicted_peak_bytes <= tight_budget
    assert tight.measured_peak_bytes is None and tight.resolved_from_budget_bytes == res.budget_bytes
    # `memfit fit --json` keys after the profiled sizes (DESIGN's contract, as before FitResult was typed)
    assert list(res.to_dict())[-2:] == ["profiled_batch_sizes", "margin"] and res.to_dict()["margin"] == 0.02
    assert list(tight.to_dict())[-2:] == ["margin", "resolved_from_budget_bytes"]
    assert tight.to_dict()["resolved_from_budget_bytes"] == res.budget_bytes
    assert tight.predicted_peak_bytes < res.predicted_peak_bytes
    peak = profiler_window_peak(DEMO_SMALL, tight.plan, tight.micro_batch, 16)  # the replan, run
    assert peak <= tight_budget and abs(tight.predicted_peak_bytes - peak) <= 0.10 * peak


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_interpolation_moves_the_chunked_head_with_the_batch() -> None:
    """A head option's peaks are interpolated like the model's own head's (they were the smaller
    size's, i.e. low, at every size between): checked against a profile measured at the middle size.
    A narrow GPT-2 with a wide vocabulary at 32 tokens: the head dominates and grows with the batch,
    and its three profiles (keep and recompute, heads calibrated) take an eighth of the time of a
    2048-token vocabulary at the default 256 tokens with every selective option."""
    wl = load_workload("hf:gpt2?n_layer=2&n_embd=16&n_head=2&vocab_size=4096&seq_len=32")
    s2, s4, s6 = (
        profile(wl, step=StepSpec(batch_size=b, repeats=1), options=BASE_OPTIONS, activations=False) for b in (2, 4, 6)
    )
    assert "chunked" in s4.head_options
    lo, mid, measured = (
        s2.head_options["chunked"],
        interpolate_stats(s2, s6, 4).head_options["chunked"],
        s4.head_options["chunked"],
    )
    assert lo.head_peak_bytes != measured.head_peak_bytes
    assert abs(mid.head_peak_bytes - measured.head_peak_bytes) <= 0.01 * measured.head_peak_bytes
    for mode, v in measured.head_peak_bytes_by_option.items():
        assert abs(mid.head_peak_bytes_by_option[mode] - v) <= 0.01 * v
    assert abs(mid.measured_peak_bytes - measured.measured_peak_bytes) <= 0.02 * measured.measured_peak_bytes
