"""The checkpointing engine against the unmodified model: gradients, buffers, structure, errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from memfit import MemfitError, PlanMismatchError, StepSpec, UnsupportedModelError
from memfit.apply import apply_plan, is_applied, remove_plan
from memfit.capture.chain import discover_chain, set_blocks
from memfit.models.registry import load_workload
from memfit.plan import Option, Plan, Segment, policy_plan
from memfit.verification.plans import verify
from memfit.workload import Workload, cast_batch, mean_loss

POLICIES = ["none", "all", "every:2", "every:3"]


# --- models ---------------------------------------------------------------------------------------


def conv_bn_chain(n: int = 6) -> nn.Sequential:
    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(), nn.Dropout2d(0.2))

    chans = [3, 8, 8, 16, 16, 16, 16, 16, 16][: n + 1]
    return nn.Sequential(
        *[block(a, b) for a, b in zip(chans, chans[1:], strict=False)],
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(chans[n], 10)),
    )


class KwBlock(nn.Module):
    """A block with extra positional and keyword arguments and a tuple output (as HF layers)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, mask, *, pos: tuple[torch.Tensor, torch.Tensor], scale: float = 1.0):
        cos, sin = pos
        h = self.drop(self.fc(self.ln(x) * cos + sin)) * mask[..., None] * scale
        return (x + h, h.detach().sum())


class KwModel(nn.Module):
    def __init__(self, d: int = 16, n: int = 5) -> None:
        super().__init__()
        self.emb = nn.Linear(d, d)
        self.layers = nn.ModuleList(KwBlock(d) for _ in range(n))
        self.register_buffer("freq", torch.linspace(0.1, 1.0, d))

    def forward(self, x, mask):
        h = self.emb(x)
        pos = (torch.cos(self.freq), torch.sin(self.freq))
        for layer in self.layers:
            h, _aux = layer(h, mask, pos=pos, scale=0.5)
        return h


def workload_of(model: nn.Module, make_batch, loss_fn, name: str = "test") -> Workload:
    return Workload(name=name, model=model, make_batch=make_batch, loss_fn=loss_fn)


def conv_workload() -> Workload:
    torch.manual_seed(0)
    return workload_of(
        conv_bn_chain(),
        lambda b: (torch.randn(b, 3, 12, 12), torch.randint(0, 10, (b,))),
        lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        "conv-bn",
    )


def kw_workload() -> Workload:
    torch.manual_seed(0)
    return workload_of(
        KwModel(),
        lambda b: {"x": torch.randn(b, 7, 16), "mask": (torch.rand(b, 7) > 0.2).float()},
        lambda m, b: m(b["x"], b["mask"]).pow(2).mean(),
        "kw-model",
    )


