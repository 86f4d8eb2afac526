"""Sequence tiling on the zoo's decoders, built by transformers with their defaults.

For each decoder family: the position-wise submodules memfit finds by its rule (NOTE [ Which modules
are tiled ] in memfit.apply.tiling: a class named *MLP that passes the position-wise check on the
real input), and a plan with every block recomputed and its MLP over 4 tiles verified in float64
against the unmodified model (gradients within 1e-10: tiling reorders the parameter-gradient sums
only). Run alone with ``pytest -m zoo tests/zoo/test_tiling_zoo.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers
from test_zoo import _DECODER, FAMILIES, _build, _causal_lm

from memfit import StepSpec
from memfit.apply.tiling import find_tileable
from memfit.capture.chain import discover_chain
from memfit.plan.policies import policy_plan
from memfit.plan.types import BlockDecision, Option
from memfit.verification.plans import verify

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]

TILED = {
    "gpt2": "GPT2MLP",
    "llama": "LlamaMLP",
    "qwen2": "Qwen2MLP",
    "gpt_neox": "GPTNeoXMLP",
    "gemma2": "Gemma2MLP",
    "phi": "PhiMLP",
    "falcon": "FalconMLP",
    "peft_lora_llama": "LlamaMLP",
}
"""Decoder families and the MLP class memfit must find and tile in every block."""

MORE: dict[str, tuple[Callable[[], object], str]] = {
    "mistral": (lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**_DECODER, num_key_value_heads=2)), "MistralMLP"),
    "qwen3": (lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_DECODER, num_key_value_heads=2, head_dim=8)), "Qwen3MLP"),
    "phi3": (lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**_DECODER, num_key_value_heads=2, pad_token_id=0)), "Phi3MLP"),
    "gemma": (lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**_DECODER, num_key_value_heads=2, head_dim=8)), "GemmaMLP"),
    "starcoder2": (lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(**_DECODER, num_key_value_heads=2)), "Starcoder2MLP"),
}  # fmt: skip
"""Decoders outside the zoo's list, built the same way (tiny, library defaults)."""


def _workload(family: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    if family in MORE:
        return _causal_lm(family, MORE[family][0]()), MORE[family][1]
    assert family in FAMILIES
    return _build(family), TILED[family]


@pytest.mark.parametrize("family", [*TILED, *MORE])
def test_decoder_mlps_are_found_and_tiled_gradients_equal(family: str) -> None:
    wl, mlp = _workload(family)
    chain = discover_chain(wl.model)
    torch.manual_seed(0)
    batch = wl.make_batch(2)
    found = find_tileable(wl.model, chain.blocks, chain.names, lambda: wl.loss_fn(wl.model, batch))
    assert found.classes == (mlp,) and all(found.modules), (found.classes, found.dropped)
    base = policy_plan(wl.model, "all")
    blocks = tuple(
        BlockDecision(name=b.name, option=Option.RECOMPUTE, tiles=4, tiled=found.modules[i])
        for i, b in enumerate(base.blocks)
    )
    out = verify(wl, base.with_(blocks=blocks), step=StepSpec(batch_size=2, repeats=0, dtype=torch.float64))
    assert out.ok and out.grad_rtol == 1e-10, out.to_dict()
