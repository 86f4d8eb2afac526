"""``estimate_stats``: the planner's :class:`~memfit.capture.stats.Stats` from fake-tensor steps.

A profile (:func:`memfit.profiling.blocks.profile`) runs one tracked step per option on the real
model and times it. This module runs the same tracked steps on fake tensors
(:mod:`memfit.estimation.fake`), with the profile's own per-block memory pass (hooks at block
boundaries, saved-tensor hooks; ``memory_pass`` and ``Derived`` of :mod:`memfit.capture.passes`), so a block's bytes are what a
real step of the same kernels gives, and takes per-block seconds from the device table's
roofline (:mod:`memfit.estimation.devices`): the FLOPs between a block's boundaries, counted by
torch's FLOP formulas, over ``peak x mfu``. The planner (:func:`memfit.fitting.budget.plan_for_budget`)
and auto-fit (:func:`memfit.fitting.autofit`) take such stats as they take measured ones, so a
model that does not fit this machine can be planned for a GPU it does not have.

Size: about 670 lines, over the ~500 of other modules: the fake steps of every calibration option and the
assembly of their Stats are one pass, as in :mod:`memfit.profiling.blocks`; the long-sequence set-ups
are in :mod:`memfit.estimation.setups`.

NOTE [ Estimated stats ]
- Bytes: the tracked live-tensor bytes of the target's kernels (``gpu_kernels``: CUDA's dropout
  and attention saved tensors; NOTE [ CUDA kernels on a fake CPU device ] in
  :mod:`memfit.estimation.kernels`). On this machine's CPU kernels (``gpu_kernels=False``) they equal a
  measured CPU profile's per-block bytes (tests/test_estimate_stats.py). The allocator's extra
  memory on a GPU (cuBLAS workspaces, block rounding) is not modelled: ``device_overhead_bytes``
  is 0.
- Seconds: FLOPs (matmuls, convolutions, attention) at ``peak x mfu``; elementwise ops are free;
  the optimizer step is a memory-bound pass at the device's bandwidth. A recompute costs its
  forward's FLOPs again, so the cost model's recompute scale comes out as 1.
- ``calibration.estimated`` (:class:`~memfit.capture.stats.EstimatedInfo`) says how the stats were
  made (device, mfu, kernels, FLOPs per option); reports read it to say "estimated".

- Long sequences (NOTE [ Estimated long-sequence options ] in :mod:`memfit.estimation.setups`):
  ``keep:tiles-N`` / ``recompute:tiles-N`` at the tile counts a profile measures, ``recompute:host``
  (the copies at the device's host link, ``DeviceSpec.host_bytes_per_s``, beyond the compute they
  overlap) and the chunked head run as calibration steps of their own, as in a profile.

Known limitations:
    - Options: ``keep``, ``recompute``, selective options of a fixed policy
      (``selective:PRESET``, ``selective:save:OP,...``: the fake step runs every block under the policy,
      its recompute included, so bytes and FLOPs are the policy's own), tiled and host-held options and
      the chunked head; not the MILP variants (they need the op-level capture) nor offload (a bandwidth).
    - The checks a profile runs on values are not run: which submodules are tiled comes from the rule
      and shapes, and the chunked head from the model's structure (NOTE [ Estimated long-sequence
      options ]).
    - One device, one process: no world size, sharding or communication (per-rank planning is :mod:`memfit.plan.parallel`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.apply.activations import remove_fused_activations
from memfit.apply.engine import plan_applied
from memfit.capture.chain import discover_chain
from memfit.capture.coverage import ordered_by
from memfit.capture.passes import check_block_order, container_order, memory_pass, segment_spans, segments_note
from memfit.capture.stats import (
    BlockStats,
    Calibration,
    EstimatedInfo,
    HeadOptionStats,
    OptionStats,
    Stats,
    head_fields,
)
from memfit.capture.step import StepMemory, StepSpec
from memfit.errors import SpecError
from memfit.estimation.devices import DEVICES, DeviceSpec, get_device, resolve_mfu, step_seconds
from memfit.estimation.estimator import _quiet_fake_kernel_errors
from memfit.estimation.fake import (
    build_fake_workload,
    fake_batch,
    fake_mode,
    fake_parameters,
    run_fake_step,
    swap_fake_tensors,
)
from memfit.estimation.setups import host_exposed_s, long_setups
from memfit.estimation.static import OPTIMIZER_STATES, static_bytes
from memfit.plan.options import BASE_OPTIONS, BlockOption
from memfit.plan.policies import Selective, make_fingerprint, policy_plan
from memfit.plan.types import Plan
from memfit.profiling.blocks import install_activations
from memfit.workload import Workload

__all__ = ["estimate_stats", "estimated_device", "load_fake_workload", "stats_fn"]


def load_fake_workload(
    spec: str, *, seq_len: int | None = None, dtype: torch.dtype | None = None, seed: int = 0
) -> Workload:
    """Build the workload a ``--model`` spec names with fake parameters (nothing allocated).

    What ``memfit plan --estimate`` and ``memfit fit --estimate`` plan for: the planner and
    auto-fit read the model's structure (chain, parameter shapes) but never run it.

    Args:
        spec: a ``--model`` spec.
        seq_len: tokens per row for the built-in token workloads.
        dtype: the training dtype (the fake parameters are cast as ``load_workload`` casts).
        seed: seed for building.
    """
    wl, _built = build_fake_workload(spec, mode=fake_mode(), seq_len=seq_len, seed=seed)
    if dtype is not None:
        swap_fake_tensors(wl.model, _mode_of(wl.model) or fake_mode(), dtype=dtype)
    return wl


def stats_fn(
    workload: Workload,
    *,
    device: str | DeviceSpec,
    step: StepSpec | None = None,
    mfu: float | None = None,
    activations: bool = True,
    gpu_kernels: bool | None = None,
    options: tuple[str, ...] = BASE_OPTIONS,
    heads: bool = True,
    tiling: bool = True,
    tile_modules: tuple[str, ...] | None = None,
    host_inputs: bool | None = None,
) -> Callable[[int], Stats]:
    """``batch_size -> Stats`` by :func:`estimate_stats`, for the planner's and auto-fit's
    ``stats_fn`` option. The device name and the step are checked now (a bad one raises here).

    ``step`` gives the dtype, optimizer and seed of every estimate (as :func:`estimate_stats`); the
    batch size is the planner's, so a step with ``batch_size`` is refused, as are ``device`` and
    ``repeats``. ``options``: as :func:`estimate_stats` (a selective policy's option to plan it);
    ``heads``, ``tiling`` (tiled options and, off ``cpu``, host-held inputs, as ``--no-tiling``
    turns both off), ``tile_modules`` and ``host_inputs`` (default: as ``tiling``) as there.

    Example:
        >>> from memfit.fitting.budget import plan_for_budget
        >>> wl = load_fake_workload("demo?n_layer=2")
        >>> res = plan_for_budget(wl, 64 * 2**20, stats_fn=stats_fn(wl, device="h100-sxm"))
        >>> res.stats.calibration.estimated.device
        'h100-sxm'
    """
    dev = device if isinstance(device, DeviceSpec) else get_device(device)
    step = _estimated_step(step)
    if step.batch_size is not None:
        raise SpecError(
            "memfit.estimate: stats_fn makes stats at each batch size the planner asks for (plan_for_budget's "
            "step=StepSpec(batch_size=...), autofit's micro-batches); give it a StepSpec without batch_size "
            f"(got {step.batch_size})."
        )

    def make(batch_size: int) -> Stats:
        return estimate_stats(
            workload,
            device=dev,
            step=replace(step, batch_size=batch_size),
            mfu=mfu,
            activations=activations,
            gpu_kernels=gpu_kernels,
            options=options,
            heads=heads,
            tiling=tiling,
            tile_modules=tile_modules,
            host_inputs=tiling if host_inputs is None else host_inputs,
        )

    return make


def _estimated_step(step: StepSpec | None) -> StepSpec:
    """``step`` (default: ``StepSpec()``), refused when it has a device or repeats: estimated stats
    come from fake tensors on no device and time nothing."""
    step = step or StepSpec()
    if step.device is not None or step.repeats is not None:
        raise SpecError(
            "memfit.estimate: estimated stats come from fake-tensor steps and time nothing; the target device is "
            "device= (a name such as 'h100-sxm'), not the step's. Give a StepSpec without device and repeats "
            f"(got device={step.device!r}, repeats={step.repeats!r})."
        )
    return step


def estimated_device(stats: Stats) -> str | None:
    """The device name of estimated stats (NOTE [ Estimated stats ]), None for measured ones."""
    est = stats.calibration.estimated
    return est.device if est is not None else None


def estimate_stats(
    workload: str | Workload,
    *,
    device: str | DeviceSpec,
    step: StepSpec | None = None,
    seq_len: int | None = None,
    options: tuple[str, ...] = BASE_OPTIONS,
    mfu: float | None = None,
    activations: bool = True,
    gpu_kernels: bool | None = None,
    foreach: bool | None = None,
    heads: bool = True,
    tiling: bool = True,
    tile_modules: tuple[str, ...] | None = None,
    host_inputs: bool = True,
) -> Stats:
    """Per-block :class:`Stats` of a training step from fake-tensor steps (NOTE [ Estimated stats ]).

    Nothing of the model's size is allocated: the steps run on fake tensors, so a Llama-7B shape
    is planned on a laptop. A real workload's model is lifted to fake tensors for the steps and
    left as it was.

    Args:
        workload: a ``--model`` spec (built with fake parameters) or a workload (real or built by
            :func:`load_fake_workload`).
        device: the target, a name from :data:`memfit.estimation.DEVICES` or its spec; it must have
            a peak FLOP/s for the training dtype (per-block seconds come from it).
        step: the step estimated (:class:`~memfit.capture.step.StepSpec`): ``batch_size`` (default:
            the workload's), ``dtype`` (the training dtype; default: the model's), ``optimizer`` and
            ``seed`` (for building and for the batch). Nothing runs on a device or is timed: no
            ``device`` (the target is ``device=``) and no ``repeats``.
        seq_len: tokens per row (specs only).
        options: options to estimate: ``keep`` first, then ``recompute``, selective options of a
            fixed policy (``selective:torchtitan``, ``selective:save:aten.mm.default@0``) and tiled
            or host-held ones (``recompute:tiles-8``, ``recompute:host``); ``tiling`` and
            ``host_inputs`` add the ones a profile measures.
        mfu: assumed fraction of the device's peak FLOP/s, in ``(0, 1]``; None: the one fitted to a
            published run of the device's class, else 0.4 (:func:`memfit.estimation.devices.resolve_mfu`).
        activations: fuse activation modules that have a fused kernel, as :func:`profile` does.
        gpu_kernels: keep the tensors CUDA's dropout and attention kernels keep (default: unless
            ``device`` is ``cpu``); False gives this machine's CPU kernels, which is what a CPU
            profile measures.
        foreach: the optimizer's multi-tensor pass (default: on the GPU kernels, as torch runs it
            on CUDA; torch's CPU default otherwise).
        heads: also estimate the chunked head (:mod:`memfit.apply.head`) where the model's structure
            takes it (``--keep-head``: False).
        tiling, tile_modules: also estimate ``keep:tiles-N`` and ``recompute:tiles-N`` at the tile
            counts a profile measures (``--no-tiling``: False; ``tile_modules``: the submodules to
            tile, as :func:`memfit.profiling.blocks.profile` takes them).
        host_inputs: also estimate ``recompute:host`` (and ``recompute:tiles-N:host``), priced at the
            device's host link (not on ``cpu``). Tiled and host-held options need ``recompute`` in
            ``options`` (NOTE [ Estimated long-sequence options ] in :mod:`memfit.estimation.setups`).

    Returns:
        :class:`Stats` with ``calibration.estimated`` set.

    Raises:
        SpecError: an unknown device, optimizer or option, a device without a peak for the dtype,
            or a step with a device or repeats (the message lists what to use).
        UnsupportedModelError: the step reads tensor values (fake tensors have none).
    """
    dev = device if isinstance(device, DeviceSpec) else get_device(device)
    step = _estimated_step(step)
    placement = str(step.states)  # the fake steps run with its optimizer (step-in-backward: memfit.optim's)
    _check_request(step, placement, options)
    mfu = resolve_mfu(dev, mfu)
    if not 0 < mfu <= 1:
        raise SpecError(f"memfit.estimate: mfu={mfu} must be in (0, 1], e.g. 0.4 (40 % of peak FLOP/s).")
    gpu = dev.name != "cpu" if gpu_kernels is None else gpu_kernels
    if foreach is None and gpu:
        foreach = True
    wl = _workload_of(workload, seq_len=seq_len, step=step)
    return _estimate_fake(
        wl, dev, step, options, mfu=mfu, gpu=gpu, foreach=foreach, placement=placement, activations=activations,
        heads=heads, tiling=tiling, tile_modules=tile_modules, host_inputs=host_inputs,
    )  # fmt: skip


def _workload_of(workload: str | Workload, *, seq_len: int | None, step: StepSpec) -> Workload:
    """The workload estimated: built with fake parameters from a spec, or the one given."""
    if isinstance(workload, str):
        return load_fake_workload(workload, seq_len=seq_len, dtype=step.dtype, seed=step.seed)
    if seq_len is not None:
        raise SpecError("memfit.estimate: seq_len applies when building from a spec; pass the spec instead.")
    return workload


def _estimate_fake(
    wl: Workload,
    dev: DeviceSpec,
    step: StepSpec,
    options: tuple[str, ...],
    *,
    mfu: float,
    gpu: bool,
    foreach: bool | None,
    placement: str,
    activations: bool,
    heads: bool,
    tiling: bool,
    tile_modules: tuple[str, ...] | None,
    host_inputs: bool,
) -> Stats:
    """:func:`estimate_stats` once its request is checked: the fake-tensor steps on the model's
    parameters lifted to fake tensors, priced on ``dev`` at ``mfu`` of its peak."""
    mode = _mode_of(wl.model) or fake_mode()
    bs = step.batch_size or wl.default_batch_size

    with fake_parameters(wl.model, mode, dtype=step.dtype) as model:
        model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        peak = _peak_flops(dev, model_dtype)
        rate = peak * mfu
        static = static_bytes(model, optimizer=step.optimizer)
        traffic = 2 * static.params_bytes + static.grads_bytes + 2 * static.optimizer_bytes
        opt_s = (
            step_seconds(dev, dtype=model_dtype, flops=0, optimizer_traffic_bytes=traffic, mfu=mfu).optimizer_s or 0.0
        )
        fused, note = install_activations(model) if activations else (None, Calibration())
        try:
            runner = _PassRunner(
                model=model, wl=wl, mode=mode, optimizer=step.optimizer, foreach=foreach, gpu=gpu,
                placement=placement, seed=step.seed, model_bytes=static.params_bytes + static.buffers_bytes,
            )  # fmt: skip
            with _quiet_fake_kernel_errors():
                runner.batch = fake_batch(wl, bs, mode, seed=step.seed)
                ran = _run_passes(runner, options, dev, heads=heads, tiling=tiling, tile_modules=tile_modules,
                                  host_inputs=host_inputs)  # fmt: skip
            fingerprint = make_fingerprint(model, ran.chain, runner.batch)
        finally:
            if fused is not None:
                remove_fused_activations(model)

    estimated = EstimatedInfo(
        device=dev.name,
        mfu=mfu,
        kernels="cuda" if gpu else "cpu",
        optimizer_impl="foreach" if foreach else "torch's cpu default",
        peak_flops_per_s=peak,
        optimizer_s=opt_s,
        flops_by_option={m: f + b for m, (f, b) in ran.phase_flops.items()},
        time_model="roofline: FLOPs / (peak x mfu), optimizer bytes / bandwidth",
    )
    return _assemble(ran, wl, dev, estimated, note, fused=fused, fingerprint=fingerprint, rate=rate, opt_s=opt_s,
                     batch_size=bs, model_dtype=model_dtype, optimizer=step.optimizer, placement=placement)  # fmt: skip


def _check_request(step: StepSpec, placement: str, options: tuple[str, ...]) -> None:
    """Refuse, with the fix, a placement, option, optimizer or batch size an estimate cannot run."""
    if placement not in ("device", "step-in-backward"):
        raise SpecError(
            f"memfit.estimate: estimated stats run the model states on the device or stepped inside the backward, "
            f"not {placement!r}; `memfit estimate --states {placement}` prices that placement, or plan with "
            "--states device or step-in-backward."
        )
    if not options or options[0] != "keep" or any(not _estimable(m) for m in options):
        raise SpecError(
            f"memfit.estimate: options {options!r} cannot be estimated; estimated stats have 'keep' first, then "
            "'recompute', selective options of a fixed policy and tiled or host-held ones (offload and the "
            "selective MILP variants need measured timings), e.g. options=('keep', 'recompute', "
            "'selective:torchtitan', 'recompute:tiles-8', 'recompute:host')."
        )
    if step.optimizer not in OPTIMIZER_STATES:
        raise SpecError(
            f"memfit.estimate: unknown optimizer {step.optimizer!r}. Use one of: {', '.join(OPTIMIZER_STATES)}."
        )
    if step.batch_size is not None and step.batch_size < 1:
        raise SpecError(f"memfit.estimate: batch_size={step.batch_size} must be at least 1.")


def _peak_flops(dev: DeviceSpec, model_dtype: torch.dtype) -> float:
    """The device's peak FLOP/s for the dtype; a device without a peak or a bandwidth in memfit's table
    is refused with those that have them."""
    peak = dev.peak_flops_per_s(model_dtype)
    if peak is None or dev.memory_bandwidth_bytes_per_s is None:
        usable = [d for d in _devices() if d.peak_flops_per_s(model_dtype) and d.memory_bandwidth_bytes_per_s]
        raise SpecError(
            f"memfit.estimate: {dev.name} has no published {str(model_dtype).removeprefix('torch.')} peak FLOP/s "
            f"or bandwidth in memfit's table, and planning needs per-block seconds. Use one of: "
            f"{', '.join(d.name for d in usable)}."
        )
    return peak


@dataclass(kw_only=True, slots=True)
class _PassRunner:
    """Runs the profile's memory pass over one fake step of a calibration plan (NOTE [ Estimated stats ])."""

    model: torch.nn.Module
    wl: Workload
    mode: Any
    optimizer: str
    foreach: bool | None
    gpu: bool
    placement: str
    seed: int
    model_bytes: int
    batch: Any = None

    def run(self, plan: Plan, chain: Any) -> tuple[Any, list[tuple[int, int]], tuple[int, int]]:
        """``(pass, FLOP log, (forward FLOPs, backward FLOPs))`` of one step under ``plan``."""
        log: list[tuple[int, int]] = []
        box: dict[str, Any] = {}

        def run_step(tracker: Any, on_phase: Callable[[str, str], None]) -> StepMemory:
            step = run_fake_step(
                self.model, self.batch, self.wl.loss_fn, mode=self.mode, optimizer=self.optimizer,
                foreach=self.foreach, gpu_kernels=self.gpu, tracker=tracker, on_phase=on_phase, flop_log=log,
                states=self.placement,
            )  # fmt: skip
            box["step"] = step
            return _step_memory(step, self.model_bytes)

        with plan_applied(self.model, plan, batch=self.batch):
            got = memory_pass(self.model, chain, self.batch, self.wl, None, self.seed, run_step=run_step)
        return got, log, (box["step"].forward_flops, box["step"].flops - box["step"].forward_flops)


