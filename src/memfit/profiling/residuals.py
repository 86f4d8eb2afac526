"""Per block, every tensor autograd saves and what a plan does with it, and why.

For each block of the chain: every storage autograd saves in the block's forward (the op that made
it, shape, dtype, bytes; :func:`memfit.capture.ops.capture_ops`) and its decision under the plan:

- ``saved``: it stays on the device until backward (a kept block; a checkpoint's input; an op
  output the selective policy caches; a tensor too small or an input an offloaded block keeps);
- ``recomputed``: freed after the forward and made again in backward (``bytes_saved`` is what that
  frees, ``seconds_added`` the measured time of the op that makes it);
- ``offloaded``: moved to host memory and back (``seconds_added``: both copies at the measured
  bandwidth, where one was measured).

The listed tensors of a block add up to its captured saved bytes (``saved_bytes``, the same number
``memfit profile`` reports). A selective policy may also cache op outputs that autograd does not
save (a matmul whose output only feeds a residual add): those are listed under ``cached``, since
they cost memory too.

``memfit explain`` prints it (:mod:`memfit.cli.explain`).

Example:
    >>> from memfit.plan import policy_plan
    >>> from memfit.models.registry import load_workload
    >>> wl = load_workload("demo?n_layer=2&n_embd=32&seq_len=32")
    >>> ex = explain(wl, policy_plan(wl.model, "all"), repeats=1)
    >>> [b.option for b in ex.blocks]
    ['recompute', 'recompute']
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memfit.apply.activations import install_fused_activations, remove_fused_activations
from memfit.apply.offload import DEFAULT_MIN_BYTES, measure_bandwidth
from memfit.capture.chain import discover_chain
from memfit.capture.ops import capture_ops
from memfit.capture.opstats import BlockOps, OpStats
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.step import StepSpec
from memfit.errors import PlanMismatchError, UnsupportedModelError
from memfit.plan.policies import check_fingerprint
from memfit.plan.savepolicy import cached_calls, parse_save_policy
from memfit.plan.types import BlockDecision, Option, Plan
from memfit.units import format_bytes
from memfit.workload import Workload, cast_batch

SAVED, RECOMPUTED, OFFLOADED = "saved", "recomputed", "offloaded"


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorDecision:
    """One saved storage of a block and what the plan does with it (bytes, seconds)."""

    op: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    decision: str
    why: str
    bytes_saved: int
    seconds_added: float | None

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockExplanation:
    """A block's saved tensors under a plan, with totals (bytes, seconds)."""

    name: str
    option: str
    policy: str | None
    saved_bytes: int
    kept_bytes: int
    recomputed_bytes: int
    offloaded_bytes: int
    cached_extra_bytes: int
    seconds_added: float
    tensors: tuple[TensorDecision, ...]
    cached: tuple[TensorDecision, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["tensors"] = [t.to_dict() for t in self.tensors]
        d["cached"] = [t.to_dict() for t in self.cached]
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    """What ``memfit explain --json`` prints."""

    model: str
    batch_size: int
    device: str
    dtype: str
    plan_policy: str
    blocks: tuple[BlockExplanation, ...]
    offload_bytes_per_s: tuple[float, float] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "device": self.device,
            "dtype": self.dtype,
            "plan_policy": self.plan_policy,
            "saved_bytes": sum(b.saved_bytes for b in self.blocks),
            "kept_bytes": sum(b.kept_bytes for b in self.blocks),
            "recomputed_bytes": sum(b.recomputed_bytes for b in self.blocks),
            "offloaded_bytes": sum(b.offloaded_bytes for b in self.blocks),
            "cached_extra_bytes": sum(b.cached_extra_bytes for b in self.blocks),
            "seconds_added": sum(b.seconds_added for b in self.blocks),
            "offload_bytes_per_s": list(self.offload_bytes_per_s) if self.offload_bytes_per_s else None,
            "blocks": [b.to_dict() for b in self.blocks],
            **self.info,
        }


def explain(
    workload: Workload,
    plan: Plan,
    *,
    step: StepSpec | None = None,
    ops: OpStats | None = None,
) -> Explanation:
    """Every tensor each block saves, and what ``plan`` does with it.

    Measuring never changes the model: the op-level capture runs its forwards (dropout, BatchNorm
    statistics), and afterwards the model's state, applied plan and the RNGs are back bitwise;
    the step's ``dtype`` and ``device`` measure a cast copy (NOTE [ Measuring leaves the model as it was ] in
    :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload the plan is for (a plan applied to its model is lifted meanwhile).
        plan: the plan (from a policy, the planner or a file).
        step: the step (:class:`~memfit.capture.step.StepSpec`: batch size, dtype, seed, device;
            ``repeats``: timed forwards of the op-level capture, default 3; no optimizer runs).
        ops: an op-level capture to use instead of capturing again.

    Returns:
        The :class:`Explanation`.

    Raises:
        PlanMismatchError: the plan was made for another model or batch shape.
        SpecError: a selective policy does not parse.
    """
    step = step or StepSpec()
    with leave_unchanged(workload.model, device=step.device, dtype=step.dtype) as model:
        if model is not workload.model:
            workload = replace(workload, model=model)
        return _explain(
            workload,
            plan,
            batch_size=step.batch_size,
            dtype=step.dtype,
            seed=step.seed,
            repeats=step.repeats_or(3),
            ops=ops,
        )


