"""Workload specs, batch helpers and the built-in workloads (demo, hf:TYPE, example files)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import SpecError
from memfit.models.registry import _parse_overrides, load_workload
from memfit.workload import (
    Workload,
    batch_size_of,
    cast_batch,
    mean_loss,
    reduce_loss,
    split_batch,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HAS_HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")

DEMO_TINY = "demo?n_layer=2&n_embd=32&n_head=2&seq_len=32"
HF_TINY = "num_hidden_layers=2&hidden_size=64&num_attention_heads=2&intermediate_size=128&vocab_size=128"


# --- spec parsing --------------------------------------------------------------------------------


def test_overrides_are_parsed_with_types() -> None:
    got = _parse_overrides("llama?a=2&b=0.5&c=true&d=None&e=silu", "llama")
    assert got == {"a": 2, "b": 0.5, "c": True, "d": None, "e": "silu"}
    assert _parse_overrides("llama", "llama") == {}


def test_demo_spec_and_overrides() -> None:
    wl = load_workload(DEMO_TINY + "&dropout=0")
    assert isinstance(wl, Workload) and wl.blocks == "blocks" and wl.default_batch_size == 8
    assert isinstance(wl.model.blocks, nn.Sequential) and len(wl.model.blocks) == 2
    assert wl.info["config"] == {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "dropout": 0,
        "seq_len": 32,
        "vocab_size": 256,
    }
    assert wl.model.training
    assert wl.make_batch(3)["idx"].shape == (3, 32)


def test_demo_defaults() -> None:
    wl = load_workload("demo")
    cfg = wl.info["config"]
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["seq_len"]) == (12, 128, 4, 128)
    assert cfg["dropout"] == 0.1 and len(wl.model.blocks) == 12


def test_seq_len_option_sets_and_must_agree_with_the_spec() -> None:
    assert load_workload("demo?n_layer=1", seq_len=16).make_batch(2)["idx"].shape == (2, 16)
    assert load_workload("demo?n_layer=1&seq_len=16", seq_len=16).info["config"]["seq_len"] == 16
    with pytest.raises(SpecError, match="Give it once"):
        load_workload("demo?n_layer=1&seq_len=16", seq_len=32)


@pytest.mark.parametrize(
    ("spec", "fix"),
    [
        ("", "Use one of"),
        ("   ", "Use one of"),
        ("resnet50", "Use one of"),
        ("hf:", "Use one of"),
        ("demo?n_layer", "key=value"),
        ("demo?n_layers=2", "Valid keys: n_layer"),
        ("demo?n_embd=30&n_head=4", "multiple of n_head"),
        ("demo?n_layer=0", "positive integer"),
        ("demo?dropout=1.5", r"\[0, 1\)"),
        ("demo?vocab_size=100", "vocab_size >= 256"),
    ],
)
def test_bad_specs_raise_with_the_fix(spec: str, fix: str) -> None:
    with pytest.raises(SpecError, match=fix):
        load_workload(spec)


def test_file_spec_missing_file_and_missing_name(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no file"):
        load_workload(str(tmp_path / "nope.py") + ":build")
    f = tmp_path / "wl.py"
    f.write_text("def other():\n    return 1\n")
    with pytest.raises(SpecError, match=r"has no function 'build' \(it has: other\)"):
        load_workload(f"{f}:build")
    with pytest.raises(SpecError, match="must return"):
        load_workload(f"{f}:other")


@pytest.mark.parametrize("name", ["convnet", "custom_mlp"])
def test_example_file_workloads_run(name: str) -> None:
    wl = load_workload(f"{EXAMPLES / name}.py:build")
    batch = wl.make_batch(4)
    assert batch_size_of(batch) == 4
    loss = wl.loss_fn(wl.model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in wl.model.parameters())


def test_example_structures() -> None:
    conv = load_workload(f"{EXAMPLES / 'convnet.py'}:build").model
    assert isinstance(conv, nn.Sequential) and len(conv) >= 8
    assert all(isinstance(block, nn.Sequential) for block in conv)
    assert any(isinstance(m, nn.BatchNorm2d) for m in conv[0])
    mlp = load_workload(f"{EXAMPLES / 'custom_mlp.py'}:build").model
    assert isinstance(mlp.blocks, nn.ModuleList) and len(mlp.blocks) >= 4


# --- batch helpers -------------------------------------------------------------------------------


def test_split_batch_keeps_structure_and_order() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "y": (torch.arange(5), torch.tensor(3.0))}
    pieces = split_batch(batch, [2, 3])
    assert [batch_size_of(p) for p in pieces] == [2, 3]
    assert torch.equal(torch.cat([p["x"] for p in pieces]), batch["x"])
    assert torch.equal(pieces[1]["y"][0], torch.tensor([2, 3, 4]))
    assert pieces[0]["y"][1] is batch["y"][1]  # 0-dim tensors are shared, not split
    assert torch.equal(split_batch(torch.arange(4), [1, 3])[1], torch.tensor([1, 2, 3]))
    with pytest.raises(SpecError, match="add up to the batch size"):
        split_batch(batch, [2, 2])
    with pytest.raises(SpecError, match="positive"):
        split_batch(batch, [5, 0])


def test_batch_size_of_requires_agreement() -> None:
    assert batch_size_of([torch.zeros(3, 2), torch.zeros(3)]) == 3
    with pytest.raises(SpecError, match="disagree on dim 0"):
        batch_size_of((torch.zeros(3), torch.zeros(4)))


def test_cast_batch_converts_floating_tensors_only() -> None:
    batch = {
        "x": torch.zeros(2, 3),
        "ids": torch.ones(2, dtype=torch.long),
        "m": torch.ones(2).bool(),
    }
    out = cast_batch(batch, dtype=torch.float64, device="cpu")
    assert out["x"].dtype == torch.float64
    assert out["ids"].dtype == torch.long and out["m"].dtype == torch.bool


def test_reduce_loss_and_mean_loss() -> None:
    loss, count = reduce_loss(torch.tensor(2.0))
    assert count is None and loss.item() == 2.0
    loss, count = reduce_loss((torch.tensor(6.0), 3))
    assert isinstance(count, torch.Tensor) and count.item() == 3.0
    assert mean_loss((torch.tensor(6.0), torch.tensor(4))).item() == 1.5
    with pytest.raises(SpecError, match="loss.mean"):
        reduce_loss(torch.ones(3))
    with pytest.raises(SpecError, match="scalar tensor"):
        reduce_loss("nope")


# --- the demo workload ---------------------------------------------------------------------------


def _assert_right_padded(valid: torch.Tensor, ids: torch.Tensor, pad: int, T: int) -> None:
    lengths = valid.sum(1)
    # Right padding: each row's valid positions are exactly a prefix of it.
    assert torch.equal(valid, torch.arange(T)[None, :] < lengths[:, None])
    assert int(lengths.min()) >= T // 2 and int(lengths.max()) <= T
    assert len(set(lengths.tolist())) > 1  # variable length
    assert bool((ids[~valid] == pad).all())


def test_demo_batches_are_variable_length_and_right_padded() -> None:
    wl = load_workload(DEMO_TINY)
    torch.manual_seed(3)
    batch = wl.make_batch(16)
    assert batch["idx"].dtype == torch.long and batch["mask"].dtype == torch.bool
    _assert_right_padded(batch["mask"], batch["idx"], 0, 32)
    assert int(batch["idx"].max()) < 256
    torch.manual_seed(3)
    assert torch.equal(wl.make_batch(16)["idx"], batch["idx"])  # deterministic given the RNG


def test_demo_corpus_is_the_stdlib_source() -> None:
    from memfit.models.demo import load_corpus

    corpus = load_corpus()
    assert corpus.dtype == torch.uint8 and corpus.numel() >= 1 << 16
    assert load_corpus() is corpus  # cached
    assert b"def " in bytes(corpus[:200_000].tolist())


def _reference_next_token_loss(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> float:
    """Mean over rows and positions, written as plainly as possible."""
    total, n = 0.0, 0
    logp = F.log_softmax(logits.double(), dim=-1)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if valid[b, t] and valid[b, t + 1]:
                total -= float(logp[b, t, ids[b, t + 1]])
                n += 1
    return total / n


def test_demo_loss_matches_a_reference_and_count_fn() -> None:
    wl = load_workload(DEMO_TINY)
    wl.model.eval()  # dropout off, so two forwards agree
    batch = wl.make_batch(4)
    loss_sum, count = wl.loss_fn(wl.model, batch)
    assert isinstance(count, torch.Tensor) and int(count) == wl.count_fn(batch)
    assert int(count) == int((batch["mask"].sum(1) - 1).sum())
    with torch.no_grad():
        logits = wl.model(batch["idx"])
    ref = _reference_next_token_loss(logits, batch["idx"], batch["mask"])
    assert (loss_sum / count).item() == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
def test_demo_learns() -> None:
    # 60 AdamW steps must take the held-out loss from ~ln(256) = 5.5 to below the corpus's
    # unigram entropy (3.15 nats): the model uses context, so the demo trains for real.
    wl = load_workload("demo?n_layer=2&seq_len=64", seed=0)
    model = wl.model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    held_out = wl.make_batch(32)

    def held_out_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = mean_loss(wl.loss_fn(model, held_out)).item()
        model.train()
        return loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: one thread is as fast and immune to a busy machine
    try:
        before = held_out_loss()
        for _ in range(60):
            loss = mean_loss(wl.loss_fn(model, wl.make_batch(8)))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        after = held_out_loss()
    finally:
        torch.set_num_threads(threads)
    assert before > 5.0 and after < 3.05, (before, after)


def test_demo_blocks_compose_as_sequential_segments() -> None:
    wl = load_workload("demo?n_layer=4&n_embd=32&n_head=2&seq_len=16&dropout=0")
    blocks = wl.model.blocks
    x = torch.randn(2, 16, 32)  # (B, T, C)
    segments = nn.Sequential(blocks[:2], blocks[2:])
    torch.testing.assert_close(segments(x), blocks(x))


def test_same_seed_gives_the_same_weights() -> None:
    a = load_workload(DEMO_TINY, seed=7).model.state_dict()
    b = load_workload(DEMO_TINY, seed=7).model.state_dict()
    c = load_workload(DEMO_TINY, seed=8).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_demo_dtype_option() -> None:
    wl = load_workload(DEMO_TINY, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in wl.model.parameters())
    loss_sum, _ = wl.loss_fn(wl.model, wl.make_batch(2))
    assert loss_sum.dtype == torch.float64


# --- hf:TYPE workloads ---------------------------------------------------------------------------


@needs_hf
def test_hf_overrides_reach_the_config() -> None:
    wl = load_workload("hf:llama?num_hidden_layers=2&hidden_size=64", seq_len=16)
    cfg = wl.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (2, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 4, 8192)
    assert cfg.use_cache is True and wl.model.training  # the library's default: memfit adapts
    assert len(wl.model.model.layers) == 2
    assert wl.info["model_type"] == "llama" and wl.info["task"] == "causal-lm"
    assert wl.info["num_params"] == sum(p.numel() for p in wl.model.parameters())


@needs_hf
def test_hf_model_specific_names_win_over_the_defaults() -> None:
    cfg = load_workload("hf:gpt2?n_layer=2&n_embd=64&n_head=2", seq_len=16).model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head) == (2, 64, 2)
    # the generic intermediate_size reaches GPT-2's n_inner and OPT's ffn_dim
    assert load_workload(f"hf:gpt2?{HF_TINY}", seq_len=16).model.config.n_inner == 128
    assert load_workload(f"hf:opt?{HF_TINY}", seq_len=16).model.config.ffn_dim == 128


@needs_hf
def test_hf_gpt2_defaults() -> None:
    wl = load_workload("hf:gpt2")
    cfg = wl.model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (12, 256, 4, 8192)
    assert wl.default_batch_size == 4 and wl.blocks is None
    assert wl.make_batch(wl.default_batch_size)["input_ids"].shape == (4, 256)
    assert wl.info["attn_implementation"] == "sdpa"


@needs_hf
@pytest.mark.parametrize(
    ("model_type", "width_key", "ffn_key"),
    [
        ("gpt2", "n_embd", "n_inner"),
        ("llama", "hidden_size", "intermediate_size"),
        ("bert", "hidden_size", "intermediate_size"),
        ("opt", "hidden_size", "ffn_dim"),
        ("distilbert", "dim", "hidden_dim"),
        ("vit", "hidden_size", "intermediate_size"),
    ],
)
def test_hf_a_given_width_gets_the_librarys_feed_forward_width(model_type: str, width_key: str, ffn_key: str) -> None:
    """A spec is the library's defaults plus the user's values: memfit's small feed-forward width
    (4 x its width 256) must not stay under a width the user gave."""
    import transformers

    width = 128
    user = {width_key: width, "num_hidden_layers": 1}
    cfg = load_workload(f"hf:{model_type}?{width_key}={width}&num_hidden_layers=1").model.config
    library = transformers.AutoConfig.for_model(model_type, **user)
    assert getattr(cfg, ffn_key) == getattr(library, ffn_key) != 1024
    # and without a width, memfit's small consistent sizes stay
    small = load_workload(f"hf:{model_type}?num_hidden_layers=1").model.config
    assert (small.hidden_size, getattr(small, ffn_key)) == (256, 1024)


@needs_hf
def test_hf_given_heads_get_the_librarys_key_value_grouping() -> None:
    def kv(spec: str) -> tuple[int, int]:
        cfg = load_workload(spec, seq_len=16).model.config
        return cfg.num_attention_heads, cfg.num_key_value_heads

    assert kv("hf:mistral?num_hidden_layers=1") == (4, 4)  # memfit's small model: plain multi-head
    assert kv("hf:mistral?num_hidden_layers=1&num_attention_heads=16") == (16, 8)  # MistralConfig's 8
    assert kv("hf:llama?num_hidden_layers=1&num_attention_heads=8") == (8, 8)  # LlamaConfig: None = the heads
    assert kv("hf:mistral?num_hidden_layers=1&num_attention_heads=16&num_key_value_heads=2") == (16, 2)


@needs_hf
def test_hf_rotary_families_keep_their_own_positions_and_tables_stay_small() -> None:
    """memfit's 512 positions size a learned table; a rotary model holds no table, so a longest-sequence
    search on it stops where its family's config does, not at memfit's small default."""
    import transformers

    for model_type in ("llama", "qwen2", "gpt_neox"):
        lim = load_workload(f"hf:{model_type}?num_hidden_layers=1&hidden_size=32&num_attention_heads=2").positions
        library = transformers.AutoConfig.for_model(model_type).max_position_embeddings
        assert lim is not None and (lim.kind, lim.max_positions) == ("rope", library) and library > 512
    assert (
        load_workload("hf:llama?num_hidden_layers=1&max_position_embeddings=300", seq_len=16).positions.max_positions
        == 300
    )
    gpt2 = load_workload("hf:gpt2?n_layer=1&n_embd=32&n_head=2")
    assert (gpt2.positions.kind, gpt2.positions.max_positions) == ("learned", 512)
    assert gpt2.model.transformer.wpe.num_embeddings == 512


@needs_hf
def test_hf_gpt2_width_from_the_spec_builds_a_4x_mlp() -> None:
    model = load_workload("hf:gpt2?n_embd=2048&n_layer=1&n_head=16&vocab_size=64", seq_len=16).model
    assert tuple(model.transformer.h[0].mlp.c_fc.weight.shape) == (2048, 4 * 2048)  # Conv1D: (in, out)
    cfg = load_workload("hf:gpt2?n_embd=64&n_inner=96&n_layer=1&n_head=2", seq_len=16).model.config
    assert cfg.n_inner == 96  # the user's value wins


@needs_hf
@pytest.mark.parametrize(
    ("spec", "fix"),
    [
        ("hf:gpt2?num_layer=2", r"did you mean .*n_layer"),
        ("hf:llam", "Did you mean 'llama'"),
        ("hf:t5", "encoder-decoder"),
        ("hf:bert?hidden_size=66", "hidden_size divisible"),
        ("hf:vit?seq_len=16", "image_size"),
    ],
)
def test_hf_bad_specs_raise_with_the_fix(spec: str, fix: str) -> None:
    with pytest.raises(SpecError, match=fix):
        load_workload(spec)


def test_hf_without_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(SpecError, match=r"pip install memfit\[hf\]"):
        load_workload("hf:gpt2")


@needs_hf
def test_hf_causal_lm_batches_loss_and_count() -> None:
    wl = load_workload(f"hf:gpt2?{HF_TINY}", seq_len=32)
    torch.manual_seed(0)
    batch = wl.make_batch(8)
    assert set(batch) == {"input_ids", "attention_mask"}
    assert batch["attention_mask"].dtype == torch.long
    _assert_right_padded(batch["attention_mask"].bool(), batch["input_ids"], 0, 32)
    assert int(batch["input_ids"].max()) < 128

    wl.model.eval()
    loss_sum, count = wl.loss_fn(wl.model, batch)
    assert int(count) == wl.count_fn(batch) == int((batch["attention_mask"].sum(1) - 1).sum())
    with torch.no_grad():
        logits = wl.model(**batch).logits
    ref = _reference_next_token_loss(logits, batch["input_ids"], batch["attention_mask"].bool())
    assert (loss_sum / count).item() == pytest.approx(ref, rel=1e-5)


@needs_hf
def test_hf_masked_lm_batches_loss_and_count() -> None:
    wl = load_workload(f"hf:bert?{HF_TINY}", seq_len=32)
    assert wl.info["task"] == "masked-lm"
    mask_id = wl.info["mask_token_id"]
    torch.manual_seed(0)
    batch = wl.make_batch(8)
    valid = batch["attention_mask"].bool()
    _assert_right_padded(valid, batch["input_ids"], 0, 32)
    labelled = batch["labels"] != -100
    assert bool((labelled.sum(1) >= 1).all())  # at least one target per row
    assert not bool((labelled & ~valid).any())  # never on padding
    assert bool((batch["input_ids"][labelled] == mask_id).all())
    assert 0.05 < labelled.sum().item() / valid.sum().item() < 0.3

    wl.model.eval()
    loss_sum, count = wl.loss_fn(wl.model, batch)
    assert int(count) == wl.count_fn(batch) == int(labelled.sum())
    with torch.no_grad():
        logits = wl.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = F.log_softmax(logits.double(), dim=-1)
    ref = -sum(float(logp[b, t, batch["labels"][b, t]]) for b in range(8) for t in range(32) if labelled[b, t]) / int(
        labelled.sum()
    )
    assert (loss_sum / count).item() == pytest.approx(ref, rel=1e-5)


@needs_hf
@pytest.mark.parametrize("model_type", ["gpt2", "llama", "bert", "vit"])
def test_hf_forward_backward(model_type: str) -> None:
    extra = "&image_size=32&patch_size=8" if model_type == "vit" else "&vocab_size=128"
    spec = f"hf:{model_type}?num_hidden_layers=2&hidden_size=64&num_attention_heads=2{extra}"
    wl = load_workload(spec, seq_len=None if model_type == "vit" else 16)
    loss = mean_loss(wl.loss_fn(wl.model, wl.make_batch(2)))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in wl.model.parameters() if p.requires_grad)


@needs_hf
def test_hf_same_seed_gives_the_same_weights() -> None:
    spec = f"hf:llama?{HF_TINY}"
    a = load_workload(spec, seed=1).model.state_dict()
    b = load_workload(spec, seed=1).model.state_dict()
    c = load_workload(spec, seed=2).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