@dataclass(kw_only=True, slots=True)
class _Ran:
    """Every calibration step's pass, FLOP log and phase FLOPs, by option, over the chain they ran."""

    chain: Any
    long: Any  # memfit.estimation.setups.LongSetups
    passes: dict[str, Any] = field(default_factory=dict)
    logs: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    phase_flops: dict[str, tuple[int, int]] = field(default_factory=dict)
    head_passes: dict[str, Any] = field(default_factory=dict)
    head_flops: dict[str, tuple[int, int]] = field(default_factory=dict)


def _run_passes(
    runner: _PassRunner,
    options: tuple[str, ...],
    dev: DeviceSpec,
    *,
    heads: bool,
    tiling: bool,
    tile_modules: tuple[str, ...] | None,
    host_inputs: bool,
) -> _Ran:
    """The base and fixed selective options' steps (towers in the order they run), then the
    long-sequence set-ups and the chunked head's."""
    model, chain = runner.model, discover_chain(runner.model, runner.wl.blocks)
    passes: dict[str, Any] = {}
    logs: dict[str, list[tuple[int, int]]] = {}
    phase_flops: dict[str, tuple[int, int]] = {}
    for m in (o for o in options if o in BASE_OPTIONS or _fixed_selective(o) is not None):
        passes[m], logs[m], phase_flops[m] = runner.run(_base_plan(model, m, chain), chain)
        ran = ordered_by(chain, container_order(passes[m], chain)) if len(passes) == 1 else chain
        if ran is not chain:  # towers measured in the order they ran (NOTE [ Chain discovery ])
            chain = ran
            passes[m], logs[m], phase_flops[m] = runner.run(_base_plan(model, m, chain), chain)
        check_block_order(passes[m], chain, model)
    # NOTE [ Estimated long-sequence options ] in memfit.estimation.setups
    long = long_setups(
        model, chain, runner.wl, runner.batch, runner.mode, options, dev,
        heads=heads, tiling=tiling, tile_modules=tile_modules, host_inputs=host_inputs,
    )  # fmt: skip
    for m, plan in long.plans.items():
        passes[m], logs[m], phase_flops[m] = runner.run(plan, chain)
    out = _Ran(chain=chain, long=long, passes=passes, logs=logs, phase_flops=phase_flops)
    for m in (o for o in BASE_OPTIONS if o in passes and long.head):
        out.head_passes[m], _log, out.head_flops[m] = runner.run(
            _base_plan(model, m, chain).with_(head="chunked"), chain
        )
    return out


