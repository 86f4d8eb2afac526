"""Model zoo: real model families as their libraries build them, tried as a user would.

Each family is built from its library's config class at a tiny size with that library's defaults
(``use_cache=True``, dropout as configured, the model's own loss) and called the way its users call
it: ``model(input_ids=..., attention_mask=..., labels=...)`` on right-padded rows of random length,
``model(pixel_values=..., labels=...)`` on images. For each family:

1. ``memfit.profile`` (keep and recompute: what the block-level planner needs);
2. a plan at the budget halfway between the least peak any plan reaches and store-all (the peak
   with every block kept): the middle of the range where the planner must choose which blocks
   to recompute, rather than the trivial ends (keep all / recompute all). Sizes are chosen so
   that activations are a real share of the step (width 32, 4 blocks, batch 4 x 32 tokens: the
   blocks' activations are larger than parameters, gradients and AdamW state together), else
   the range would be a few kB wide;
3. ``memfit.verification.plans.verify`` of that plan: gradients and buffers equal the unmodified model's, the
   measured peak within the budget and within ``PREDICTION_RTOL`` of the prediction;
4. ``memfit.verify_accumulation`` in float64 (2 micro-batches of 4 and 2
   against one batch of 6).

Families outside the issue's list were tried the same way (mistral, gemma, gemma3, opt, bloom, gptj,
gpt_bigcode, starcoder2, mpt, olmo, stablelm, cohere, granite, phi3, qwen3, qwen3_moe, dbrx, mbart,
pegasus, marian, mt5, deberta-v2, electra, distilbert, deit, mobilevit, segformer,
convnextv2, regnet, dinov2, CLIP and SigLIP vision towers, a timm-style ResNet): the ones here
exercise something the others do not (an audio encoder-decoder, a state-space scan, state kept
in module attributes, blocks of two kinds with a float32 router, stochastic depth, stages with a
patch-merging layer beside their blocks); ALBERT's shared layer is refused by design
(``REFUSED``).

torchvision and timm are not used: the registry's torchvision wheels are CUDA builds whose C ops
do not load with the CPU torch, and timm imports torchvision. transformers' own ResNet and
ConvNeXT stand in for the convolutional families.

Run alone with ``pytest -m zoo tests/zoo``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import memfit
from memfit import StepSpec
from memfit.capture.chain import discover_chain
from memfit.errors import BudgetInfeasibleError
from memfit.plan.options import BASE_OPTIONS
from memfit.verification import verify_accumulation
from memfit.verification.plans import verify

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]

B, T, VOCAB, WIDTH, LAYERS = 4, 32, 128, 32, 4
IMAGE = 32
PREDICTION_RTOL = 0.06
"""Measured peak against predicted: within 6 %. The cost model adds a 2 % margin; the PEFT LoRA
model is predicted 5.4 % above what it measures (on the safe side: its frozen base has no
gradients), every other family within 3 %."""

FLOAT32_INSIDE = {
    "gemma2": "Gemma2RMSNorm normalises x.float() and scales by 1 + weight.float(): float32 even in a float64 model",
    "recurrent_gemma": "RecurrentGemmaRMSNorm as Gemma2's, and the recurrence accumulates in float32",
    "mamba": "the selective scan computes exp(dt * A) and its state in float32 (A_log.float())",
    "deepseek_v3": "DeepseekV3TopkRouter computes its logits in float32 (measured 1.5e-7 on the gate weight)",
}
"""Families whose transformers code rounds values to float32 even in a float64 model, so that their
float64 accumulation check carried float32 rounding (gemma2: 7.8e-8) instead of ~1e-15. The check
runs those casts in float64 in both runs and names them (NOTE [ float32 islands ] in
memfit.verification.islands): they pass at float64's tolerance like every other family."""


# --- families ---------------------------------------------------------------------------------


