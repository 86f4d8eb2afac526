"""transformers' own losses in float64 for float64 models (``memfit verify --dtype float64``).

transformers' ``ForCausalLMLoss`` and ``ForMaskedLMLoss`` cast the logits to float32; for a
float64 model :func:`float64_loss` runs the same formula in the logits' dtype
(:mod:`memfit.models.hf` builds the workloads that use it).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Float64LossWarning", "causal_lm_loss", "float64_loss", "masked_lm_loss", "set_float64_loss"]


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``, except that only half-precision logits are upcast.

    transformers casts the logits to float32 before the cross-entropy, which for a float64 model
    (memfit's verification dtype) is a downcast: gradients would match the reference to 1e-7
    instead of 1e-15.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / (
            num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        )
    return loss


def masked_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForMaskedLMLoss``, except that only half-precision logits are upcast."""
    return causal_lm_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels=labels)


_EXACT_LOSSES = {"ForCausalLMLoss": causal_lm_loss, "ForMaskedLMLoss": masked_lm_loss}


class Float64LossWarning(UserWarning):
    """memfit computes a transformers loss in float64 for a float64 model (see :func:`float64_loss`)."""


@contextmanager
def float64_loss(model: nn.Module, *, warn: bool = True) -> Iterator[None]:
    """While in this context, float64 transformers models in ``model`` compute their loss in float64.

    transformers' ``ForCausalLMLoss`` and ``ForMaskedLMLoss`` cast the logits to float32
    (``logits.float()``), which for a float64 model is a downcast: gradients then carry float32
    rounding, and two float64 runs that differ only in summation order (accumulated micro-batches
    against the whole batch) differ by ~1e-7 instead of ~1e-15. Here the same formula runs in
    the logits' dtype. A model whose ``loss_function`` was set by someone (the user, memfit's
    chunked head) is left alone, and so are models in other dtypes. Undone on exit.

    Args:
        model: any model; its transformers submodules (``PreTrainedModel``) are looked at.
        warn: say once (a :class:`Float64LossWarning`) that the loss was changed.
    """
    changed = set_float64_loss(model, warn=warn)
    try:
        yield
    finally:
        for mod in changed:
            mod.__dict__.pop("_loss_function", None)


def set_float64_loss(model: nn.Module, *, warn: bool = True) -> list[nn.Module]:
    """:func:`float64_loss` without the undo (for a copy of a model); returns the modules changed."""
    changed: list[nn.Module] = []
    for mod in model.modules():
        prop = getattr(type(mod), "loss_function", None)
        if not isinstance(prop, property) or "_loss_function" in mod.__dict__:
            continue
        if next((p.dtype for p in mod.parameters() if p.is_floating_point()), None) != torch.float64:
            continue
        exact = _EXACT_LOSSES.get(getattr(prop.fget(mod), "__name__", ""))
        if exact is not None:
            mod.__dict__["_loss_function"] = exact
            changed.append(mod)
    if changed and warn:
        warnings.warn(
            f"memfit.models.hf: {type(changed[0]).__name__} computes its loss in float32 (transformers' logits.float()); for "
            "this float64 run memfit computes the same loss in float64.",
            Float64LossWarning,
            stacklevel=3,
        )
    return changed
