"""Check that accumulated gradients (with any checkpoint plan) equal one pass over the whole batch.

``memfit verify --global-batch G --micro-batch b`` calls :func:`verify_accumulation`: two copies
of the workload's model from the same weights, dropout off in both, one run through an
:class:`~memfit.accumulate.Accumulator` over micro-batches of ``b`` (with the plan applied), the
other one forward and backward over all ``G`` samples, on the same batch.

Known limitations:
    - BatchNorm in train mode cannot match (each micro-batch has its own statistics, and running
      statistics move once per micro-step); the result says how many such layers there are and
      ``buffers_equal`` is then False.
    - Runs on one process; distributed runs are covered by the test suite.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from memfit.accumulate import Accumulator, BatchNormMode, Normalize, disable_dropout
from memfit.capture.snapshot import leave_unchanged
from memfit.errors import VerificationError
from memfit.models.hf import set_float64_loss
from memfit.workload import Workload, batch_size_of, cast_batch, reduce_loss

__all__ = ["GRAD_RTOL", "grad_rel_errors", "verify_accumulation"]

# Tolerance on max_grad_rel_err for `ok`, by the dtype the comparison runs in. float64 is the
# issue's bar (1e-10); float32 leaves room for summation order over micro-batches.
GRAD_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 1e-2,
}


def verify_accumulation(
    workload: Workload,
    global_batch: int,
    micro_batch: int,
    dtype: torch.dtype | None = torch.float64,
    plan: Any = None,
    *,
    normalize: Normalize | str = Normalize.AUTO,
    seed: int = 0,
    measure_memory: bool = True,
) -> dict[str, Any]:
    """Accumulated gradients over micro-batches vs one pass over the whole batch.

    Measuring never changes the model: both runs are on copies, and the model's state, applied plan
    and the RNGs are restored bitwise afterwards, also when the check raises (NOTE [ Measuring
    leaves the model as it was ] in :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload; its model is copied twice (with a plan it had lifted) and left untouched.
        global_batch: samples in the batch (``G``).
        micro_batch: samples per micro-step (``b``); the last micro-step takes the rest.
        dtype: convert both copies (and floating batch tensors) to this dtype; ``None`` keeps
            the model's. float64 makes the comparison sharp (expect ~1e-15).
        plan: a memfit ``Plan``, a policy name (``"all"``, ``"sqrt"``, ``"every:K"``, ``"none"``;
            made for the converted copy), or None. Applied to the accumulated copy only.
        normalize: the Accumulator's normalisation (``auto``: tokens for ``(loss_sum, count)``
            losses, else mean). The reference is the matching whole-batch loss.
        seed: torch seed set before ``make_batch``.
        measure_memory: measure both runs' peak live bytes with ``MemoryTracker`` (params, grads,
            activations; no optimizer) as ``measured_peak_bytes`` (accumulated) and
            ``baseline_peak_bytes`` (whole batch).

    Returns:
        ``ok`` (``max_grad_rel_err <= grad_rtol`` for the dtype, see :data:`GRAD_RTOL`, no
        missing gradient, and ``buffers_equal``), ``grad_rtol``, ``max_grad_rel_err`` (max over parameters of ``max|g - g_ref| / max(max|g_ref|, 1e-30)``),
        ``worst_param``, ``loss``, ``ref_loss``, ``loss_rel_err``, ``buffers_equal`` (every buffer
        bitwise equal after the step), ``unequal_buffers``, ``missing_grads`` (parameters with a gradient in only one
        copy; each counts as error ``inf``), ``params_compared``, ``micro_steps``,
        ``global_batch``, ``micro_batch``, ``normalize``, ``dtype``, ``batchnorm_train_layers``,
        ``dropout_disabled``, and with ``measure_memory`` ``measured_peak_bytes`` and
        ``baseline_peak_bytes``.

    Raises:
        VerificationError: ``micro_batch`` larger than ``global_batch``, or the loss is not finite.
        PlanMismatchError: the plan does not fit the (converted) model.
    """
    if micro_batch > global_batch:
        raise VerificationError(
            f"memfit.verify: micro-batch {micro_batch} is larger than the global batch "
            f"{global_batch}. Use --micro-batch <= --global-batch."
        )
    with leave_unchanged(workload.model):
        return _verify_accumulation(
            workload, global_batch, micro_batch, dtype, plan, normalize=normalize, seed=seed, measure_memory=measure_memory
        )


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
) -> dict[str, Any]:
    """:func:`verify_accumulation` inside the snapshot of the user's model (plan lifted)."""
    base = workload.model
    ref = copy.deepcopy(base)
    test = copy.deepcopy(base)
    if dtype is not None:
        ref.to(dtype=dtype)
        test.to(dtype=dtype)
    dropped = disable_dropout(ref)
    disable_dropout(test)
    # transformers' LM losses round float64 logits to float32; on these copies, compute them in float64.
    set_float64_loss(ref)
    set_float64_loss(test, warn=False)
    ref.train()
    test.train()
    # Parameter objects survive apply_plan, so pair them before it (names may not).
    pairs = list(zip(ref.named_parameters(), test.parameters(), strict=True))
    device = next((p.device for p in ref.parameters()), torch.device("cpu"))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        batch = workload.make_batch(global_batch)
    batch = cast_batch(batch, dtype=dtype, device=device)
    if batch_size_of(batch) != global_batch:
        raise VerificationError(
            f"memfit.verify: make_batch({global_batch}) returned a batch of {batch_size_of(batch)}."
        )
    if plan is not None:
        _apply(test, plan, batch)

    norm = Normalize(normalize)
    peaks: dict[str, int] = {}
    with _tracked(measure_memory, ref, batch, peaks, "baseline_peak_bytes"):
        out = workload.loss_fn(ref, batch)
        loss_sum, count = reduce_loss(out)
        if norm is Normalize.AUTO:
            norm = Normalize.TOKENS if (count is not None or workload.count_fn is not None) else Normalize.MEAN
        ref_loss = _reference_loss(loss_sum, count, norm, global_batch)
        del out, loss_sum
        if not torch.isfinite(ref_loss):
            raise VerificationError(f"memfit.verify: the reference loss is {float(ref_loss)}; check the workload.")
        ref_loss.backward()
    ref_value = float(ref_loss.detach())
    del ref_loss

    acc = Accumulator(test, None, micro_batch=micro_batch, normalize=norm, bn=BatchNormMode.GHOST)
    with _tracked(measure_memory, test, batch, peaks, "measured_peak_bytes"):
        res = acc.step(batch, workload.loss_fn, count_fn=workload.count_fn if norm is Normalize.TOKENS else None)

    errs, missing = grad_rel_errors(pairs)
    worst = max(errs, key=errs.get) if errs else None
    max_err = max(errs.values(), default=0.0)
    if missing:
        max_err = float("inf")
        worst = missing[0]
    ref_buffers = dict(ref.named_buffers())
    unequal = [n for n, b in test.named_buffers() if n not in ref_buffers or not torch.equal(ref_buffers[n], b)]
    run_dtype = dtype or next(iter(ref.parameters())).dtype
    rtol = GRAD_RTOL.get(run_dtype, 1e-4)
    return {
        "ok": max_err <= rtol and not missing and not unequal,
        "grad_rtol": rtol,
        "max_grad_rel_err": max_err,
        "worst_param": worst,
        "loss": res.loss,
        "ref_loss": ref_value,
        "loss_rel_err": abs(res.loss - ref_value) / max(abs(ref_value), 1e-30),
        "buffers_equal": not unequal,
        "unequal_buffers": unequal,
        "missing_grads": missing,
        "params_compared": len(errs),
        "micro_steps": res.micro_steps,
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "normalize": norm.value,
        "dtype": str(run_dtype).removeprefix("torch."),
        "batchnorm_train_layers": sum(isinstance(m, _BatchNorm) and m.training for m in test.modules()),
        "dropout_disabled": dropped,
        **peaks,
    }