def _host_seconds(ran: _Ran, derived: dict[str, Any], dev: DeviceSpec, rate: float) -> dict[str, list[float]]:
    """Per host-held option, per block: the copies' seconds not hidden behind compute."""
    keep, dk, n = ran.passes["keep"], derived["keep"], len(ran.chain)
    return {
        m: [
            host_exposed_s(
                keep.inputs[i],
                _flops_between(ran.logs["keep"], *dk.fwd_ops[i]) / rate,
                _flops_between(ran.logs["keep"], *dk.bwd_ops[i]) / rate,
                dev.host_bytes_per_s or 1.0,
            )
            for i in range(n)
        ]
        for m in ran.long.plans
        if BlockOption.parse(m).host
    }


def _block_stats(ran: _Ran, derived: dict[str, Any], host_s: dict[str, list[float]], rate: float) -> list[BlockStats]:
    """Each block's bytes per option from its pass, and its seconds from the FLOPs between its boundaries."""
    keep, dk, n = ran.passes["keep"], derived["keep"], len(ran.chain)
    blocks = []
    for i, name in enumerate(ran.chain.names):
        costs: dict[str, OptionStats] = {}
        for m in ran.passes:
            d = derived[m]
            fwd_s = _flops_between(ran.logs[m], *d.fwd_ops[i]) / rate
            bwd_s = _flops_between(ran.logs[m], *d.bwd_ops[i]) / rate + host_s.get(m, [0.0] * n)[i]
            sel = _fixed_selective(m)
            if m in BASE_OPTIONS:
                rerun_s = 0.0
            elif sel is not None:  # a selective block's recompute: the FLOPs its backward runs beyond the kept block's
                rerun_s = max(0.0, bwd_s - costs["keep"].bwd_s)
            else:  # tiled, host-held: all it adds to the kept block (the step's own sum, so the cost model's scale is 1)
                rerun_s = max(0.0, fwd_s + bwd_s - costs["keep"].fwd_s - costs["keep"].bwd_s)
            plan = ran.long.plans.get(m)
            costs[m] = OptionStats(
                retained_bytes=d.retained[i],
                fwd_peak_bytes=d.fwd_peak[i],
                bwd_peak_bytes=d.bwd_peak[i],
                bwd_base_bytes=d.bwd_base[i],
                fwd_s=fwd_s,
                bwd_s=bwd_s,
                policy=sel.save_text if sel is not None else None,
                rerun_s=rerun_s,
                tiled=plan.blocks[i].tiled if plan is not None else (),
                fwd_only_bytes=d.fwd_only[i],  # NOTE [ Tensors the forward drops ] in memfit.plan.costmodel
            )
        blocks.append(
            BlockStats(
                name=name,
                fwd_s=costs["keep"].fwd_s,
                bwd_s=costs["keep"].bwd_s,
                saved_bytes=keep.saved_bytes(i),
                output_bytes=keep.outputs[i],
                input_bytes=keep.inputs[i],
                fwd_temp_bytes=dk.fwd_peak[i],
                bwd_temp_bytes=dk.bwd_peak[i],
                input_saved=keep.input_saved(i),
                options=costs,
                freed_inputs=keep.freed_inputs[i],
            )
        )
    return blocks


