"""What the fake step (:mod:`memfit.estimation.fake`) counts besides bytes: FLOPs, and which
kernels' saved tensors (the CUDA ones, on a fake CPU device).

NOTE [ CUDA kernels on a fake CPU device ]
Two ops keep different tensors for backward on CPU and on CUDA, and the fake step runs on the
CPU device. Dropout: CUDA's fused kernel saves a 1-byte mask, the CPU path a noise tensor in the
input's dtype (2-4 bytes). Attention with dropout: CUDA's flash/efficient kernels keep only the
output and log-sum-exp, the CPU has no fused kernel with dropout and falls back to the math path,
which keeps the ``(B, heads, T, T)`` probabilities. With ``gpu_kernels`` (the default unless the
target is ``cpu``) a function mode routes both to the ops with the CUDA kernels' saved tensors
(``native_dropout``; the fused attention op, dropout included), so that a GPU estimate matches
a GPU step: on an H200 (bf16, AdamW; Llama, GPT-2 with dropout, the demo GPT, with and
without checkpointing) the fake peak equalled the real CUDA step's tracked peak within 0.02 %.
The other way round, float64 attention runs CUDA's math path (no fused CUDA kernel takes it) where
the CPU's flash kernel would keep linear memory: the mode routes it to SDPA's math path, which
keeps the ``(B, heads, T, T)`` probabilities as the GPU does (:func:`memfit.capture.attention.cuda_kernel`
says which kernel CUDA picks; NOTE [ Attention memory at long sequences ] there says what is
quadratic in the sequence and why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from memfit.capture.attention import AttentionKernel, cuda_kernel
from memfit.capture.tracker import MemoryTracker

__all__ = ["CudaKernels", "FlopCounter"]

_aten = torch.ops.aten


def _cpu_flash_forward_flop(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward_flop(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's flop counter knows the CUDA attention kernels; the fake step runs on the CPU device,
# whose flash-attention kernel does the same matmuls. They are counted as torch counts the CUDA
# ones: the full T x T score matrix, causal or not.
_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_cpu_flash_forward_flop),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_cpu_flash_backward_flop),
}


class FlopCounter(TorchDispatchMode):
    """FLOPs of the ops torch's ``flop_counter`` has formulas for, in total and by op.

    NOTE [ Not FlopCounterMode ]
    ``torch.utils.flop_counter.FlopCounterMode`` also attributes FLOPs to modules through a
    ``ModuleTracker`` whose backward hooks keep tensors alive longer: under it a small Llama's
    backward peak rose 7 % above the real step's. This mode only counts.
    """

    def __init__(self, *, log: list[tuple[int, int]] | None = None, tracker: MemoryTracker | None = None) -> None:
        super().__init__()
        self.flops = 0
        self.by_op: dict[str, int] = {}
        self.log = log
        self.tracker = tracker

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            n = int(formula(*args, **kwargs, out_val=out))
            self.flops += n
            name = func._overloadpacket.__name__
            self.by_op[name] = self.by_op.get(name, 0) + n
            if self.log is not None and self.tracker is not None:
                # the tracker is below this mode: it has counted this op already
                self.log.append((self.tracker.op_count, self.flops))
        return out


class CudaKernels(TorchFunctionMode):
    """Route dropout and dropout-attention to the ops CUDA runs (NOTE [ CUDA kernels on a fake
    CPU device ]); everything else passes through."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout or func is torch.dropout:
            names = ("input", "p", "training", "inplace") if func is F.dropout else ("input", "p", "train")
            a = {**dict(zip(names, args, strict=False)), **kwargs}
            x, p = a["input"], a.get("p", 0.5)
            train = a.get("training", a.get("train", True))
            if train and not a.get("inplace", False) and 0 < p < 1 and x.numel() > 0:
                return torch.native_dropout(x, p, True)[0]  # CUDA's fused kernel: bool mask
        elif func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            a = {**dict(zip(names, args, strict=False)), **kwargs}
            q, k = a["query"], a["key"]
            mask = a.get("attn_mask")
            if cuda_kernel(q.dtype, mask=mask is not None, head_dim=q.shape[-1]) is AttentionKernel.MATH:
                return _aten._scaled_dot_product_attention_math(
                    q,
                    k,
                    a["value"],
                    mask,
                    a.get("dropout_p", 0.0),
                    a.get("is_causal", False),
                    scale=a.get("scale"),
                    enable_gqa=a.get("enable_gqa", False),
                )[0]
            if (
                a.get("dropout_p", 0.0) > 0
                and q.dim() == 4
                and q.shape[1] == k.shape[1]
                and not a.get("enable_gqa", False)
            ):
                mask = a.get("attn_mask")
                if mask is not None and mask.dtype == torch.bool:
                    # as scaled_dot_product_attention does before any kernel (and keeps it
                    # for backward): a boolean mask becomes an additive one in q's dtype
                    neg_inf = torch.scalar_tensor(float("-inf"), dtype=q.dtype, device=q.device)
                    mask = torch.where(mask, 0.0, neg_inf)
                return _aten._scaled_dot_product_flash_attention_for_cpu(
                    q,
                    k,
                    a["value"],
                    a["dropout_p"],
                    a.get("is_causal", False),
                    attn_mask=mask,
                    scale=a.get("scale"),
                )[0]
        return func(*args, **kwargs)
