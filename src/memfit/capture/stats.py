"""Stats: what a profile measured, per block and per step (data only).

size: one file format (blocks, options, head options, calibration, estimates) and its JSON, read together.

:class:`Stats` is immutable and JSON-shaped (``to_dict`` / ``from_dict``); planning consumes it
(:mod:`memfit.plan.costmodel`). It is produced by :func:`memfit.profiling.blocks.profile` (measured passes,
:mod:`memfit.capture.passes`) and by :func:`memfit.estimation.estimate_stats` (fake-tensor passes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from memfit.errors import SpecError

if TYPE_CHECKING:
    from memfit.capture.passes import Derived


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionStats:
    """What one block costs under one option (``keep``, ``recompute``, ``selective:...``,
    ``offload``), measured in a step where every block ran under that option. The planner's cost model adds these up (see
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
            ``recompute``: the ``keep`` option's, plus ``rerun_s``).
        policy: for a selective option, the block's save policy (a preset or ``save:...``).
        rerun_s: for options other than ``keep`` and ``recompute``, the seconds the option adds to
            the step by the op-level estimate: forward time of the ops a selective block re-runs,
            transfer time of what an offloaded block moves (or of a host-held input), the extra
            forward of a tiled block's tiled submodules. Calibrated by the cost model.
        tiled: for a tiled option (``keep:tiles-N``, ``recompute:tiles-N``), the block's tiled
            submodules (relative names; empty: the block has none and ran untiled).
        fwd_only_bytes: bytes the block's forward leaves alive after it returns that the model's
            forward drops before the backward, taken by no later block (BLOOM's block returns its
            attention probabilities, which its loop holds until the next block returns), keyed by
            the index of the block in whose forward they are dropped (``n``, the number of blocks:
            after the last block's forward, before the head's peak; ``n + 1``: after the head's
            peak, as a KV cache the model's output holds); not in ``retained_bytes`` (NOTE [ Tensors
            the forward drops ] in :mod:`memfit.plan.costmodel`). Empty: none.
    """

    retained_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    bwd_base_bytes: int
    fwd_s: float
    bwd_s: float
    policy: str | None = None
    rerun_s: float = 0.0
    tiled: tuple[str, ...] = ()
    fwd_only_bytes: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        if self.tiled:
            d["tiled"] = list(self.tiled)
        else:
            del d["tiled"]  # untiled options: the JSON they had before tiling
        if self.fwd_only_bytes:
            d["fwd_only_bytes"] = {str(k): v for k, v in self.fwd_only_bytes.items()}
        else:
            del d["fwd_only_bytes"]  # the JSON options had before it was recorded
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptionStats:
        return cls(
            **{
                **data,
                "tiled": tuple(data.get("tiled") or ()),
                "fwd_only_bytes": {int(k): int(v) for k, v in (data.get("fwd_only_bytes") or {}).items()},
            }
        )


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
        options: per option (``keep``, ``recompute``, ``selective:...``, ``offload``), the costs
            the planner uses.
        freed_inputs: its tensor inputs that nothing keeps once the backward starts when every
            block is kept, by source (``out:K``: block K's output), bytes: a recomputed block holds
            them until its backward (NOTE [ Inputs a recompute holds ] in :mod:`memfit.plan.costmodel`).
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
    options: dict[str, OptionStats] = field(default_factory=dict)
    freed_inputs: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["options"] = {k: v.to_dict() for k, v in self.options.items()}
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockStats:
        d = _renamed(data)
        d["options"] = {k: OptionStats.from_dict(v) for k, v in (d.get("options") or {}).items()}
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
        measured_peak_bytes_by_option: the whole step's peak per block option measured with it
            (``keep``, ``recompute``).
        head_peak_bytes_by_option: the option's ``H`` in each of those steps (empty in stats made
            before it was recorded); see :class:`Stats`.
    """

    head_peak_bytes: int
    step_s: float
    measured_peak_bytes: int
    measured_peak_bytes_by_option: dict[str, int] = field(default_factory=dict)
    head_peak_bytes_by_option: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadOptionStats:
        return cls(**_renamed(data))


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedActivations:
    """What a profile fused (:mod:`memfit.apply.activations`).

    Attributes:
        modules: activation modules fused.
        classes: their class names, sorted.
    """

    modules: int
    classes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"modules": self.modules, "classes": list(self.classes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FusedActivations:
        return cls(modules=int(data["modules"]), classes=tuple(data["classes"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class TiledModules:
    """What a profile tiles (:mod:`memfit.apply.tiling`, NOTE [ Which modules are tiled ]).

    Attributes:
        modules: tiled submodules over all blocks.
        classes: their class names, sorted.
        tile_counts: the tile counts measured.
    """

    modules: int
    classes: tuple[str, ...]
    tile_counts: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"modules": self.modules, "classes": list(self.classes), "tile_counts": list(self.tile_counts)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TiledModules:
        return cls(
            modules=int(data["modules"]),
            classes=tuple(data["classes"]),
            tile_counts=tuple(int(n) for n in data["tile_counts"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimatedInfo:
    """How estimated stats were made (NOTE [ Estimated stats ] in :mod:`memfit.estimation.stats`).

    Attributes:
        device: the device spec's name (e.g. ``h100-sxm``).
        mfu: the fraction of the device's peak FLOP rate the step is assumed to reach.
        kernels: whose kernels the fake step counted: ``cuda`` or ``cpu``.
        optimizer_impl: the optimizer implementation its time assumes.
        peak_flops_per_s: the device's peak rate in the stats' dtype (FLOP/s).
        optimizer_s: the optimizer step's seconds (its bytes over the memory bandwidth).
        flops_by_option: the step's FLOPs per block option (``keep``, ``recompute``).
        time_model: how the seconds were computed, in words.
    """

    device: str
    mfu: float
    kernels: str
    optimizer_impl: str
    peak_flops_per_s: float
    optimizer_s: float
    flops_by_option: Mapping[str, int]
    time_model: str

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["flops_by_option"] = dict(self.flops_by_option)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EstimatedInfo:
        d = _renamed(data)
        return cls(**{**d, "flops_by_option": dict(d["flops_by_option"])})


_PARALLEL_KEYS = (
    "rank", "memory", "single_process_peak_bytes", "unit_grad_bytes", "unit_grad_shard_bytes", "head_grad_bytes", "backward_end_bytes",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelInfo:
    """The rank of a data-parallel job that rank stats describe (:func:`memfit.plan.parallel.rank_stats`).

    ``layout`` and ``memory`` hold the JSON of the plan layer's ``Parallel`` and ``RankMemory``
    (``to_dict``; rebuild them with their ``from_dict``): :mod:`memfit.capture` sits below
    :mod:`memfit.plan` and cannot import them.

    Attributes:
        layout: the layout (``Parallel.to_dict()``: ``kind``, ``world_size``, bucket caps, ...).
        rank: the rank.
        memory: the rank's parts in bytes (``RankMemory.to_dict()``).
        single_process_peak_bytes: the one-process peak the rank stats were made from.
        unit_grad_bytes: per unit (blocks, then the root) its gradients' bytes, whole (for the
            accumulation window's prediction, :func:`memfit.plan.window.window_peak_bytes`).
        unit_grad_shard_bytes: the same, one rank's padded shard.
        head_grad_bytes: the LM head's gradient bytes (accumulated in place over a window).
        backward_end_bytes: live bytes when the blocks' backward ends (None: the post-backward peak).
    """

    layout: Mapping[str, Any]
    rank: int
    memory: Mapping[str, Any]
    single_process_peak_bytes: int
    unit_grad_bytes: tuple[int, ...] = ()
    unit_grad_shard_bytes: tuple[int, ...] = ()
    head_grad_bytes: int = 0
    backward_end_bytes: int | None = None

    @property
    def world_size(self) -> int:
        return int(self.layout["world_size"])

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.layout,
            "rank": self.rank,
            "memory": dict(self.memory),
            "single_process_peak_bytes": self.single_process_peak_bytes,
            "unit_grad_bytes": list(self.unit_grad_bytes),
            "unit_grad_shard_bytes": list(self.unit_grad_shard_bytes),
            "head_grad_bytes": self.head_grad_bytes,
            "backward_end_bytes": self.backward_end_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelInfo:
        return cls(
            layout={k: v for k, v in data.items() if k not in _PARALLEL_KEYS},
            rank=int(data["rank"]),
            memory=dict(data["memory"]),
            single_process_peak_bytes=int(data["single_process_peak_bytes"]),
            unit_grad_bytes=tuple(data.get("unit_grad_bytes", ())),
            unit_grad_shard_bytes=tuple(data.get("unit_grad_shard_bytes", ())),
            head_grad_bytes=int(data.get("head_grad_bytes", 0)),
            backward_end_bytes=data.get("backward_end_bytes"),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """How a profile's extra options were made, and what its stats stand for (:attr:`Stats.calibration`).

    Every field is optional; ``to_dict`` writes the set ones only, in this order (the JSON
    ``calibration`` object of ``memfit profile --json``).

    Attributes:
        estimated: set for estimated stats (no measurement): how they were made.
        dropped_options: option name (``offload``, ``head:chunked``, ``selective:<preset>``,
            ``activations:fused``) -> why it was not offered. Written when not empty, and always
            once selective options were considered (then ``milp_fractions`` is set).
        milp_fractions: the per-block MILP's budget fractions, when selective options were built.
        offload_d2h_bytes_per_s: measured device-to-host bandwidth, when offload was calibrated.
        offload_h2d_bytes_per_s: measured host-to-device bandwidth, when offload was calibrated.
        segments: why some blocks cannot share a segment with the one before (a residual the
            model's loop adds between blocks), else None.
        fused_activations: what was fused, when the stats were made with fused activations.
        parallel: set for one rank's stats of a data-parallel job.
        tiling: what was tiled, when tiled options were measured.
    """

    estimated: EstimatedInfo | None = None
    dropped_options: Mapping[str, str] = field(default_factory=dict)
    milp_fractions: tuple[float, ...] | None = None
    offload_d2h_bytes_per_s: float | None = None
    offload_h2d_bytes_per_s: float | None = None
    segments: str | None = None
    fused_activations: FusedActivations | None = None
    parallel: ParallelInfo | None = None
    tiling: TiledModules | None = None

    def merged(self, other: Calibration) -> Calibration:
        """This calibration with ``other``'s set fields; ``dropped_options`` of both (``other``'s win)."""
        kw = {
            f.name: getattr(other, f.name)
            for f in fields(other)
            if f.name != "dropped_options" and getattr(other, f.name) is not None
        }
        return replace(self, **kw, dropped_options={**self.dropped_options, **other.dropped_options})

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.estimated is not None:
            d["estimated"] = self.estimated.to_dict()
        if self.dropped_options or self.milp_fractions is not None:
            d["dropped_options"] = dict(self.dropped_options)
        if self.milp_fractions is not None:
            d["milp_fractions"] = list(self.milp_fractions)
        if self.offload_d2h_bytes_per_s is not None:
            d["offload_d2h_bytes_per_s"] = self.offload_d2h_bytes_per_s
        if self.offload_h2d_bytes_per_s is not None:
            d["offload_h2d_bytes_per_s"] = self.offload_h2d_bytes_per_s
        if self.segments is not None:
            d["segments"] = self.segments
        if self.fused_activations is not None:
            d["fused_activations"] = self.fused_activations.to_dict()
        if self.parallel is not None:
            d["parallel"] = self.parallel.to_dict()
        if self.tiling is not None:
            d["tiling"] = self.tiling.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """The inverse of :meth:`to_dict`.

        Raises:
            SpecError: a key this version does not know.
        """
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise SpecError(
                f"memfit.capture: the stats' calibration has keys {unknown} this memfit does not know; "
                "profile again with this version (memfit profile --json)."
            )
        est, fused, par = data.get("estimated"), data.get("fused_activations"), data.get("parallel")
        fr = data.get("milp_fractions")
        return cls(
            estimated=EstimatedInfo.from_dict(est) if est is not None else None,
            dropped_options=dict(data.get("dropped_options") or {}),
            milp_fractions=tuple(float(x) for x in fr) if fr is not None else None,
            offload_d2h_bytes_per_s=data.get("offload_d2h_bytes_per_s"),
            offload_h2d_bytes_per_s=data.get("offload_h2d_bytes_per_s"),
            segments=data.get("segments"),
            fused_activations=FusedActivations.from_dict(fused) if fused is not None else None,
            parallel=ParallelInfo.from_dict(par) if par is not None else None,
            tiling=TiledModules.from_dict(data["tiling"]) if data.get("tiling") is not None else None,
        )


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
    the optimizer step). Those three head fields are the largest over the calibration steps;
    ``head_peak_bytes_by_option``, ``head_model_peak_bytes_by_option`` and
    ``head_backward_peak_bytes_by_option`` hold each step's own (keyed by the option every block ran
    in; empty in stats made before they were recorded): the head differs between them (NOTE [ The
    head's peak per option ]). ``measured_peak_bytes_by_option`` holds each calibration step's peak and
    ``step_s_by_option`` its time; ``device_overhead_bytes`` is what the CUDA allocator holds beyond
    the tracked tensors at the peak (0 on the CPU); ``calibration`` (:class:`Calibration`) records how the
    extra options were made (MILP allotments, options dropped and why, offload bandwidth) and what the
    stats stand for (estimated, one rank of a parallel job). ``head_options`` holds each head
    option's :class:`HeadOptionStats`. ``activations`` is ``"fused"`` when the model
    was measured with fused activations (:mod:`memfit.apply.activations`), else None.
    ``chain_coverage`` is the share of the bytes autograd saves in the step's forward that the
    chain's blocks save (what a plan can act on; None: not measured), and ``chain_left_out`` the
    share of each list of blocks outside the chain that saves some (a tower left out; NOTE [ Chain
    discovery ] in :mod:`memfit.capture.chain`); ``lists_as_run`` the chain's lists and those left
    out in the order the forward ran them; ``suggested_blocks`` the lists a plan could cover, as
    ``memfit.set_blocks`` accepts them (:func:`memfit.capture.coverage.suggest_block_lists`; empty:
    none beyond the chain).
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
    head_peak_bytes_by_option: dict[str, int] = field(default_factory=dict)
    head_model_peak_bytes_by_option: dict[str, int] = field(default_factory=dict)
    head_backward_peak_bytes_by_option: dict[str, int] = field(default_factory=dict)
    step_s_by_option: dict[str, float] = field(default_factory=dict)
    measured_peak_bytes_by_option: dict[str, int] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    calibration: Calibration = field(default_factory=Calibration)
    device_overhead_bytes: int = 0
    head_options: dict[str, HeadOptionStats] = field(default_factory=dict)
    activations: str | None = None
    segment_spans: tuple[tuple[int, int], ...] | None = None
    chain_coverage: float | None = None
    chain_left_out: dict[str, float] = field(default_factory=dict)
    lists_as_run: tuple[str, ...] = ()
    suggested_blocks: tuple[str, ...] = ()
    states: str = "device"  # the model states' placement the step ran with (memfit.optim.ModelStates)

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["states"] = str(self.states)
        d["blocks"] = [b.to_dict() for b in self.blocks]
        d["head_options"] = {k: v.to_dict() for k, v in self.head_options.items()}
        d["calibration"] = self.calibration.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stats:
        """The inverse of :meth:`to_dict`; also reads stats written before the keys said "option"
        (``modes``, ``*_by_mode``)."""
        d = _renamed(data)
        d["blocks"] = tuple(BlockStats.from_dict(b) for b in d["blocks"])
        d["head_options"] = {k: HeadOptionStats.from_dict(v) for k, v in (d.get("head_options") or {}).items()}
        d["calibration"] = Calibration.from_dict(d.get("calibration") or {})
        d["lists_as_run"] = tuple(d.get("lists_as_run") or ())
        d["suggested_blocks"] = tuple(d.get("suggested_blocks") or ())
        if d.get("segment_spans") is not None:
            d["segment_spans"] = tuple((int(a), int(b)) for a, b in d["segment_spans"])
        return cls(**d)


def _renamed(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with the keys stats files written by earlier versions used for a block's option
    (``modes``, ``*_by_mode``) under their names now (``options``, ``*_by_option``)."""
    d = dict(data)
    for old in [k for k in d if k == "modes" or k.endswith("_by_mode")]:
        new = "options" if old == "modes" else old.removesuffix("_by_mode") + "_by_option"
        d.setdefault(new, d[old])
        del d[old]
    return d


def head_fields(derived: Mapping[str, Derived]) -> dict[str, Any]:
    """The head's fields of :class:`Stats` from calibration steps ``derived`` (option every block
    ran in -> its :class:`~memfit.capture.passes.Derived`): each step's own peaks (``*_by_option``)
    and the largest over them (``head_peak_bytes``, ``head_model_peak_bytes``,
    ``head_backward_peak_bytes``, which stats made before the per-option fields hold alone)."""
    models = {m: d.head_model_peak for m, d in derived.items() if d.head_model_peak is not None}
    backwards = {m: d.head_backward_peak for m, d in derived.items() if d.head_backward_peak is not None}
    return {
        "head_peak_bytes": max(d.head_peak for d in derived.values()),
        "head_model_peak_bytes": max(models.values(), default=None),
        "head_backward_peak_bytes": max(backwards.values(), default=None),
        "head_peak_bytes_by_option": {m: d.head_peak for m, d in derived.items()},
        "head_model_peak_bytes_by_option": models,
        "head_backward_peak_bytes_by_option": backwards,
    }
