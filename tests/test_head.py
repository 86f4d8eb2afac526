"""The chunked head: fused linear cross-entropy, its installation on HF causal LMs, calibration,
planning and verification (NOTE [ Chunked head ] in memfit.apply.head)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit import StepSpec
from memfit.apply import apply_plan, plan_applied, remove_plan
from memfit.apply.head import (
    fused_linear_cross_entropy,
    head_installed,
    head_mismatch,
    head_unsupported_reason,
    install_chunked_head,
    remove_chunked_head,
)
from memfit.capture.tracker import MemoryTracker
from memfit.errors import PlanFileError, PlanMismatchError
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.solve import plan_from_solution, solve
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile
from memfit.verification.plans import verify
from memfit.workload import mean_loss

HF_TINY = "num_hidden_layers=3&hidden_size=64&intermediate_size=128&num_attention_heads=4&vocab_size=512"
GPT2 = f"hf:gpt2?{HF_TINY.replace('intermediate_size', 'n_inner')}"

pytestmark = pytest.mark.usefixtures("one_thread")


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    h=st.integers(1, 12),
    v=st.integers(2, 50),
    rows=st.integers(1, 45),
    bias=st.booleans(),
    ignored=st.floats(0, 1),
    scale=st.floats(-3, 3),
    seed=st.integers(0, 2**16),
)
def test_fused_loss_and_gradients_equal_the_plain_head(
    n: int, h: int, v: int, rows: int, bias: bool, ignored: float, scale: float, seed: int
) -> None:
    """fp64: loss and every gradient equal F.cross_entropy(F.linear(...)) for any chunking, rows
    without a target, a bias or not, and an upstream gradient (the normaliser) of any sign."""
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = -100
    grads = []
    for fused in (False, True):
        xs = [x.clone().requires_grad_(True) for x in (hid, w, *([b] if bias else []))]
        bb = xs[2] if bias else None
        if fused:
            loss = fused_linear_cross_entropy(xs[0], xs[1], t, bb, rows=rows)
        else:
            loss = F.cross_entropy(F.linear(xs[0], xs[1], bb), t, ignore_index=-100, reduction="sum")
        (loss * scale).backward()
        grads.append((loss.detach(), [x.grad for x in xs]))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-12)
    for a, c in zip(g0, g1, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-12)


def test_fused_loss_half_precision_is_close_and_accumulates_in_float32() -> None:
    torch.manual_seed(0)
    hid = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(300, 32, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 300, (64,))
    loss = fused_linear_cross_entropy(hid, w, t, rows=16)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(F.linear(hid.float(), w.float()), t, reduction="sum")
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    loss.backward()
    assert hid.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_fused_loss_refuses_wrong_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(N, H\)"):
        fused_linear_cross_entropy(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(6, dtype=torch.long))


def test_installed_head_defers_logits_only_for_training_losses_and_is_removed_cleanly() -> None:
    wl = load_workload(GPT2)
    model = wl.model.eval()  # no dropout: calls are comparable
    loss_fn_before = model.__dict__.get("_loss_function")
    torch.manual_seed(0)
    batch = wl.make_batch(2)
    plain_logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    install_chunked_head(model)
    assert head_installed(model)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
    assert out.logits.device.type == "meta" and out.logits.shape == plain_logits.shape  # never materialised
    assert out.loss.device.type == "cpu" and out.loss.requires_grad
    with torch.no_grad():  # evaluation: the model's own head
        ev = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
    torch.testing.assert_close(ev.loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
    no_labels = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(no_labels, plain_logits)
    remove_chunked_head(model)
    assert not head_installed(model)
    assert "forward" not in model.__dict__ and "forward" not in model.get_output_embeddings().__dict__
    assert model.__dict__.get("_loss_function") is loss_fn_before


def test_deepcopy_of_a_model_with_the_head_trains_the_copy() -> None:
    wl = load_workload(GPT2)
    install_chunked_head(wl.model)
    twin = copy.deepcopy(wl.model)
    torch.manual_seed(0)
    batch = wl.make_batch(2)
    mean_loss(wl.loss_fn(twin, batch)).backward()
    assert all(p.grad is None for p in wl.model.parameters())
    assert twin.get_output_embeddings().weight.grad is not None
    remove_chunked_head(twin)
    assert head_installed(wl.model) and not head_installed(twin)


def test_unsupported_models_are_refused_with_the_reason_and_nothing_applied() -> None:
    demo = load_workload("demo?n_layer=2&n_embd=32&seq_len=16").model
    assert "not a transformers causal language model" in head_unsupported_reason(demo)
    bert = load_workload(f"hf:bert?{HF_TINY}").model
    assert head_unsupported_reason(bert) is not None
    llama = load_workload(f"hf:llama?{HF_TINY}").model
    assert head_unsupported_reason(llama) is None
    llama.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in head_unsupported_reason(llama)
    plan = policy_plan(demo, "all").with_(head="chunked")
    with pytest.raises(PlanMismatchError, match="head option 'chunked' cannot be applied"):
        apply_plan(demo, plan)
    assert not any("forward" in m.__dict__ for m in demo.modules())  # nothing half-applied


def test_mismatch_check_catches_a_model_that_changes_its_logits() -> None:
    wl = load_workload(GPT2)
    torch.manual_seed(0)
    batch = wl.make_batch(2)
    assert head_mismatch(wl.model, batch, wl.loss_fn) is None
    handle = wl.model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: out * 0.5)
    try:
        assert "chunked loss" in head_mismatch(wl.model, batch, wl.loss_fn)
    finally:
        handle.remove()
    assert all(p.grad is None for p in wl.model.parameters())


def test_plan_file_round_trip_and_bad_head() -> None:
    wl = load_workload(GPT2)
    plan = policy_plan(wl.model, "all").with_(head="chunked")
    assert Plan.from_dict(plan.to_dict()) == plan
    old = plan.to_dict()
    del old["head"]  # files written before head options: the model's own head
    assert Plan.from_dict(old).head is None
    with pytest.raises(PlanFileError, match='"head"'):
        Plan.from_dict({**plan.to_dict(), "head": "tiled"})


@pytest.mark.parametrize(
    "spec",
    [
        GPT2.replace("vocab_size=512", "vocab_size=4096"),
        pytest.param(f"hf:llama?{HF_TINY.replace('vocab_size=512', 'vocab_size=4096')}", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_profile_calibrates_the_head_and_the_planner_beats_all_at_its_peak(spec: str) -> None:
    """The calibration's prediction equals its measured peak; at the peak of policy 'all' the
    plan uses the chunked head and keeps blocks, measured within the budget; gradients equal.
    (Vocabulary 4096 over width 64: the logits outweigh a block, as in real language models.)"""
    wl = load_workload(spec, seq_len=64)
    stats = profile(wl, step=StepSpec(batch_size=4, repeats=1), options=BASE_OPTIONS)
    assert "chunked" in stats.head_options, stats.calibration
    h = stats.head_options["chunked"]
    assert h.head_peak_bytes < stats.head_peak_bytes
    costs = ChainCosts.from_stats(stats, margin=0.0)
    # Where the model's own head fits, plain training is what runs: a chunked head measured a little
    # "faster" by noise must not replace it (at the no-checkpointing peak, nothing is recomputed).
    roomy_bytes = int(1.05 * stats.measured_peak_bytes_by_option["keep"])
    roomy = plan_from_solution(
        solve(costs, roomy_bytes),
        costs,
        chain_path=stats.chain_path,
        fingerprint=stats.fingerprint,
        budget_bytes=roomy_bytes,
    )
    assert roomy.head is None and roomy.recomputed == (), roomy
    for mode, policy in (("keep", "none"), ("recompute", "all")):  # H is the larger of the two calibrations
        measured = h.measured_peak_bytes_by_option[mode]
        assert (
            measured
            <= predict(costs, policy_plan(wl.model, policy).with_(head="chunked")).peak_bytes
            <= 1.01 * measured
        )
    all_peak = stats.measured_peak_bytes_by_option["recompute"]
    sol = solve(costs, all_peak)
    plan = plan_from_solution(
        sol, costs, chain_path=stats.chain_path, fingerprint=stats.fingerprint, budget_bytes=all_peak
    )
    assert plan.head == "chunked" and len(plan.recomputed) < len(plan.blocks)
    torch.manual_seed(0)
    batch = wl.make_batch(4)
    opt = torch.optim.AdamW(wl.model.parameters())
    with plan_applied(wl.model, plan):
        for _ in range(2):  # the second step holds the optimizer state
            tracker = MemoryTracker(device="cpu").track(wl.model, opt, batch)
            with tracker:
                mean_loss(wl.loss_fn(wl.model, batch)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert tracker.peak_bytes <= all_peak
    assert abs(tracker.peak_bytes - plan.predicted_peak_bytes) <= 0.02 * tracker.peak_bytes
    remove_plan(wl.model)
    res = verify(
        load_workload(spec, seq_len=64, dtype=torch.float64),
        plan.with_(fingerprint={}, predicted_peak_bytes=None),  # gradients in float64; the peak was checked above
        step=StepSpec(batch_size=4, repeats=0),
    )
    assert res.ok, res


def test_keep_head_leaves_the_head_alone() -> None:
    wl = load_workload(GPT2, seq_len=32)
    stats = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep",), heads=False)
    assert stats.head_options == {} and "head:chunked" not in stats.calibration.dropped_options


def test_fused_loss_under_autocast_matches_the_plain_head() -> None:
    """bf16 autocast (CPU): the chunk's projection runs in bf16, the loss and the gradients in
    float32; the loss is the plain head's to bf16 precision and float32 parameters get float32
    gradients."""
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(300, 32, requires_grad=True)
    t = torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fused_linear_cross_entropy(h, w, t, rows=16)
        plain = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")
    assert fused.dtype == torch.float32 and abs(fused.item() - plain.item()) <= 1e-3 * abs(plain.item())
    fused.backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32 and torch.isfinite(h.grad).all()


def test_no_grad_computes_the_loss_only() -> None:
    torch.manual_seed(0)
    h, w, t = (
        torch.randn(50, 8, dtype=torch.float64, requires_grad=True),
        torch.randn(30, 8, dtype=torch.float64),
        torch.randint(0, 30, (50,)),
    )
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, w, t, rows=7)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(h.detach(), w), t, reduction="sum"))
