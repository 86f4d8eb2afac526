"""A user model that keeps its blocks in an ``nn.ModuleList`` and passes them extra arguments.

``memfit profile --model examples/custom_mlp.py:build``

Unlike an ``nn.Sequential``, the chain of blocks here lives in ``self.blocks`` (a ModuleList) that
``forward`` iterates, and every block also receives a mask tensor and a float keyword
(``mask=..., scale=...``). memfit has to find the list on its own and carry those extra
arguments through its checkpoint wrappers unchanged.

The task: classify a set of up to ``N_ITEMS`` feature vectors (a padded set, with a validity mask)
by the class whose prototype the valid items were drawn around.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

N_ITEMS = 32  # set size N (padded)
D_IN = 16  # features per item
D_MODEL = 64  # width D
N_BLOCKS = 8
NUM_CLASSES = 5


class ResidualMLPBlock(nn.Module):
    """``x + scale * MLP(LayerNorm(x))`` on valid items only: ``(B, N, D) -> (B, N, D)``."""

    def __init__(self, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.dropout(self.fc2(F.gelu(self.fc1(self.ln(x)))))  # (B, N, D)
        return x + scale * h * mask[..., None].to(h.dtype)  # padded items stay unchanged


class SetClassifier(nn.Module):
    """Items ``(B, N, D_IN)`` with mask ``(B, N)`` -> class logits ``(B, NUM_CLASSES)``."""

    def __init__(self, n_blocks: int = N_BLOCKS, d_model: int = D_MODEL) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, d_model)
        self.blocks = nn.ModuleList(ResidualMLPBlock(d_model) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, NUM_CLASSES)
        self.residual_scale = 1.0 / n_blocks**0.5  # keeps the residual stream's scale steady

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, N, D)
        for block in self.blocks:
            h = block(h, mask=mask, scale=self.residual_scale)  # (B, N, D)
        w = mask[..., None].to(h.dtype)  # (B, N, 1)
        pooled = (self.ln_f(h) * w).sum(1) / w.sum(1).clamp_min(1)  # (B, D): mean of valid items
        return self.head(pooled)  # (B, NUM_CLASSES)


def build() -> tuple[nn.Module, Callable[[int], Any], Callable[[nn.Module, Any], torch.Tensor]]:
    """The workload: ``(model, make_batch, loss_fn)``.

    Returns:
        model: a :class:`SetClassifier` in train mode.
        make_batch: ``batch_size -> {"x": (B, N, D_IN) float, "mask": (B, N) bool, "y": (B,) long}``;
            each set has between ``N // 4`` and ``N`` valid items, the rest zero.
        loss_fn: ``(model, batch) -> mean cross-entropy`` (a scalar tensor).
    """
    model = SetClassifier().train()
    gen = torch.Generator().manual_seed(4321)  # private: leaves the global RNG to memfit
    prototypes = torch.randn(NUM_CLASSES, D_IN, generator=gen)  # (C, D_IN)

    def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
        B, N = batch_size, N_ITEMS
        y = torch.randint(0, NUM_CLASSES, (B,))  # (B,)
        lengths = torch.randint(N // 4, N + 1, (B,))  # (B,)
        mask = torch.arange(N)[None, :] < lengths[:, None]  # (B, N)
        x = prototypes[y][:, None, :] + torch.randn(B, N, D_IN)  # (B, N, D_IN)
        x = x * mask[..., None]
        return {"x": x, "mask": mask, "y": y}

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"], batch["mask"]), batch["y"])

    return model, make_batch, loss_fn
