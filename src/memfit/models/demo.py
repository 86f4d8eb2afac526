"""The built-in demo workload: a small GPT on the Python standard library's own source code.

A byte-level (vocab 256) GPT written the nanoGPT way: token + position embedding, ``n_layer``
pre-LN transformer blocks held in ``model.blocks`` (an ``nn.Sequential``), a final LayerNorm and a
language-model head. Every block takes one tensor ``(B, T, C)`` and returns one tensor
``(B, T, C)``, so any run of consecutive blocks is itself a valid ``nn.Sequential`` segment: the
shape activation checkpointing works on.

The corpus is built at run time from text every Python installation has (the standard library's
``.py`` files), so the demo needs no download and no data files. Batches are windows of that text
with random lengths, right-padded to a fixed ``T``; the loss is token-level, returned as
``(loss_sum, count)`` so gradient accumulation can normalise by the global number of valid tokens.

Example:
    >>> from memfit.models.registry import load_workload
    >>> wl = load_workload("demo?n_layer=2")
    >>> batch = wl.make_batch(2)
    >>> loss_sum, count = wl.loss_fn(wl.model, batch)
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import SpecError
from memfit.workload import PositionLimit, Workload

__all__ = [
    "GPT",
    "DemoConfig",
    "build_demo_workload",
    "demo_count",
    "demo_loss",
    "load_corpus",
    "make_demo_batch",
]

CORPUS_MAX_BYTES = 4 * 1024 * 1024  # 4 MiB: plenty for a demo, read in well under a second
PAD_ID = 0  # byte 0 never occurs in source text, so it is free to mark padding


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """Size of the demo GPT and of its batches.

    Attributes:
        n_layer: number of transformer blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        n_embd: model width ``C``.
        dropout: probability of the ``nn.Dropout`` modules (embedding, attention output, MLP).
        seq_len: tokens per row ``T`` (also the number of position embeddings).
        vocab_size: tokens in the vocabulary; at least 256, since tokens are bytes.
    """

    n_layer: int = 12
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1
    seq_len: int = 128
    vocab_size: int = 256


def build_demo_workload(*, overrides: dict[str, Any], seq_len: int | None) -> Workload:
    """Build the demo workload: the small GPT, its batches and its token-level loss.

    Args:
        overrides: config fields to change, by :class:`DemoConfig` field name
            (``n_layer``, ``n_head``, ``n_embd``, ``dropout``, ``seq_len``, ``vocab_size``).
        seq_len: tokens per row; overrides the default (and must agree with a ``seq_len``
            override when both are given).

    Returns:
        A :class:`~memfit.workload.Workload` whose ``make_batch(B)`` returns
        ``{"idx": LongTensor (B, T), "mask": BoolTensor (B, T)}`` and whose ``loss_fn`` returns
        ``(loss_sum, count)`` over valid next-token predictions.

    Raises:
        SpecError: an unknown override key, a value of the wrong type or range, or ``n_head``
            not dividing ``n_embd``.
    """
    cfg = _make_config(overrides, seq_len)
    corpus = load_corpus()  # reads files only: the weights below draw the same random numbers
    if cfg.seq_len >= corpus.numel():
        raise SpecError(
            f"memfit.models.demo: seq_len={cfg.seq_len} is longer than the demo corpus "
            f"({corpus.numel()} bytes), so no window of it fits a row. Use a smaller --seq-len, e.g. 128."
        )
    model = GPT(cfg)
    model.train()

    def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
        return make_demo_batch(corpus, batch_size, cfg.seq_len)

    def make_batch_at(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        return make_demo_batch(corpus, batch_size, seq_len)

    name = "demo"
    if overrides:
        name += "?" + "&".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    info = {
        "config": asdict(cfg),
        "num_params": sum(p.numel() for p in model.parameters()),
        "corpus_bytes": corpus.numel(),
        "seq_len": cfg.seq_len,
    }
    return Workload(
        name=name,
        model=model,
        make_batch=make_batch,
        loss_fn=demo_loss,
        count_fn=demo_count,
        default_batch_size=8,
        blocks="blocks",
        info=info,
        make_batch_at=make_batch_at,
        positions=PositionLimit(max_positions=cfg.seq_len, kind="learned"),
    )


def make_demo_batch(corpus: torch.Tensor, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Random windows of ``corpus`` with random lengths, right-padded to ``seq_len``.

    Each row has a length drawn uniformly from ``[seq_len // 2, seq_len]``; the rest of the row is
    ``PAD_ID`` and ``mask`` is False there. Uses the torch global RNG, so it is deterministic
    given ``torch.manual_seed``.

    Args:
        corpus: uint8 tensor of bytes, longer than ``seq_len``.
        batch_size: rows ``B``.
        seq_len: row length ``T`` (fixed, so batch shapes are stable).

    Returns:
        ``{"idx": LongTensor (B, T), "mask": BoolTensor (B, T)}``.
    """
    B, T = batch_size, seq_len
    lengths = torch.randint(T // 2, T + 1, (B,))  # (B,)
    starts = torch.randint(0, corpus.numel() - T, (B,))  # (B,)
    pos = torch.arange(T)  # (T,)
    idx = corpus[starts[:, None] + pos[None, :]].long()  # (B, T)
    mask = pos[None, :] < lengths[:, None]  # (B, T)
    idx = idx.masked_fill(~mask, PAD_ID)
    return {"idx": idx, "mask": mask}


def demo_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over valid positions, and their number.

    Position ``t`` predicts ``idx[t + 1]``; it counts only where both ``t`` and ``t + 1`` are valid.

    Args:
        model: the demo :class:`GPT` (or any model mapping ``idx (B, T)`` to logits ``(B, T, V)``).
        batch: ``{"idx": (B, T), "mask": (B, T)}`` from ``make_batch``.

    Returns:
        ``(loss_sum, count)``: a scalar tensor and a 0-dim int64 tensor.
    """
    targets = _next_token_targets(batch["idx"], batch["mask"])  # (B, T)
    logits = model(batch["idx"])  # (B, T, V)
    # Flattening the full logits is a view (no copy of B*T*V floats); the last position of each
    # row is excluded through ignore_index rather than by slicing the logits.
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, (targets != -100).sum()


def demo_count(batch: dict[str, torch.Tensor]) -> int:
    """Number of valid next-token predictions in a batch (the ``count`` of :func:`demo_loss`)."""
    mask = batch["mask"]
    return int((mask[:, 1:] & mask[:, :-1]).sum())


@functools.lru_cache(maxsize=1)
def load_corpus(max_bytes: int = CORPUS_MAX_BYTES) -> torch.Tensor:
    """The demo corpus: the standard library's ``.py`` files, as bytes.

    Files are read in sorted path order (walking directories in sorted order, skipping
    ``site-packages``) until ``max_bytes`` are read, so the corpus is the same on every run of the
    same Python. Nothing is written to disk.

    Args:
        max_bytes: cap on the corpus size in bytes.

    Returns:
        A uint8 tensor of at most ``max_bytes`` bytes. Do not modify it: it is cached.
    """
    chunks: list[bytes] = []
    total = 0
    for path in _iter_source_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 1 << 16:
        # A Python without its source files (an embedded or frozen build): fall back to memfit's
        # own source, repeated, so the demo still runs.
        own = b"".join(p.read_bytes() for p in sorted(Path(__file__).parents[1].rglob("*.py")))
        data = (own * (1 + (1 << 20) // max(len(own), 1)))[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# --- model ---------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # (B, T, C)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        # No attention dropout: randomness stays in nn.Dropout modules, where it is easy to see.
        # Right padding needs no mask here: a valid position only attends to earlier positions,
        # which are valid too.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``C -> 4C -> C`` with GELU."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """A pre-LN transformer block: one tensor ``(B, T, C)`` in, one tensor ``(B, T, C)`` out."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """The demo GPT: ``idx (B, T)`` long -> logits ``(B, T, vocab_size)``.

    Args:
        cfg: sizes; see :class:`DemoConfig`.
    """

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.n_layer)))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # NOTE [demo init]: the head is not tied to the token embedding, and the embedding starts
        # at unit scale (PyTorch's own default) rather than GPT-2's 0.02. Then the current byte
        # dominates the residual stream at init and the head learns bigram statistics at once:
        # in 60 AdamW steps (lr 3e-3, batch 8) the loss falls to ~2.7 instead of stalling at the
        # unigram entropy (~3.15 nats), which tied 0.02 embeddings did.
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance
        # from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        if T > self.config.seq_len:
            raise ValueError(
                f"memfit.models.demo: sequence of {T} tokens is longer than the model's "
                f"{self.config.seq_len} positions. Build it with a larger seq_len."
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        x = self.blocks(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)


# --- private helpers -----------------------------------------------------------------------------


def _next_token_targets(idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Targets ``(B, T)``: ``idx[:, t + 1]`` where positions ``t`` and ``t + 1`` are valid, else -100."""
    targets = torch.full_like(idx, -100)
    valid = mask[:, 1:] & mask[:, :-1]  # (B, T-1)
    targets[:, :-1] = idx[:, 1:].masked_fill(~valid, -100)
    return targets


def _make_config(overrides: dict[str, Any], seq_len: int | None) -> DemoConfig:
    valid = [f.name for f in fields(DemoConfig)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise SpecError(
            f"memfit.models.demo: unknown override(s) {', '.join(map(repr, unknown))}. "
            f"Valid keys: {', '.join(valid)}; e.g. 'demo?n_layer=6&n_embd=256'."
        )
    values = dict(overrides)
    if seq_len is not None:
        if "seq_len" in values and values["seq_len"] != seq_len:
            raise SpecError(
                f"memfit.models.demo: seq_len given twice with different values "
                f"({values['seq_len']} in the spec, {seq_len} as an option). Give it once."
            )
        values["seq_len"] = seq_len
    for key, value in values.items():
        if key == "dropout":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
                raise SpecError(
                    f"memfit.models.demo: dropout={value!r} is not a probability. "
                    "Give a number in [0, 1), e.g. 'demo?dropout=0'."
                )
        elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(
                f"memfit.models.demo: {key}={value!r} must be a positive integer, "
                f"e.g. 'demo?{key}={getattr(DemoConfig(), key)}'."
            )
    cfg = replace(DemoConfig(), **values)
    if cfg.n_embd % cfg.n_head:
        raise SpecError(
            f"memfit.models.demo: n_head={cfg.n_head} does not divide n_embd={cfg.n_embd}. "
            "Choose n_embd as a multiple of n_head, e.g. 'demo?n_embd=128&n_head=4'."
        )
    if cfg.vocab_size < 256:
        raise SpecError(
            f"memfit.models.demo: vocab_size={cfg.vocab_size} is below 256; the demo's tokens are "
            "bytes. Use vocab_size >= 256."
        )
    if cfg.seq_len < 2:
        raise SpecError(f"memfit.models.demo: seq_len={cfg.seq_len} leaves nothing to predict. Use seq_len >= 2.")
    return cfg


def _iter_source_files() -> Iterator[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for fname in sorted(filenames):
            if fname.endswith(".py"):
                yield Path(dirpath) / fname