def _tokens(vocab: int = VOCAB, pad: int = 0) -> Callable[[int], dict[str, torch.Tensor]]:
    """Right-padded rows of random length in [T // 2, T], labels -100 on padding."""

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        lengths = torch.randint(T // 2, T + 1, (b,))
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (b, T)
        ids = torch.randint(4, vocab, (b, T)).masked_fill(mask == 0, pad)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return make_batch


def _causal_lm(name: str, model: nn.Module) -> memfit.Workload:
    """A causal LM trained as HF Trainer does: the model's own loss, summed through
    ``num_items_in_batch`` and divided by the global count of target tokens."""

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = m(**batch, num_items_in_batch=1).loss
        return loss_sum, (batch["labels"][:, 1:] != -100).sum()

    return memfit.Workload(
        name=name, model=model.train(), make_batch=_tokens(), loss_fn=loss_fn,
        count_fn=lambda batch: int((batch["labels"][:, 1:] != -100).sum()), default_batch_size=B,
    )  # fmt: skip


def _seq2seq(
    name: str, model: nn.Module, make_src: Callable[[int], dict[str, torch.Tensor]] | None = None
) -> memfit.Workload:
    """An encoder-decoder: T5 and BART compute a mean loss in forward, so a token sum comes from
    the logits (as a user accumulating over micro-batches must do). ``make_src`` gives the encoder's
    inputs (default: right-padded tokens with their attention mask)."""
    make_tgt = _tokens()
    make_src = make_src or _text

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {**make_src(b), "labels": make_tgt(b)["labels"]}

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = m(**batch).logits  # (b, T, V)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
        return loss_sum, (batch["labels"] != -100).sum()

    return memfit.Workload(
        name=name, model=model.train(), make_batch=make_batch, loss_fn=loss_fn,
        count_fn=lambda batch: int((batch["labels"] != -100).sum()), default_batch_size=B,
    )  # fmt: skip


def _classifier(
    name: str, model: nn.Module, make_inputs: Callable[[int], dict[str, torch.Tensor]], num_labels: int
) -> memfit.Workload:
    """Sequence or image classification with the model's own mean loss."""

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {**make_inputs(b), "labels": torch.randint(0, num_labels, (b,))}

    return memfit.Workload(
        name=name, model=model.train(), make_batch=make_batch, loss_fn=lambda m, batch: m(**batch).loss, default_batch_size=B,
    )  # fmt: skip


def _images(b: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(b, 3, IMAGE, IMAGE)}


def _text(b: int) -> dict[str, torch.Tensor]:
    batch = _tokens()(b)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


_DECODER = {
    "hidden_size": WIDTH,
    "intermediate_size": 2 * WIDTH,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
}


def _gpt2() -> memfit.Workload:
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=2 * T)
    return _causal_lm("gpt2", transformers.GPT2LMHeadModel(cfg))


def _llama() -> memfit.Workload:
    return _causal_lm(
        "llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER, num_key_value_heads=2))
    )


def _qwen2() -> memfit.Workload:
    return _causal_lm(
        "qwen2", transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_DECODER, num_key_value_heads=2))
    )


def _gpt_neox() -> memfit.Workload:
    cfg = transformers.GPTNeoXConfig(**_DECODER, hidden_dropout=0.1, attention_dropout=0.1)
    return _causal_lm("gpt_neox", transformers.GPTNeoXForCausalLM(cfg))


def _mixtral() -> memfit.Workload:
    cfg = transformers.MixtralConfig(
        **_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1,
        output_router_logits=True,
    )  # fmt: skip
    return _causal_lm("mixtral", transformers.MixtralForCausalLM(cfg))


def _qwen2_moe() -> memfit.Workload:
    cfg = transformers.Qwen2MoeConfig(
        **_DECODER, num_key_value_heads=2, moe_intermediate_size=WIDTH, shared_expert_intermediate_size=WIDTH,
        num_experts=4, num_experts_per_tok=2, output_router_logits=True,
    )  # fmt: skip
    return _causal_lm("qwen2_moe", transformers.Qwen2MoeForCausalLM(cfg))


