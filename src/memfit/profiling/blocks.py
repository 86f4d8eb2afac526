"""profile: measure one workload's training step, per block, in every option the planner can choose.

Produces immutable :class:`~memfit.capture.stats.Stats` (per block: forward and backward seconds,
bytes autograd saves, output bytes, transient working memory) that planning consumes. This module
orchestrates the three stages below it, each in its own layer:

- :mod:`memfit.plan.options` decides which set-ups to measure: ``keep`` and ``recompute``; selective
  options (``selective:<preset>`` for each preset that caches something different, and ``selective:milp-<pct>``,
  the per-block MILP's choice with ``pct`` % of the block's saved bytes allotted, :mod:`memfit.plan.milp`);
  ``offload`` on a device that is not the CPU; the chunked head (:mod:`memfit.apply.head`) where the
  model's loss allows it; tiled and host-held options (:mod:`memfit.profiling.tiling`);
- :mod:`memfit.apply` installs each set-up (a plan applied, fused activations);
- :mod:`memfit.capture.passes` measures it: a *memory pass* (one steady-state step under the
  live-tensor tracker, with saved-tensor hooks around each block's forward and events at block
  boundaries) per option, and *time passes* (plain steps with timestamps at block boundaries,
  medians over repeats) for ``keep`` and ``recompute``.

For the other options the seconds they add per block come from the op-level capture
(:func:`memfit.capture.ops.record_ops`: the ops a selective block re-runs, the bytes an offloaded
block moves at the measured bandwidth), and every option's whole step is timed so that the cost
model can calibrate them (NOTE [ Cost model ] in :mod:`memfit.plan.costmodel`).

Size: about 510 lines, over the ~500 of other modules: the orchestration of one profile (the set-ups,
their passes, the Stats they make, the chain's coverage) is one pass; each stage lives in its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from memfit.apply.activations import (
    activation_mismatch,
    fusable_activations,
    install_fused_activations,
    remove_fused_activations,
)
from memfit.apply.engine import plan_applied
from memfit.apply.head import head_mismatch, head_unsupported_reason
from memfit.apply.offload import measure_bandwidth
from memfit.apply.tiling import TileCheck
from memfit.capture.chain import Chain, discover_chain
from memfit.capture.coverage import chain_as_run, suggest_block_lists, warn_coverage
from memfit.capture.ops import record_ops
from memfit.capture.opstats import OpStats
from memfit.capture.passes import (
    MemoryPass,
    TimePass,
    check_block_order,
    memory_pass,
    segment_spans,
    segments_note,
    time_pass,
)
from memfit.capture.snapshot import every_layer_runs, leave_unchanged
from memfit.capture.stats import (
    BlockStats,
    Calibration,
    FusedActivations,
    HeadOptionStats,
    OptionStats,
    Stats,
    head_fields,
)
from memfit.capture.step import StepSpec, step_optimizer, step_runner, time_steps, warm_up
from memfit.plan.options import (
    BASE_OPTIONS,
    DEFAULT_OPTIONS,
    MILP_FRACTIONS,
    BlockOption,
    option_plan,
    requested_options,
    rerun_fraction,
    selective_options,
)
from memfit.plan.policies import make_fingerprint, policy_plan
from memfit.plan.types import Option, Plan
from memfit.profiling.tiling import TiledRequest, tiled_rerun_s, tiled_setups
from memfit.workload import Batch, Workload, cast_batch

__all__ = ["install_activations", "profile"]


def profile(
    workload: Workload,
    *,
    step: StepSpec | None = None,
    options: tuple[str, ...] = DEFAULT_OPTIONS,
    heads: bool = True,
    activations: bool = True,
    tiling: bool = True,
    tile_modules: tuple[str, ...] | None = None,
    tile_counts: tuple[int, ...] | None = None,
    host_inputs: bool = True,
    progress: Callable[[str], None] | None = None,
    on_memory_pass: Callable[[str, MemoryPass], None] | None = None,
) -> Stats:
    """Measure the workload's training step per block, in every option the planner can choose.

    One tracked step per option (every block kept, every block recomputed, every block in each
    selective option, every block offloaded) gives each block's memory costs in each option;
    timed steps give times (medians, options interleaved).

    Measuring never changes the model: the steps train it (AdamW at lr 1e-3 by default) and draw
    random numbers, and afterwards its parameters, buffers, gradients, ``requires_grad`` and
    ``training`` flags and the RNGs (torch, CUDA, Python, NumPy) are restored bitwise, also when
    the measurement raises; a plan applied to it is lifted for the measurement and applied again.
    The step's ``dtype`` and ``device`` measure a cast copy and leave the model where it is (NOTE
    [ Measuring leaves the model as it was ] in :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload (a plan applied to its model is lifted while measuring).
        step: the step measured (:class:`~memfit.capture.step.StepSpec`: batch size, dtype,
            optimizer, seed, device; ``repeats``: timed steps per option, medians, default 3).
        options: which options to calibrate, ``keep`` first: ``keep``, ``recompute``,
            ``selective`` (all selective options), ``selective:<preset>``, ``offload`` (ignored
            on the CPU). ``("keep",)`` is enough for per-block stats; ``BASE_OPTIONS`` gives the
            block-level planner of keep and recompute only.
        heads: also calibrate the head options where the model takes them (the chunked loss of
            :mod:`memfit.apply.head`, checked against the model's own loss and gradients first).
        activations: profile with fused activations where the model has activation modules with a
            fused kernel (:mod:`memfit.apply.activations`, checked against the modules' own first);
            the stats then say ``activations="fused"`` and so do plans made from them.
        tiling, tile_modules, tile_counts, host_inputs: the tiled and host-held options
            (:class:`memfit.profiling.tiling.TiledRequest`, which says what they refuse).
        progress: called with a short text before each pass.
        on_memory_pass: called with each option's name and its tracked step
            (:class:`~memfit.capture.passes.MemoryPass`, whose ``allocations`` ``memfit profile
            --snapshot`` writes for ``keep``: the step whose peak is ``Stats.peak_bytes`` on the CPU).

    Returns:
        The measured :class:`~memfit.capture.stats.Stats`.
    """
    requested = requested_options(options)
    step = step or StepSpec()
    with leave_unchanged(workload.model, device=step.device, dtype=step.dtype) as model:
        if model is not workload.model:
            workload = replace(workload, model=model)
        fused, note = install_activations(model) if activations else (None, Calibration())
        try:
            with every_layer_runs(model) as layerdrop:  # NOTE [ LayerDrop is measured with every layer running ]
                stats = _profile(
                    workload,
                    step=step,
                    options=requested,
                    heads=heads,
                    progress=progress,
                    on_memory_pass=on_memory_pass,
                    extras=TiledRequest(
                        tiling=tiling, tile_modules=tile_modules, tile_counts=tile_counts, host_inputs=host_inputs
                    ),
                )
        finally:
            if fused is not None:
                remove_fused_activations(model)
    if layerdrop:
        note = note.merged(Calibration(segments=layerdrop_note(layerdrop)))
        stats = replace(stats, sequential=False, segment_spans=())
    return replace(stats, activations=fused, calibration=stats.calibration.merged(note))


def layerdrop_note(where: tuple[str, ...]) -> str:
    """``Calibration.segments`` of a model with LayerDrop (NOTE [ LayerDrop is measured with every
    layer running ] in :mod:`memfit.capture.snapshot`)."""
    return (
        f"LayerDrop ({', '.join(where)}) skips blocks in training: measured with every block running (the "
        "largest step), and no segments (a segment needs each of its blocks to run once per forward)"
    )


def install_activations(model: nn.Module) -> tuple[str | None, Calibration]:
    """Fuse the model's activation modules where they have a fused kernel that matches them:
    ``("fused", note)``, else ``(None, note)`` (the note, for ``Stats.calibration``, says what was
    fused or why the option was dropped: ``fused_activations`` or ``dropped_options``). Undo with
    :func:`memfit.apply.activations.remove_fused_activations`."""
    found = fusable_activations(model)
    why = activation_mismatch(model) if found else None
    if found and why is None:
        install_fused_activations(model)
        classes = tuple(sorted({type(m).__name__ for m in found.values()}))
        return "fused", Calibration(fused_activations=FusedActivations(modules=len(found), classes=classes))
    if why is not None:
        return None, Calibration(dropped_options={"activations:fused": why})
    return None, Calibration()


# --- the measurement, on the model as it is (moved, cast, fused or not) ----------------------------


@dataclass(slots=True)
class _Run:
    """The model set up for measuring: its chain, one batch and the step's optimizer."""

    workload: Workload
    chain: Chain
    batch: Batch
    opt: Any  # the step's torch.optim.Optimizer, made once the set-ups are checked
    seed: int
    repeats: int
    say: Callable[[str], None]
    on_memory_pass: Callable[[str, MemoryPass], None] | None = None

    @property
    def model(self) -> nn.Module:
        return self.workload.model


@dataclass(slots=True)
class _Setups:
    """What to measure: a calibration plan per block option (by option name, measured in this
    order, ``keep`` first) and per head option, and what :attr:`Stats.calibration` records."""

    plans: dict[str, Plan]
    head_plans: dict[str, Plan]
    ops: OpStats | None
    calibration: Calibration
    tiles: TileCheck | None = None  # what the tiled options tile, when measured


@dataclass(slots=True)
class _Measured:
    passes: dict[str, MemoryPass]
    times: dict[str, TimePass]
    head_passes: dict[str, dict[str, MemoryPass]]
    step_s: dict[str, float]


def _profile(
    workload: Workload,
    *,
    step: StepSpec,
    options: tuple[BlockOption, ...],
    heads: bool,
    progress: Callable[[str], None] | None,
    on_memory_pass: Callable[[str, MemoryPass], None] | None = None,
    extras: TiledRequest | None = None,
) -> Stats:
    """:func:`profile`'s measurements, on the model as it is (moved, cast, fused or not), with the
    step's optimizer placed as ``step.states`` says (its hooks taken off the model after)."""
    model, seed, optimizer = workload.model, step.seed, step.optimizer
    model.zero_grad(set_to_none=True)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    chain = discover_chain(model, workload.blocks)
    bs = step.batch_size or workload.default_batch_size
    torch.manual_seed(seed)
    batch = cast_batch(workload.make_batch(bs), dtype=step.dtype, device=dev)
    # The forward once, to see the order its towers run in and what share of the saved bytes the
    # chain covers (NOTE [ Chain discovery ]); the measured passes then use the chain as it ran.
    found = chain
    chain, probe = chain_as_run(model, chain, lambda: workload.loss_fn(model, batch))
    if chain is not found:  # the op-level capture finds the chain from the workload
        workload = replace(workload, blocks=chain.path)
    run = _Run(
        workload, chain, batch, None, seed, max(1, step.repeats_or(3)), progress or (lambda _s: None), on_memory_pass
    )
    setups = _setups(
        run, options, heads=heads, device=dev, extras=extras
    )  # their checks run backwards: no optimizer yet
    with step_optimizer(model, optimizer, states=step.states) as run.opt:
        measured = _measure(run, setups)
    stats = _stats(run, setups, measured, batch_size=bs, optimizer=optimizer, device=dev)
    suggested = suggest_block_lists(model, chain, probe)
    warn_coverage(chain, probe.coverage, suggested)
    return replace(
        stats, chain_coverage=probe.coverage, chain_left_out=probe.left_out_shares(), lists_as_run=probe.lists_as_run,
        states=str(step.states), suggested_blocks=suggested,
    )  # fmt: skip


def _setups(run: _Run, options: tuple[BlockOption, ...], *, heads: bool, device: torch.device, extras: Any) -> _Setups:
    """The calibration set-ups (NOTE [ Cost model ]): the selective ones from an op-level capture,
    offload with the measured bandwidth, the chunked head where it matches the model's loss, tiled."""
    model, chain = run.model, run.chain
    base = policy_plan(model, "none", chain=chain)
    dropped: dict[str, str] = {}
    milp_fractions: tuple[float, ...] | None = None
    d2h = h2d = None
    plans = {
        o.name: policy_plan(model, "none" if o.kind is Option.KEEP else "all", chain=chain)
        for o in options
        if o.name in BASE_OPTIONS
    }
    ops = None
    if any(o.kind is Option.SELECTIVE for o in options):
        run.say("op-level capture")
        # The recording itself: profile already leaves the model as it was (no second snapshot).
        ops = record_ops(run.workload, batch_size=None, dtype=None, seed=run.seed, repeats=run.repeats, batch=run.batch)
        chosen, dropped_selective = selective_options(ops, options)
        dropped.update(dropped_selective)
        milp_fractions = tuple(MILP_FRACTIONS)
        for o, pols in chosen.items():
            plans[o.name] = option_plan(base, o, pols)
    if any(o.kind is Option.OFFLOAD for o in options):
        if device.type == "cpu":
            dropped["offload"] = "the device is the CPU: offloading to host memory saves nothing"
        else:
            d2h, h2d = measure_bandwidth(device)
            plans["offload"] = option_plan(base, BlockOption(Option.OFFLOAD))
    tiled = tiled_setups(
        model, chain, lambda: run.workload.loss_fn(model, run.batch), base, extras, options, device, run.say
    )
    plans.update(tiled.plans)
    dropped.update(tiled.dropped)
    d2h, h2d = tiled.bandwidth or (d2h, h2d)
    head_plans: dict[str, Plan] = {}
    if heads:
        why = head_unsupported_reason(model)
        if why is None:
            run.say("checking the chunked head")
            why = head_mismatch(model, run.batch, run.workload.loss_fn, seed=run.seed)
        if why is None:
            head_plans["chunked"] = base.with_(head="chunked")
        else:
            dropped["head:chunked"] = why
    calibration = Calibration(
        dropped_options=dropped, milp_fractions=milp_fractions, offload_d2h_bytes_per_s=d2h, offload_h2d_bytes_per_s=h2d,
        tiling=tiled.record,
    )  # fmt: skip
    return _Setups(plans=plans, head_plans=head_plans, ops=ops, calibration=calibration, tiles=tiled.tiles)


def _measure(run: _Run, setups: _Setups) -> _Measured:
    """Apply each set-up and measure it: a memory pass per option, time passes for the base
    options, a memory pass per head option and base option, then every whole step, interleaved."""
    model, chain, batch, wl, opt, seed = run.model, run.chain, run.batch, run.workload, run.opt, run.seed
    plans = setups.plans
    run.say("warm-up step")
    warm_up(model, batch, wl.loss_fn, opt, seed=seed + 1)
    passes: dict[str, MemoryPass] = {}
    times: dict[str, TimePass] = {}
    first = next(iter(plans))
    for m, plan in plans.items():
        run.say(f"memory pass ({m})")
        with plan_applied(model, plan):
            passes[m] = memory_pass(model, chain, batch, wl, opt, seed)
        if run.on_memory_pass is not None:
            run.on_memory_pass(m, passes[m])
        if m == first:
            check_block_order(passes[m], chain, model)
        if m in BASE_OPTIONS:
            run.say(f"time pass ({m})")
            with plan_applied(model, plan):
                times[m] = time_pass(model, chain, batch, wl, opt, seed, run.repeats)
    # Each head option runs with every block kept, and (when calibrated) every block recomputed:
    # its H is the larger of the two, as the model's own head's is over the block options.
    head_passes: dict[str, dict[str, MemoryPass]] = {}
    for h, hp in setups.head_plans.items():
        for m in BASE_OPTIONS:
            if m not in plans:
                continue
            run.say(f"memory pass (head {h}, {m})")
            with plan_applied(model, plans[m].with_(head=hp.head)):
                head_passes.setdefault(h, {})[m] = memory_pass(model, chain, batch, wl, opt, seed)
    run.say("timing whole steps")
    step_s = time_steps(  # every option just ran its memory pass: no separate warm-up
        {
            **{m: _planned_runner(run, plan) for m, plan in plans.items()},
            **{f"head:{h}": _planned_runner(run, hp) for h, hp in setups.head_plans.items()},
        },
        repeats=run.repeats,
        warmup=0,
    )
    opt.zero_grad(set_to_none=True)
    return _Measured(passes=passes, times=times, head_passes=head_passes, step_s=step_s)


def _planned_runner(run: _Run, plan: Plan) -> Callable[[], Any]:
    step = step_runner(run.model, run.batch, run.workload.loss_fn, run.opt, seed=run.seed)

    def go() -> None:
        with plan_applied(run.model, plan):
            step()

    return go


def _rerun_s(run: _Run, setups: _Setups, measured: _Measured) -> dict[str, list[float]]:
    """Per option other than the base ones, per block: the seconds it adds by the op-level estimate
    (the ops a selective block re-runs; the transfer time of what an offloaded block moves)."""
    n = len(run.chain)
    keep, keep_t = measured.passes["keep"], measured.times["keep"]
    rerun: dict[str, list[float]] = {}
    for m, plan in setups.plans.items():
        if m in BASE_OPTIONS:
            continue
        opt = BlockOption.parse(m)
        if opt.tiles is not None or opt.host:
            bw = (setups.calibration.offload_d2h_bytes_per_s, setups.calibration.offload_h2d_bytes_per_s)
            rerun[m] = tiled_rerun_s(run.chain.blocks, setups.tiles, opt, keep_t.block_fwd_s, keep.inputs, bw)
            continue
        if m == "offload":
            cal = setups.calibration
            assert (
                cal.offload_d2h_bytes_per_s is not None and cal.offload_h2d_bytes_per_s is not None
            )  # set with the offload plan
            per_byte_s = 1.0 / cal.offload_d2h_bytes_per_s + 1.0 / cal.offload_h2d_bytes_per_s
            rerun[m] = [keep.offloaded_bytes(i) * per_byte_s for i in range(n)]
        else:
            assert setups.ops is not None
            rerun[m] = [
                keep_t.block_fwd_s[i] * rerun_fraction(setups.ops.blocks[i], plan.blocks[i].policy or "")
                for i in range(n)
            ]
    return rerun


def _block_stats(run: _Run, setups: _Setups, measured: _Measured) -> tuple[BlockStats, ...]:
    n = len(run.chain)
    keep, keep_t = measured.passes["keep"], measured.times["keep"]
    derived = {m: p.derive(n) for m, p in measured.passes.items()}
    rerun = _rerun_s(run, setups, measured)
    blocks = []
    for i, name in enumerate(run.chain.names):
        costs = {}
        for m, plan in setups.plans.items():
            t = measured.times.get(m)
            extra = rerun.get(m, [0.0] * n)[i]
            costs[m] = OptionStats(
                retained_bytes=derived[m].retained[i],
                fwd_peak_bytes=derived[m].fwd_peak[i],
                bwd_peak_bytes=derived[m].bwd_peak[i],
                bwd_base_bytes=derived[m].bwd_base[i],
                fwd_s=t.block_fwd_s[i] if t else keep_t.block_fwd_s[i],
                bwd_s=t.block_bwd_s[i] if t else keep_t.block_bwd_s[i] + extra,
                policy=plan.blocks[i].policy,
                rerun_s=extra,
                tiled=plan.blocks[i].tiled,
                fwd_only_bytes=derived[m].fwd_only[i],
            )
        blocks.append(
            BlockStats(
                name=name,
                fwd_s=keep_t.block_fwd_s[i],
                bwd_s=keep_t.block_bwd_s[i],
                saved_bytes=keep.saved_bytes(i),
                output_bytes=keep.outputs[i],
                input_bytes=keep.inputs[i],
                fwd_temp_bytes=derived["keep"].fwd_peak[i],
                bwd_temp_bytes=derived["keep"].bwd_peak[i],
                input_saved=keep.input_saved(i),
                options=costs,
                freed_inputs=keep.freed_inputs[i],
            )
        )
    return tuple(blocks)


def _stats(
    run: _Run, setups: _Setups, measured: _Measured, *, batch_size: int, optimizer: str, device: torch.device
) -> Stats:
    """Assemble :class:`Stats` from the measured passes."""
    n = len(run.chain)
    passes, step_s = measured.passes, measured.step_s
    keep, keep_t = passes["keep"], measured.times["keep"]
    derived = {m: p.derive(n) for m, p in passes.items()}
    mem = keep.mem
    spans = segment_spans(keep, run.chain)
    calibration = replace(setups.calibration, segments=segments_note(keep, run.chain))
    eff_dtype = next((p.dtype for p in run.model.parameters() if p.is_floating_point()), torch.float32)
    return Stats(
        model=run.workload.name,
        batch_size=batch_size,
        dtype=str(eff_dtype).removeprefix("torch."),
        device=str(device),
        optimizer=optimizer,
        chain_path=run.chain.path,
        sequential=bool(spans),
        segment_spans=spans,
        blocks=_block_stats(run, setups, measured),
        peak_bytes=mem.device_peak_bytes,
        step_s=step_s["keep"],
        params_bytes=mem.params_bytes,
        grads_bytes=mem.grads_bytes,
        optimizer_bytes=mem.optimizer_bytes,
        activations_peak_bytes=mem.activations_peak_bytes,
        peak_bytes_by_phase=dict(mem.peak_bytes_by_phase),
        fwd_s=keep_t.fwd_s,
        bwd_s=keep_t.bwd_s,
        start_bytes=max(d.start for d in derived.values()),
        pre_peak_bytes=max(d.pre_peak for d in derived.values()),
        **head_fields(derived),
        post_peak_bytes=max(d.post_peak for d in derived.values()),
        step_s_by_option={m: t for m, t in step_s.items() if not m.startswith("head:")},
        measured_peak_bytes_by_option={m: p.mem.peak_bytes for m, p in passes.items()},
        fingerprint=make_fingerprint(run.model, run.chain, run.batch),
        calibration=calibration,
        # On CUDA the allocator holds memory no tensor owns (cuBLAS workspaces): the largest gap
        # between its peak and the tracker's over the calibration steps, added to every
        # prediction so that predictions compare with torch.cuda.max_memory_allocated.
        device_overhead_bytes=max(
            (
                p.mem.allocator_peak_bytes - p.mem.peak_bytes
                for p in passes.values()
                if p.mem.allocator_peak_bytes is not None
            ),
            default=0,
        ),
        head_options={
            h: HeadOptionStats(
                head_peak_bytes=max(p.derive(n).head_peak for p in ps.values()),
                head_peak_bytes_by_option={m: p.derive(n).head_peak for m, p in ps.items()},
                step_s=step_s[f"head:{h}"],
                measured_peak_bytes=ps["keep"].mem.peak_bytes,
                measured_peak_bytes_by_option={m: p.mem.peak_bytes for m, p in ps.items()},
            )
            for h, ps in measured.head_passes.items()
        },
    )
