"""The key/value cache under recomputing plans, as a training step uses it: ``use_cache=True``
(transformers' default) and the model's output dropped once the loss is taken.

A recomputed layer fills the caller's cache in the forward and replays its update in the
recompute (NOTE [ A recomputed layer fills its cache once ] in :mod:`memfit.apply.kv_cache`);
nothing memfit keeps for the recompute holds that cache, so a dropped cache frees its keys and
values before the backward, as without a plan, and a kept one is left as the forward left it.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

from memfit.apply import apply_plan, remove_plan
from memfit.apply.kv_cache import _ReleasedLayer
from memfit.capture.tracker import MemoryTracker
from memfit.errors import UnsupportedModelError
from memfit.plan import Option, policy_plan
from memfit.plan.types import Plan, Segment

transformers = pytest.importorskip("transformers")

VOCAB, T = 64, 12


def _gpt2(n_layer: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=n_layer, n_head=4, vocab_size=VOCAB, resid_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).train()


def _plan(model: nn.Module, kind: str) -> Plan:
    if kind == "segments":  # blocks 0..3 as one unit over 0..1 and 2..3, block 1 also recomputed on its own
        plan = policy_plan(model, "none")
        blocks = tuple(
            dataclasses.replace(b, option=Option.RECOMPUTE) if i == 1 else b for i, b in enumerate(plan.blocks)
        )
        return plan.with_(
            policy="custom",
            blocks=blocks,
            segments=(Segment(start=0, stop=4), Segment(start=0, stop=2), Segment(start=2, stop=4)),
        )
    return policy_plan(model, kind)


@pytest.mark.parametrize("kind", ["all", "every:2", "segments"])
@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_a_dropped_cache_is_freed_before_the_backward(kind: str) -> None:
    """The loss taken, the output dropped: the cache the forward filled is gone before backward
    (it held every layer's keys and values until the backward reached the first recomputed layer),
    and the gradients are the unplanned model's."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    apply_plan(model, _plan(model, kind))
    torch.manual_seed(3)
    out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values.get_seq_length() == T  # filled in the forward, every layer
    cache = weakref.ref(out.past_key_values)
    keys = weakref.ref(out.past_key_values.layers[0].keys)
    loss = out.logits.square().mean()
    del out
    gc.collect()
    assert cache() is None and keys() is None
    loss.backward()
    torch.manual_seed(3)
    ref(input_ids=ids, use_cache=True).logits.square().mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7, msg=name)
    remove_plan(model)


def test_a_kept_cache_is_left_as_the_forward_left_it() -> None:
    """The recompute writes into copies of the layers, never into the caller's cache."""
    model = _gpt2()
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    apply_plan(model, _plan(model, "segments"))
    out = model(input_ids=ids, use_cache=True)
    layers = list(out.past_key_values.layers)
    tensors = [(layer.keys, layer.values) for layer in layers]
    out.logits.square().mean().backward()
    assert list(out.past_key_values.layers) == layers
    assert all(
        layer.keys is k and layer.values is v for layer, (k, v) in zip(out.past_key_values.layers, tensors, strict=True)
    )
    remove_plan(model)


def test_the_backward_holds_no_forward_keys_and_values() -> None:
    """Measured: with every layer recomputed and the output dropped after the loss, the backward's
    peak is below its peak with the caller keeping the cache by exactly every layer's keys and values
    (what memfit's recompute kept alive until the backward before)."""

    def backward_peak(keep_output: bool) -> int:
        model = _gpt2(n_layer=6)
        apply_plan(model, policy_plan(model, "all"))
        ids = torch.randint(1, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
        with MemoryTracker(device="cpu") as tracker:
            with tracker.phase("forward"):
                out = model(input_ids=ids, use_cache=True)
                loss = out.logits.square().mean()
                held = out.past_key_values if keep_output else None
                del out
            with tracker.phase("backward"):
                loss.backward()
        assert held is None or held.get_seq_length() == 32
        return tracker.peak_bytes_by_phase["backward"]

    kv_bytes = 6 * 2 * 8 * 32 * 32 * 4  # layers x (keys, values) x B x T x C x float32
    assert backward_peak(keep_output=True) - backward_peak(keep_output=False) == kv_bytes


def test_reading_a_layer_of_a_dropped_cache_in_a_recompute_says_so() -> None:
    with pytest.raises(UnsupportedModelError, match="read layer 3 of its key/value cache.*keep the model's output"):
        _ = _ReleasedLayer(3).keys
