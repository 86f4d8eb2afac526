"""State a recompute would change twice (NOTE [ State a recompute would change twice ] in
memfit.apply.engine): random generators other than torch's, buffers updated by reassignment,
key/value caches, other Python state. Every test compares against the unmodified model."""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.testing import assert_close

import memfit
from memfit import StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.apply.engine import CacheDroppedWarning
from memfit.plan import Selective, policy_plan

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]

D = 8


class RandomBlock(nn.Module):
    """A block whose forward draws from Python's or NumPy's global generator (augmentation-style)."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = random.random() if self.source == "python" else float(np.random.rand())
        return x + torch.tanh(self.fc(x)) * scale


class EmaBlock(nn.Module):
    """A block that updates a running buffer by reassignment (a new tensor each call)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return x + torch.tanh(self.fc(x))


class ScaleStateBlock(nn.Module):
    """A block that reads and reassigns plain attributes in forward: a number and a tensor (a
    recurrent state carried between calls, as RecurrentGemma keeps its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.scale = 1.0
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = 0.5 * self.scale + 1.0
        prev = torch.zeros(D) if self.state is None else self.state
        self.state = x.detach().mean(0)
        return x + torch.tanh(self.fc(x)) * self.scale + prev


class ListCacheBlock(nn.Module):
    """A block that keeps what it saw in a Python list (a hand-written KV cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.append(x.detach())
        return x + torch.tanh(self.fc(x))


class CacheArgBlock(nn.Module):
    """A block that fills a cache object passed in by the model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, cache: dict[int, torch.Tensor]) -> torch.Tensor:
        cache[len(cache)] = x.detach()
        return x + torch.tanh(self.fc(x))


class CacheArgModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CacheArgBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            x = layer(x, cache)
        return x


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model(x).square().sum().backward()


@pytest.mark.parametrize("source", ["python", "numpy"])
@pytest.mark.parametrize("policy", ["all", "sqrt", "selective"])
def test_python_and_numpy_random_replayed(source: str, policy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[RandomBlock(source) for _ in range(4)])
    ref = copy.deepcopy(model)
    x = torch.randn(5, D)
    plan = policy_plan(model, Selective(preset="save_matmuls")) if policy == "selective" else policy_plan(model, policy)
    apply_plan(model, plan)
    _step(ref, x, seed=1)
    after_ref = (random.random(), float(np.random.rand()))
    _step(model, x, seed=1)
    after = (random.random(), float(np.random.rand()))
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, r.grad, rtol=0, atol=0)
    assert after == after_ref  # the recompute leaves the generators where backward found them
    remove_plan(model)


def test_buffer_updated_by_reassignment_is_updated_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[EmaBlock() for _ in range(3)])
    ref = copy.deepcopy(model)
    x = torch.randn(5, D)
    apply_plan(model, policy_plan(model, "all"))
    for _ in range(2):
        _step(ref, x, seed=0)
        _step(model, x, seed=0)
    for (name, b), r in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, r), name
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, r.grad, rtol=0, atol=0)
    remove_plan(model)


@pytest.mark.parametrize("policy", ["all", "sqrt", "selective"])
def test_attributes_reassigned_in_forward_are_replayed(policy: str) -> None:
    """The recompute runs from the values the forward started from, and leaves what the forward left
    (measured without the replay: the scale moves twice per step, 1.75 instead of 1.5 after one,
    and the second step's gradients are 20 % off)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[ScaleStateBlock() for _ in range(4)])
    ref = copy.deepcopy(model)
    x = torch.randn(5, D)
    plan = policy_plan(model, Selective(preset="save_matmuls")) if policy == "selective" else policy_plan(model, policy)
    apply_plan(model, plan)
    for seed in range(3):
        model.zero_grad()
        ref.zero_grad()
        _step(ref, x + seed, seed=seed)
        _step(model, x + seed, seed=seed)
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close(p.grad, r.grad, rtol=0, atol=0, msg=name)
        for blk, r in zip(model, ref, strict=True):
            assert blk.scale == r.scale and torch.equal(blk.state, r.state)
    remove_plan(model)


def test_verify_copies_a_model_that_keeps_a_tensor_of_its_graph() -> None:
    """After a training forward a module may hold a tensor of the autograd graph in an attribute
    (RecurrentGemma's recurrent state); copy.deepcopy refuses it, verify's copy detaches it."""
    from memfit.capture.snapshot import copy_model
    from memfit.verification.plans import verify

    torch.manual_seed(0)
    model = nn.Sequential(*[ScaleStateBlock() for _ in range(3)])
    for blk in model:
        blk.kept = blk.fc.weight * 2  # a non-leaf tensor, as a forward would leave it
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(model)
    twin = copy_model(model)
    assert torch.equal(twin[0].kept, model[0].kept) and twin[0].kept.grad_fn is None
    wl = memfit.Workload(
        name="graph state",
        model=model,
        make_batch=lambda b: torch.randn(b, D),
        loss_fn=lambda m, x: m(x).square().mean(),
    )
    assert verify(wl, policy_plan(model, "all"), step=StepSpec(batch_size=3, repeats=0)).ok


@pytest.mark.parametrize("kind", ["list attribute", "cache argument"])
def test_python_state_changed_in_forward_is_refused_at_profile(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[ListCacheBlock() for _ in range(3)]) if kind == "list attribute" else CacheArgModel()
    wl = memfit.Workload(
        name=kind, model=model, make_batch=lambda b: torch.randn(b, D), loss_fn=lambda m, x: m(x).square().mean()
    )
    with pytest.raises(
        memfit.UnsupportedModelError, match=r"would change it twice.*use_cache=False.*keep that block"
    ) as err:
        memfit.profile(
            wl, step=StepSpec(batch_size=2, repeats=1), options=("keep", "recompute"), heads=False, activations=False
        )
    assert "\n" not in str(err.value)
    assert not memfit.apply.is_applied(model)


# --- transformers: the key/value cache ---------------------------------------------------------


def _llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 64, (3, 12))
    mask = (torch.arange(12)[None, :] < torch.tensor([[12], [9], [6]])).long()  # a mask: the cache bug needs one
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("mode", ["train", "eval"])  # eval: fine-tuning without dropout, gradients on
def test_recomputed_transformers_layers_fill_their_cache_once(mode: str) -> None:
    model = _llama().train(mode == "train")
    assert model.config.use_cache is True  # the library's default
    ref = copy.deepcopy(model)
    batch = _batch()
    apply_plan(model, policy_plan(model, "all"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheDroppedWarning)  # a dynamic cache is replayed, not dropped
        out = model(**batch)
        out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7, msg=name)
    # The cache the planned forward returns is the unplanned model's, layer by layer.
    for got, exp in zip(out.past_key_values.layers, want.past_key_values.layers, strict=True):
        assert torch.equal(got.keys, exp.keys) and torch.equal(got.values, exp.values)
    with torch.no_grad():  # no backward, nothing recomputed: generation keeps its cache
        assert model(**batch).past_key_values.get_seq_length() == 12
    remove_plan(model)
    assert model(**batch).past_key_values.get_seq_length() == 12


def test_peft_lora_on_a_frozen_base_gets_its_gradients() -> None:
    import peft

    model = peft.get_peft_model(
        _llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    )
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)  # the embeddings (the blocks' inputs) are frozen
    ref = copy.deepcopy(model)
    batch = _batch()
    apply_plan(model, policy_plan(model, "all"))
    model(**batch).loss.backward()
    ref(**batch).loss.backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        if name in lora:
            assert r.grad is not None and r.grad.abs().max() > 0, name
            assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-8, msg=name)
        else:
            assert p.grad is None, name
    remove_plan(model)


