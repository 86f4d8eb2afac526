"""Which attention kernel a model runs, and whether its memory is linear or quadratic in the sequence.

``inspect_attention(workload)`` runs one forward (with the loss, no backward) and watches every
attention: each ``F.scaled_dot_product_attention`` call and the aten kernel it dispatched to, and
attention written out in Python (transformers' ``attn_implementation="eager"``: a matmul, a
softmax over ``(B, heads, T, T)`` scores, a matmul). It reports per kind of call the kernel, the
bytes autograd saves that are quadratic in the sequence, why, and what would make them linear.

NOTE [ Attention memory at long sequences ]
The fused kernels (CUDA flash, memory-efficient, cuDNN; the CPU's
``_scaled_dot_product_flash_attention_for_cpu``) keep ``q, k, v``, the output and a log-sum-exp for
backward: memory linear in ``T``. The math path of SDPA and eager attention keep the
``(B, heads, T, T)`` probabilities (and a dropout mask of the same shape): quadratic. An explicit
mask is quadratic whatever the kernel: transformers builds a ``(B, 1, T, T)`` mask for a padded
batch, SDPA turns a boolean one into an additive one in the query's dtype, and the kernel keeps it
for backward. What picks the path:

- the CPU's flash kernel takes every floating dtype and masks, but no dropout (the math path runs);
- on CUDA, flash takes float16/bfloat16, no explicit mask, head dim up to 256; memory-efficient
  takes float32 and masks; float64 runs the math path (:func:`cuda_kernel`);
- transformers' ``attn_implementation="eager"`` never calls SDPA.

So at long sequences: ``attn_implementation="sdpa"``, no padding mask (full-length rows, which
transformers turns into ``is_causal=True`` and no mask; ``padding=false`` in an ``hf:`` spec), no
attention dropout on the CPU, and a half dtype for CUDA's flash kernel. The quadratic bytes are
measured here as the saved storages whose last two dims are the sequence length twice.

Known limitations:
- One forward at the workload's own length and batch: a model whose attention path depends on the
  length (a sliding window switched on past some length) is seen at this length only.
- Attention written out by hand is recognised by its softmax over square ``(T, T)`` scores; a
  model that computes attention in another shape (chunked by hand) is reported as linear.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.capture.snapshot import leave_unchanged
from memfit.units import format_bytes
from memfit.workload import Workload, cast_batch, iter_tensors

__all__ = ["AttentionCall", "AttentionKernel", "AttentionReport", "cuda_kernel", "inspect_attention"]


class AttentionKernel(enum.StrEnum):
    """An attention implementation, named as a user would look it up."""

    FLASH = "flash"  # CUDA aten._scaled_dot_product_flash_attention
    EFFICIENT = "efficient"  # CUDA memory-efficient
    CUDNN = "cudnn"
    CPU_FLASH = "cpu_flash"  # aten._scaled_dot_product_flash_attention_for_cpu
    MATH = "math"  # SDPA's math path: matmul, softmax, matmul
    EAGER = "eager"  # attention written out in Python (transformers' eager)

    @property
    def quadratic(self) -> bool:
        """Whether the kernel keeps the ``(T, T)`` probabilities for backward."""
        return self in (AttentionKernel.MATH, AttentionKernel.EAGER)


_KERNEL_OF_OP = {
    "aten._scaled_dot_product_flash_attention_for_cpu": AttentionKernel.CPU_FLASH,
    "aten._scaled_dot_product_flash_attention": AttentionKernel.FLASH,
    "aten._flash_attention_forward": AttentionKernel.FLASH,
    "aten._scaled_dot_product_efficient_attention": AttentionKernel.EFFICIENT,
    "aten._efficient_attention_forward": AttentionKernel.EFFICIENT,
    "aten._scaled_dot_product_cudnn_attention": AttentionKernel.CUDNN,
    "aten._scaled_dot_product_fused_attention_overrideable": AttentionKernel.FLASH,
}
_SOFTMAX_OPS = frozenset({"aten._softmax", "aten.softmax", "aten._safe_softmax"})


def cuda_kernel(dtype: torch.dtype, *, mask: bool, dropout_p: float = 0.0, head_dim: int = 64) -> AttentionKernel:
    """The kernel CUDA's SDPA dispatcher picks for a call (torch's order: flash, efficient, math).

    Args:
        dtype: the query's dtype.
        mask: whether an explicit ``attn_mask`` is passed (``is_causal`` alone is no mask).
        dropout_p: attention dropout (both fused CUDA kernels take it).
        head_dim: the last dim of the query.
    """
    del dropout_p  # flash and memory-efficient both take dropout on CUDA
    if dtype in (torch.float16, torch.bfloat16) and not mask and head_dim <= 256:
        return AttentionKernel.FLASH
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return AttentionKernel.EFFICIENT
    return AttentionKernel.MATH


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionCall:
    """One kind of attention call in a forward (calls with the same kernel, shapes and mask).

    Attributes:
        kernel: the :class:`AttentionKernel` that ran.
        memory: ``"linear"`` or ``"quadratic"`` in the sequence length (NOTE [ Attention memory
            at long sequences ]).
        calls: how many calls of this kind one forward made (one per layer, typically).
        seq_len: query length ``T``.
        heads: query heads.
        head_dim: per-head width.
        dtype: the query's dtype.
        mask: ``None``, or the explicit mask's dtype and shape (``"bool (2, 1, 512, 512)"``).
        dropout_p: attention dropout.
        quadratic_bytes: bytes autograd saves per call whose last two dims are ``(T, T)``
            (probabilities, dropout mask, an explicit mask), measured.
        reasons: why the memory is quadratic (empty when linear).
        fixes: what would make it linear.
        cuda_kernel: the kernel CUDA would pick for the same call (:func:`cuda_kernel`); None for
            eager attention, which calls no SDPA.
    """

    kernel: AttentionKernel
    memory: str
    calls: int
    seq_len: int
    heads: int
    head_dim: int
    dtype: str
    mask: str | None
    dropout_p: float
    quadratic_bytes: int
    reasons: tuple[str, ...] = ()
    fixes: tuple[str, ...] = ()
    cuda_kernel: AttentionKernel | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["kernel"] = str(self.kernel)
        d["cuda_kernel"] = None if self.cuda_kernel is None else str(self.cuda_kernel)
        d["reasons"], d["fixes"] = list(self.reasons), list(self.fixes)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionCall:
        d = dict(data)
        d["kernel"] = AttentionKernel(d["kernel"])
        d["cuda_kernel"] = None if d.get("cuda_kernel") is None else AttentionKernel(d["cuda_kernel"])
        d["reasons"], d["fixes"] = tuple(d.get("reasons", ())), tuple(d.get("fixes", ()))
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionReport:
    """What :func:`inspect_attention` saw in one forward.

    Attributes:
        calls: the kinds of attention call (empty: the model has no attention memfit recognises).
        attn_implementation: transformers' ``config._attn_implementation``, where the model has one.
        device: where the forward ran.
    """

    calls: tuple[AttentionCall, ...]
    attn_implementation: str | None = None
    device: str = "cpu"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def memory(self) -> str:
        """``"quadratic"`` when any call's saved memory is quadratic in the sequence, else ``"linear"``
        (also for a model without attention)."""
        return "quadratic" if any(c.memory == "quadratic" for c in self.calls) else "linear"

    @property
    def quadratic_bytes(self) -> int:
        """Bytes quadratic in the sequence that one forward saves for backward (all calls)."""
        return sum(c.quadratic_bytes * c.calls for c in self.calls)

    def summary(self) -> str:
        """One line: the kernels, and for quadratic memory the bytes, why, and the fix."""
        if not self.calls:
            return "attention: none recognised (no SDPA call, no softmax over (T, T) scores)"
        kinds = ", ".join(f"{c.kernel} x{c.calls} at T={c.seq_len}" for c in self.calls)
        if self.memory == "linear":
            return f"attention: {kinds}; memory linear in the sequence"
        quad = [c for c in self.calls if c.memory == "quadratic"]
        reasons = "; ".join(dict.fromkeys(r for c in quad for r in c.reasons))
        fixes = "; ".join(dict.fromkeys(f for c in quad for f in c.fixes))
        return (
            f"attention: {kinds}; memory QUADRATIC in the sequence ({format_bytes(self.quadratic_bytes)} of (T, T) tensors "
            f"saved per step at T={quad[0].seq_len}, x4 at twice the length): {reasons}. To make it linear: {fixes}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory": self.memory,
            "quadratic_bytes": self.quadratic_bytes,
            "attn_implementation": self.attn_implementation,
            "device": self.device,
            "calls": [c.to_dict() for c in self.calls],
            "summary": self.summary(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionReport:
        return cls(
            calls=tuple(AttentionCall.from_dict(c) for c in data.get("calls", ())),
            attn_implementation=data.get("attn_implementation"),
            device=data.get("device", "cpu"),
        )


def inspect_attention(workload: Workload, *, batch_size: int = 1, seed: int = 0) -> AttentionReport:
    """Run one forward of the workload and report its attention kernels and their memory.

    The forward runs in training mode with the loss and without backward; the model is left as
    it was (:func:`memfit.capture.snapshot.leave_unchanged`: RNGs, buffers).

    Args:
        workload: the workload (its own sequence length).
        batch_size: rows of the batch (1 is enough: the kernel choice does not depend on it).
        seed: seed for the batch and dropout.

    Returns:
        The :class:`AttentionReport`.

    Example:
        >>> from memfit.models.registry import load_workload
        >>> rep = inspect_attention(load_workload("demo?n_layer=1&n_embd=32&seq_len=16"))
        >>> rep.memory, str(rep.calls[0].kernel)
        ('linear', 'cpu_flash')
    """
    with leave_unchanged(workload.model) as model:
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        torch.manual_seed(seed)
        batch = cast_batch(workload.make_batch(batch_size), device=dev)
        watch = _Watch()
        model.train()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(watch.pack, _identity):
            with _SdpaCalls(watch), watch:
                out = workload.loss_fn(model, batch)
        del out
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None) if config is not None else None
    return AttentionReport(
        calls=_group(watch.calls, impl=impl, device=dev),
        attn_implementation=impl if isinstance(impl, str) else None,
        device=str(dev),
        info={"batch_size": batch_size, "batch_tensors": [list(t.shape) for t in iter_tensors(batch)]},
    )


# --- watching ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    kernel: AttentionKernel
    seq_len: int
    kv_len: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    mask: str | None
    dropout_p: float
    quadratic_bytes: int = 0


class _Watch(TorchDispatchMode):
    """Sees aten ops (which attention kernel ran; softmaxes over square scores) and saved tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.sdpa: _Call | None = None  # the SDPA call running now
        self.ops: list[str] = []
        self.current: _Call | None = None  # the last eager attention: its square saved tensors
        self.counted: set[int] = set()  # storages counted already

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if self.sdpa is not None:
            self.ops.append(name)
        elif name in _SOFTMAX_OPS and isinstance(out, torch.Tensor) and out.dim() >= 3:
            T, S = out.shape[-2], out.shape[-1]
            if T == S and T > 1:  # (B, heads, T, T) scores outside SDPA: eager attention
                heads = out.shape[-3] if out.dim() >= 4 else 1
                self.current = _Call(
                    kernel=AttentionKernel.EAGER,
                    seq_len=T,
                    kv_len=S,
                    heads=heads,
                    head_dim=0,
                    dtype=out.dtype,
                    mask=None,
                    dropout_p=0.0,
                )
                self.calls.append(self.current)
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # Inside an SDPA call every saved (T, S) tensor is the call's (the mask it converted, the
        # math path's probabilities); after an eager softmax, the (B, heads, T, T) ones are.
        call = self.sdpa if self.sdpa is not None else self.current
        if call is None or t.dim() < 2 or t.shape[-2] != call.seq_len or t.shape[-1] != call.kv_len:
            return t
        if call is self.current and (t.dim() != 4 or t.shape[-3] not in (call.heads, 1)):
            return t
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return t
        if id(st) not in self.counted:  # a mask shared by every layer is counted once
            self.counted.add(id(st))
            call.quadratic_bytes += st.nbytes()
        return t


