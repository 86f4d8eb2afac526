"""``estimate``: memory and time of one training step, without allocating the model.

The pipeline is: build the workload with fake parameters (:mod:`memfit.estimation.fake`), count the
static parts by arithmetic (:mod:`memfit.estimation.static`), run one fake step under the plan to
get the activation and whole-step peaks and the FLOPs, then turn FLOPs into seconds with a
device's published peaks (:mod:`memfit.estimation.devices`).

NOTE [ What an estimate counts ]
Memory is the step's live tensor bytes: kernel workspaces, allocator rounding, the CUDA context and
fragmentation are not in ``peak_bytes`` (the caching-allocator replay, :mod:`memfit.estimation.allocator`,
adds what a device reserves). Time is the step's FLOPs over the device's peak FLOP/s times ``mfu``: matmuls,
convolutions and attention are counted (attention in full ``T x T``, as torch's counter does, even when
causal); elementwise ops are free, which ``mfu`` absorbs; communication, data loading and host overhead
are not seen. How far both were off on real devices: docs/limitations.md.

Size: about 580 lines, over the ~500 of other modules: the public ``estimate`` (its docstring a third of the
file) and one private function per phase of it (the options checked, the fake step run, its breakdown, the
allocator replay).

Example:
    >>> from memfit.estimation import estimate
    >>> from memfit.capture.step import StepSpec
    >>> est = estimate("demo?n_layer=2", step=StepSpec(batch_size=2, optimizer="sgd"))
    >>> est.params_bytes == est.n_params * 4
    True
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.apply.engine import applied_plan, apply_plan, remove_plan
from memfit.capture.chain import discover_chain
from memfit.capture.snapshot import RngSnapshot
from memfit.capture.step import StepSpec
from memfit.errors import SpecError
from memfit.estimation.allocator import AllocatorPrediction, allocator_model, shard_model_states
from memfit.estimation.devices import DeviceSpec, get_device, resolve_mfu, step_seconds
from memfit.estimation.fake import (
    FakeStep,
    build_fake_workload,
    fake_batch,
    fake_mode,
    fake_parameters,
    run_fake_step,
)
from memfit.estimation.static import OPTIMIZER_STATES, StaticBytes, static_bytes
from memfit.plan.policies import KeepAll, Offload, Policy, parse_policy, policy_plan
from memfit.plan.types import Option, Plan
from memfit.units import parse_dtype
from memfit.workload import Workload

__all__ = ["Estimate", "estimate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """Predicted memory (bytes) and time (seconds) of one training step.

    ``peak_bytes`` is the budget quantity of DESIGN.md: the peak of live tensor memory over the
    whole step, as the tracker counts it. The other byte fields split it: parameters, gradients
    and optimizer state by exact arithmetic (NOTE [ Precision convention ] in
    :mod:`memfit.estimation.static`), and the activations' peak from the fake step. Because
    gradients appear during backward while activations go, ``peak_bytes`` is at most, and usually
    below, ``params + buffers + batch + optimizer + grads + activations``.

    Attributes:
        model: the workload's name (its spec).
        n_params: parameters (tied ones once).
        params_bytes: parameters in the training dtype.
        grads_bytes: gradients of the trainable parameters (parameters' dtype).
        optimizer_bytes: optimizer state, plus fp32 master weights when used.
        activations_bytes: peak of activations and temporaries during forward and backward, above
            the step's starting memory, gradients not included.
        peak_bytes: peak of live tensor memory during the whole step.
        step_s: predicted seconds per step on ``device`` (None without a device or its peaks).
        flops: FLOPs of forward and backward (recompute included).
        mfu: the assumed fraction of the device's peak FLOP/s.
        device: the device name, or None.
        device_memory_bytes: the device's memory, or None.
        fits: ``peak_bytes <= device_memory_bytes`` (None without a device memory).
        headroom_bytes: ``device_memory_bytes - peak_bytes`` (negative: short by that much).
        batch_size: samples per step.
        seq_len: tokens per row for token workloads, else None.
        dtype: the training dtype.
        optimizer: the optimizer's name.
        master_weights: whether fp32 master weights are used.
        policy: the checkpoint plan's policy (``none`` without a plan).
        breakdown: further detail: buffers, batch, master weights, optimizer temporaries, per
            phase peaks, time components, how the model was built, seconds taken, the allocator
            model's replay (``allocator``).
        predicted_allocated_bytes: on a GPU, ``torch.cuda.max_memory_allocated`` by the caching-allocator
            model (:mod:`memfit.estimation.allocator`: the step's allocations replayed, plus cuBLAS
            workspaces); None without a GPU.
        predicted_reserved_bytes: on a GPU, ``torch.cuda.max_memory_reserved`` by the same model: what
            runs out on CUDA; None without a GPU.
    """

    model: str
    n_params: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    peak_bytes: int
    step_s: float | None
    flops: int
    mfu: float
    device: str | None
    device_memory_bytes: int | None
    fits: bool | None
    headroom_bytes: int | None
    batch_size: int
    seq_len: int | None
    dtype: str
    optimizer: str
    master_weights: bool
    policy: str
    breakdown: Mapping[str, Any] = field(default_factory=dict)
    predicted_allocated_bytes: int | None = None
    predicted_reserved_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "n_params": self.n_params,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes,
            "peak_bytes": self.peak_bytes,
            "predicted_allocated_bytes": self.predicted_allocated_bytes,
            "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "step_s": self.step_s,
            "flops": self.flops,
            "mfu": self.mfu,
            "device": self.device,
            "device_memory_bytes": self.device_memory_bytes,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "master_weights": self.master_weights,
            "policy": self.policy,
            "breakdown": dict(self.breakdown),
        }


def estimate(
    workload: str | Workload,
    *,
    device: str | DeviceSpec | None = None,
    step: StepSpec | None = None,
    seq_len: int | None = None,
    policy: Policy | str | None = None,
    plan: Plan | None = None,
    master_weights: bool = False,
    mfu: float | None = None,
    foreach: bool | None = None,
    states: str = "device",
    states_shards: int = 1,
) -> Estimate:
    """Estimate the memory and time of one training step without allocating the model.

    The model is built with fake parameters and one whole step (forward, backward, optimizer)
    runs on fake tensors under the memory tracker and the FLOP counter (see
    :mod:`memfit.estimation.fake`), so models far larger than this machine are estimated in
    seconds.

    Args:
        workload: a ``--model`` spec, or a :class:`~memfit.workload.Workload` (left unchanged; a
            plan applied to it is lifted meanwhile: pass ``plan=`` to estimate with a plan).
        device: a device name from :data:`memfit.estimation.DEVICES` (or its spec): adds
            ``step_s``, ``fits`` and ``headroom_bytes``. None: memory only.
        step: the step (:class:`~memfit.capture.step.StepSpec`): ``batch_size``, ``dtype`` (default:
            the model's), ``optimizer`` (``adamw``, ``adam``, ``sgd``) and ``seed``; no ``device`` (the
            target is ``device=``) and no ``repeats`` (nothing is timed).
        seq_len: tokens per row for the built-in token workloads (specs only).
        policy: a checkpoint policy (:mod:`memfit.plan.policies`, or its text): ``none``, ``all``,
            ``sqrt``, ``every:K``, ``selective:...`` (offload is refused: fake tensors have no host copies).
        plan: a checkpoint plan (e.g. from ``Plan.load``) instead of ``policy``.
        master_weights: fp32 master weights and optimizer state (a ``dtype`` of bfloat16 or float16).
        mfu: the fraction of the device's peak FLOP/s achieved, in ``(0, 1]``; None:
            :func:`memfit.estimation.devices.resolve_mfu`.
        foreach: the optimizer multi-tensor (True) or per parameter (False); default: as torch runs
            it on the target (``foreach`` on a GPU, a per-parameter loop for ``device="cpu"``).
        states: ``device`` or ``step-in-backward`` (the fake step runs with that placement's
            optimizer); :mod:`memfit.estimation.states` prices the host placements.
        states_shards: the caching-allocator replay only: the model states at 1/``states_shards`` of
            their bytes, as one FSDP2 rank holds them (NOTE [ A rank's reserved memory ] in
            :mod:`memfit.estimation.allocator`).

    Returns :class:`Estimate`.

    Raises:
        SpecError: a bad spec, option, device name or combination (the message gives the fix).
        UnsupportedModelError: the step cannot run on fake tensors, or the policy does not fit the model.
        PlanMismatchError: ``plan`` was made for another model or batch shape.

    What the estimate counts and leaves out: NOTE [ What an estimate counts ].

    Example:
        >>> est = estimate("demo?n_layer=2", step=StepSpec(batch_size=2), policy="all", device="a100-80gb")
        >>> est.fits
        True
    """
    step = step or StepSpec()
    if step.device is not None or step.repeats is not None:
        raise SpecError(
            "memfit.estimate: an estimate runs on fake tensors and times nothing; the target device is device= "
            f"(a name such as 'h100-sxm'), not the step's. Give a StepSpec without device and repeats "
            f"(got device={step.device!r}, repeats={step.repeats!r})."
        )
    with _left_as_it_was(workload):
        return _estimate(
            workload,
            device=device,
            batch_size=step.batch_size,
            seq_len=seq_len,
            dtype=step.dtype,
            optimizer=step.optimizer,
            policy=policy,
            plan=plan,
            master_weights=master_weights,
            mfu=mfu,
            foreach=foreach,
            seed=step.seed,
            states=states,
            states_shards=states_shards,
        )


@contextlib.contextmanager
def _left_as_it_was(workload: str | Workload) -> Iterator[None]:
    """Estimating never changes the caller's state (NOTE [ Measuring leaves the model as it was ] in
    memfit.capture.snapshot): building and the batch seed the global RNGs, restored on exit, and a
    plan applied to a given workload's model is lifted for the step (as profile does) and applied again."""
    user_plan = applied_plan(workload.model) if isinstance(workload, Workload) else None
    rng = RngSnapshot.take()
    if user_plan is not None:
        remove_plan(workload.model)
    try:
        yield
    finally:
        rng.restore()
        if user_plan is not None:
            apply_plan(workload.model, user_plan)


def _estimate(
    workload: str | Workload,
    *,
    device: str | DeviceSpec | None,
    batch_size: int | None,
    seq_len: int | None,
    dtype: torch.dtype | str | None,
    optimizer: str,
    policy: Policy | str | None,
    plan: Plan | None,
    master_weights: bool,
    mfu: float | None,
    foreach: bool | None,
    seed: int,
    states: str = "device",
    states_shards: int = 1,
) -> Estimate:
    """:func:`estimate` with the RNGs saved and a user's plan lifted: the options checked, the fake
    step run, then its time, breakdown and allocator model."""
    t0 = time.perf_counter()
    train_dtype = _as_dtype(dtype)
    _check_options(optimizer=optimizer, policy=policy, plan=plan, states=states, master_weights=master_weights,
                   train_dtype=train_dtype, batch_size=batch_size, states_shards=states_shards)  # fmt: skip
    dev = device if isinstance(device, DeviceSpec) or device is None else get_device(device)
    mfu = resolve_mfu(dev, mfu)
    if not 0 < mfu <= 1:
        raise SpecError(f"memfit.estimate: mfu={mfu} must be in (0, 1], e.g. 0.4 (40 % of peak FLOP/s).")
    gpu = dev is None or dev.name != "cpu"
    if foreach is None and gpu:
        foreach = True  # torch's default for CUDA parameters; `cpu` keeps torch's CPU default
    run = _run_step(workload, seq_len=seq_len, seed=seed, batch_size=batch_size, train_dtype=train_dtype,
                    policy=policy, plan=plan, optimizer=optimizer, master_weights=master_weights,
                    foreach=foreach, gpu=gpu, states=states)  # fmt: skip
    step, static = run.step, run.static
    timing = None
    if dev is not None:
        traffic = 2 * static.params_bytes + static.grads_bytes + 2 * static.optimizer_bytes
        timing = step_seconds(dev, dtype=run.model_dtype, flops=step.flops, optimizer_traffic_bytes=traffic, mfu=mfu)
    breakdown = _breakdown(run, states=states, foreach=foreach, gpu=gpu)
    breakdown["estimate_s"] = time.perf_counter() - t0
    if timing is not None:
        breakdown["time"] = timing.to_dict()
    alloc = _allocator(step, dev, states_shards)
    if alloc is not None:
        breakdown["allocator"] = alloc.to_dict()
    memory = dev.memory_bytes if dev is not None else None
    return Estimate(
        model=run.workload.name,
        n_params=static.n_params,
        params_bytes=static.params_bytes,
        grads_bytes=static.grads_bytes,
        optimizer_bytes=static.optimizer_bytes,
        activations_bytes=step.activations_bytes,
        peak_bytes=step.peak_bytes,
        step_s=timing.step_s if timing is not None else None,
        flops=step.flops,
        mfu=mfu,
        device=dev.name if dev is not None else None,
        device_memory_bytes=memory,
        fits=None if memory is None else step.peak_bytes <= memory,
        headroom_bytes=None if memory is None else memory - step.peak_bytes,
        batch_size=run.batch_size,
        seq_len=run.workload.info.get("seq_len") if run.workload.info else seq_len,
        dtype=str(run.model_dtype).removeprefix("torch."),
        optimizer=optimizer,
        master_weights=master_weights,
        policy=run.plan.policy if run.plan is not None else "none",
        breakdown=breakdown,
        predicted_allocated_bytes=alloc.predicted_allocated_bytes if alloc is not None else None,
        predicted_reserved_bytes=alloc.predicted_reserved_bytes if alloc is not None else None,
    )


def _check_options(
    *,
    optimizer: str,
    policy: Policy | str | None,
    plan: Plan | None,
    states: str,
    master_weights: bool,
    train_dtype: torch.dtype | None,
    batch_size: int | None,
    states_shards: int,
) -> None:
    """Refuse, with the fix, what a fake step cannot estimate or what contradicts itself."""
    if optimizer not in OPTIMIZER_STATES:
        raise SpecError(f"memfit.estimate: unknown optimizer {optimizer!r}. Use one of: {', '.join(OPTIMIZER_STATES)}.")
    if policy is not None and plan is not None:
        raise SpecError("memfit.estimate: give a policy or a plan, not both.")
    offloads = (
        isinstance(parse_policy(policy), Offload)
        if policy is not None
        else plan is not None and any(b.option is Option.OFFLOAD for b in plan.blocks)
    )
    if offloads:
        raise SpecError(
            "memfit.estimate: offloaded blocks cannot be estimated yet (fake tensors have no host memory "
            "to copy to); estimate policy none, all, sqrt, every:K or selective:..., or run offload on "
            "the device: `memfit verify --policy offload`."
        )
    if states not in ("device", "step-in-backward") or (states != "device" and master_weights):
        raise SpecError(
            f"memfit.estimate: a fake step runs states='device' or 'step-in-backward' (without master weights), not "
            f"{states!r}{' with master weights' if master_weights else ''}; memfit.estimation.states prices the others "
            "from the device step (memfit estimate --states)."
        )
    if master_weights and train_dtype not in (torch.bfloat16, torch.float16):
        raise SpecError(
            "memfit.estimate: master weights are fp32 copies of low-precision parameters; they need "
            "dtype bfloat16 or float16 (e.g. --dtype bfloat16 --master-weights)."
        )
    if batch_size is not None and batch_size < 1:
        raise SpecError(f"memfit.estimate: batch_size={batch_size} must be at least 1.")
    if isinstance(states_shards, bool) or not isinstance(states_shards, int) or states_shards < 1:
        raise SpecError(
            f"memfit.estimate: states_shards={states_shards!r} must be a whole number of ranks, at least 1 "
            "(1: the model states unsharded)."
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class _StepRun:
    """The fake step and what it was run on."""

    workload: Workload
    built: str
    batch_size: int
    plan: Plan | None
    model_dtype: torch.dtype
    static: StaticBytes
    step: FakeStep


def _run_step(
    workload: str | Workload,
    *,
    seq_len: int | None,
    seed: int,
    batch_size: int | None,
    train_dtype: torch.dtype | None,
    policy: Policy | str | None,
    plan: Plan | None,
    optimizer: str,
    master_weights: bool,
    foreach: bool | None,
    gpu: bool,
    states: str,
) -> _StepRun:
    """Build the workload with fake parameters (or lift a given one) and run the planned fake step; a
    shape past torch's 64-bit sizes is refused with the fix."""
    mode = fake_mode()
    if isinstance(workload, Workload):
        if seq_len is not None:
            raise SpecError(
                "memfit.estimate: seq_len applies when building from a spec; this workload is built "
                "already. Pass the spec instead, or build it with load_workload(spec, seq_len=...)."
            )
        wl, built = workload, "given"
    else:
        wl, built = build_fake_workload(workload, mode=mode, seq_len=seq_len, seed=seed)
    bs = batch_size or wl.default_batch_size
    with fake_parameters(wl.model, mode, dtype=train_dtype) as model:
        static = static_bytes(model, optimizer=optimizer, master_weights=master_weights)
        model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        try:
            with _quiet_fake_kernel_errors():
                batch = fake_batch(wl, bs, mode, dtype=train_dtype, seed=seed)
                the_plan = _resolve_plan(wl, model, policy, plan, batch)
                step = _run_planned(wl, model, batch, the_plan, mode, optimizer, master_weights, foreach, gpu, states)
        except Exception as err:
            overflow = _size_overflow(err)
            if overflow is None:
                raise
            raise SpecError(
                f"memfit.estimate: batch {bs}{f' x {seq_len} tokens' if seq_len else ''} needs a tensor "
                f"larger than torch can describe (sizes and byte counts are 64-bit integers: {overflow}). "
                "Lower --batch-size or --seq-len."
            ) from err
    return _StepRun(workload=wl, built=built, batch_size=bs, plan=the_plan, model_dtype=model_dtype,
                    static=static, step=step)  # fmt: skip


def _breakdown(run: _StepRun, *, states: str, foreach: bool | None, gpu: bool) -> dict[str, Any]:
    """The estimate's further detail (without its time, allocator and seconds taken)."""
    static, step = run.static, run.step
    return {
        "buffers_bytes": static.buffers_bytes,
        "batch_bytes": step.batch_bytes,
        "master_weights_bytes": static.master_weights_bytes,
        "optimizer_state_bytes": static.optimizer_state_bytes,
        "optimizer_temp_bytes": step.optimizer_temp_bytes,
        "start_bytes": step.start_bytes,
        "peak_bytes_by_phase": step.peak_bytes_by_phase,
        "peak_phase": step.peak_phase,
        "measured_grads_bytes": step.grads_bytes,
        "measured_optimizer_bytes": step.optimizer_state_bytes,
        "forward_flops": step.forward_flops,
        "backward_flops": step.flops - step.forward_flops,
        "flops_by_op": step.flops_by_op,
        "n_trainable": static.n_trainable,
        "states": states,
        "optimizer_impl": "foreach" if foreach else ("per-parameter" if foreach is False else "torch's cpu default"),
        "kernels": "cuda" if gpu else "cpu",
        "built": run.built,
        "ops": step.op_count,
    }


def _allocator(step: FakeStep, dev: DeviceSpec | None, states_shards: int) -> AllocatorPrediction | None:
    """The CUDA caching allocator replayed on the step's allocations (the model states' at
    1/``states_shards``); None without a GPU."""
    if dev is None or dev.name == "cpu":
        return None
    events = shard_model_states(
        step.allocations, states_end=step.states_end, step_start=step.step_start,
        optimizer_start=step.optimizer_start, shards=states_shards,
    )  # fmt: skip
    return allocator_model(step.peak_bytes, dev, events=events, step_start=step.step_start)


# ---------------------------------------------------------------- private machinery


@contextlib.contextmanager
def _quiet_fake_kernel_errors() -> Iterator[None]:
    """Silence fake_tensor's log of a failing meta kernel (a multi-line traceback on stderr);
    the exception itself still propagates and is reported once, by the caller."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    before = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = before


def _size_overflow(err: BaseException) -> str | None:
    """torch's message when ``err`` was raised from a 64-bit size overflow (innermost cause first)."""
    chain: list[BaseException] = []
    seen: BaseException | None = err
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__
    root = chain[-1]
    text = " ".join(str(root).split())
    if isinstance(root, RuntimeError | OverflowError) and "overflow" in text.lower():
        return text[:200]
    return None


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return parse_dtype(dtype)


def _resolve_plan(
    wl: Workload, model: torch.nn.Module, policy: Policy | str | None, plan: Plan | None, batch: Any
) -> Plan | None:
    if plan is not None:
        return plan
    if policy is None:
        return None
    if isinstance(parse_policy(policy), KeepAll):
        return None
    chain = discover_chain(model, wl.blocks)
    return policy_plan(model, policy, chain=chain, batch=batch)


def _run_planned(
    wl: Workload,
    model: torch.nn.Module,
    batch: Any,
    plan: Plan | None,
    mode: Any,
    optimizer: str,
    master_weights: bool,
    foreach: bool | None,
    gpu_kernels: bool,
    states: str = "device",
) -> FakeStep:
    if plan is None:
        return run_fake_step(
            model,
            batch,
            wl.loss_fn,
            mode=mode,
            optimizer=optimizer,
            master_weights=master_weights,
            foreach=foreach,
            gpu_kernels=gpu_kernels,
            states=states,
        )
    apply_plan(model, plan, batch=batch)
    try:
        return run_fake_step(
            model,
            batch,
            wl.loss_fn,
            mode=mode,
            optimizer=optimizer,
            master_weights=master_weights,
            foreach=foreach,
            gpu_kernels=gpu_kernels,
            states=states,
        )
    finally:
        remove_plan(model)
