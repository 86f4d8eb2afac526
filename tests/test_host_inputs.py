"""Checkpoint inputs held on the host (memfit.apply.host_inputs): gradients equal the unmodified
model's, the kept inputs leave the device count, the prefetch runs one block ahead, the planner prices
the option and chooses it when the budget needs it, and the CPU profile refuses it with the reason.

The CUDA path (pinned buffers, side stream, events) runs on a lent GPU: the ``gpu`` test below and
``benchmarks/gpu_check.py`` (its ``host_inputs`` case).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_engine import assert_same_training
from torch import nn

from memfit import StepSpec
from memfit.apply.engine import plan_applied
from memfit.apply.host_inputs import HostInputs
from memfit.capture.stats import OptionStats, Stats
from memfit.capture.step import make_optimizer, measure_step, warm_up
from memfit.errors import BudgetInfeasibleError, PlanFileError
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, block_options, predict
from memfit.plan.policies import policy_plan
from memfit.plan.solve import min_budget, solve
from memfit.plan.types import BlockDecision, Option, Plan, Segment
from memfit.profiling.blocks import profile
from memfit.verification.plans import verify

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = (
    "hf:llama?num_hidden_layers=4&hidden_size=64&intermediate_size=128&num_attention_heads=4"
    "&num_key_value_heads=2&vocab_size=256"
)  # at 2 x 256 tokens a layer's input is 128 KiB, over the 64 KiB below which inputs stay


def _held(plan: Plan) -> Plan:
    return plan.with_(
        blocks=tuple(dataclasses.replace(b, host_input=b.option is Option.RECOMPUTE) for b in plan.blocks)
    )


def test_held_inputs_train_the_same() -> None:
    wl = load_workload(LLAMA, seq_len=256)
    assert_same_training(wl, _held(policy_plan(wl.model, "all")), batch_size=2)


def test_held_inputs_leave_the_device_count_and_gradients_are_equal() -> None:
    """verify: gradients equal the unmodified model's (the same ops on the same bytes brought back);
    the tracker: by the forward's end the four layers' kept inputs (128 KiB each) are off the count."""
    wl = load_workload(LLAMA, seq_len=256)
    plan = policy_plan(wl.model, "all")
    held = verify(wl, _held(plan), step=StepSpec(batch_size=2, repeats=0))
    assert held.ok and held.max_grad_rel_err == 0.0, held.to_dict()
    batch = wl.make_batch(2)

    def forward_peak(p: Plan) -> int:
        with plan_applied(wl.model, p):
            opt = make_optimizer(wl.model)
            warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
            return measure_step(wl.model, batch, wl.loss_fn, opt, seed=2).peak_bytes_by_phase["forward"]

    inputs = 4 * 2 * 256 * 64 * 4
    assert forward_peak(plan) - forward_peak(_held(plan)) >= 0.95 * inputs


def _t(n_bytes: int, fill: float) -> torch.Tensor:
    return torch.full((n_bytes // 4,), fill)


def test_pack_and_unpack_prefetch_one_block_ahead() -> None:
    """Inputs are packed in forward order; unpacking one (its block's recompute starts) starts the
    copy back of the one before it; small tensors and parameters stay as they are."""
    state = HostInputs(min_bytes=1024)
    a, b, c = _t(4096, 1.0), _t(4096, 2.0), _t(4096, 3.0)
    pa, pb, pc = state.pack(a), state.pack(b), state.pack(c)
    assert state.waiting() == 3 and state.prefetched() == 0
    small, param = _t(512, 4.0), nn.Parameter(_t(4096, 5.0))
    assert state.pack(small) is small and state.pack(param) is param
    got_c = state.unpack(pc)
    assert torch.equal(got_c, c) and got_c.data_ptr() != c.data_ptr()  # a copy back, not the original
    assert state.waiting() == 2 and state.prefetched() == 1  # b is on its way
    got_b = state.unpack(pb)
    assert torch.equal(got_b, b) and state.waiting() == 1 and state.prefetched() == 1  # now a
    assert torch.equal(state.unpack(pa), a) and state.waiting() == 0


def test_a_view_comes_back_with_its_shape_and_offset() -> None:
    state = HostInputs(min_bytes=0)
    base = torch.arange(48.0).reshape(4, 12)
    view = base[1:, 2:8]
    assert torch.equal(state.unpack(state.pack(view)), view)


def test_host_input_plan_json_and_refusals() -> None:
    blocks = (
        BlockDecision(name="h.0", option=Option.RECOMPUTE, host_input=True),
        BlockDecision(name="h.1", option=Option.RECOMPUTE),
    )
    plan = Plan(policy="memfit", chain_path="h", blocks=blocks)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    inside = plan.with_(segments=(Segment(start=0, stop=2),)).to_dict()
    with pytest.raises(PlanFileError, match="'host_input' inside segment"):
        Plan.from_dict(inside)


def test_the_cpu_profile_does_not_offer_it_and_says_why() -> None:
    wl = load_workload(LLAMA, seq_len=32)
    stats = profile(wl, step=StepSpec(batch_size=1, repeats=1), options=("keep", "recompute"), tiling=False)
    assert "recompute:host" not in stats.blocks[0].options
    assert "CPU" in stats.calibration.dropped_options["recompute:host"]


# --- planning: the cost model prices it, the solver chooses it -----------------------------------


def _with_host_option(stats: Stats, transfer_s: float) -> Stats:
    """The stats with a ``recompute:host`` option as a GPU profile measures it: the recompute's bytes
    without the kept input (it waits on the host), its seconds plus the copies both ways."""
    blocks = []
    for b in stats.blocks:
        rec = b.options["recompute"]
        host = dataclasses.replace(rec, retained_bytes=rec.retained_bytes - b.input_bytes, rerun_s=b.fwd_s + transfer_s)
        blocks.append(dataclasses.replace(b, options={**b.options, "recompute:host": host}))
    return dataclasses.replace(stats, blocks=tuple(blocks))


@pytest.fixture(scope="module")
def llama_stats() -> Stats:
    wl = load_workload(LLAMA, seq_len=256)
    return profile(
        wl, step=StepSpec(batch_size=2, repeats=1), options=("keep", "recompute"), tiling=False, activations=False
    )


def test_the_planner_holds_inputs_on_the_host_when_the_budget_needs_it(llama_stats: Stats) -> None:
    stats = _with_host_option(llama_stats, transfer_s=1e-3)
    assert isinstance(stats.blocks[0].options["recompute:host"], OptionStats)
    costs = ChainCosts.from_stats(stats)
    plain = costs.restricted(("keep", "recompute"))
    need_plain, _ = min_budget(plain)
    need, low = min_budget(costs)
    assert need < need_plain
    assert "recompute:host" in low.options
    budget = (need + need_plain) // 2
    with pytest.raises(BudgetInfeasibleError):
        solve(plain, budget)
    sol = solve(costs, budget)
    assert "recompute:host" in sol.options and sol.prediction.peak_with_margin_bytes <= budget
    # A held input costs its transfer: with no measured step to scale it (scale 1), the prediction
    # charges each held block its recompute's forward and the copies both ways.
    all_rec = policy_plan_for(costs, "recompute")
    all_held = policy_plan_for(costs, "recompute:host")
    want = costs.base_step_s + sum(b.fwd_s + 1e-3 for b in stats.blocks)
    assert predict(costs, all_held).step_s == pytest.approx(want, rel=1e-9)
    assert predict(costs, all_held).peak_bytes < predict(costs, all_rec).peak_bytes
    assert block_options(all_held, costs) == ["recompute:host"] * len(costs)
    assert all(d.host_input and d.option is Option.RECOMPUTE for d in all_held.blocks)


def policy_plan_for(costs: ChainCosts, option: str) -> Plan:
    return Plan(policy=option, chain_path="", blocks=tuple(costs.decision(i, option) for i in range(len(costs))))


def test_without_a_measured_option_the_solver_never_holds_inputs(llama_stats: Stats) -> None:
    sol = solve(ChainCosts.from_stats(llama_stats), llama_stats.peak_bytes)
    assert not any(o.endswith(":host") for o in sol.options)


@pytest.mark.gpu
def test_cuda_held_inputs_measured_planned_and_verified() -> None:
    wl = load_workload(LLAMA.replace("hidden_size=64", "hidden_size=256"), seq_len=1024)
    wl.model.cuda()
    step = StepSpec(batch_size=2, repeats=1, device="cuda")
    stats = profile(wl, step=step, options=("keep", "recompute"))
    assert "recompute:host" in stats.blocks[0].options
    held = verify(wl, _held(policy_plan(wl.model, "all")), step=StepSpec(batch_size=2, repeats=0, device="cuda"))
    rec = verify(wl, policy_plan(wl.model, "all"), step=StepSpec(batch_size=2, repeats=0, device="cuda"))
    assert held.ok, held.to_dict()
    assert held.measured_peak_bytes < rec.measured_peak_bytes