def _assemble(
    ran: _Ran,
    wl: Workload,
    dev: DeviceSpec,
    estimated: EstimatedInfo,
    note: Calibration,
    *,
    fused: Any,
    fingerprint: Any,
    rate: float,
    opt_s: float,
    batch_size: int,
    model_dtype: torch.dtype,
    optimizer: str,
    placement: str,
) -> Stats:
    """The :class:`Stats` of the passes: blocks, the step's numbers, calibration and the chunked head."""
    n = len(ran.chain)
    derived = {m: p.derive(n) for m, p in ran.passes.items()}
    host_s = _host_seconds(ran, derived, dev, rate)
    blocks = _block_stats(ran, derived, host_s, rate)
    step_s = {m: (f + b) / rate + opt_s + sum(host_s.get(m, ())) for m, (f, b) in ran.phase_flops.items()}
    calibration = Calibration(
        estimated=estimated, dropped_options=ran.long.dropped, tiling=ran.long.record,
        offload_d2h_bytes_per_s=dev.host_bytes_per_s if host_s else None,
        offload_h2d_bytes_per_s=dev.host_bytes_per_s if host_s else None,
    ).merged(note)  # fmt: skip
    keep = ran.passes["keep"]
    spans = segment_spans(keep, ran.chain)
    calibration = replace(calibration, segments=segments_note(keep, ran.chain))
    mem = keep.mem
    fk, bk = ran.phase_flops["keep"]
    return Stats(
        states=placement,
        model=wl.name,
        batch_size=batch_size,
        dtype=str(model_dtype).removeprefix("torch."),
        device=dev.name,
        optimizer=optimizer,
        chain_path=ran.chain.path,
        sequential=bool(spans),
        segment_spans=spans,
        blocks=tuple(blocks),
        peak_bytes=mem.peak_bytes,
        step_s=step_s["keep"],
        params_bytes=mem.params_bytes,
        grads_bytes=mem.grads_bytes,
        optimizer_bytes=mem.optimizer_bytes,
        activations_peak_bytes=mem.activations_peak_bytes,
        peak_bytes_by_phase=dict(mem.peak_bytes_by_phase),
        fwd_s=fk / rate,
        bwd_s=bk / rate,
        start_bytes=max(d.start for d in derived.values()),
        pre_peak_bytes=max(d.pre_peak for d in derived.values()),
        **head_fields(derived),
        post_peak_bytes=max(d.post_peak for d in derived.values()),
        step_s_by_option=step_s,
        measured_peak_bytes_by_option={m: p.mem.peak_bytes for m, p in ran.passes.items()},
        fingerprint=fingerprint,
        calibration=calibration,
        device_overhead_bytes=0,
        activations=fused,
        head_options=_head_options(ran, n, rate, opt_s),
    )


