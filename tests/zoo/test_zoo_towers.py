"""Model zoo, part two: models whose blocks are not one stack.

Towers (CLIP's text and vision encoders, trained with its contrastive loss), a backbone with a neck
and a head (DPT for depth and for segmentation), stages whose blocks sit in lists of their own
(transformers' RegNet), and skip connections written as users write them in plain torch (a U-Net:
encoder and decoder lists of conv-norm blocks, a wider bottleneck, each encoder block's output
concatenated into a decoder block; a DenseNet: each layer takes the list of every earlier output).
For each family:

1. ``memfit.profile`` (keep and recompute), which measures the towers in the order the forward
   runs them; the chain it measured (``CHAINS``), the share of the bytes autograd saves that its
   blocks save (``chain_coverage``, at least ``MIN_COVERAGE``), and the lists left out
   (``LEFT_OUT``);
2. plans at three budgets (a quarter, half and three quarters of the way from the least peak any
   plan reaches to store-all), each checked by ``memfit.verification.plans.verify``: gradients and
   buffers equal the unmodified model's, the measured peak within the budget and within the
   prediction's tolerance (verify fails otherwise), and within ``PREDICTION_RTOL`` of the
   prediction either way.

timm is not used: its import needs torchvision (timm 1.0.31 imports ``torchvision.ops.misc`` in
``timm.layers.create_norm``), whose registry wheels are CUDA builds; transformers' RegNet and the
timm-style RegNet of ``tests/test_towers.py`` (stages registering blocks ``b1``, ``b2`` by name)
stand in. Run alone with ``pytest -m zoo tests/zoo/test_zoo_towers.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import DenseNet, UNet
from torch import nn

import memfit
from memfit import StepSpec
from memfit.errors import BudgetInfeasibleError
from memfit.plan.options import BASE_OPTIONS
from memfit.verification.plans import verify

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]

B, T, VOCAB, WIDTH, LAYERS, IMAGE = 4, 32, 128, 32, 4, 32
PREDICTION_RTOL = 0.03
"""Measured peak against predicted, either way: within 3 % (verify itself fails a peak over the
prediction by more than the cost model's 2 % margin)."""


def _workload(name: str, model: nn.Module, make_batch: Callable[[int], dict], loss_fn: Callable) -> memfit.Workload:
    return memfit.Workload(name=name, model=model.train(), make_batch=make_batch, loss_fn=loss_fn, default_batch_size=B)


def _unet() -> memfit.Workload:
    # Plain torch as a user writes it: segmentation with a per-pixel cross-entropy.
    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(b, 3, IMAGE, IMAGE), "y": torch.randint(0, 2, (b, IMAGE, IMAGE))}

    return _workload("unet", UNet(), make_batch, lambda m, b: F.cross_entropy(m(b["x"]), b["y"]))


def _densenet() -> memfit.Workload:
    # Plain torch: each layer takes the list of all earlier outputs, as torchvision's DenseNet layers.
    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(b, 3, IMAGE, IMAGE), "y": torch.randint(0, 5, (b,))}

    return _workload("densenet", DenseNet(), make_batch, lambda m, b: F.cross_entropy(m(b["x"]), b["y"]))


def _clip() -> memfit.Workload:
    # Text and vision towers of CLIPEncoderLayer; the forward runs the vision tower first.
    cfg = transformers.CLIPConfig(
        text_config={
            "vocab_size": VOCAB, "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH, "num_hidden_layers": LAYERS,
            "num_attention_heads": 4, "max_position_embeddings": 2 * T, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0,
        },
        vision_config={
            "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH, "num_hidden_layers": LAYERS,
            "num_attention_heads": 4, "image_size": IMAGE, "patch_size": 4,
        },
        projection_dim=16,
    )  # fmt: skip
    model = transformers.CLIPModel(cfg)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        lengths = torch.randint(T // 2, T + 1, (b,))
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (b, T)
        ids = torch.randint(4, VOCAB, (b, T)).masked_fill(mask == 0, 0)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(b, 3, IMAGE, IMAGE)}

    return _workload("clip", model, make_batch, lambda m, b: m(**b, return_loss=True).loss)


def _dpt_config(**kw: object) -> transformers.DPTConfig:
    return transformers.DPTConfig(
        image_size=IMAGE, patch_size=4, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=2 * WIDTH, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 32, 32],
        fusion_hidden_size=16, reassemble_factors=[4, 2, 1, 0.5], **kw,
    )  # fmt: skip


def _dpt_depth() -> memfit.Workload:
    # DPTForDepthEstimation computes no loss in training: an L1 loss on the depth map, resized to the
    # labels as its users do.
    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(b, 3, IMAGE, IMAGE), "depth": torch.rand(b, IMAGE, IMAGE)}

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        depth = m(pixel_values=b["pixel_values"]).predicted_depth  # (b, H', W')
        return F.l1_loss(F.interpolate(depth[:, None], size=(IMAGE, IMAGE), mode="bilinear")[:, 0], b["depth"])

    return _workload("dpt_depth", transformers.DPTForDepthEstimation(_dpt_config()), make_batch, loss_fn)


