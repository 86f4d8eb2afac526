"""Offload: gradients equal the unmodified model's, and saved activations leave the device count."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_engine import BUILTIN, assert_same_training, conv_workload, kw_workload
from torch import nn
from torch.testing import assert_close

import memfit.apply.offload as offload_mod
from memfit import StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.capture.step import make_optimizer, measure_step, warm_up
from memfit.capture.tracker import MemoryTracker
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan import BlockDecision, Offload, Option, Plan, policy_plan
from memfit.plan.costmodel import ChainCosts
from memfit.verification.plans import verify

WORKLOADS = {
    "conv-bn": conv_workload,
    "kw-model": kw_workload,
    "demo": lambda: load_workload(BUILTIN["demo"], seq_len=32),
    "hf:gpt2": lambda: load_workload(BUILTIN["hf:gpt2"], seq_len=32),
    "hf:llama": lambda: load_workload(BUILTIN["hf:llama"], seq_len=32),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_offload_trains_the_same(name: str) -> None:
    wl = WORKLOADS[name]()
    assert_same_training(wl, policy_plan(wl.model, Offload()), batch_size=3)


def test_offload_mixed_with_other_actions_trains_the_same() -> None:
    wl = WORKLOADS["hf:gpt2"]()
    acts = [Option.OFFLOAD, Option.RECOMPUTE, Option.KEEP, Option.SELECTIVE]
    base = policy_plan(wl.model, "none")
    blocks = tuple(
        BlockDecision(
            name=b.name, option=acts[i % 4], policy="save_matmuls" if acts[i % 4] is Option.SELECTIVE else None
        )
        for i, b in enumerate(base.blocks)
    )
    assert_same_training(wl, base.with_(blocks=blocks), batch_size=3)


def test_activations_leave_the_tracked_device_and_come_back_for_backward() -> None:
    """The forward ends with far fewer live bytes; the peak drops; gradients are equal (verify)."""
    wl = WORKLOADS["demo"]()

    def forward_end_bytes(plan: Plan) -> int:
        torch.manual_seed(0)
        batch = wl.make_batch(8)
        opt = make_optimizer(wl.model)
        warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
        apply_plan(wl.model, plan)
        try:
            mem = measure_step(wl.model, batch, wl.loss_fn, opt, seed=2, timeline=True)
        finally:
            remove_plan(wl.model)
        ends = [b for _, b, ph in mem.timeline if ph == "forward"]
        return ends[-1] - mem.params_bytes

    keep = forward_end_bytes(policy_plan(wl.model, "none"))
    off = forward_end_bytes(policy_plan(wl.model, Offload()))
    assert off < 0.6 * keep, (off, keep)
    res = verify(wl, policy_plan(wl.model, Offload()), step=StepSpec(batch_size=8, repeats=0))
    assert res.ok and res.measured_peak_bytes < res.baseline_peak_bytes


def test_one_host_copy_per_storage_and_views_rebuilt(monkeypatch) -> None:
    """A block saving three views of one storage copies that storage once."""

    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 3 * 64)

        def forward(self, x):
            q, k, v = self.lin(x).chunk(3, dim=-1)  # three views of one (B, 192) storage
            return (q * k).tanh() * v.transpose(0, 1).transpose(0, 1)

    torch.manual_seed(0)
    model = nn.Sequential(QKV(), QKV())
    ref = copy.deepcopy(model)
    copies: list[int] = []
    real = offload_mod._copy_to_host

    def spy(st, device, state):
        copies.append(st.nbytes())
        return real(st, device, state)

    monkeypatch.setattr(offload_mod, "_copy_to_host", spy)
    x = torch.randn(512, 64, requires_grad=True)
    apply_plan(model, policy_plan(model, Offload()))
    model(x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    ref(x).sum().backward()
    assert_close(g, x.grad, rtol=0, atol=0)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, r.grad, rtol=0, atol=0)
    # per block: the linear's output (3 views, one storage), q*k, its tanh; x and params stay
    qkv = 512 * 192 * 4
    assert copies.count(qkv) == 2, copies


def test_small_tensors_stay_on_the_device(monkeypatch) -> None:
    copies: list[int] = []
    monkeypatch.setattr(offload_mod, "_copy_to_host", lambda st, *a: copies.append(st.nbytes()))
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, 1))
    apply_plan(model, policy_plan(model, Offload()))
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()  # every saved tensor is under DEFAULT_MIN_BYTES: nothing moves
    assert copies == [] and x.grad is not None


def test_offload_plan_roundtrips_and_the_cpu_planner_never_offloads(tmp_path: Path) -> None:
    wl = WORKLOADS["demo"]()
    plan = policy_plan(wl.model, Offload())
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    from memfit.profiling.blocks import profile

    stats = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep", "recompute", "offload"))
    assert "offload" not in stats.blocks[0].options
    assert "CPU" in stats.calibration.dropped_options["offload"]
    res = plan_for_budget(wl, int(0.8 * stats.peak_bytes), stats=stats)
    assert res.plan.count(Option.OFFLOAD) == 0
    assert all("offload" not in o for o in ChainCosts.from_stats(stats).options)


@pytest.mark.gpu
@pytest.mark.gpu
def test_cuda_offload_same_gradients_and_lower_allocator_peak() -> None:
    wl = load_workload("hf:gpt2?num_hidden_layers=4&hidden_size=256&num_attention_heads=4", seq_len=256)
    wl.model.cuda()
    res = verify(wl, policy_plan(wl.model, Offload()), step=StepSpec(batch_size=4, repeats=0, device="cuda"))
    assert res.ok, res
    torch.manual_seed(0)
    batch = {k: v.cuda() for k, v in wl.make_batch(4).items()}

    def peak(plan: Plan) -> int:
        apply_plan(wl.model, plan)
        try:
            wl.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss, n = wl.loss_fn(wl.model, batch)
            (loss / n).backward()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        finally:
            remove_plan(wl.model)

    assert peak(policy_plan(wl.model, Offload())) < 0.8 * peak(policy_plan(wl.model, "none"))


def test_tracker_does_not_count_host_copies_on_cpu() -> None:
    """What the CPU test relies on (NOTE [ Offload ]): host copies are invisible to the tracker."""

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())

    torch.manual_seed(0)
    model = nn.Sequential(block(), block())
    x = torch.randn(256, 256)
    live = {}
    for name, plan in (("keep", policy_plan(model, "none")), ("offload", policy_plan(model, Offload()))):
        apply_plan(model, plan)
        with MemoryTracker(device="cpu") as tr:
            y = model(x)
            live[name] = tr.current_bytes
        y.sum().backward()
        remove_plan(model)
        del y
    # keep: both tanh outputs of both blocks (4 x 256 KiB); offload: each block's inner tanh output
    # moved off; block 0's output stays (block 1 keeps its input) and y stays (the caller holds it).
    mat = 256 * 256 * 4
    assert live["keep"] == 4 * mat
    assert live["offload"] == 2 * mat
