"""A small conv net as a memfit file workload: ``memfit profile --model examples/convnet.py:build``.

The model is an ``nn.Sequential`` of blocks, each block itself an ``nn.Sequential`` of Conv2d,
BatchNorm2d, ReLU and Dropout2d, ending in a pooling / flatten / linear head. BatchNorm in train
mode is what makes recomputation delicate: a naive recompute would update its running statistics
twice (see docs/design.md), so this example exercises memfit's BatchNorm-safe recompute.

Images are 3 x 32 x 32 with 10 classes, drawn from the torch RNG around fixed class prototypes,
so the task is learnable and a training run shows the loss falling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)  # (C, H, W)
# (in channels, out channels, stride) of each conv block: 32x32 -> 16x16 -> 8x8 -> 4x4
CONV_BLOCKS = [
    (3, 16, 1),
    (16, 16, 1),
    (16, 32, 2),
    (32, 32, 1),
    (32, 64, 2),
    (64, 64, 1),
    (64, 128, 2),
    (128, 128, 1),
]


def conv_block(c_in: int, c_out: int, stride: int, dropout: float = 0.1) -> nn.Sequential:
    """Conv 3x3 -> BatchNorm -> ReLU -> Dropout2d: ``(B, c_in, H, W) -> (B, c_out, H/stride, W/stride)``."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.Dropout2d(p=dropout),
    )


def build_model() -> nn.Sequential:
    """The conv net: 8 conv blocks and a head block, ``(B, 3, 32, 32) -> (B, 10)`` logits."""
    blocks = [conv_block(c_in, c_out, stride) for c_in, c_out, stride in CONV_BLOCKS]
    head = nn.Sequential(
        nn.AdaptiveAvgPool2d(1),  # (B, 128, 1, 1)
        nn.Flatten(),  # (B, 128)
        nn.Linear(CONV_BLOCKS[-1][1], NUM_CLASSES),  # (B, 10)
    )
    return nn.Sequential(*blocks, head)


def build() -> tuple[nn.Module, Callable[[int], Any], Callable[[nn.Module, Any], torch.Tensor]]:
    """The workload: ``(model, make_batch, loss_fn)``.

    Returns:
        model: :func:`build_model`, in train mode.
        make_batch: ``batch_size -> (images (B, 3, 32, 32) float, labels (B,) long)``.
        loss_fn: ``(model, batch) -> mean cross-entropy`` (a scalar tensor).
    """
    model = build_model().train()
    # Fixed class prototypes from a private generator: the global RNG (and so the weights and
    # batches memfit seeds) is left alone.
    gen = torch.Generator().manual_seed(1234)
    prototypes = 0.5 * torch.randn(NUM_CLASSES, *IMAGE_SHAPE, generator=gen)  # (10, 3, 32, 32)

    def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, NUM_CLASSES, (batch_size,))  # (B,)
        images = prototypes[labels] + torch.randn(batch_size, *IMAGE_SHAPE)  # (B, 3, 32, 32)
        return images, labels

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    return model, make_batch, loss_fn