def _gemma2() -> memfit.Workload:
    cfg = transformers.Gemma2Config(**_DECODER, num_key_value_heads=2, head_dim=8)  # soft-capping on by default
    return _causal_lm("gemma2", transformers.Gemma2ForCausalLM(cfg))


def _phi() -> memfit.Workload:
    return _causal_lm("phi", transformers.PhiForCausalLM(transformers.PhiConfig(**_DECODER)))


def _falcon() -> memfit.Workload:
    cfg = transformers.FalconConfig(
        hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4, vocab_size=VOCAB
    )
    return _causal_lm("falcon", transformers.FalconForCausalLM(cfg))


def _t5() -> memfit.Workload:
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_ff=2 * WIDTH, d_kv=8, num_layers=LAYERS, num_heads=4, decoder_start_token_id=0,
    )  # fmt: skip
    return _seq2seq("t5", transformers.T5ForConditionalGeneration(cfg))


def _bart() -> memfit.Workload:
    cfg = transformers.BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, max_position_embeddings=2 * T,
    )  # fmt: skip
    return _seq2seq("bart", transformers.BartForConditionalGeneration(cfg))


def _bert() -> memfit.Workload:
    cfg = transformers.BertConfig(**_DECODER, num_labels=3)
    return _classifier("bert", transformers.BertForSequenceClassification(cfg), _text, 3)


def _vit() -> memfit.Workload:
    cfg = transformers.ViTConfig(
        image_size=IMAGE, patch_size=4, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=2 * WIDTH, num_labels=5,
    )  # fmt: skip
    return _classifier("vit", transformers.ViTForImageClassification(cfg), _images, 5)


def _resnet() -> memfit.Workload:
    # ResNet's stem (7x7 conv, BatchNorm, max-pool at half resolution) lies outside the chain and is
    # always kept; at 32x32 images and widths 8-64 the parameters and AdamW state outweigh every
    # block's activations and no plan gets below store-all (3.25 vs 3.18 MiB, measured). At 128x128
    # with width 16 the blocks hold a real share: least peak 4.79 MiB against 5.68 MiB store-all.
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[16, 16, 16, 16], depths=[2, 2, 2, 2], layer_type="basic", num_labels=5
    )
    return _classifier("resnet", transformers.ResNetForImageClassification(cfg), _large_images, 5)


def _large_images(b: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(b, 3, 4 * IMAGE, 4 * IMAGE)}


def _convnext() -> memfit.Workload:
    cfg = transformers.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 2, 2], num_labels=5, image_size=IMAGE)
    return _classifier("convnext", transformers.ConvNextForImageClassification(cfg), _images, 5)


def _whisper() -> memfit.Workload:
    # Audio encoder-decoder: a convolutional front-end on log-mel features (input_features), the
    # encoder's and the decoder's layers planned as one chain, the decoder's cross-attention cache.
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, num_mel_bins=16,
        max_source_positions=T, max_target_positions=2 * T, decoder_start_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = transformers.WhisperForConditionalGeneration(cfg)
    return _seq2seq("whisper", model, lambda b: {"input_features": torch.randn(b, 16, 2 * T)})  # (b, mels, frames)


def _mamba() -> memfit.Workload:
    # A state-space model: no attention, a selective scan; its cache is off in training by default.
    cfg = transformers.MambaConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS, vocab_size=VOCAB, state_size=8)
    return _causal_lm("mamba", transformers.MambaForCausalLM(cfg))


def _recurrent_gemma() -> memfit.Workload:
    # Keeps its recurrent and convolution states in plain module attributes that every forward
    # reassigns (replayed in the recompute: NOTE [ State a recompute would change twice ]), and a
    # tensor of the last forward's graph in them (verify's copy detaches it).
    cfg = transformers.RecurrentGemmaConfig(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, lru_width=WIDTH, attention_window_size=16,
    )  # fmt: skip
    return _causal_lm("recurrent_gemma", transformers.RecurrentGemmaForCausalLM(cfg))