def _explain(
    workload: Workload,
    plan: Plan,
    *,
    batch_size: int | None,
    dtype: torch.dtype | None,
    seed: int,
    repeats: int,
    ops: OpStats | None,
) -> Explanation:
    """:func:`explain` on the model as it is (cast already, inside the snapshot)."""
    model = workload.model
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        chain = discover_chain(model, plan.chain_path if plan.chain_path or not workload.blocks else workload.blocks)
    except UnsupportedModelError as err:
        raise PlanMismatchError(
            f"memfit explain: the plan's blocks are in {plan.chain_path or 'the model itself'!r}, which "
            f"{type(model).__name__} does not have ({err}). Make a plan for this model."
        ) from None
    bs = batch_size or workload.default_batch_size
    torch.manual_seed(seed)
    batch = cast_batch(workload.make_batch(bs), dtype=dtype, device=dev)
    check_fingerprint(plan, model, chain, batch)
    if ops is None:
        fused = plan.activations is not None and install_fused_activations(model) > 0
        try:  # the tensors the plan's model saves: with its activations fused if it fuses them
            ops = capture_ops(workload, batch=batch, batch_size=bs, seed=seed, repeats=repeats)
        finally:
            if fused:
                remove_fused_activations(model)
    bandwidth = None
    if any(b.option is Option.OFFLOAD for b in plan.blocks) and dev.type != "cpu":
        bandwidth = measure_bandwidth(dev)
    # The outermost segment around each block: only its first block's input is kept between
    # the forward and the backward (inner segments' inputs exist during its recompute only).
    outermost: dict[int, Any] = {}
    for seg in sorted(plan.segments, key=lambda s: s.start - s.stop):
        for i in range(seg.start, seg.stop):
            outermost.setdefault(i, seg)
    out = []
    for i, (bo, d) in enumerate(zip(ops.blocks, plan.blocks, strict=True)):
        policy = parse_save_policy(d.policy) if d.option is Option.SELECTIVE and d.policy else None
        cached = set(cached_calls(bo, policy)) if policy is not None else set()
        seg = outermost.get(i)
        out.append(
            _explain_block(
                bo,
                d,
                cached,
                segment=seg,
                first_of_segment=seg is not None and seg.start == i,
                bandwidth=bandwidth,
                min_bytes=DEFAULT_MIN_BYTES,
            )
        )
    return Explanation(
        model=workload.name,
        batch_size=ops.batch_size,
        device=ops.device,
        dtype=ops.dtype,
        plan_policy=plan.policy,
        blocks=tuple(out),
        offload_bytes_per_s=bandwidth,
        info={"head": plan.head, "activations": plan.activations},
    )


def _explain_block(
    bo: BlockOps,
    d: BlockDecision,
    cached: set[int],
    *,
    segment: Any,
    first_of_segment: bool,
    bandwidth: tuple[float, float] | None,
    min_bytes: int,
) -> BlockExplanation:
    rows: list[TensorDecision] = []
    per_byte_s = (1.0 / bandwidth[0] + 1.0 / bandwidth[1]) if bandwidth else None
    charged: set[int] = set()  # calls whose time is already on a row (one op may save several)
    for s in bo.saved:
        name = short_op(bo.calls[s.call].name) if s.call is not None else "input"
        op_s = bo.calls[s.call].time_s if s.call is not None and s.call not in charged else 0.0
        if segment is not None:
            rows.append(_segment_row(s, segment, name, op_s, first=first_of_segment))
        else:
            rows.append(_block_row(s, d, cached, name, op_s, min_bytes=min_bytes, per_byte_s=per_byte_s))
        if rows[-1].decision == RECOMPUTED and s.call is not None:
            charged.add(s.call)
    extra = _cached_extra(bo, cached, bo.saved) if d.option is Option.SELECTIVE and segment is None else []
    by = {k: sum(r.bytes for r in rows if r.decision == k) for k in (SAVED, RECOMPUTED, OFFLOADED)}
    return BlockExplanation(
        name=bo.name,
        option=d.option.value,
        policy=d.policy,
        saved_bytes=sum(r.bytes for r in rows),
        kept_bytes=by[SAVED],
        recomputed_bytes=by[RECOMPUTED],
        offloaded_bytes=by[OFFLOADED],
        cached_extra_bytes=sum(r.bytes for r in extra),
        seconds_added=_seconds_added(bo, d, cached, segment=segment, rows=rows),
        tensors=tuple(rows),
        cached=tuple(extra),
    )