def grad_rel_errors(
    pairs: list[tuple[tuple[str, nn.Parameter], nn.Parameter]],
) -> tuple[dict[str, float], list[str]]:
    """Per-parameter ``max|g - g_ref| / max(max|g_ref|, 1e-30)``; and names with one gradient missing.

    Args:
        pairs: ``((name, reference_param), param)`` pairs.
    """
    errs: dict[str, float] = {}
    missing: list[str] = []
    for (name, p_ref), p in pairs:
        g_ref, g = p_ref.grad, p.grad
        if g_ref is None and g is None:
            continue
        if g_ref is None or g is None:
            missing.append(name)
            continue
        g_ref, g = _full(g_ref), _full(g)
        scale = max(float(g_ref.abs().max()), 1e-30) if g_ref.numel() else 1e-30
        diff = float((g.to(g_ref.dtype) - g_ref).abs().max()) if g_ref.numel() else 0.0
        errs[name] = diff / scale
    return errs, missing


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference_loss(loss: torch.Tensor, count: torch.Tensor | None, norm: Normalize, batch: int) -> torch.Tensor:
    if norm is Normalize.TOKENS:
        if count is None:
            raise VerificationError(
                "memfit.verify: normalize='tokens' needs loss_fn to return (loss_sum, count)."
            )
        return loss / count.to(loss.dtype)
    mean = loss if count is None else loss / count.to(loss.dtype)
    return mean if norm is Normalize.MEAN else mean * batch


@contextlib.contextmanager
def _tracked(enabled: bool, model: nn.Module, batch: Any, peaks: dict[str, int], key: str) -> Iterator[None]:
    if not enabled:
        yield
        return
    from memfit.capture.tracker import MemoryTracker

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with MemoryTracker(device=device) as tracker:
        tracker.track(model, batch)
        yield
    peaks[key] = tracker.peak_bytes


def _apply(model: nn.Module, plan: Any, batch: Any) -> None:
    from memfit.apply import apply_plan
    from memfit.plan import policy_plan

    if isinstance(plan, str):
        plan = policy_plan(model, plan, batch=batch)
    apply_plan(model, plan)
