"""Op-level stats: the op calls and saved tensors of each block's forward (data only).

:func:`memfit.capture.ops.capture_ops` records them (NOTE [ Saved tensors and the ops that made
them ] there); selective checkpointing's policies are read against them
(:mod:`memfit.plan.savepolicy`, :mod:`memfit.plan.milp`) and ``memfit explain`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ATTENTION_OPS",
    "BlockOps",
    "CATEGORIES",
    "MATMUL_OPS",
    "OpCall",
    "OpStats",
    "SavedTensor",
    "op_category",
]

# Op overload packets (``namespace.name``) by kind. Matmul and attention are the expensive ones to
# recompute; everything else (elementwise, norms, softmax, dropout, reductions) is cheap.
MATMUL_OPS = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten.addbmm",
        "aten.matmul",
        "aten.linear",
        "aten.mv",
        "aten.addmv",
        "aten.dot",
        "aten._int_mm",
        "aten._scaled_mm",
        "aten.convolution",
        "aten._convolution",
        "aten.conv1d",
        "aten.conv2d",
        "aten.conv3d",
        "aten.mkldnn_convolution",
        "aten.cudnn_convolution",
        "aten.convolution_overrideable",
        "aten._slow_conv2d_forward",
        "aten.slow_conv3d_forward",
        "aten._mkldnn_convolution",
    }
)
ATTENTION_OPS = frozenset(
    {
        "aten._scaled_dot_product_flash_attention_for_cpu",  # CPU (torch 2.x)
        "aten._scaled_dot_product_flash_attention",  # CUDA flash
        "aten._scaled_dot_product_efficient_attention",  # CUDA memory-efficient
        "aten._scaled_dot_product_cudnn_attention",  # CUDA cuDNN
        "aten._scaled_dot_product_fused_attention_overrideable",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
    }
)

CATEGORIES = ("matmul", "attention", "view", "inplace", "other")


def op_category(op: str, *, creates: bool = True, mutable: bool = False) -> str:
    """The kind of an op call: ``matmul``, ``attention``, ``view``, ``inplace`` or ``other``.

    Args:
        op: the overload's name, e.g. ``"aten.addmm.default"``.
        creates: whether the call created a new storage (False for views and in-place ops).
        mutable: whether the op's schema mutates an argument.
    """
    packet = op.rsplit(".", 1)[0]
    if packet in MATMUL_OPS:
        return "matmul"
    if packet in ATTENTION_OPS:
        return "attention"
    if not creates:
        return "inplace" if mutable else "view"
    return "other"


@dataclass(frozen=True, kw_only=True, slots=True)
class OpCall:
    """One op call inside a block's forward.

    Attributes:
        op: the op overload's name, e.g. ``"aten.addmm.default"``.
        index: how many calls of the same op came before it in the block's forward (0-based): the
            counter torch's selective checkpointing keeps, so ``(op, index)`` names this call in a
            ``save:`` policy (``aten.addmm.default@2``).
        category: ``matmul``, ``attention``, ``view``, ``inplace`` or ``other``.
        shapes: shapes of its tensor outputs.
        dtype: dtype of its first tensor output.
        out_bytes: bytes of the new storages it created (0 for views and in-place ops).
        saved_bytes: bytes of those storages that autograd saves.
        time_s: measured seconds (median over the forwards).
        flops: floating-point operations (``torch.utils.flop_counter``; 0 where it has no formula).
        cheap: whether recomputing it is cheap (not a matmul, convolution or attention).
        cacheable: whether selective checkpointing can save its output: it created storage, that
            storage is not mutated later in the block, and torch does not ignore the op.
    """

    op: str
    index: int
    category: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    out_bytes: int
    saved_bytes: int
    time_s: float
    flops: int
    cheap: bool
    cacheable: bool

    @property
    def name(self) -> str:
        """``op@index``, the call's name in a ``save:`` policy."""
        return f"{self.op}@{self.index}"

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["shapes"] = [list(s) for s in self.shapes]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpCall:
        d = dict(data)
        d["shapes"] = tuple(tuple(s) for s in d["shapes"])
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedTensor:
    """One storage autograd saves in a block's forward (bytes counted once per storage).

    Attributes:
        op: the op that last wrote it: its creator, or the in-place op that wrote it after (a
            dropout mask: ``aten.div_.Scalar``); ``"input"`` for a block input, ``"external"`` for
            a tensor from elsewhere.
        call: index in :attr:`BlockOps.calls` of the call that created the storage, or None.
        shape: shape of the creating call's output (the saved tensor may be a view of it).
        dtype: its dtype.
        bytes: the storage's bytes.
        n_views: how many tensors autograd saves from this storage.
    """

    op: str
    call: int | None
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    n_views: int = 1

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SavedTensor:
        d = dict(data)
        d["shape"] = tuple(d["shape"])
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockOps:
    """The op calls and saved tensors of one block's forward.

    Attributes:
        name: qualified module name.
        calls: every op call in order (ops torch's selective checkpointing ignores left out).
        saved: every storage autograd saves, in the order it was first saved.
        fwd_s: sum of the calls' times (seconds).
    """

    name: str
    calls: tuple[OpCall, ...]
    saved: tuple[SavedTensor, ...]
    fwd_s: float

    @property
    def saved_bytes(self) -> int:
        """Bytes of the distinct storages autograd saves (equals ``BlockStats.saved_bytes``)."""
        return sum(s.bytes for s in self.saved)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fwd_s": self.fwd_s,
            "saved_bytes": self.saved_bytes,
            "calls": [c.to_dict() for c in self.calls],
            "saved": [s.to_dict() for s in self.saved],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockOps:
        return cls(
            name=data["name"],
            fwd_s=data["fwd_s"],
            calls=tuple(OpCall.from_dict(c) for c in data["calls"]),
            saved=tuple(SavedTensor.from_dict(s) for s in data["saved"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class OpStats:
    """What :func:`capture_ops` measured: per block, op calls and saved tensors."""

    model: str
    batch_size: int
    device: str
    dtype: str
    blocks: tuple[BlockOps, ...]
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "device": self.device,
            "dtype": self.dtype,
            "blocks": [b.to_dict() for b in self.blocks],
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpStats:
        d = dict(data)
        d["blocks"] = tuple(BlockOps.from_dict(b) for b in d["blocks"])
        return cls(**d)
