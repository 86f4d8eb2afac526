"""transformers' own loss in float64 (memfit.models.hf_loss.float64_loss), against a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from memfit.models.hf_loss import Float64LossWarning, float64_loss
from memfit.models.registry import load_workload

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg).double().train()


def test_float64_loss_keeps_float64_and_is_undone() -> None:
    model = _gpt2()
    ids = torch.randint(0, 64, (2, 10))
    logits = model(input_ids=ids).logits  # (2, 10, 64) float64
    exact = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    plain = model(input_ids=ids, labels=ids).loss
    assert plain.dtype == torch.float32  # transformers' logits.float()
    with pytest.warns(Float64LossWarning, match="in float64"), float64_loss(model):
        inside = model(input_ids=ids, labels=ids).loss
    assert inside.dtype == torch.float64
    torch.testing.assert_close(inside, exact, rtol=1e-14, atol=0)
    assert "_loss_function" not in model.__dict__
    assert model(input_ids=ids, labels=ids).loss.dtype == torch.float32


def test_float64_loss_leaves_a_loss_someone_set_and_other_dtypes_alone() -> None:
    model = _gpt2()
    own = lambda logits, labels, vocab_size, **kw: logits.sum() * 0  # noqa: E731
    model.loss_function = own
    with float64_loss(model, warn=False):
        assert model.loss_function is own
    model = _gpt2().float()
    with float64_loss(model, warn=False):
        assert "_loss_function" not in model.__dict__


def test_hf_causal_lm_workload_is_a_float64_token_sum() -> None:
    wl = load_workload(
        "hf:gpt2?n_layer=1&hidden_size=16&num_attention_heads=2&n_inner=32&vocab_size=64",
        seq_len=12,
        dtype=torch.float64,
    )
    assert wl.model.config.use_cache is True
    torch.manual_seed(0)
    batch = wl.make_batch(3)
    loss_sum, count = wl.loss_fn(wl.model, batch)
    assert loss_sum.dtype == torch.float64 and int(count) == wl.count_fn(batch)
    torch.manual_seed(1)  # GPT-2's dropout: the same draws for both
    loss_sum = wl.loss_fn(wl.model, batch)[0]
    torch.manual_seed(1)
    logits = wl.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    m = batch["attention_mask"].bool()
    targets = batch["input_ids"][:, 1:].masked_fill(~(m[:, 1:] & m[:, :-1]), -100)
    ref = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss_sum, ref, rtol=1e-13, atol=0)
