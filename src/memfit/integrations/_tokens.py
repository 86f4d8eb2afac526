"""The tokens a Hugging Face model's loss averages over: what Trainer calls ``num_items_in_batch``.

Shared by the Trainer and accelerate adapters.

NOTE [ Counting a token batch ]
A batch is a *token batch* when it is a mapping whose integer ``labels`` have a sequence dimension
(``(B, T)``), or that carries ``shift_labels`` (padding-free collators). transformers' losses
average cross-entropy over the labels that are not ``-100``: ``ForCausalLMLoss`` predicts
``labels[:, t + 1]`` at position ``t``, so it averages over ``labels[..., 1:]`` (over
``shift_labels`` as given when the batch has them); the masked-LM and token-classification losses
and encoder-decoder models average over ``labels`` as they are. That is the rule of transformers
5.24's ``Trainer._get_num_items_in_batch``, with the loss resolved as the model resolves it (its
``loss_function`` property: ``GPT2LMHeadModel`` has ``loss_type=None`` and still shifts).
``attention_mask`` does not enter the count: the loss reads only the labels (a collator that
leaves padding in ``labels`` has its padding averaged over, and counted).

A micro-batch's mean loss times its count is its summed loss, so accumulation normalised by the
window's count is the big batch's (NOTE [ Normalisation ] in :mod:`memfit.accumulate.normalize`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memfit.workload import Batch

__all__ = ["base_model", "is_token_batch", "loss_shifts_labels", "token_counter"]

IGNORE_INDEX = -100  # transformers' (and torch's) ignore_index


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under DDP (``.module``) and PEFT (``get_base_model``) wrappers."""
    while isinstance(getattr(model, "module", None), nn.Module) and type(model).__name__ in (
        "DistributedDataParallel",
        "DataParallel",
    ):
        model = model.module
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def is_token_batch(batch: Any) -> bool:
    """True for a mapping with ``shift_labels``, or integer ``labels`` of shape ``(B, T, ...)``
    (float labels of that shape are multi-label targets, not tokens)."""
    if not isinstance(batch, Mapping):
        return False
    if torch.is_tensor(batch.get("shift_labels")):
        return True
    labels = batch.get("labels")
    return torch.is_tensor(labels) and labels.dim() >= 2 and not labels.is_floating_point()


def loss_shifts_labels(model: nn.Module) -> bool | None:
    """Whether ``model``'s own loss predicts ``labels[:, t + 1]`` at ``t``; None when it is not a
    transformers model (its loss cannot be read)."""
    base = base_model(model)
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    prop = getattr(type(base), "loss_function", None)
    if not isinstance(prop, property):
        return None
    from transformers.loss.loss_utils import ForCausalLMLoss

    return prop.fget(base) is ForCausalLMLoss


def token_counter(shifts: bool) -> Callable[[Batch], torch.Tensor]:
    """``batch -> tokens the loss averages over`` (a 0-dim int64 tensor on the labels' device)."""

    def count(batch: Batch) -> torch.Tensor:
        if torch.is_tensor(batch.get("shift_labels")):
            labels = batch["shift_labels"]
        else:
            labels = batch["labels"][..., 1:] if shifts else batch["labels"]
        return labels.ne(IGNORE_INDEX).sum()

    return count