def _deepseek_v3() -> memfit.Workload:
    # Multi-head latent attention, a dense first layer then MoE layers (blocks of two kinds in one
    # chain), a float32 router with a bias buffer.
    cfg = transformers.DeepseekV3Config(
        **_DECODER, num_key_value_heads=4, moe_intermediate_size=WIDTH, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
    )  # fmt: skip
    return _causal_lm("deepseek_v3", transformers.DeepseekV3ForCausalLM(cfg))


def _beit() -> memfit.Workload:
    # Stochastic depth on by default (drop_path_rate 0.1): whole residual branches dropped per sample.
    cfg = transformers.BeitConfig(
        image_size=IMAGE, patch_size=4, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=2 * WIDTH, num_labels=5,
    )  # fmt: skip
    return _classifier("beit", transformers.BeitForImageClassification(cfg), _images, 5)


def _swin() -> memfit.Workload:
    # Hierarchical stages whose blocks sit beside a patch-merging layer with parameters (the chain
    # is the stages' block lists), shifted-window attention, stochastic depth on by default.
    cfg = transformers.SwinConfig(
        image_size=IMAGE, patch_size=2, embed_dim=8, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=5,
    )  # fmt: skip
    return _classifier("swin", transformers.SwinForImageClassification(cfg), _images, 5)


def _peft_lora_llama() -> memfit.Workload:
    import peft

    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER, num_key_value_heads=2))
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    return _causal_lm("peft_lora_llama", model)


# --- families the probes tried as users would (each built as its library builds it) -----------------


def _decoder(name: str, config_cls: str, model_cls: str, **kw: object) -> memfit.Workload:
    cfg = getattr(transformers, config_cls)(**{**_DECODER, "num_key_value_heads": 2, **kw})
    return _causal_lm(name, getattr(transformers, model_cls)(cfg))


def _qwen3() -> memfit.Workload:
    return _decoder("qwen3", "Qwen3Config", "Qwen3ForCausalLM", head_dim=8)


def _qwen3_moe() -> memfit.Workload:
    return _decoder(
        "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=8, moe_intermediate_size=WIDTH,
        num_experts=4, num_experts_per_tok=2, output_router_logits=True,
    )  # fmt: skip