def _dpt_segmentation() -> memfit.Workload:
    # The model's own loss (with its auxiliary head).
    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(b, 3, IMAGE, IMAGE), "labels": torch.randint(0, 3, (b, IMAGE, IMAGE))}

    model = transformers.DPTForSemanticSegmentation(_dpt_config(num_labels=3))
    return _workload("dpt_segmentation", model, make_batch, lambda m, b: m(**b).loss)


def _regnet() -> memfit.Workload:
    # Stages of RegNetXLayer lists; 128 x 128 images, so that the blocks hold a real share of the step.
    cfg = transformers.RegNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 32, 32], depths=[1, 2, 2, 1], groups_width=8, num_labels=5
    )

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(b, 3, 4 * IMAGE, 4 * IMAGE), "labels": torch.randint(0, 5, (b,))}

    return _workload("regnet", transformers.RegNetForImageClassification(cfg), make_batch, lambda m, b: m(**b).loss)


FAMILIES: dict[str, Callable[[], memfit.Workload]] = {
    "unet": _unet,
    "densenet": _densenet,
    "clip": _clip,
    "dpt_depth": _dpt_depth,
    "dpt_segmentation": _dpt_segmentation,
    "regnet": _regnet,
}
CHAINS = {
    "unet": "encoder,decoder",
    "densenet": "layers",
    "clip": "vision_model.encoder.layers,text_model.encoder.layers",
    "dpt_depth": "dpt.encoder.layer",
    "dpt_segmentation": "dpt.encoder.layer",
    "regnet": ",".join(f"regnet.encoder.stages.{i}.layers" for i in range(4)),
}
"""The chain each family's profile measures, in the order the forward runs it."""
LEFT_OUT = {
    "dpt_depth": "neck.fusion_stage.layers",
    "dpt_segmentation": "neck.fusion_stage.layers",
}
"""A list of blocks outside the chain the profile names (its blocks save at least 5 %)."""
MIN_COVERAGE = {"unet": 0.85, "densenet": 0.95, "clip": 0.9, "dpt_depth": 0.09, "dpt_segmentation": 0.1, "regnet": 0.7}
"""The least share of the saved bytes each chain's blocks save (measured 0.904, 0.996, 0.954, 0.095,
0.110 and 0.776 when written; DPT's neck and heads save most of the rest)."""


def _build(family: str) -> memfit.Workload:
    torch.manual_seed(0)
    return FAMILIES[family]()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plans_within_budget_and_prediction_and_verified(family: str) -> None:
    wl = _build(family)
    stats = memfit.profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
    assert stats.chain_path == CHAINS[family]
    assert stats.chain_coverage is not None and stats.chain_coverage >= MIN_COVERAGE[family], stats.chain_coverage
    left_out = {p for p, share in stats.chain_left_out.items() if share >= 0.05}
    assert left_out == ({LEFT_OUT[family]} if family in LEFT_OUT else set()), stats.chain_left_out
    try:
        memfit.plan_for_budget(wl, 1, stats=stats)
    except BudgetInfeasibleError as err:
        least = err.min_budget_bytes
    assert least is not None and least < stats.peak_bytes, (least, stats.peak_bytes)
    for quarter in (1, 2, 3):
        budget = least + (stats.peak_bytes - least) * quarter // 4
        plan = memfit.plan_for_budget(wl, budget, stats=stats).plan
        result = verify(wl, plan, budget_bytes=budget, step=StepSpec(repeats=0))
        assert result.ok, (quarter, result.to_dict())
        assert result.measured_peak_bytes <= budget and result.peak_rtol is not None
        predicted = plan.predicted_peak_bytes
        assert abs(result.measured_peak_bytes - predicted) <= PREDICTION_RTOL * predicted, (
            quarter, result.measured_peak_bytes, predicted,
        )  # fmt: skip


@pytest.mark.parametrize("family", ["dpt_segmentation"])
def test_the_left_out_list_named_with_the_backbone_plans_and_verifies(family: str) -> None:
    """What profile says to do with DPT's neck (name it with the backbone) plans and verifies."""
    wl = _build(family)
    memfit.set_blocks(wl.model, CHAINS[family], LEFT_OUT[family])
    stats = memfit.profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
    assert stats.chain_coverage is not None and stats.chain_coverage >= 0.25
    budget = (stats.peak_bytes + memfit.plan_for_budget(wl, stats.peak_bytes, stats=stats).plan.min_budget_bytes) // 2
    plan = memfit.plan_for_budget(wl, budget, stats=stats).plan
    result = verify(wl, plan, budget_bytes=budget, step=StepSpec(repeats=0))
    assert result.ok and result.measured_peak_bytes <= budget, result.to_dict()