def _head_options(ran: _Ran, n: int, rate: float, opt_s: float) -> dict[str, HeadOptionStats]:
    """The chunked head's numbers, where it was estimated."""
    if not ran.head_passes:
        return {}
    return {
        "chunked": HeadOptionStats(
            head_peak_bytes=max(p.derive(n).head_peak for p in ran.head_passes.values()),
            head_peak_bytes_by_option={m: p.derive(n).head_peak for m, p in ran.head_passes.items()},
            step_s=sum(ran.head_flops["keep"]) / rate + opt_s,
            measured_peak_bytes=ran.head_passes["keep"].mem.peak_bytes,
            measured_peak_bytes_by_option={m: p.mem.peak_bytes for m, p in ran.head_passes.items()},
        )
    }


def _base_plan(model: torch.nn.Module, option: str, chain: Any) -> Plan:
    """The calibration plan of ``keep``, ``recompute`` or a fixed selective option."""
    return policy_plan(model, _fixed_selective(option) or ("none" if option == "keep" else "all"), chain=chain)


def _estimable(option: str) -> bool:
    """``option`` is one an estimate runs: a base option, a fixed selective one, tiled or host-held."""
    if option in BASE_OPTIONS or _fixed_selective(option) is not None:
        return True
    try:
        o = BlockOption.parse(option)
    except SpecError:
        return False
    return o.tiles is not None or o.host