class _SdpaCalls(TorchFunctionMode):
    """Records each ``F.scaled_dot_product_attention`` call's arguments and the kernel it ran."""

    _NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.watch.sdpa is not None:
            return func(*args, **kwargs)
        a = {**dict(zip(self._NAMES, args, strict=False)), **kwargs}
        q, k, m = a["query"], a["key"], a.get("attn_mask")
        call = _Call(
            kernel=AttentionKernel.MATH,
            seq_len=q.shape[-2],
            kv_len=k.shape[-2],
            heads=q.shape[-3] if q.dim() >= 3 else 1,
            head_dim=q.shape[-1],
            dtype=q.dtype,
            mask=None if m is None else f"{str(m.dtype).removeprefix('torch.')} {tuple(m.shape)}",
            dropout_p=float(a.get("dropout_p", 0.0) or 0.0),
        )
        self.watch.sdpa, self.watch.ops = call, []
        try:
            out = func(*args, **kwargs)
        finally:
            self.watch.sdpa = None
        call.kernel = next((_KERNEL_OF_OP[o] for o in self.watch.ops if o in _KERNEL_OF_OP), AttentionKernel.MATH)
        self.watch.calls.append(call)
        self.watch.current = None  # what is saved after the call is not this attention's
        return out


# --- reporting -----------------------------------------------------------------------------------