def test_a_transformers_cache_passed_to_a_generic_block_is_replayed() -> None:
    """A user's own block that writes a transformers ``DynamicCache`` it is given: recomputed, it
    fills the cache once and its gradients are the plain model's (NOTE [ A recomputed layer fills
    its cache once ])."""
    import transformers

    class Attn(nn.Module):
        def __init__(self, idx: int) -> None:
            super().__init__()
            self.qkv, self.idx = nn.Linear(D, 3 * D), idx

        def forward(self, x: torch.Tensor, cache: object) -> torch.Tensor:
            q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # (B, 1, T, D) each
            k, v = cache.update(k, v, self.idx)
            return x + torch.nn.functional.scaled_dot_product_attention(q, k, v).squeeze(1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Attn(i) for i in range(3))

        def forward(self, x: torch.Tensor, cache: object) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x, cache)
            return x

    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    x, nxt = torch.randn(2, 5, D), torch.randn(2, 1, D)
    apply_plan(model, policy_plan(model, "all"))
    caches = [transformers.DynamicCache(), transformers.DynamicCache()]
    for m, cache in zip((model, ref), caches, strict=True):
        (m(x, cache).square().sum() + m(nxt, cache).square().sum()).backward()  # a second forward reads the past
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7, msg=name)
    for got, exp in zip(caches[0].layers, caches[1].layers, strict=True):
        assert got.keys.shape[-2] == 6 and torch.equal(got.keys, exp.keys) and torch.equal(got.values, exp.values)
    remove_plan(model)