def _gemma3() -> memfit.Workload:
    return _decoder("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8)


def _olmo2() -> memfit.Workload:
    return _decoder("olmo2", "Olmo2Config", "Olmo2ForCausalLM")


def _mistral_sliding() -> memfit.Workload:
    return _decoder("mistral", "MistralConfig", "MistralForCausalLM", sliding_window=T // 2)


def _phi3() -> memfit.Workload:
    return _decoder("phi3", "Phi3Config", "Phi3ForCausalLM", pad_token_id=0)


def _starcoder2() -> memfit.Workload:
    return _decoder("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM")


def _stablelm() -> memfit.Workload:
    return _decoder("stablelm", "StableLmConfig", "StableLmForCausalLM")


def _cohere() -> memfit.Workload:
    return _decoder("cohere", "CohereConfig", "CohereForCausalLM")


def _granite() -> memfit.Workload:
    return _decoder("granite", "GraniteConfig", "GraniteForCausalLM")


def _gptj() -> memfit.Workload:
    cfg = transformers.GPTJConfig(
        n_layer=LAYERS, n_embd=WIDTH, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=2 * T
    )
    return _causal_lm("gptj", transformers.GPTJForCausalLM(cfg))


def _codegen() -> memfit.Workload:
    cfg = transformers.CodeGenConfig(
        n_layer=LAYERS, n_embd=WIDTH, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=2 * T, n_ctx=2 * T
    )
    return _causal_lm("codegen", transformers.CodeGenForCausalLM(cfg))


def _bloom() -> memfit.Workload:
    cfg = transformers.BloomConfig(hidden_size=WIDTH, n_layer=LAYERS, n_head=4, vocab_size=VOCAB)
    return _causal_lm("bloom", transformers.BloomForCausalLM(cfg))


def _deberta_v2() -> memfit.Workload:
    cfg = transformers.DebertaV2Config(**_DECODER, num_labels=3, max_position_embeddings=2 * T)
    return _classifier("deberta_v2", transformers.DebertaV2ForSequenceClassification(cfg), _text, 3)


def _mobilebert() -> memfit.Workload:
    cfg = transformers.MobileBertConfig(
        **_DECODER, embedding_size=WIDTH, intra_bottleneck_size=WIDTH // 2, true_hidden_size=WIDTH // 2, num_labels=3,
    )  # fmt: skip
    return _classifier("mobilebert", transformers.MobileBertForSequenceClassification(cfg), _text, 3)


FAMILIES: dict[str, Callable[[], memfit.Workload]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "qwen2": _qwen2,
    "gpt_neox": _gpt_neox,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "gemma2": _gemma2,
    "phi": _phi,
    "falcon": _falcon,
    "t5": _t5,
    "bart": _bart,
    "bert": _bert,
    "vit": _vit,
    "resnet": _resnet,
    "convnext": _convnext,
    "peft_lora_llama": _peft_lora_llama,
    "whisper": _whisper,
    "mamba": _mamba,
    "recurrent_gemma": _recurrent_gemma,
    "deepseek_v3": _deepseek_v3,
    "beit": _beit,
    "swin": _swin,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma3": _gemma3,
    "olmo2": _olmo2,
    "mistral": _mistral_sliding,
    "phi3": _phi3,
    "starcoder2": _starcoder2,
    "stablelm": _stablelm,
    "cohere": _cohere,
    "granite": _granite,
    "gptj": _gptj,
    "codegen": _codegen,
    "bloom": _bloom,
    "deberta_v2": _deberta_v2,
    "mobilebert": _mobilebert,
}
CHAINS = {
    "t5": "encoder.block,decoder.block",
    "bart": "model.encoder.layers,model.decoder.layers",
    "resnet": ",".join(f"resnet.encoder.stages.{i}.layers" for i in range(4)),
    "convnext": ",".join(f"convnext.encoder.stages.{i}.layers" for i in range(4)),
    "whisper": "model.encoder.layers,model.decoder.layers",
    "swin": "swin.encoder.layers.0.blocks,swin.encoder.layers.1.blocks",
}
"""Models whose blocks sit in several containers: the chain discovery must find (checked, not set)."""
BATCHNORM = {"resnet"}
"""BatchNorm in train mode: accumulated micro-batches normalise with micro-batch statistics
(ghost BatchNorm), so the float64 accumulation check differs from one whole batch by design."""
MOE = {"mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe"}


def _exact_accumulation(model: nn.Module) -> None:
    """MoE settings for the float64 accumulation check. Not exact by design, so off there (the plan
    test keeps them): router jitter is noise drawn per call (like dropout, which
    verify_accumulation turns off; measured 0.81 on a gate weight), and the load-balancing loss is
    not a sum over samples (7e-4). torch's grouped_mm (the default experts kernel) has no float64
    kernel."""
    model.set_experts_implementation("eager")
    for mod in model.modules():
        if hasattr(mod, "jitter_noise"):
            mod.jitter_noise = 0.0
    model.config.output_router_logits = False


def _albert(blocks: str | None = None) -> memfit.Workload:
    # One layer shared across depth: AlbertTransformer runs albert_layer_groups[0] num_hidden_layers times.
    model = transformers.AlbertForSequenceClassification(
        transformers.AlbertConfig(**_DECODER, embedding_size=16, num_labels=3)
    )
    if blocks is not None:
        memfit.set_blocks(model, blocks)
    return _classifier("albert", model, _text, 3)


REFUSED: dict[str, tuple[Callable[[], memfit.Workload], str]] = {
    "albert": (_albert, r"no nn.ModuleList or nn.Sequential with two or more children.*holds one block.*ALBERT"),
    "albert_named": (
        lambda: _albert("albert.encoder.albert_layer_groups"),
        r"albert_layer_groups.0 \(AlbertLayerGroup\) ran 4 times in one forward.*gradient_checkpointing_enable",
    ),
}
"""Families refused by design at profile time, with the message (one line) that says why and what
to do. A block run several times per forward (ALBERT's shared layer) was planned with memory
predicted from its first run only: 1.27 MB predicted, 0.73 MB measured (gradients were exact)."""


def _build(family: str) -> memfit.Workload:
    torch.manual_seed(0)
    wl = FAMILIES[family]()
    return wl


# --- the checks ---------------------------------------------------------------------------------


PREDICTION_GAPS: dict[str, str] = {}
"""Families whose plan verify fails on the peak against the prediction (a defect of the cost model,
found by the check; strict: the test fails once the prediction holds). BLOOM's was here (3.5 to 5.2 %
over: its blocks return their attention probabilities, which its loop holds until the next block
returns) until the cost model counted what a forward drops (NOTE [ Tensors the forward drops ])."""


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=PREDICTION_GAPS[f])) if f in PREDICTION_GAPS else f
        for f in FAMILIES
    ],
)
def test_plan_within_budget_and_verified(family: str) -> None:
    wl = _build(family)
    if family in CHAINS:
        assert discover_chain(wl.model).path == CHAINS[family]
    stats = memfit.profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
    assert len(stats.blocks) >= 2
    store_all = stats.peak_bytes
    try:
        memfit.plan_for_budget(wl, 1, stats=stats)
    except BudgetInfeasibleError as err:
        min_bytes = err.min_budget_bytes
    assert min_bytes is not None and min_bytes < store_all, (min_bytes, store_all)
    budget = (min_bytes + store_all) // 2
    res = memfit.plan_for_budget(wl, budget, stats=stats)
    plan = res.plan
    assert plan.recomputed or plan.segments or any(b.tiles for b in plan.blocks), (
        "a budget below store-all needs some recompute (a tiled MLP recomputes in backward too)"
    )
    result = verify(wl, plan, budget_bytes=budget, step=StepSpec(repeats=0))
    assert result.ok, result.to_dict()
    assert result.measured_peak_bytes <= budget
    assert abs(result.measured_peak_bytes - plan.predicted_peak_bytes) <= PREDICTION_RTOL * plan.predicted_peak_bytes, (
        result.measured_peak_bytes, plan.predicted_peak_bytes,
    )  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_accumulation_float64(family: str) -> None:
    wl = _build(family)
    if family in MOE:
        _exact_accumulation(wl.model)
    out = verify_accumulation(wl, 6, 4, plan="all", measure_memory=False)
    assert out["micro_steps"] == 2 and not out["missing_grads"], out
    if family in BATCHNORM:
        # Ghost BatchNorm by design: verify says so and offers the modes that check the rest exactly.
        assert out["batchnorm_train_layers"] > 0 and not out["ok"] and "bn='freeze'" in out["reason"], out
        out = verify_accumulation(wl, 6, 4, plan="all", measure_memory=False, bn="freeze")
    assert out["buffers_equal"], out
    if family in FLOAT32_INSIDE:
        assert out["float32_islands"] and out["grad_rtol"] == 1e-10, (FLOAT32_INSIDE[family], out)
    # An attention key bias has a zero gradient in exact arithmetic (softmax ignores a shift of a
    # row's scores): judged against the floor tied to the largest gradient (memfit.verification.gradients).
    assert out["ok"], out