def step_grads(model: nn.Module, batch, loss_fn, seed: int = 3) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    mean_loss(loss_fn(model, batch)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_training(wl: Workload, plan: Plan, batch_size: int = 4) -> None:
    """fp64: planned model == unmodified model in gradients and buffers after one step."""
    model = wl.model.double()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    batch = cast_batch(wl.make_batch(batch_size), dtype=torch.float64)
    apply_plan(model, plan)
    try:
        g = step_grads(model, batch, wl.loss_fn)
    finally:
        remove_plan(model)
    g_ref = step_grads(ref, batch, wl.loss_fn)
    assert g.keys() == g_ref.keys() and g
    for n in g:
        # atol: 1e-12 of the tensor's largest gradient. A transformers layer recomputed without its
        # key/value cache (as HF's checkpointing runs it) rounds an element near zero differently in
        # the last bits (5e-19 absolute) from the unmodified model that fills its cache.
        atol = 1e-12 * float(g_ref[n].abs().max())
        assert_close(g[n], g_ref[n], rtol=1e-12, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
    for (n, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.equal(b, b_ref), n


# --- gradients and buffers --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [*POLICIES, "sqrt"])
def test_conv_bn_dropout_chain(policy: str) -> None:
    wl = conv_workload()
    assert_same_training(wl, policy_plan(wl.model, policy))


@pytest.mark.parametrize("policy", POLICIES)
def test_modulelist_blocks_with_args_kwargs_and_tuple_outputs(policy: str) -> None:
    wl = kw_workload()
    assert_same_training(wl, policy_plan(wl.model, policy))


def test_nested_segments_and_recomputed_blocks_inside() -> None:
    wl = conv_workload()
    base = policy_plan(wl.model, "none")
    blocks = tuple(
        b if i not in (1, 4) else type(b)(name=b.name, option=Option.RECOMPUTE) for i, b in enumerate(base.blocks)
    )
    plan = base.with_(
        policy="custom",
        blocks=blocks,
        segments=(Segment(start=0, stop=6), Segment(start=1, stop=3), Segment(start=3, stop=5)),
    )
    assert_same_training(wl, plan)


def test_recompute_really_happens_and_saves_memory() -> None:
    """The plan is not a no-op: recomputed blocks run their forward twice and the peak drops."""
    wl = conv_workload()
    calls = {"n": 0}
    wl.model[0][0].register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    torch.manual_seed(0)
    batch = wl.make_batch(8)
    step_grads(wl.model, batch, wl.loss_fn)
    assert calls["n"] == 1
    apply_plan(wl.model, policy_plan(wl.model, "all"))
    step_grads(wl.model, batch, wl.loss_fn)
    assert calls["n"] == 3  # forward + recompute
    remove_plan(wl.model)
    res = verify(wl, policy_plan(wl.model, "all"), step=StepSpec(batch_size=16, repeats=0))
    assert res.ok and res.measured_peak_bytes < res.baseline_peak_bytes


def test_batchnorm_updated_once_where_torch_checkpoint_updates_twice() -> None:
    torch.manual_seed(0)
    bn_block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(16, 4) + 3.0
    # torch's own checkpoint: statistics move twice (the bug memfit guards against)
    raw = copy.deepcopy(bn_block)
    checkpoint(raw, x, use_reentrant=False).sum().backward()
    assert raw[1].num_batches_tracked.item() == 2
    model = nn.Sequential(copy.deepcopy(bn_block), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    apply_plan(model, policy_plan(model, "all"))
    model(x).sum().backward()
    ref(x).sum().backward()
    assert model[0][1].num_batches_tracked.item() == 1
    assert torch.equal(model[0][1].running_mean, ref[0][1].running_mean)
    assert torch.equal(model[0][1].running_var, ref[0][1].running_var)


def test_batchnorm_cumulative_average_momentum_none() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    apply_plan(model, policy_plan(model, "all"))
    for _ in range(3):
        x = torch.randn(8, 4)
        model(x).sum().backward()
        ref(x).sum().backward()
    for b, r in zip(model.buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, r)


def test_autograd_grad_works() -> None:
    wl = kw_workload()
    torch.manual_seed(1)
    batch = wl.make_batch(3)
    params = [p for p in wl.model.parameters()]
    torch.manual_seed(2)
    g_ref = torch.autograd.grad(wl.loss_fn(wl.model, batch), params)
    apply_plan(wl.model, policy_plan(wl.model, "all"))
    torch.manual_seed(2)
    g = torch.autograd.grad(wl.loss_fn(wl.model, batch), params)
    for a, b in zip(g, g_ref, strict=True):
        assert_close(a, b)


def test_no_grad_and_eval_run_plainly() -> None:
    wl = conv_workload()
    apply_plan(wl.model, policy_plan(wl.model, "all"))
    wl.model.eval()
    with torch.no_grad():
        out = wl.model(torch.randn(2, 3, 12, 12))
    assert out.shape == (2, 10)


# --- structure ------------------------------------------------------------------------------------


def test_state_dict_keys_unchanged_and_checkpoint_loads_into_plain_model() -> None:
    wl = kw_workload()
    plain = copy.deepcopy(wl.model)
    keys = list(wl.model.state_dict())
    names = [n for n, _ in wl.model.named_parameters()]
    apply_plan(wl.model, policy_plan(wl.model, "all"))
    assert list(wl.model.state_dict()) == keys
    assert [n for n, _ in wl.model.named_parameters()] == names
    buf = io.BytesIO()
    torch.save(wl.model.state_dict(), buf)
    buf.seek(0)
    plain.load_state_dict(torch.load(buf))


def test_remove_plan_restores_the_module_tree() -> None:
    wl = conv_workload()
    before = repr(wl.model)
    dicts = [set(m.__dict__) for m in wl.model.modules()]
    plan = policy_plan(wl.model, "sqrt").with_(blocks=policy_plan(wl.model, "all").blocks)
    apply_plan(wl.model, plan)
    assert is_applied(wl.model)
    assert any("forward" in m.__dict__ for m in wl.model.modules())
    remove_plan(wl.model)
    assert not is_applied(wl.model)
    assert repr(wl.model) == before
    assert [set(m.__dict__) for m in wl.model.modules()] == dicts


def test_instance_forward_overrides_are_kept() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    calls = []
    orig = model[0].forward

    def spy(x):
        calls.append(1)
        return orig(x)

    model[0].forward = spy
    apply_plan(model, policy_plan(model, "all"))
    model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # forward + recompute go through the user's override
    remove_plan(model)
    assert model[0].forward is spy


def test_deepcopy_of_applied_model_is_independent() -> None:
    wl = conv_workload()
    apply_plan(wl.model, policy_plan(wl.model, "all"))
    clone = copy.deepcopy(wl.model)
    x = torch.randn(2, 3, 12, 12)
    clone(x).sum().backward()
    assert all(p.grad is None for p in wl.model.parameters())
    assert all(p.grad is not None for p in clone.parameters())


# --- chain discovery ------------------------------------------------------------------------------


def test_discovery_picks_the_largest_container() -> None:
    assert discover_chain(KwModel()).path == "layers"
    assert discover_chain(conv_bn_chain()).path == ""
    assert discover_chain(conv_bn_chain()).sequential


def test_set_blocks_overrides_and_bad_path_says_how() -> None:
    m = KwModel()
    with pytest.raises(UnsupportedModelError, match="no submodule 'nope'"):
        set_blocks(m, "nope")
    with pytest.raises(UnsupportedModelError, match="not an nn.ModuleList"):
        set_blocks(m, "emb")


def test_model_without_blocks_is_unsupported_with_the_fix() -> None:
    with pytest.raises(UnsupportedModelError, match="set_blocks"):
        discover_chain(nn.Linear(3, 3))


# --- errors leave the model unchanged ----------------------------------------------------------


def test_plan_for_another_model_refused_saying_what_differs() -> None:
    plan = policy_plan(KwModel(n=5), "all")
    other = KwModel(n=4)
    with pytest.raises(PlanMismatchError, match="number of blocks: plan 5, model 4"):
        apply_plan(other, plan)
    assert not is_applied(other)
    with pytest.raises(PlanMismatchError, match="batch"):
        apply_plan(KwModel(n=5), policy_plan(KwModel(n=5), "all", batch=torch.zeros(2, 3)), batch=torch.zeros(4, 3))


def test_apply_twice_refused() -> None:
    m = KwModel()
    apply_plan(m, policy_plan(m, "all"))
    with pytest.raises(MemfitError, match="remove_plan"):
        apply_plan(m, policy_plan(m, "all"))


def test_unknown_policy_lists_the_valid_ones() -> None:
    from memfit import SpecError

    with pytest.raises(SpecError, match="every:K"):
        policy_plan(KwModel(), "every:0")
    with pytest.raises(SpecError, match="sqrt"):
        policy_plan(KwModel(), "half")


# --- built-in workloads -----------------------------------------------------------------------

HF_TINY = "num_hidden_layers=4&hidden_size=64&intermediate_size=128&num_attention_heads=4&vocab_size=256"
BUILTIN = {
    "demo": "demo?n_layer=4&n_embd=32&seq_len=32",
    "hf:gpt2": f"hf:gpt2?{HF_TINY.replace('intermediate_size', 'n_inner')}",
    "hf:llama": f"hf:llama?{HF_TINY}&num_key_value_heads=2",
    "hf:bert": f"hf:bert?{HF_TINY}",
}


@pytest.mark.parametrize("policy", ["all", "every:2", "sqrt"])
@pytest.mark.parametrize("name", list(BUILTIN))
def test_builtin_workloads_train_the_same(name: str, policy: str) -> None:
    wl = load_workload(BUILTIN[name], seq_len=32)
    plan = policy_plan(wl.model, policy)
    assert bool(plan.segments) == (policy == "sqrt")  # HF layers sit in a ModuleList: segments all the same
    assert_same_training(wl, plan, batch_size=3)


def test_hf_gradient_checkpointing_enabled_is_refused() -> None:
    wl = load_workload(BUILTIN["hf:gpt2"], seq_len=16)
    wl.model.gradient_checkpointing_enable()
    with pytest.raises(MemfitError, match="gradient_checkpointing_disable"):
        apply_plan(wl.model, policy_plan(wl.model, "all"))
    assert not is_applied(wl.model)


def test_segment_over_the_whole_chain() -> None:
    wl = conv_workload()
    n = len(wl.model)
    plan = policy_plan(wl.model, "none").with_(
        policy="custom", segments=(Segment(start=0, stop=n), Segment(start=2, stop=5))
    )
    assert_same_training(wl, plan)


def test_compare_grads_floor_ignores_rounding_on_zero_gradients_but_catches_real_errors() -> None:
    """A gradient that is zero in exact arithmetic (1e-17 after rounding) differing by rounding
    does not count as a relative error of order 1; a 10 % error on a small real gradient does."""
    from memfit.verification.plans import compare_grads

    def pair(g_big: float, g_small: float, g_small_ref: float) -> tuple[nn.Module, nn.Module]:
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        for m, small in ((a, g_small), (b, g_small_ref)):
            m.weight.grad = torch.full_like(m.weight, g_big)
            m.bias.grad = torch.full_like(m.bias, small)
        return a, b

    err, _ = compare_grads(*pair(1.0, 3e-17, -2e-17))
    assert err < 1e-12
    err, name = compare_grads(*pair(1.0, 1.1e-2, 1e-2))
    assert name == "bias" and 0.09 < err < 0.11
    err, name = compare_grads(*pair(1.0, 1.1e-5, 1e-5))  # below the floor: judged against 1e-3 of the largest
    assert err == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("policy", ["all", "every:2", "sqrt"])
def test_backward_twice_with_retain_graph(policy: str) -> None:
    """A graph kept with ``retain_graph=True`` is recomputed again on the next backward, with the
    same dropout masks: gradients equal the unmodified model's (its recompute context is entered
    once per recompute; it could be entered once only before)."""

    def make() -> nn.Sequential:
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.GELU()) for _ in range(4)])

    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    apply_plan(model, policy_plan(model, policy))
    x = torch.randn(4, 8)
    for m in (model, ref):
        torch.manual_seed(1)
        y = m(x).pow(2).sum()
        y.backward(retain_graph=True)
        y.backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_block_that_overwrites_its_input_is_kept_and_gradients_stay_equal() -> None:
    """torchvision's DenseNet has an ``nn.ReLU(inplace=True)`` in its block list (``features.relu0``):
    recomputing it fails in the backward (torch's checkpoint saved the input it overwrote). memfit keeps
    such a block, says so, and every other block is recomputed; gradients equal the unplanned model's."""
    from memfit.apply.engine import InPlaceBlockWarning

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 3))
    wl = Workload(
        name="in-place",
        model=model,
        make_batch=lambda b: (torch.randn(b, 3, 8, 8), torch.randn(b, 4, 6, 6)),
        loss_fn=lambda m, bt: F.mse_loss(m(bt[0]), bt[1]),
    )
    with pytest.warns(InPlaceBlockWarning, match=r"\b2 overwrite their input"):
        res = verify(wl, policy_plan(model, "all"), step=StepSpec(batch_size=4))
    assert res.ok
    assert not is_applied(model)