def _row(s: Any, decision: str, why: str, *, seconds: float | None = 0.0) -> TensorDecision:
    """The row of saved tensor ``s``: what happens to it, why, and the seconds it adds."""
    freed = s.bytes if decision != SAVED else 0
    return TensorDecision(
        op=s.op,
        shape=s.shape,
        dtype=s.dtype,
        bytes=s.bytes,
        decision=decision,
        why=why,
        bytes_saved=freed,
        seconds_added=seconds,
    )


def _segment_row(s: Any, segment: Any, name: str, op_s: float, *, first: bool) -> TensorDecision:
    """The row of a tensor saved in a recomputed segment: the segment's input (in its ``first``
    block) is kept by its checkpoint, the rest is re-run."""
    if first and s.call is None:
        return _row(s, SAVED, f"input of segment [{segment.start}, {segment.stop}), kept by its checkpoint")
    return _row(s, RECOMPUTED, f"in recomputed segment [{segment.start}, {segment.stop}): re-run {name}", seconds=op_s)


def _block_row(
    s: Any,
    d: BlockDecision,
    cached: set[int],
    name: str,
    op_s: float,
    *,
    min_bytes: int,
    per_byte_s: float | None,
) -> TensorDecision:
    """The row of a tensor the block saves, by the block's option (kept, recomputed, selective,
    offloaded)."""
    if d.option is Option.KEEP:
        return _row(s, SAVED, "block kept")
    if s.call is None and d.option in (Option.RECOMPUTE, Option.SELECTIVE):
        return _row(s, SAVED, "block input, kept by the checkpoint")
    if d.option is Option.RECOMPUTE:
        return _row(s, RECOMPUTED, f"block recomputed: re-run {name}", seconds=op_s)
    if d.option is Option.SELECTIVE:
        if s.call in cached:
            return _row(s, SAVED, f"cached by the policy ({name})")
        return _row(s, RECOMPUTED, f"not cached by the policy: re-run {name}", seconds=op_s)
    if s.call is None:  # offload
        return _row(s, SAVED, "block input, stays on the device")
    if s.bytes < min_bytes:
        return _row(s, SAVED, f"under the offload threshold ({format_bytes(min_bytes)})")
    secs = s.bytes * per_byte_s if per_byte_s is not None else None
    return _row(
        s, OFFLOADED, "to host memory and back" + ("" if per_byte_s else " (CPU: no transfer time)"), seconds=secs
    )


def _cached_extra(bo: BlockOps, cached: set[int], saved: Any) -> list[TensorDecision]:
    """Outputs a selective policy caches that the backward does not need: memory, no re-run saved."""
    extra: list[TensorDecision] = []
    saved_calls = {s.call for s in saved if s.call is not None}
    for j in sorted(cached - saved_calls):
        c = bo.calls[j]
        if c.out_bytes:
            extra.append(
                TensorDecision(
                    op=c.op,
                    shape=c.shapes[0] if c.shapes else (),
                    dtype=c.dtype,
                    bytes=c.out_bytes,
                    decision=SAVED,
                    why=f"cached by the policy ({short_op(c.name)}), not needed by backward: costs memory, saves a re-run",
                    bytes_saved=0,
                    seconds_added=0.0,
                )
            )
    return extra


def _seconds_added(
    bo: BlockOps, d: BlockDecision, cached: set[int], *, segment: Any, rows: list[TensorDecision]
) -> float:
    """Seconds the block adds to the step: every op re-run (selective: every op not cached), or
    its tensors' transfers (offload)."""
    if segment is not None or d.option is Option.RECOMPUTE:
        return bo.fwd_s
    if d.option is Option.SELECTIVE:
        return sum(c.time_s for j, c in enumerate(bo.calls) if j not in cached)
    if d.option is Option.OFFLOAD:
        return sum(r.seconds_added or 0.0 for r in rows)
    return 0.0


def short_op(name: str) -> str:
    """``aten.addmm.default@0`` -> ``addmm@0`` (for the tables; JSON keeps full names)."""
    op, _, index = name.partition("@")
    parts = op.split(".")
    core = parts[1] if len(parts) == 3 and parts[0] == "aten" else op
    if len(parts) == 3 and parts[2] != "default":
        core += f".{parts[2]}"
    return core + (f"@{index}" if index else "")