@pytest.mark.parametrize("family", list(REFUSED))
def test_refused_at_profile_with_one_line(family: str) -> None:
    torch.manual_seed(0)
    build, message = REFUSED[family]
    wl = build()
    with pytest.raises(memfit.UnsupportedModelError, match=message) as err:
        memfit.profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
    assert "\n" not in str(err.value)


def _table() -> None:
    """Print the zoo's measured table (``python tests/zoo/test_zoo.py``): what each check measured."""
    torch.set_num_threads(1)
    print("| family | blocks | store-all | least peak | budget | predicted | measured | verify | accumulation fp64 |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 2**20
    for family in FAMILIES:
        wl = _build(family)
        stats = memfit.profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
        try:
            memfit.plan_for_budget(wl, 1, stats=stats)
        except BudgetInfeasibleError as err:
            min_bytes = err.min_budget_bytes or 0
        if min_bytes >= stats.peak_bytes:
            plan_cells = f"{min_bytes / mib:.2f} MiB | - | - | - | no saving"
        else:
            budget = (min_bytes + stats.peak_bytes) // 2
            plan = memfit.plan_for_budget(wl, budget, stats=stats).plan
            r = verify(wl, plan, budget_bytes=budget, step=StepSpec(repeats=0))
            plan_cells = (
                f"{min_bytes / mib:.2f} MiB | {budget / mib:.2f} MiB | {plan.predicted_peak_bytes / mib:.2f} MiB | "
                f"{r.measured_peak_bytes / mib:.2f} MiB ({len(plan.recomputed)} recomputed) | "
                f"{'ok' if r.ok else 'FAIL'} {r.max_grad_rel_err:.1e}"
            )
        wl = _build(family)
        if family in MOE:
            _exact_accumulation(wl.model)
        out = verify_accumulation(wl, 6, 4, plan="all", measure_memory=False)
        acc = (
            f"{'ok' if out['ok'] else 'not ok'} {out['max_grad_rel_err']:.1e} ({out['worst_param'].rsplit('.', 2)[-2]})"
        )
        print(
            f"| {family} | {len(stats.blocks)} | {stats.peak_bytes / mib:.2f} MiB | {plan_cells} | {acc} |", flush=True
        )


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    _table()


def test_a_tensor_every_decoder_layer_takes_does_not_end_their_backwards() -> None:
    """BART's decoder layers all take the encoder's states; that tensor's gradient exists only
    once every layer's backward is done, so it must not mark where a layer's backward ends (it
    did: the windows of decoder layers 0-2 collapsed, their recompute backward peak read 0 B, and
    a segment with a recomputed last layer was predicted 248,256 B under its measured peak, over
    the budget the zoo test gave it). Every plan of this list is predicted to the byte."""
    from memfit.plan import KeepAll, policy_plan
    from memfit.plan.costmodel import ChainCosts, predict
    from memfit.plan.types import BlockDecision, Option, Segment

    wl = _build("bart")
    stats = memfit.profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
    costs = ChainCosts.from_stats(stats)
    assert all(costs.options[i]["recompute"].bwd_peak_bytes > 0 for i in range(len(costs)))
    base = policy_plan(wl.model, KeepAll()).with_(chain_path=stats.chain_path, fingerprint=stats.fingerprint)
    for recomputed, segments in [((6,), ((5, 7),)), ((6,), ((4, 7),)), ((), ((5, 7),)), ((4, 5, 6, 7), ())]:
        blocks = tuple(
            BlockDecision(name=b.name, option=Option.RECOMPUTE if i in recomputed else Option.KEEP)
            for i, b in enumerate(base.blocks)
        )
        plan = base.with_(blocks=blocks, segments=tuple(Segment(start=a, stop=b) for a, b in segments))
        measured = verify(wl, plan, budget_bytes=1 << 40, step=StepSpec(repeats=0)).measured_peak_bytes
        assert measured == predict(costs, plan).peak_bytes, (recomputed, segments)