def _fixed_selective(option: str) -> Selective | None:
    """The policy of a selective option with a fixed policy (``selective:torchtitan``,
    ``selective:save:...``), None for any other option (or a MILP variant)."""
    head, sep, what = option.partition(":")
    if head != "selective" or not sep or what.startswith("milp-"):
        return None
    try:
        return Selective.from_save_text(what)
    except SpecError:
        return None


def _devices() -> list[DeviceSpec]:
    return list(DEVICES.values())


def _mode_of(model: torch.nn.Module) -> Any:
    """The fake mode of a model built under one (None for a real model)."""
    for t in (*model.parameters(), *model.buffers()):
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


def _step_memory(step: Any, params_bytes: int) -> StepMemory:
    """A fake step's numbers as the :class:`StepMemory` a measured step gives."""
    return StepMemory(
        peak_bytes=step.peak_bytes,
        params_bytes=params_bytes,
        grads_bytes=step.grads_bytes,
        optimizer_bytes=step.optimizer_state_bytes,
        peak_bytes_by_phase=dict(step.peak_bytes_by_phase),
        activations_peak_bytes=step.peak_bytes - step.start_bytes,
        loss=math.nan,
    )


def _flops_between(log: list[tuple[int, int]], op_a: int, op_b: int) -> int:
    """FLOPs of the ops after op count ``op_a`` up to ``op_b`` (``log``: (op count, FLOPs so far))."""
    keys = [k for k, _ in log]

    def upto(op: int) -> int:
        j = bisect.bisect_right(keys, op)
        return log[j - 1][1] if j else 0

    return max(0, upto(op_b) - upto(op_a))
