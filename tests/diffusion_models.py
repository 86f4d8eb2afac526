"""Small diffusers models built from configs, as workloads (a U-Net, Flux, a VAE): the tests of chain
discovery and of the suggested ``set_blocks`` calls share them. Each skips its test where diffusers
is not installed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit


def unet_workload(*, width: int = 16, batch_size: int = 2) -> memfit.Workload:
    """A ``UNet2DConditionModel`` with a cross-attention down and up block, ``width``-pixel latents
    and channels ``(width, 2 * width)``."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(
        sample_size=width, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(width, 2 * width),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=width, attention_head_dim=8, norm_num_groups=8,
    ).train()  # fmt: skip

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(n, 4, width, width), "t": torch.randint(0, 1000, (n,)), "c": torch.randn(n, 5, width)}

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(b["x"], b["t"], encoder_hidden_states=b["c"]).sample.pow(2).mean()

    return memfit.Workload(
        name="unet", model=model, make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size
    )


def flux_workload() -> memfit.Workload:
    """A ``FluxTransformer2DModel`` with two double-stream and two single-stream blocks."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
    ).train()  # fmt: skip

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        return {
            "hidden_states": torch.randn(n, 256, 4), "encoder_hidden_states": torch.randn(n, 6, 16),
            "pooled_projections": torch.randn(n, 16), "timestep": torch.rand(n),
            "img_ids": torch.zeros(256, 3), "txt_ids": torch.zeros(6, 3),
        }  # fmt: skip

    return memfit.Workload(
        name="flux", model=model, make_batch=make_batch, loss_fn=lambda m, b: m(**b).sample.pow(2).mean(),
        default_batch_size=2,
    )  # fmt: skip


def vae_workload() -> memfit.Workload:
    """An ``AutoencoderKL`` with two encoder and two decoder blocks, trained to reconstruct."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.AutoencoderKL(
        block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8, latent_channels=4, layers_per_block=1,
    ).train()  # fmt: skip
    return memfit.Workload(
        name="vae", model=model, make_batch=lambda n: torch.randn(n, 3, 32, 32),
        loss_fn=lambda m, x: (m(x).sample - x).pow(2).mean(), default_batch_size=2,
    )  # fmt: skip