def _group(calls: list[_Call], *, impl: Any, device: torch.device) -> tuple[AttentionCall, ...]:
    groups: dict[tuple, AttentionCall] = {}
    for c in calls:
        key = (c.kernel, c.seq_len, c.kv_len, c.heads, c.head_dim, c.dtype, c.mask, c.dropout_p, c.quadratic_bytes)
        if key in groups:
            groups[key] = replace(groups[key], calls=groups[key].calls + 1)
            continue
        quadratic = c.kernel.quadratic or c.quadratic_bytes > 0
        reasons, fixes = _why(c, impl=impl, device=device) if quadratic else ((), ())
        groups[key] = AttentionCall(
            kernel=c.kernel,
            memory="quadratic" if quadratic else "linear",
            calls=1,
            seq_len=c.seq_len,
            heads=c.heads,
            head_dim=c.head_dim,
            dtype=str(c.dtype).removeprefix("torch."),
            mask=c.mask,
            dropout_p=c.dropout_p,
            quadratic_bytes=c.quadratic_bytes,
            reasons=reasons,
            fixes=fixes,
            cuda_kernel=None
            if c.kernel is AttentionKernel.EAGER
            else cuda_kernel(c.dtype, mask=c.mask is not None, dropout_p=c.dropout_p, head_dim=c.head_dim),
        )
    return tuple(groups.values())


