"""Fused activations: each fused kernel against the module's own function, installation and removal,
plans that fuse them, and profiling with them (NOTE [ Fused activations ] in memfit.apply.activations)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations as hf_act

from memfit import StepSpec
from memfit.apply import activations as fa
from memfit.apply import apply_plan, is_applied, plan_applied, remove_plan
from memfit.capture.stats import FusedActivations
from memfit.capture.tracker import MemoryTracker
from memfit.errors import PlanFileError, PlanMismatchError
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile
from memfit.verification.plans import verify
from memfit.workload import mean_loss

GPT2 = "hf:gpt2?num_hidden_layers=3&hidden_size=64&n_inner=256&num_attention_heads=4&vocab_size=512"

pytestmark = pytest.mark.usefixtures("one_thread")


def _mish_python() -> nn.Module:
    m = hf_act.MishActivation()
    m.act = m._mish_python  # the path torch builds without F.mish
    return m


FUSABLE = {
    "NewGELUActivation": hf_act.NewGELUActivation,
    "FastGELUActivation": hf_act.FastGELUActivation,
    "AccurateGELUActivation": hf_act.AccurateGELUActivation,
    "GELUTanh(python)": lambda: hf_act.GELUTanh(use_gelu_tanh_python=True),
    "GELUActivation(python)": lambda: hf_act.GELUActivation(use_gelu_python=True),
    "MishActivation(python)": _mish_python,
}


def _saved_bytes(fn, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for ``fn(x)``'s backward, the input counted once."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


@pytest.mark.parametrize("name", list(FUSABLE))
def test_each_fused_kernel_equals_the_module_and_saves_no_more(name: str) -> None:
    """fp64: output and input gradient equal the module's own; autograd saves no more bytes.
    (FastGELU's constant 0.7978845608 is sqrt(2/pi) to 4e-12 relative: the tolerance is 1e-9, far
    below the 5e-4 by which the erf and tanh GELUs differ.)"""
    m = FUSABLE[name]()
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 257, generator=gen, dtype=torch.float64) * 4).requires_grad_(True)
    g = torch.randn(3, 257, generator=gen, dtype=torch.float64)
    y0 = m(x)
    (g0,) = torch.autograd.grad(y0, x, g)
    own = _saved_bytes(m, x)
    seq = nn.Sequential(m)
    assert fa.install_fused_activations(seq) == 1 and fa.fused_activations_installed(seq)
    y1 = m(x)
    (g1,) = torch.autograd.grad(y1, x, g)
    torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(g1, g0, rtol=1e-9, atol=1e-9)
    assert _saved_bytes(m, x) <= own
    fa.remove_fused_activations(seq)
    assert "forward" not in m.__dict__ and not fa.fused_activations_installed(seq)


def test_gelu_new_saves_only_its_input() -> None:
    """The case that matters (GPT-2): four activation-sized tensors saved become one."""
    m = hf_act.NewGELUActivation()
    x = torch.randn(64, 128, requires_grad=True)
    own = _saved_bytes(m, x)
    fa.install_fused_activations(m)
    assert _saved_bytes(m, x) == x.numel() * 4 < own / 3


def test_only_exact_known_classes_are_fused() -> None:
    class MyGELU(hf_act.NewGELUActivation):  # a subclass may change the function
        pass

    patched = hf_act.NewGELUActivation()
    patched.forward = lambda x: x  # someone else's instance-level forward is left alone
    model = nn.Sequential(
        MyGELU(),
        patched,
        hf_act.GELUTanh(),
        hf_act.GELUActivation(),
        hf_act.QuickGELUActivation(),
        nn.GELU(),
        hf_act.NewGELUActivation(),
    )
    assert list(fa.fusable_activations(model)) == ["6"]
    assert fa.install_fused_activations(model) == 1
    assert fa.install_fused_activations(model) == 0  # idempotent
    fa.remove_fused_activations(model)
    assert patched.forward(torch.ones(1)).item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mismatch_check_catches_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """In bf16 the op-by-op module is the less accurate one (its gradient is 3 % off): the right
    kernel passes; a wrong one (erf for tanh: 5e-4 apart, below bf16's resolution) is still caught
    in fp64."""
    model = nn.Sequential(nn.Linear(4, 4), *(cls() for cls in FUSABLE.values())).to(dtype)
    assert fa.activation_mismatch(model) is None
    monkeypatch.setattr(fa, "_gelu_tanh", F.gelu)  # the erf GELU differs from the tanh one by ~1e-3
    why = fa.activation_mismatch(model)
    assert why is not None and "NewGELUActivation" in why


def test_plan_fuses_activations_trains_equal_and_holds_fewer_bytes() -> None:
    """A plan with activations 'fused' (every block kept): fp64 gradients equal the unmodified
    model's, the measured activation peak is lower, and removing the plan restores the modules."""
    wl = load_workload(GPT2, seq_len=64, dtype=torch.float64)
    plan = policy_plan(wl.model, "none").with_(activations="fused")
    res = verify(wl, plan, step=StepSpec(batch_size=2, repeats=0))
    assert res.ok, res
    assert not fa.fused_activations_installed(wl.model)

    torch.manual_seed(0)
    batch = wl.make_batch(2)
    peaks = []
    for p in (policy_plan(wl.model, "none"), plan):
        with plan_applied(wl.model, p):
            tracker = MemoryTracker(device="cpu").track(wl.model, None, batch)
            with tracker:
                mean_loss(wl.loss_fn(wl.model, batch)).backward()
            wl.model.zero_grad(set_to_none=True)
        peaks.append(tracker.peak_bytes)
    # 3 blocks x (2 x 64 tokens x 256 wide) x 8 bytes x 3 tensors fewer (tanh, x**3, products)
    assert peaks[0] - peaks[1] >= 3 * 2 * 64 * 256 * 8 * 3


@pytest.mark.parametrize(
    "spec",
    [
        "hf:gptj?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&vocab_size=256&rotary_dim=8",
        "hf:bert?hidden_act=gelu_fast&num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=2&vocab_size=256",
    ],
)
def test_other_architectures_fuse_and_verify(spec: str) -> None:
    """Architectures no issue names: GPT-J (gelu_new) and BERT told to use gelu_fast."""
    wl = load_workload(spec, seq_len=16, dtype=torch.float64)
    assert fa.fusable_activations(wl.model)
    stats = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep", "recompute"))
    assert stats.activations == "fused"
    plan = plan_for_budget(wl, stats.measured_peak_bytes_by_option["recompute"] * 2, stats=stats).plan
    assert plan.activations == "fused"
    assert verify(wl, plan.with_(fingerprint={}), step=StepSpec(batch_size=2, repeats=0)).ok


def test_plan_file_round_trip_and_bad_activations() -> None:
    wl = load_workload(GPT2, seq_len=16)
    plan = policy_plan(wl.model, "all").with_(activations="fused")
    assert Plan.from_dict(plan.to_dict()) == plan
    old = plan.to_dict()
    del old["activations"]  # files written before activation options: the model's own
    assert Plan.from_dict(old).activations is None
    with pytest.raises(PlanFileError, match='"activations"'):
        Plan.from_dict({**plan.to_dict(), "activations": "compiled"})


def test_plan_with_fused_activations_on_a_model_without_them_is_refused_and_nothing_applied() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    plan = policy_plan(model, "all").with_(activations="fused")
    with pytest.raises(PlanMismatchError, match="no activation module with a fused kernel"):
        apply_plan(model, plan)
    assert not is_applied(model) and all("forward" not in m.__dict__ for m in model.modules())


def test_profile_fuses_plans_carry_it_and_the_model_is_restored() -> None:
    wl = load_workload(GPT2, seq_len=64)
    stats = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep", "recompute"), heads=False)
    assert stats.activations == "fused"
    assert stats.calibration.fused_activations == FusedActivations(modules=3, classes=("NewGELUActivation",))
    assert not fa.fused_activations_installed(wl.model)
    plain = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep",), heads=False, activations=False)
    assert plain.activations is None and stats.peak_bytes < plain.peak_bytes
    res = plan_for_budget(wl, stats.peak_bytes * 2, stats=stats)
    assert res.plan.activations == "fused"
    # a copy of the model with the plan applied trains (the fused forwards are plain functions)
    with plan_applied(wl.model, res.plan):
        clone = copy.deepcopy(wl.model)
    torch.manual_seed(0)
    mean_loss(wl.loss_fn(clone, wl.make_batch(2))).backward()
    remove_plan(clone)


def test_profile_drops_fusion_when_the_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa, "_gelu_tanh", F.gelu)
    wl = load_workload(GPT2, seq_len=32)
    stats = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep",), heads=False)
    assert stats.activations is None
    assert "NewGELUActivation" in stats.calibration.dropped_options["activations:fused"]
