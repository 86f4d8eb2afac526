"""Check that accumulated gradients (with any checkpoint plan) equal one pass over the whole batch.

``memfit verify --global-batch G --micro-batch b`` calls :func:`verify_accumulation`: two copies
of the workload's model from the same weights, dropout off in both, one run through an
:class:`~memfit.accumulate.Accumulator` over micro-batches of ``b`` (with the plan applied), the
other one forward and backward over all ``G`` samples, on the same batch.

Gradients are judged with the comparison every verify path shares
(:func:`memfit.verification.gradients.compare_gradients`, NOTE [ Gradient floor ]) at the tolerance of
reordered sums (:data:`memfit.verification.gradients.GRAD_RTOL_REORDERED`).

Known limitations:
    - BatchNorm in train mode cannot match with the default ``bn="ghost"`` (each micro-batch has its
      own statistics, and running statistics move once per micro-step); the result then says so in
      ``reason`` and offers ``bn="freeze"`` (both runs normalise with the running statistics) and
      ``bn="groupnorm"`` (both runs converted to GroupNorm), under which the comparison is exact.
    - Runs on one process; distributed runs are covered by the test suite (same comparison).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from memfit.accumulate.accumulator import Accumulator
from memfit.accumulate.batchnorm import BatchNormMode, convert_batchnorm_to_groupnorm
from memfit.accumulate.dropout import disable_dropout
from memfit.accumulate.normalize import Normalize
from memfit.accumulate.types import StepResult
from memfit.apply import apply_plan
from memfit.capture.snapshot import copy_model, leave_unchanged
from memfit.capture.step import StepSpec
from memfit.capture.tracker import MemoryTracker
from memfit.errors import SpecError, VerificationError
from memfit.models.hf_loss import set_float64_loss
from memfit.plan import policy_plan
from memfit.verification.gradients import (
    GRAD_RTOL_REORDERED,
    GradComparison,
    compare_gradients,
    grad_rtol,
)
from memfit.verification.islands import Float32Islands, IslandReport, LowPrecisionOps
from memfit.verification.verdict import failure_reason
from memfit.workload import Workload, batch_size_of, cast_batch, reduce_loss

__all__ = ["GRAD_RTOL", "VERIFY_BN_MODES", "grad_rel_errors", "verify_accumulation"]

# Tolerance on max_grad_rel_err for `ok`, by the dtype the comparison runs in: sums over
# micro-batches are reordered sums (float64: the bar, 1e-10).
GRAD_RTOL: dict[torch.dtype, float] = GRAD_RTOL_REORDERED
VERIFY_BN_MODES = (BatchNormMode.GHOST, BatchNormMode.FREEZE, BatchNormMode.GROUPNORM)
"""BatchNorm modes :func:`verify_accumulation` takes (``momentum`` changes how running statistics
move, not the gradients: it stays ghost batch norm)."""


def verify_accumulation(
    workload: Workload,
    global_batch: int,
    micro_batch: int,
    plan: Any = None,
    *,
    step: StepSpec | None = None,
    normalize: Normalize | str = Normalize.AUTO,
    measure_memory: bool = True,
    bn: BatchNormMode | str = BatchNormMode.GHOST,
) -> dict[str, Any]:
    """Accumulated gradients over micro-batches vs one pass over the whole batch.

    Measuring never changes the model: both runs are on copies, and the model's state, applied plan
    and the RNGs are restored bitwise afterwards, also when the check raises (NOTE [ Measuring
    leaves the model as it was ] in :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload; its model is copied twice (with a plan it had lifted) and left untouched.
        global_batch: samples in the batch (``G``).
        micro_batch: samples per micro-step (``b``); the last micro-step takes the rest.
        plan: a memfit ``Plan``, a policy name (``"all"``, ``"sqrt"``, ``"every:K"``, ``"none"``;
            made for the converted copy), or None. Applied to the accumulated copy only.
        step: the step checked (:class:`~memfit.capture.step.StepSpec`): ``dtype`` converts both
            copies (and floating batch tensors), None keeps the model's; ``seed`` is the torch seed
            set before ``make_batch``. ``step=None`` checks in float64, which makes the comparison
            sharp (expect ~1e-15): pass ``StepSpec(dtype=...)`` for another dtype. The batch is
            ``global_batch``, no optimizer runs (gradients are compared) and the copies stay where
            the model is: no ``batch_size``, ``optimizer``, ``repeats`` or ``device``.
        normalize: the Accumulator's normalisation (``auto``: tokens for ``(loss_sum, count)``
            losses, else mean). The reference is the matching whole-batch loss.
        bn: BatchNorm layers in train mode: ``ghost`` (as they are: each micro-batch normalised
            with its own statistics, which cannot equal the big batch), ``freeze`` (both runs
            normalise with the running statistics and keep them) or ``groupnorm`` (both runs with
            BatchNorm converted to GroupNorm, :func:`memfit.accumulate.convert_batchnorm_to_groupnorm`).
        measure_memory: measure both runs' peak live bytes with ``MemoryTracker`` (params, grads,
            activations; no optimizer) as ``measured_peak_bytes`` (accumulated) and
            ``baseline_peak_bytes`` (whole batch).

    Returns:
        ``ok`` (``max_grad_rel_err <= grad_rtol`` for the dtype, see :data:`GRAD_RTOL`, no
        missing gradient, and ``buffers_equal``), ``reason`` (why not, when not ok: first the
        reasons that are not memfit's, a non-finite reference or ghost BatchNorm, with the fix),
        ``bn``, ``grad_rtol``, ``max_grad_rel_err`` (max over parameters of
        ``max|g - g_ref| / max(max|g_ref|, 1e-3 G)``, NOTE [ Gradient floor ]),
        ``worst_param``, ``loss``, ``ref_loss``, ``loss_rel_err``, ``buffers_equal`` (every buffer
        bitwise equal after the step), ``unequal_buffers``, ``missing_grads`` (parameters with a gradient in only one
        copy; each counts as error ``inf``), ``params_compared``, ``micro_steps``,
        ``global_batch``, ``micro_batch``, ``normalize``, ``dtype``, ``batchnorm_train_layers``,
        ``dropout_disabled``, ``grad_rtol_reason`` (why that tolerance), ``float32_islands`` and
        ``float32_kept`` (where a float64 check met float32: run in float64 in both runs, or left and
        judged at float32's tolerance, NOTE [ float32 islands ] in :mod:`memfit.verification.islands`),
        ``notes``, and with ``measure_memory`` ``measured_peak_bytes`` and ``baseline_peak_bytes``.

    Raises:
        VerificationError: ``micro_batch`` larger than ``global_batch``, or ``bn`` is not one of
            :data:`VERIFY_BN_MODES`.
        PlanMismatchError: the plan does not fit the (converted) model.
        SpecError: a step with a batch size, an optimizer other than the default, repeats or a device.
    """
    dtype = torch.float64 if step is None else step.dtype
    step = step or StepSpec()
    _check_request(step, global_batch, micro_batch)
    bn_mode = _bn_mode(bn)
    with leave_unchanged(workload.model):
        return _verify_accumulation(
            workload,
            global_batch,
            micro_batch,
            dtype,
            plan,
            normalize=normalize,
            seed=step.seed,
            measure_memory=measure_memory,
            bn_mode=bn_mode,
        )


def _check_request(step: StepSpec, global_batch: int, micro_batch: int) -> None:
    """Refuse a step setting an accumulation check would ignore, and a micro-batch over the batch."""
    if (
        step.batch_size is not None
        or step.optimizer != StepSpec().optimizer
        or step.repeats is not None
        or step.device is not None
    ):
        raise SpecError(
            "memfit.verify: an accumulation check runs global_batch samples (micro_batch at a time), compares "
            "gradients before any optimizer step, times nothing and runs where the model is (move it first: "
            "model.to(device)); give a StepSpec with dtype and seed only "
            f"(got batch_size={step.batch_size!r}, optimizer={step.optimizer!r}, repeats={step.repeats!r}, "
            f"device={step.device!r})."
        )
    if micro_batch > global_batch:
        raise VerificationError(
            f"memfit.verify: micro-batch {micro_batch} is larger than the global batch "
            f"{global_batch}. Use --micro-batch <= --global-batch."
        )


def _bn_mode(bn: BatchNormMode | str) -> BatchNormMode:
    """``bn`` as a :class:`BatchNormMode` an accumulation check takes (:data:`VERIFY_BN_MODES`), else refused."""
    bn_mode = BatchNormMode(bn) if isinstance(bn, str) and bn in {m.value for m in BatchNormMode} else bn
    if bn_mode not in VERIFY_BN_MODES:
        raise VerificationError(
            f"memfit.verify: bn={bn!r} cannot be verified against the big batch; use one of "
            f"{', '.join(m.value for m in VERIFY_BN_MODES)} ('momentum' keeps ghost statistics: it changes how "
            "running statistics move, not the gradients)."
        )
    return bn_mode


def _verify_accumulation(
    workload: Workload,
    global_batch: int,
    micro_batch: int,
    dtype: torch.dtype | None,
    plan: Any,
    *,
    normalize: Normalize | str,
    seed: int,
    measure_memory: bool,
    bn_mode: BatchNormMode,
) -> dict[str, Any]:
    """:func:`verify_accumulation` inside the snapshot of the user's model (plan lifted)."""
    ref, test, dropped = _copies(workload.model, dtype, bn_mode)
    n_bn = sum(isinstance(m, _BatchNorm) for m in test.modules())
    # Parameter objects survive apply_plan, so pair them before it (names may not).
    pairs = list(zip(ref.named_parameters(), test.parameters(), strict=True))
    device = next((p.device for p in ref.parameters()), torch.device("cpu"))
    batch = _batch(workload, global_batch, seed=seed, dtype=dtype, device=device)
    if plan is not None:
        _apply(test, plan, batch)
    peaks: dict[str, int] = {}
    run_dtype = dtype or next(iter(ref.parameters())).dtype
    promote = run_dtype is torch.float64  # NOTE [ float32 islands ]
    with _tracked(measure_memory, ref, batch, peaks, "baseline_peak_bytes"):
        ref_value, norm, islands = _whole_batch(
            ref, batch, workload, Normalize(normalize), global_batch, promote=promote
        )
    res = _accumulated(
        test, batch, workload, micro_batch, norm, bn_mode, promote=promote, measure_memory=measure_memory, peaks=peaks
    )

    grads = compare_gradients({n: p.grad for (n, _), p in pairs}, {n: p.grad for (n, p), _ in pairs})
    ref_buffers = dict(ref.named_buffers())
    unequal = [n for n, b in test.named_buffers() if n not in ref_buffers or not torch.equal(ref_buffers[n], b)]
    rtol, rtol_reason = _tolerance(run_dtype, islands)
    ok = grads.ok(rtol) and not unequal
    dtype_name = str(run_dtype).removeprefix("torch.")
    bn_train = sum(isinstance(m, _BatchNorm) and m.training for m in test.modules())
    reason = None
    if not ok:
        reason = _reason(
            grads,
            rtol,
            ref_loss=ref_value,
            dtype=dtype_name,
            unequal=unequal,
            bn_train=bn_train,
            bn=bn_mode,
            micro_steps=res.micro_steps,
        )
    return {
        "ok": ok,
        "reason": reason,
        "bn": bn_mode.value,
        "grad_rtol": rtol,
        "grad_rtol_reason": rtol_reason,
        "max_grad_rel_err": grads.max_rel_err,
        "worst_param": grads.worst_param,
        "loss": res.loss,
        "ref_loss": ref_value,
        "loss_rel_err": abs(res.loss - ref_value) / max(abs(ref_value), 1e-30),
        "buffers_equal": not unequal,
        "unequal_buffers": unequal,
        "missing_grads": list(grads.missing),
        "params_compared": len(grads.errors),
        "micro_steps": res.micro_steps,
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "normalize": norm.value,
        "dtype": dtype_name,
        "batchnorm_layers": n_bn,
        "batchnorm_train_layers": bn_train,
        "dropout_disabled": dropped,
        "float32_islands": islands.promoted_json(),
        "float32_kept": islands.kept_json(),
        "notes": [n for n in (islands.note(),) if n],
        **peaks,
    }


def _copies(base: nn.Module, dtype: torch.dtype | None, bn_mode: BatchNormMode) -> tuple[nn.Module, nn.Module, Any]:
    """The reference and the accumulated copy of ``base``, cast to ``dtype`` (when given), BatchNorm
    as ``bn_mode`` says, dropout off, losses in float64, in train mode; and what turning dropout off
    in the reference returned (``dropout_disabled``)."""
    ref = copy_model(base)
    test = copy_model(base)
    if dtype is not None:
        ref.to(dtype=dtype)
        test.to(dtype=dtype)
    if bn_mode is BatchNormMode.GROUPNORM:
        ref = convert_batchnorm_to_groupnorm(ref)
        test = convert_batchnorm_to_groupnorm(test)
    dropped = disable_dropout(ref)
    disable_dropout(test)
    # transformers' LM losses round float64 logits to float32; on these copies, compute them in float64.
    set_float64_loss(ref)
    set_float64_loss(test, warn=False)
    ref.train()
    test.train()
    if bn_mode is BatchNormMode.FREEZE:  # the big batch with frozen statistics, as the Accumulator runs
        for m in ref.modules():
            if isinstance(m, _BatchNorm):
                m.eval()
    return ref, test, dropped


def _batch(workload: Workload, global_batch: int, *, seed: int, dtype: torch.dtype | None, device: torch.device) -> Any:
    """The workload's batch of ``global_batch`` samples drawn with ``seed`` (the RNGs left as they
    were), cast to ``dtype`` and moved to ``device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        batch = workload.make_batch(global_batch)
    batch = cast_batch(batch, dtype=dtype, device=device)
    if batch_size_of(batch) != global_batch:
        raise VerificationError(
            f"memfit.verify: make_batch({global_batch}) returned a batch of {batch_size_of(batch)}."
        )
    return batch


def _accumulated(
    test: nn.Module,
    batch: Any,
    workload: Workload,
    micro_batch: int,
    norm: Normalize,
    bn_mode: BatchNormMode,
    *,
    promote: bool,
    measure_memory: bool,
    peaks: dict[str, int],
) -> StepResult:
    """The accumulated copy's step over micro-batches of ``micro_batch`` (``promote``: its float32
    islands run in float64, as the reference's); with ``measure_memory`` its peak goes to
    ``peaks["measured_peak_bytes"]``."""
    acc = Accumulator(
        test,
        None,
        micro_batch=micro_batch,
        normalize=norm,
        bn=BatchNormMode.FREEZE if bn_mode is BatchNormMode.FREEZE else BatchNormMode.GHOST,
    )
    with (
        _tracked(measure_memory, test, batch, peaks, "measured_peak_bytes"),
        Float32Islands(record=False) if promote else contextlib.nullcontext(),
    ):
        return acc.step(batch, workload.loss_fn, count_fn=workload.count_fn if norm is Normalize.TOKENS else None)


def _whole_batch(
    ref: nn.Module, batch: Any, workload: Workload, norm: Normalize, global_batch: int, *, promote: bool
) -> tuple[float, Normalize, IslandReport]:
    """The reference's forward and backward over the whole batch: its loss, the normalisation
    (``auto`` resolved: tokens for ``(loss_sum, count)`` losses, else mean) and, with ``promote``,
    the float32 islands run in float64 (NOTE [ float32 islands ])."""
    islands = IslandReport()
    with (
        Float32Islands() if promote else contextlib.nullcontext() as promoted,
        LowPrecisionOps() if promote else contextlib.nullcontext() as narrow,
    ):
        out = workload.loss_fn(ref, batch)
        loss_sum, count = reduce_loss(out)
        if norm is Normalize.AUTO:
            norm = Normalize.TOKENS if (count is not None or workload.count_fn is not None) else Normalize.MEAN
        ref_loss = _reference_loss(loss_sum, count, norm, global_batch)
        del out, loss_sum
        ref_loss.backward()
    if promote:
        islands = IslandReport(promoted=promoted.sites, kept=narrow.sites)
    return float(ref_loss.detach()), norm, islands


def _tolerance(run_dtype: torch.dtype, islands: IslandReport) -> tuple[float, str]:
    """The relative tolerance accumulated gradients are judged at, and why."""
    rtol = grad_rtol(run_dtype, reordered=True)
    rtol_reason = (
        f"{str(run_dtype).removeprefix('torch.')} sums in another order (micro-batches against the whole batch)"
    )
    if islands.kept:
        rtol = max(rtol, grad_rtol(torch.float32, reordered=True))
        rtol_reason = "float32 sums in another order: the model computes in float32 where memfit cannot promote it"
    return rtol, rtol_reason


def grad_rel_errors(
    pairs: list[tuple[tuple[str, nn.Parameter], nn.Parameter]],
) -> tuple[dict[str, float], list[str]]:
    """Per-parameter errors of the shared comparison (NOTE [ Gradient floor ]); and names with one
    gradient missing.

    Args:
        pairs: ``((name, reference_param), param)`` pairs.
    """
    res = compare_gradients({n: p.grad for (n, _), p in pairs}, {n: p.grad for (n, p), _ in pairs})
    return res.errors, list(res.missing)


def _reason(
    grads: GradComparison,
    rtol: float,
    *,
    ref_loss: float,
    dtype: str,
    unequal: list[str],
    bn_train: int,
    bn: BatchNormMode,
    micro_steps: int,
) -> str:
    if math.isfinite(ref_loss) and grads.ref_finite and bn_train and micro_steps > 1 and bn is BatchNormMode.GHOST:
        return (
            f"the model has {bn_train} BatchNorm layer(s) in train mode: accumulation normalises each of the "
            f"{micro_steps} micro-batches with its own statistics (ghost batch norm) and moves running statistics "
            "once per micro-step, which no accumulation can make equal to the big batch; this is not memfit's "
            "doing. Verify the rest with bn='freeze' or bn='groupnorm' (`memfit verify --bn freeze`), and train "
            "with Accumulator(..., bn='freeze' | 'momentum' | 'groupnorm') or accept ghost batch norm."
        )
    return failure_reason(grads, rtol, ref_loss=ref_loss, dtype=dtype, unequal_buffers=unequal)


def _reference_loss(loss: torch.Tensor, count: torch.Tensor | None, norm: Normalize, batch: int) -> torch.Tensor:
    if norm is Normalize.TOKENS:
        if count is None:
            raise VerificationError("memfit.verify: normalize='tokens' needs loss_fn to return (loss_sum, count).")
        return loss / count.to(loss.dtype)
    mean = loss if count is None else loss / count.to(loss.dtype)
    return mean if norm is Normalize.MEAN else mean * batch


@contextlib.contextmanager
def _tracked(enabled: bool, model: nn.Module, batch: Any, peaks: dict[str, int], key: str) -> Iterator[None]:
    if not enabled:
        yield
        return
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with MemoryTracker(device=device) as tracker:
        tracker.track(model, batch)
        yield
    peaks[key] = tracker.peak_bytes


def _apply(model: nn.Module, plan: Any, batch: Any) -> None:
    if isinstance(plan, str):
        plan = policy_plan(model, plan, batch=batch)
    apply_plan(model, plan)
