"""Stats: what a profile measured, per block and per step (data only).

:class:`Stats` is immutable and JSON-shaped (``to_dict`` / ``from_dict``); planning consumes it
(:mod:`memfit.plan.costmodel`). It is produced by :func:`memfit.profiling.profile` (measured passes,
:mod:`memfit.capture.passes`) and by :func:`memfit.estimate.estimate_stats` (fake-tensor passes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeCosts:
    """What one block costs when run in one mode (``keep`` or ``recompute``), measured in a step
    where every block ran in that mode. The planner's cost model adds these up (see
    :mod:`memfit.plan.costmodel`).

    Attributes:
        retained_bytes: live bytes the block adds from its forward until its backward (what
            autograd or the checkpoint keeps, and its output).
        fwd_peak_bytes: peak live bytes during its forward above the live bytes at its start.
        bwd_peak_bytes: peak live bytes during its backward (recompute included) above the live
            bytes when its output's gradient arrives.
        bwd_base_bytes: live bytes at its backward start that are neither the step's starting
            memory nor retained activations (gradients of later blocks, its output's gradient).
        fwd_s: forward seconds (median).
        bwd_s: backward seconds (median), recompute included (for options other than ``keep`` and
            ``recompute``: the keep mode's, plus ``rerun_s``).
        policy: for a selective option, the block's save policy (a preset or ``save:...``).
        rerun_s: for options other than ``keep`` and ``recompute``, the seconds the option adds to
            the step by the op-level estimate: forward time of the ops a selective block re-runs,
            or transfer time of what an offloaded block moves. Calibrated by the cost model.
    """

    retained_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    bwd_base_bytes: int
    fwd_s: float
    bwd_s: float
    policy: str | None = None
    rerun_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockStats:
    """Measured costs of one block (bytes and seconds).

    Attributes:
        name: qualified module name.
        fwd_s: forward seconds (median).
        bwd_s: backward seconds (median): from its output's gradient to its input's and
            parameters' gradients.
        saved_bytes: bytes of the distinct storages autograd saves in the block's forward (the
            block's input included when an op saves it; parameters and buffers excluded).
        output_bytes: bytes of the block's output tensors.
        input_bytes: bytes of the block's tensor inputs.
        fwd_temp_bytes: peak live bytes during its forward above the live bytes at its start.
        bwd_temp_bytes: peak live bytes during its backward above the live bytes at its start.
        input_saved: whether the block's forward saves its input (so that its input stays alive
            without a checkpoint holding it).
        modes: per option (``keep``, ``recompute``, ``selective:...``, ``offload``), the costs
            the planner uses.
    """

    name: str
    fwd_s: float
    bwd_s: float
    saved_bytes: int
    output_bytes: int
    input_bytes: int
    fwd_temp_bytes: int
    bwd_temp_bytes: int
    input_saved: bool = True
    modes: dict[str, ModeCosts] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["modes"] = {k: v.to_dict() for k, v in self.modes.items()}
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockStats:
        d = dict(data)
        d["modes"] = {k: ModeCosts(**v) for k, v in (d.get("modes") or {}).items()}
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadOptionStats:
    """One head option's measurements (:mod:`memfit.apply.head`; the chunked loss).

    Attributes:
        head_peak_bytes: the option's ``H``: the peak from the last block's output through the loss
            and the head's backward, above the live bytes after the last block; the larger over the
            step with every block kept and the one with every block recomputed.
        step_s: the whole step's seconds with every block kept (median).
        measured_peak_bytes: the whole step's peak with every block kept.
        measured_peak_bytes_by_mode: the whole step's peak per block option measured with it
            (``keep``, ``recompute``).
    """

    head_peak_bytes: int
    step_s: float
    measured_peak_bytes: int
    measured_peak_bytes_by_mode: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadOptionStats:
        return cls(**data)


@dataclass(frozen=True, kw_only=True, slots=True)
class Stats:
    """Everything one profile measured. JSON fields follow DESIGN.md (``memfit profile``).

    Besides the per-block stats, the plan-independent parts of a step (bytes):
    ``start_bytes`` live when the first block starts (parameters, optimizer state, batch,
    embeddings); ``pre_peak_bytes`` the peak before it; ``head_peak_bytes`` the peak from the last
    block's output through the loss and the head's backward, above the live bytes after the last
    block; ``head_model_peak_bytes`` the part of it until the model's own forward returns and
    ``head_backward_peak_bytes`` the part from the start of backward (None: not recorded; the
    per-rank accounting of FSDP2 needs them); ``post_peak_bytes`` the peak after the first block's backward (embeddings' backward and
    the optimizer step). ``measured_peak_bytes_by_mode`` holds each calibration step's peak and
    ``step_s_by_mode`` its time; ``device_overhead_bytes`` is what the CUDA allocator holds beyond
    the tracked tensors at the peak (0 on the CPU); ``calibration`` records how the extra options were made (MILP
    allotments, options dropped and why, offload bandwidth). ``head_options`` holds each head
    option's :class:`HeadOptionStats`. ``activations`` is ``"fused"`` when the model
    was measured with fused activations (:mod:`memfit.apply.activations`), else None.
    """

    model: str
    batch_size: int
    dtype: str
    device: str
    optimizer: str
    chain_path: str
    sequential: bool
    blocks: tuple[BlockStats, ...]
    peak_bytes: int
    step_s: float
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_peak_bytes: int
    peak_bytes_by_phase: dict[str, int]
    fwd_s: float
    bwd_s: float
    start_bytes: int = 0
    pre_peak_bytes: int = 0
    head_peak_bytes: int = 0
    post_peak_bytes: int = 0
    head_model_peak_bytes: int | None = None
    head_backward_peak_bytes: int | None = None
    step_s_by_mode: dict[str, float] = field(default_factory=dict)
    measured_peak_bytes_by_mode: dict[str, int] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    device_overhead_bytes: int = 0
    head_options: dict[str, HeadOptionStats] = field(default_factory=dict)
    activations: str | None = None
    segment_spans: tuple[tuple[int, int], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["blocks"] = [b.to_dict() for b in self.blocks]
        d["head_options"] = {k: v.to_dict() for k, v in self.head_options.items()}
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stats:
        d = dict(data)
        d["blocks"] = tuple(BlockStats.from_dict(b) for b in d["blocks"])
        d["head_options"] = {k: HeadOptionStats.from_dict(v) for k, v in (d.get("head_options") or {}).items()}
        if d.get("segment_spans") is not None:
            d["segment_spans"] = tuple((int(a), int(b)) for a, b in d["segment_spans"])
        return cls(**d)
