"""A forward with gradients and ``use_cache=True`` under a plan returns the unplanned model's cache.

Decoder families as transformers builds them from a config: the prompt's forward runs with
gradients and a plan applied (kept and recomputed layers, segments), then a next token is decoded
from the cache it returned; logits, cache and gradients equal the unplanned model's (NOTE [ A
recomputed layer fills its cache once ] in :mod:`memfit.apply.kv_cache`).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from memfit.apply import apply_plan, remove_plan
from memfit.apply.kv_cache import CacheDroppedWarning
from memfit.plan import policy_plan
from memfit.plan.types import Plan, Segment

transformers = pytest.importorskip("transformers")

VOCAB, T = 64, 10


def _decoder(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB))
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB,
    )  # fmt: skip
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[family]
    return cls(config)


def _plan(model: nn.Module, kind: str) -> Plan:
    if kind == "segment":  # blocks 1..2 recomputed as one unit, block 3 on its own
        return policy_plan(model, "every:3").with_(segments=(Segment(start=1, stop=3),))
    return policy_plan(model, kind)


@pytest.mark.parametrize("kind", ["every:2", "all", "segment"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_decoding_from_a_planned_forwards_cache_equals_the_unplanned(family: str, kind: str) -> None:
    model = _decoder(family).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(1, VOCAB, (2, 1), generator=torch.Generator().manual_seed(2))
    apply_plan(model, _plan(model, kind))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheDroppedWarning)
        torch.manual_seed(3)  # GPT-2's dropout: the same masks in both
        out = model(input_ids=ids, use_cache=True)
        out.logits.square().mean().backward()
    torch.manual_seed(3)
    want = ref(input_ids=ids, use_cache=True)
    want.logits.square().mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert out.past_key_values.get_seq_length() == T
    for got, exp in zip(out.past_key_values.layers, want.past_key_values.layers, strict=True):
        assert torch.equal(got.keys, exp.keys) and torch.equal(got.values, exp.values)
    model.eval(), ref.eval()  # decoding, as generate runs it
    with torch.no_grad():
        logits = model(input_ids=nxt, past_key_values=out.past_key_values).logits
        expected = ref(input_ids=nxt, past_key_values=want.past_key_values).logits
    assert torch.equal(logits, expected)
    remove_plan(model)


def test_a_second_forward_with_gradients_from_the_cache_is_exact() -> None:
    """Generation with gradients: the second forward attends to the first's keys; its recompute
    must see the cache as that forward found it (10 tokens), not as it left it (11)."""
    model = _decoder("llama").train()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(1, VOCAB, (2, 1), generator=torch.Generator().manual_seed(2))
    apply_plan(model, _plan(model, "all"))
    for m in (model, ref):
        first = m(input_ids=ids, use_cache=True)
        second = m(input_ids=nxt, past_key_values=first.past_key_values, use_cache=True)
        (first.logits.square().mean() + second.logits.square().mean()).backward()
        assert second.past_key_values.get_seq_length() == T + 1
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7, msg=name)
    remove_plan(model)


def test_an_encoder_decoder_cache_is_replayed() -> None:
    """T5's decoder layers read their cache's length (relative positions) and its cross-attention
    flags: the recompute finds both as the forward did."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4, d_kv=8, vocab_size=VOCAB, dropout_rate=0.0
    )
    model = transformers.T5ForConditionalGeneration(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    dec = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    apply_plan(model, policy_plan(model, "all"))
    out = model(input_ids=ids, decoder_input_ids=dec, use_cache=True)
    out.logits.square().mean().backward()
    want = ref(input_ids=ids, decoder_input_ids=dec, use_cache=True)
    want.logits.square().mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7, msg=name)
    remove_plan(model)
    with torch.no_grad():
        nxt = dec[:, :1]
        got = model(input_ids=ids, decoder_input_ids=nxt, past_key_values=out.past_key_values).logits
        exp = ref(input_ids=ids, decoder_input_ids=nxt, past_key_values=want.past_key_values).logits
    assert torch.equal(got, exp)


def test_a_cache_memfit_cannot_replay_is_dropped_with_a_warning_that_says_so() -> None:
    model = _decoder("llama").train()
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    apply_plan(model, policy_plan(model, "all"))
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with pytest.warns(CacheDroppedWarning, match="StaticCache.*misses those layers, do not decode from it"):
        model(input_ids=ids, past_key_values=cache, use_cache=True).logits.sum().backward()
    remove_plan(model)
