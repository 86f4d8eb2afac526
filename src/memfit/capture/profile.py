"""profile: measure one workload's training step, per block.

Produces immutable :class:`Stats` (per block: forward and backward seconds, bytes autograd saves,
output bytes, transient working memory) that planning consumes. Two kinds of passes:

- a *memory pass*: one steady-state step under the live-tensor tracker, with saved-tensor hooks
  around each block's forward and events at block boundaries;
- *time passes*: plain steps (no tracker) with timestamps at block boundaries, medians over repeats.

Each *option* a block can take is calibrated by a memory pass of a step in which every block takes
that option: ``keep`` and ``recompute``; selective options (``selective:<preset>`` for each preset
that caches something different, and ``selective:milp-<pct>``, the per-block MILP's choice with
``pct`` % of the block's saved bytes allotted; :mod:`memfit.apply.selective`); and ``offload`` on a
device that is not the CPU. Per-block times are measured for ``keep`` and ``recompute``; for the
other options the seconds they add per block come from the op-level capture
(:func:`memfit.capture.ops.capture_ops`: the ops a selective block re-runs, the bytes an offloaded
block moves at the measured bandwidth), and every option's whole step is timed so that the cost
model can calibrate them (NOTE [ Cost model ]).
"""

from __future__ import annotations

import bisect
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from memfit.apply.engine import plan_applied
from memfit.capture.chain import Chain, computed_between_blocks, discover_chain
from memfit.capture.snapshot import leave_unchanged
from memfit.capture.step import (
    StepMemory,
    make_optimizer,
    measure_step,
    step_runner,
    time_steps,
    training_step,
    warm_up,
)
from memfit.errors import SpecError, UnsupportedModelError
from memfit.plan.policies import make_fingerprint, policy_plan
from memfit.plan.types import Action, BlockDecision, Plan
from memfit.workload import Batch, Workload, cast_batch, iter_tensors


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
class Stats:
    """Everything one profile measured. JSON fields follow DESIGN.md (``memfit profile``).

    Besides the per-block stats, the plan-independent parts of a step (bytes):
    ``start_bytes`` live when the first block starts (parameters, optimizer state, batch,
    embeddings); ``pre_peak_bytes`` the peak before it; ``head_peak_bytes`` the peak from the last
    block's output through the loss and the head's backward, above the live bytes after the last
    block; ``post_peak_bytes`` the peak after the first block's backward (embeddings' backward and
    the optimizer step). ``measured_peak_bytes_by_mode`` holds each calibration step's peak and
    ``step_s_by_mode`` its time; ``device_overhead_bytes`` is what the CUDA allocator holds beyond
    the tracked tensors at the peak (0 on the CPU); ``calibration`` records how the extra options were made (MILP
    allotments, options dropped and why, offload bandwidth). ``head_options`` holds each head
    option (:mod:`memfit.apply.head`): its ``head_peak_bytes`` (the larger over every block kept and
    every block recomputed), the whole step's ``step_s`` and ``measured_peak_bytes`` with every
    block kept, and ``measured_peak_bytes_by_mode``. ``activations`` is ``"fused"`` when the model
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
    step_s_by_mode: dict[str, float] = field(default_factory=dict)
    measured_peak_bytes_by_mode: dict[str, int] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    device_overhead_bytes: int = 0
    head_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    activations: str | None = None
    segment_spans: tuple[tuple[int, int], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["blocks"] = [b.to_dict() for b in self.blocks]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stats:
        d = dict(data)
        d["blocks"] = tuple(BlockStats.from_dict(b) for b in d["blocks"])
        if d.get("segment_spans") is not None:
            d["segment_spans"] = tuple((int(a), int(b)) for a, b in d["segment_spans"])
        return cls(**d)


MODES = ("keep", "recompute")
"""The base options: every block kept, every block recomputed."""
DEFAULT_MODES = ("keep", "recompute", "selective", "offload")
"""What :func:`profile` calibrates by default. ``selective`` stands for the selective options
(presets and MILP variants, see :func:`selective_options`); ``offload`` is left out on the CPU,
where moving activations to host memory saves nothing."""
MILP_FRACTIONS = (0.25, 0.5, 0.75)
"""Allotments of the selective MILP variants, as fractions of each block's saved bytes."""