def _why(c: _Call, *, impl: Any, device: torch.device) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Why a call's saved memory is quadratic, and what would change it."""
    reasons: list[str] = []
    fixes: list[str] = []
    if c.kernel is AttentionKernel.EAGER:
        reasons.append(
            "eager attention (softmax over (B, heads, T, T) scores)"
            + (f', attn_implementation="{impl}"' if isinstance(impl, str) else "")
        )
        fixes.append('load the model with attn_implementation="sdpa" (fused kernels keep O(T) memory)')
    elif c.kernel is AttentionKernel.MATH:
        if c.dropout_p > 0 and device.type == "cpu":
            reasons.append(f"SDPA's math path: attention dropout {c.dropout_p:g} (the CPU's flash kernel takes none)")
            fixes.append("set attention dropout to 0 (e.g. attention_dropout=0.0 in the config), or train on CUDA")
        elif c.dtype == torch.float64:
            reasons.append("SDPA's math path: float64 (the fused kernels take float16, bfloat16, float32)")
            fixes.append("train in float32 or bfloat16")
        else:
            reasons.append("SDPA's math path (no fused kernel took the call on this device)")
            fixes.append("check torch.backends.cuda.sdp_kernel settings and the query's dtype and head dim")
    if c.mask is not None:
        reasons.append(f"an explicit attention mask {c.mask}, kept for backward")
        fixes.append(
            "pass no mask: full-length rows (no padding; attention_mask all ones, or padding=false in an hf: spec) "
            "let transformers call SDPA with is_causal=True"
        )
    if not reasons:  # a fused kernel whose call still kept (T, T) tensors, e.g. one the model made itself
        reasons.append(
            f"(T, T) tensors kept for backward around the {c.kernel} kernel (a score bias or mask the model builds)"
        )
        fixes.append("find them with `memfit explain` (every saved tensor and its source), or recompute those blocks")
    return tuple(reasons), tuple(fixes)


def _identity(t: Any) -> Any:
    return t