def profile(
    workload: Workload,
    *,
    batch_size: int | None = None,
    dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
    repeats: int = 3,
    device: torch.device | str | None = None,
    modes: tuple[str, ...] = DEFAULT_MODES,
    heads: bool = True,
    activations: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Stats:
    """Measure the workload's training step per block, in every option the planner can choose.

    One tracked step per option (every block kept, every block recomputed, every block in each
    selective option, every block offloaded) gives each block's memory costs in each option;
    timed steps give times (medians, options interleaved).

    Measuring never changes the model: the steps train it (AdamW at lr 1e-3 by default) and draw
    random numbers, and afterwards its parameters, buffers, gradients, ``requires_grad`` and
    ``training`` flags and the RNGs (torch, CUDA, Python, NumPy) are restored bitwise, also when
    the measurement raises; a plan applied to it is lifted for the measurement and applied again.
    ``dtype`` and ``device`` measure a cast copy and leave the model where it is (NOTE [ Measuring
    leaves the model as it was ] in :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload (a plan applied to its model is lifted while measuring).
        batch_size: samples per step (default: the workload's).
        dtype: measure a copy of the model in this dtype (and convert the batch).
        optimizer: the step's optimizer ('adamw', 'adam', 'sgd').
        seed: seed for data and dropout.
        repeats: timed steps per option (medians); at least 1.
        device: measure a copy of the model on this device (default: the model where it is).
        modes: which options to calibrate, ``keep`` first: ``keep``, ``recompute``,
            ``selective`` (all selective options), ``selective:<preset>``, ``offload`` (ignored
            on the CPU). ``("keep",)`` is enough for per-block stats; ``MODES`` gives the
            block-level planner of keep and recompute only.
        heads: also calibrate the head options where the model takes them (the chunked loss of
            :mod:`memfit.apply.head`, checked against the model's own loss and gradients first).
        activations: profile with fused activations where the model has activation modules with a
            fused kernel (:mod:`memfit.apply.activations`, checked against the modules' own first);
            the stats then say ``activations="fused"`` and so do plans made from them.
        progress: called with a short text before each pass.

    Returns:
        The measured :class:`Stats`.
    """
    if not modes or modes[0] != "keep":
        raise SpecError(
            f"memfit.profile: modes {modes!r} must start with 'keep' (every option is measured against it), "
            "e.g. modes=('keep', 'recompute', 'selective')."
        )
    unknown = [m for m in modes if m not in (*MODES, "selective", "offload") and not m.startswith("selective:")]
    if unknown:
        raise SpecError(
            f"memfit.profile: unknown option(s) {unknown}. Use keep, recompute, selective, "
            "selective:PRESET (save_matmuls, save_attention, save_matmuls_and_attention) or offload."
        )
    with leave_unchanged(workload.model, device=device, dtype=dtype) as model:
        if model is not workload.model:
            workload = replace(workload, model=model)
        fused, note = _install_activations(model) if activations else (None, {})
        try:
            stats = _profile(
                workload, batch_size=batch_size, dtype=dtype, optimizer=optimizer, seed=seed, repeats=repeats,
                modes=modes, heads=heads, progress=progress,
            )
        finally:
            if fused is not None:
                from memfit.apply.activations import remove_fused_activations

                remove_fused_activations(model)
    calibration = dict(stats.calibration)
    calibration.update({k: v for k, v in note.items() if k != "dropped_options"})
    if "dropped_options" in note:
        calibration["dropped_options"] = {**calibration.get("dropped_options", {}), **note["dropped_options"]}
    return replace(stats, activations=fused, calibration=calibration)


def _install_activations(model: nn.Module) -> tuple[str | None, dict[str, Any]]:
    """Fuse the model's activation modules where they have a fused kernel that matches them:
    ``("fused", note)``, else ``(None, note)`` (the note says why an option was dropped)."""
    from memfit.apply.activations import (
        activation_mismatch,
        fusable_activations,
        install_fused_activations,
    )

    found = fusable_activations(model)
    why = activation_mismatch(model) if found else None
    if found and why is None:
        install_fused_activations(model)
        return "fused", {"fused_activations": {"modules": len(found), "classes": sorted({type(m).__name__ for m in found.values()})}}
    if why is not None:
        return None, {"dropped_options": {"activations:fused": why}}
    return None, {}


def _profile(
    workload: Workload,
    *,
    batch_size: int | None,
    dtype: torch.dtype | None,
    optimizer: str,
    seed: int,
    repeats: int,
    modes: tuple[str, ...],
    heads: bool,
    progress: Callable[[str], None] | None,
) -> Stats:
    """:func:`profile`'s measurements, on the model as it is (moved, cast, fused or not)."""
    say = progress or (lambda _s: None)
    model = workload.model
    model.zero_grad(set_to_none=True)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    eff_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    chain = discover_chain(model, workload.blocks)
    n = len(chain)
    bs = batch_size or workload.default_batch_size
    torch.manual_seed(seed)
    batch = cast_batch(workload.make_batch(bs), dtype=dtype, device=dev)
    opt = make_optimizer(model, optimizer)
    repeats = max(1, repeats)
    base = policy_plan(model, "none", chain=chain)
    calibration: dict[str, Any] = {}
    plans = {m: policy_plan(model, "none" if m == "keep" else "all", chain=chain) for m in modes if m in MODES}
    rerun: dict[str, list[float]] = {}

    extra_requested = [m for m in modes if m not in MODES]
    ops = None
    if any(m.startswith("selective") for m in extra_requested):
        from memfit.capture.ops import _capture_ops

        say("op-level capture")
        # The recording itself: profile already leaves the model as it was (no second snapshot).
        ops = _capture_ops(workload, batch_size=None, dtype=None, seed=seed, repeats=repeats, batch=batch)
        options, dropped = selective_options(ops, [m for m in extra_requested if m.startswith("selective")])
        calibration["dropped_options"] = dropped
        calibration["milp_fractions"] = list(MILP_FRACTIONS)
        for m, pols in options.items():
            plans[m] = base.with_(
                policy=m,
                blocks=tuple(BlockDecision(name=nm, action=Action.SELECTIVE, policy=p) for nm, p in zip(chain.names, pols, strict=True)),
            )
    if "offload" in extra_requested:
        if dev.type == "cpu":
            calibration.setdefault("dropped_options", {})["offload"] = "the device is the CPU: offloading to host memory saves nothing"
        else:
            from memfit.apply.offload import measure_bandwidth

            d2h, h2d = measure_bandwidth(dev)
            calibration["offload_d2h_bytes_per_s"] = d2h
            calibration["offload_h2d_bytes_per_s"] = h2d
            plans["offload"] = base.with_(
                policy="offload", blocks=tuple(BlockDecision(name=nm, action=Action.OFFLOAD) for nm in chain.names)
            )
    all_modes = list(plans)
    head_plans: dict[str, Plan] = {}
    if heads:
        from memfit.apply.head import head_mismatch, head_unsupported_reason

        why = head_unsupported_reason(model)
        if why is None:
            say("checking the chunked head")
            why = head_mismatch(model, batch, workload.loss_fn, seed=seed)
        if why is None:
            head_plans["chunked"] = base.with_(head="chunked")
        else:
            calibration.setdefault("dropped_options", {})["head:chunked"] = why

    say("warm-up step")
    warm_up(model, batch, workload.loss_fn, opt, seed=seed + 1)
    passes: dict[str, _Pass] = {}
    times: dict[str, tuple[list[float], list[float], float, float]] = {}
    for m in all_modes:
        say(f"memory pass ({m})")
        with plan_applied(model, plans[m]):
            passes[m] = _memory_pass(model, chain, batch, workload, opt, seed)
        if m == all_modes[0]:
            _check_block_order(passes[m], chain, model)
        if m in MODES:
            say(f"time pass ({m})")
            with plan_applied(model, plans[m]):
                times[m] = _time_pass(model, chain, batch, workload, opt, seed, repeats)
    # Each head option runs with every block kept, and (when calibrated) every block recomputed:
    # its H is the larger of the two, as the model's own head's is over the block options.
    head_passes: dict[str, dict[str, _Pass]] = {}
    for h, hp in head_plans.items():
        for m in MODES:
            if m not in plans:
                continue
            say(f"memory pass (head {h}, {m})")
            with plan_applied(model, plans[m].with_(head=hp.head)):
                head_passes.setdefault(h, {})[m] = _memory_pass(model, chain, batch, workload, opt, seed)
    say("timing whole steps")
    step_times = time_steps(  # every option just ran its memory pass: no separate warm-up
        {
            **{m: _planned_runner(model, plans[m], batch, workload, opt, seed) for m in all_modes},
            **{f"head:{h}": _planned_runner(model, hp, batch, workload, opt, seed) for h, hp in head_plans.items()},
        },
        repeats=repeats,
        warmup=0,
    )
    opt.zero_grad(set_to_none=True)

    ref = all_modes[0]
    keep = passes[ref]
    for m in all_modes:
        if m in MODES:
            continue
        if m == "offload":
            bw = 1.0 / calibration["offload_d2h_bytes_per_s"] + 1.0 / calibration["offload_h2d_bytes_per_s"]
            rerun[m] = [_offloaded_bytes(keep, i) * bw for i in range(n)]
        else:
            assert ops is not None
            rerun[m] = [times[ref][0][i] * _rerun_fraction(ops.blocks[i], plans[m].blocks[i].policy or "") for i in range(n)]
    derived = {m: passes[m].derive(n) for m in all_modes}
    blocks = []
    for i, name in enumerate(chain.names):
        costs = {}
        for m in all_modes:
            t = times.get(m)
            extra = rerun.get(m, [0.0] * n)[i]
            costs[m] = ModeCosts(
                retained_bytes=derived[m].retained[i],
                fwd_peak_bytes=derived[m].fwd_peak[i],
                bwd_peak_bytes=derived[m].bwd_peak[i],
                bwd_base_bytes=derived[m].bwd_base[i],
                fwd_s=t[0][i] if t else times[ref][0][i],
                bwd_s=t[1][i] if t else times[ref][1][i] + extra,
                policy=plans[m].blocks[i].policy,
                rerun_s=extra,
            )
        blocks.append(
            BlockStats(
                name=name,
                fwd_s=times[ref][0][i],
                bwd_s=times[ref][1][i],
                saved_bytes=keep.saved_bytes(i),
                output_bytes=keep.outputs[i],
                input_bytes=keep.inputs[i],
                fwd_temp_bytes=derived[ref].fwd_peak[i],
                bwd_temp_bytes=derived[ref].bwd_peak[i],
                input_saved=keep.input_saved(i),
                modes=costs,
            )
        )
    mem = keep.mem
    segment_spans = _segment_spans(keep, chain, calibration)
    return Stats(
        model=workload.name,
        batch_size=bs,
        dtype=str(eff_dtype).removeprefix("torch."),
        device=str(dev),
        optimizer=optimizer,
        chain_path=chain.path,
        sequential=bool(segment_spans),
        segment_spans=segment_spans,
        blocks=tuple(blocks),
        peak_bytes=mem.device_peak_bytes,
        step_s=step_times[ref],
        params_bytes=mem.params_bytes,
        grads_bytes=mem.grads_bytes,
        optimizer_bytes=mem.optimizer_bytes,
        activations_peak_bytes=mem.activations_peak_bytes,
        peak_bytes_by_phase=dict(mem.peak_bytes_by_phase),
        fwd_s=times[ref][2],
        bwd_s=times[ref][3],
        start_bytes=max(d.start for d in derived.values()),
        pre_peak_bytes=max(d.pre_peak for d in derived.values()),
        head_peak_bytes=max(d.head_peak for d in derived.values()),
        post_peak_bytes=max(d.post_peak for d in derived.values()),
        step_s_by_mode={m: t for m, t in step_times.items() if not m.startswith("head:")},
        measured_peak_bytes_by_mode={m: p.mem.peak_bytes for m, p in passes.items()},
        fingerprint=make_fingerprint(model, chain, batch),
        calibration=calibration,
        # On CUDA the allocator holds memory no tensor owns (cuBLAS workspaces): the largest gap
        # between its peak and the tracker's over the calibration steps, added to every
        # prediction so that predictions compare with torch.cuda.max_memory_allocated.
        device_overhead_bytes=max(
            (p.mem.allocator_peak_bytes - p.mem.peak_bytes for p in passes.values() if p.mem.allocator_peak_bytes is not None),
            default=0,
        ),
        head_options={
            h: {
                "head_peak_bytes": max(p.derive(n).head_peak for p in ps.values()),
                "step_s": step_times[f"head:{h}"],
                "measured_peak_bytes": ps["keep"].mem.peak_bytes,
                "measured_peak_bytes_by_mode": {m: p.mem.peak_bytes for m, p in ps.items()},
            }
            for h, ps in head_passes.items()
        },
    )


def selective_options(ops: Any, requested: list[str]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The selective options worth calibrating, and the ones left out with the reason.

    ``selective`` asks for every preset and the MILP variants (``selective:milp-<pct>``, one per
    :data:`MILP_FRACTIONS`); ``selective:<preset>`` for one preset. An option is left out when it
    caches nothing in every block (it would be a slower ``recompute``), when it caches exactly
    what an option already kept caches, or when it would cache an output that the block then
    mutates in place (torch raises on that in backward).

    Args:
        ops: the op-level capture (:class:`memfit.capture.ops.OpStats`).
        requested: option names (``selective``, ``selective:<preset>``).

    Returns:
        ``({option: [policy per block]}, {option: why it was left out})``.
    """
    from memfit.apply.selective import (
        cached_calls,
        parse_save_policy,
        solve_block_milp,
        uncacheable_calls,
    )
    from memfit.plan.types import SELECTIVE_PRESETS

    wanted: list[str] = []
    for r in requested:
        if r == "selective":
            wanted.extend(f"selective:{p}" for p in SELECTIVE_PRESETS)
            wanted.extend(f"selective:milp-{round(f * 100)}" for f in MILP_FRACTIONS)
        else:
            wanted.append(r)
    options: dict[str, list[str]] = {}
    dropped: dict[str, str] = {}
    seen: dict[tuple[tuple[int, ...], ...], str] = {}
    for name in dict.fromkeys(wanted):
        what = name.split(":", 1)[1]
        if what.startswith("milp-"):
            frac = int(what.split("-", 1)[1]) / 100
            pols = [solve_block_milp(b, int(frac * b.saved_bytes)).policy for b in ops.blocks]
        else:
            pols = [what] * len(ops.blocks)
        parsed = [parse_save_policy(p) for p in pols]
        sets = tuple(cached_calls(b, p) for b, p in zip(ops.blocks, parsed, strict=True))
        bad = [c for b, p in zip(ops.blocks, parsed, strict=True) for c in uncacheable_calls(b, p)]
        cached = [sum(b.calls[j].out_bytes for j in s) for b, s in zip(ops.blocks, sets, strict=True)]
        if bad:
            dropped[name] = f"it would cache outputs the blocks mutate in place ({', '.join(bad[:3])})"
        elif not any(cached):
            dropped[name] = "it caches nothing in this model (the same as recompute, with overhead)"
        elif sets in seen:
            dropped[name] = f"it caches the same op outputs as {seen[sets]}"
        else:
            seen[sets] = name
            options[name] = pols
    return options, dropped


def _rerun_fraction(block_ops: Any, policy: str) -> float:
    """Share of a block's op time that a selective policy re-runs in backward."""
    from memfit.apply.selective import cached_calls, parse_save_policy

    total = sum(c.time_s for c in block_ops.calls)
    if total <= 0:
        return 1.0
    saved = sum(block_ops.calls[j].time_s for j in cached_calls(block_ops, parse_save_policy(policy)))
    return max(0.0, total - saved) / total


def _offloaded_bytes(keep: _Pass, i: int) -> int:
    """Bytes block i moves to the host: what it saves, less what stays (its inputs)."""
    return max(0, keep.saved_bytes(i) - (keep.inputs[i] if keep.input_saved(i) else 0))


def _planned_runner(
    model: nn.Module, plan: Any, batch: Batch, workload: Workload, opt: torch.optim.Optimizer, seed: int
) -> Callable[[], Any]:
    run = step_runner(model, batch, workload.loss_fn, opt, seed=seed)

    def go() -> None:
        with plan_applied(model, plan):
            run()

    return go


# --- memory pass ---------------------------------------------------------------------------------

Event = tuple[str, int, int, int]  # (label, block or -1, op_count, live bytes)


def _storage_key(t: torch.Tensor) -> int:
    return id(t.untyped_storage())


def _bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


def _dead() -> None:
    return None


@dataclass(slots=True)
class _Derived:
    """Per-block and step-level bytes derived from one pass's events (see :class:`ModeCosts`)."""

    start: int
    pre_peak: int
    head_peak: int
    post_peak: int
    retained: list[int]
    fwd_peak: list[int]
    bwd_peak: list[int]
    bwd_base: list[int]
    fwd_ops: list[tuple[int, int]] = field(default_factory=list)
    """Per block, the tracker's op counts at its forward's start and end."""
    bwd_ops: list[tuple[int, int]] = field(default_factory=list)
    """Per block, the op counts at its backward's start and end (recompute included)."""


@dataclass(slots=True)
class _Pass:
    """One tracked step with events at block and phase boundaries."""

    mem: StepMemory
    events: list[Event]
    timeline: list[Any]
    saved: list[dict[int, int]]
    output_keys: list[set[int]]
    outputs: list[int]
    inputs: list[int]
    between_blocks: list[bool] = field(default_factory=list)
    """Per block, whether it takes a tensor the model computed from earlier blocks' outputs of its
    container between the blocks (:func:`memfit.capture.chain.computed_between_blocks`)."""
    _ops: list[int] = field(default_factory=list)

    def saved_bytes(self, i: int) -> int:
        return sum(self.saved[i].values())

    def input_saved(self, i: int) -> bool:
        """Whether block i's forward saves its input (the previous block's output)."""
        return i == 0 or not self.output_keys[i - 1] or bool(self.output_keys[i - 1] & self.saved[i].keys())

    def peak_between(self, a: Event, b: Event) -> int:
        """Highest live bytes from event ``a`` to event ``b``."""
        if not self._ops:
            self._ops = [s.op_index for s in self.timeline]
        lo, hi = bisect.bisect_right(self._ops, a[2]), bisect.bisect_right(self._ops, b[2])
        return max([a[3], b[3], *(s.current_bytes for s in self.timeline[lo:hi])])

    def derive(self, n: int) -> _Derived:
        first: dict[tuple[str, int], Event] = {}
        last: dict[tuple[str, int], Event] = {}
        for ev in self.events:
            first.setdefault((ev[0], ev[1]), ev)
            last[(ev[0], ev[1])] = ev
        fstart = [first[("fwd_start", i)] for i in range(n)]
        fend = [first[("fwd_end", i)] for i in range(n)]
        step_end = last.get(("end:optimizer", -1)) or last[("end:backward", -1)]
        start = fstart[0][3]
        retained = [(fstart[i + 1][3] if i + 1 < n else fend[i][3]) - fstart[i][3] for i in range(n)]
        fwd_peak = [self.peak_between(fstart[i], fend[i]) - fstart[i][3] for i in range(n)]
        # Backward of block i: from its output's gradient to the last gradient of its inputs or
        # parameters (blocks run backward from the last one).
        bstart: list[Event] = [fend[0]] * n
        bend: list[Event] = [fend[0]] * n
        prev = last.get(("end:forward", -1), fend[n - 1])
        for i in reversed(range(n)):
            s = first.get(("bwd_start", i))
            if s is None or s[2] < prev[2]:
                s = prev
            ends = [last[k] for k in (("bwd_in", i), ("bwd_param", i)) if k in last]
            e = max(ends, key=lambda ev: ev[2]) if ends else s
            bstart[i], bend[i] = s, e
            prev = e
        prefix = 0
        bwd_base = []
        for i in range(n):
            prefix += retained[i]
            bwd_base.append(bstart[i][3] - start - prefix)
        return _Derived(
            start=start,
            pre_peak=self.peak_between(first[("start:forward", -1)], fstart[0]),
            head_peak=max(0, self.peak_between(fend[n - 1], bstart[n - 1]) - fend[n - 1][3]),
            post_peak=self.peak_between(bend[0], step_end),
            retained=retained,
            fwd_peak=[max(0, x) for x in fwd_peak],
            bwd_peak=[max(0, self.peak_between(bstart[i], bend[i]) - bstart[i][3]) for i in range(n)],
            bwd_base=bwd_base,
            fwd_ops=[(fstart[i][2], fend[i][2]) for i in range(n)],
            bwd_ops=[(bstart[i][2], bend[i][2]) for i in range(n)],
        )


def _memory_pass(
    model: nn.Module,
    chain: Chain,
    batch: Batch,
    workload: Workload,
    opt: torch.optim.Optimizer | None,
    seed: int,
    *,
    run_step: Callable[[Any, Callable[[str, str], None]], StepMemory] | None = None,
) -> _Pass:
    """One tracked step with the per-block hooks. ``run_step(tracker, on_phase)`` runs the step
    instead of :func:`measure_step` (the fake-tensor step of :mod:`memfit.estimate.stats`); it
    must run under ``tracker`` and call ``on_phase`` as :func:`measure_step` does."""
    from memfit.capture.tracker import MemoryTracker

    n = len(chain)
    saved: list[dict[int, int]] = [{} for _ in range(n)]
    output_keys: list[set[int]] = [set() for _ in range(n)]
    outputs = [0] * n
    inputs = [0] * n
    between = [False] * n
    container_of = [j for j, (a, b) in enumerate(chain.spans) for _ in range(a, b)]
    out_nodes: list[set[int]] = [set() for _ in chain.spans]  # per container: its outputs' grad_fn ids
    out_refs: list[dict[int, Any]] = [{} for _ in chain.spans]  # per container: id -> weak ref of its outputs
    fixed = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    handles: list[Any] = []
    active: dict[int, Any] = {}
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    tracker = MemoryTracker(device=dev, record_timeline=True)
    events: list[Event] = []

    def mark(label: str, i: int) -> None:
        events.append((label, i, tracker.op_count, tracker.current_bytes))

    def pre(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            ts = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
            inputs[i] = _bytes([t for t in ts if _storage_key(t) not in fixed])
            j = container_of[i]
            between[i] = between[i] or any(
                computed_between_blocks(t, out_nodes[j]) and (out_refs[j].get(id(t)) or _dead)() is not t for t in ts
            )
            for t in ts:
                if t.requires_grad:
                    t.register_hook(lambda _g, i=i: mark("bwd_in", i))
            mark("fwd_start", i)

            def pack(t: torch.Tensor) -> torch.Tensor:
                k = _storage_key(t)
                if k not in fixed:
                    saved[i][k] = t.untyped_storage().nbytes()
                return t

            ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            ctx.__enter__()
            active[i] = ctx

        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
            active.pop(i).__exit__(None, None, None)
            mark("fwd_end", i)
            outs = [t for t in iter_tensors(out) if isinstance(t, torch.Tensor)]
            outputs[i] = _bytes(outs)
            j = container_of[i]
            out_nodes[j].update(id(t.grad_fn) for t in outs if t.grad_fn is not None)
            out_refs[j].update((id(t), weakref.ref(t)) for t in outs)
            output_keys[i] = {_storage_key(t) for t in outs}
            for t in outs:
                if t.requires_grad:
                    t.register_hook(lambda _g, i=i: mark("bwd_start", i))

        return hook

    for i, blk in enumerate(chain.blocks):
        handles.append(blk.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(blk.register_forward_hook(post(i), with_kwargs=True))
        for p in blk.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: mark("bwd_param", i)))
    for j, container in enumerate(chain.containers):  # did the container's own forward run?
        handles.append(container.register_forward_pre_hook(lambda _m, _a, j=j: mark("container_start", j)))
        handles.append(container.register_forward_hook(lambda _m, _a, _o, j=j: mark("container_end", j)))
    on_phase = lambda where, name: mark(f"{where}:{name}", -1)  # noqa: E731
    try:
        if run_step is not None:
            mem = run_step(tracker, on_phase)
        else:
            assert opt is not None
            mem = measure_step(model, batch, workload.loss_fn, opt, seed=seed + 2, tracker=tracker, on_phase=on_phase)
    finally:
        for h in handles:
            h.remove()
        for ctx in active.values():
            ctx.__exit__(None, None, None)
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    return _Pass(
        mem=mem,
        events=events,
        timeline=tracker.timeline,
        saved=saved,
        output_keys=output_keys,
        outputs=outputs,
        inputs=inputs,
        between_blocks=between,
    )


def _forward_events(p: _Pass) -> list[Event]:
    end = next((k for k, ev in enumerate(p.events) if ev[0] == "end:forward"), len(p.events))
    return p.events[:end]


def _check_block_order(p: _Pass, chain: Chain, model: nn.Module) -> None:
    """Refuse a chain whose blocks did not all run, ran more than once, or ran in another order than
    the chain's."""
    order: list[int] = []
    runs = [0] * len(chain)
    for label, i, *_ in _forward_events(p):
        if label == "fwd_start":
            runs[i] += 1
            if i not in order:
                order.append(i)
    again = [i for i, n in enumerate(runs) if n > 1]
    if again:
        # NOTE: the events of a block are taken from its first run (``_Pass.derive``); a module shared
        # across depth (ALBERT runs one layer num_hidden_layers times) was predicted 1.27 MB and measured
        # 0.73 MB. The gradients would be exact, the memory plan would not be.
        i = again[0]
        raise UnsupportedModelError(
            f"memfit.profile: block {chain.names[i]} ({type(chain.blocks[i]).__name__}) ran {runs[i]} times in one "
            "forward: a module shared across depth (as ALBERT's layer) or a loss_fn that calls the model more than "
            "once. memfit plans and predicts memory for blocks that run once per forward. Call the model once per "
            "step (concatenate the inputs), name containers whose blocks run once (memfit.set_blocks), or "
            "recompute the shared module without a memfit plan (model.gradient_checkpointing_enable() for "
            "transformers models)."
        )
    if order == list(range(len(chain))):
        return
    missing = [chain.names[i] for i in range(len(chain)) if i not in order]
    if missing:
        what = f"{len(missing)} of its {len(chain)} blocks did not run in the forward ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
    else:
        k = next(k for k, i in enumerate(order) if i != k)
        what = f"its blocks ran in another order ({chain.names[order[k]]} ran before {chain.names[k]})"
    raise UnsupportedModelError(
        f"memfit.profile: the chain of {type(model).__name__} is {chain.describe()}, but {what}. Plans need "
        "every block of the chain to run once per forward, in chain order. Name the block containers in the "
        "order the forward runs them: memfit.set_blocks(model, 'encoder.layers', 'decoder.layers')."
    )


def _segment_spans(p: _Pass, chain: Chain, calibration: dict[str, Any] | None = None) -> tuple[tuple[int, int], ...]:
    """Where a plan's segments may lie: runs of two or more blocks of one container, each taking
    the blocks before it as they returned them (:mod:`memfit.apply.segments` refuses a segment
    with a block that takes a tensor the model's loop computed between blocks);
    ``calibration["segments"]`` says why when some blocks cannot be in a segment with the one
    before."""
    out = []
    for a, b in chain.spans:
        start = a
        for i in range(a + 1, b + 1):
            if i == b or p.between_blocks[i]:
                if i - start >= 2:
                    out.append((start, i))
                start = i
    cut = [chain.names[i] for i, between in enumerate(p.between_blocks) if between]
    if calibration is not None and cut:
        calibration["segments"] = (
            f"{len(cut)} blocks ({', '.join(cut[:3])}{', ...' if len(cut) > 3 else ''}) take a tensor the model's "
            "forward computed from the blocks before them (a residual in its loop): no segment holds such a block "
            "with the one before it"
        )
    return tuple(out)


# --- time passes ---------------------------------------------------------------------------------


def _time_pass(
    model: nn.Module,
    chain: Chain,
    batch: Batch,
    workload: Workload,
    opt: torch.optim.Optimizer,
    seed: int,
    repeats: int,
) -> tuple[list[float], list[float], float, float]:
    n = len(chain)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fwd_samples: list[list[float]] = [[] for _ in range(n)]
    bwd_samples: list[list[float]] = [[] for _ in range(n)]
    fwd_tot: list[float] = []
    bwd_tot: list[float] = []
    t_start: dict[int, float] = {}
    t_bstart: dict[int, float] = {}
    t_bend: dict[int, float] = {}
    handles: list[Any] = []

    def now() -> float:
        sync()
        return time.perf_counter()

    def end_at(i: int) -> None:  # the latest gradient of block i's inputs or parameters
        t_bend[i] = max(t_bend.get(i, 0.0), now())

    def start_at(i: int) -> None:  # the first gradient of block i's outputs
        if i not in t_bstart:
            t_bstart[i] = now()

    def pre(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            for t in iter_tensors((args, kwargs)):
                if t.requires_grad:
                    t.register_hook(lambda _g, i=i: end_at(i))
            t_start[i] = now()

        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: tuple, _k: dict, out: Any) -> None:
            fwd_samples[i].append(now() - t_start[i])
            for t in iter_tensors(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _g, i=i: start_at(i))

        return hook

    for i, blk in enumerate(chain.blocks):
        handles.append(blk.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(blk.register_forward_hook(post(i), with_kwargs=True))
        for p in blk.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: end_at(i)))
    try:
        phase_t: dict[str, float] = {}

        class _Phase:
            def __init__(self, name: str) -> None:
                self.name = name

            def __enter__(self) -> None:
                phase_t[self.name] = now()

            def __exit__(self, *exc: Any) -> None:
                phase_t[self.name] = now() - phase_t[self.name]

        for _ in range(repeats):
            t_bstart.clear()
            t_bend.clear()
            training_step(model, batch, workload.loss_fn, None, seed=seed + 2, phase=_Phase)
            model.zero_grad(set_to_none=True)
            fwd_tot.append(phase_t["forward"])
            bwd_tot.append(phase_t["backward"])
            for i in range(n):
                if i in t_bstart and i in t_bend:
                    bwd_samples[i].append(max(0.0, t_bend[i] - t_bstart[i]))
    finally:
        for h in handles:
            h.remove()

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    return [med(s) for s in fwd_samples], [med(s) for s in bwd_samples], med(fwd_tot), med(bwd_tot)
