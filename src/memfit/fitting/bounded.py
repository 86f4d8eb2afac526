"""Searches that stay within their budget: predict a measurement before running it, scale what cannot
run, and stop a measurement that grows past the budget (NOTE [ Bounded measurement ]).

NOTE [ Bounded measurement ]
A fit measures real steps: profiles (one step per set-up, keep-all among them: every block's
activations and the model's own head alive at once) and measured windows of the chosen plan. The
plan is what keeps a step within the budget; the keep-all step of a profile is not kept there by
anything, and at long sequences or large micro-batches it can need many times the budget (a Llama
with a 32000-token vocabulary at 8192 tokens: 3 GiB of logits and their gradients in the keep-all
step alone). So the searches (the longest sequence, auto-fit's micro-batch) bound what they run:

1. Predict: a profile's largest step (its *profile peak*: the largest tracker peak over its
   set-ups) is affine in the tokens of the step (the sequence length, or the micro-batch), through
   the two longest profiles made, or through the model's states (parameters, gradients, optimizer
   state: no tokens, no activations) and the one profile made. A profile runs only where its peak is
   predicted within the *measurement limit*: the budget, and on CPU the host's available memory (on
   CUDA the device's free memory). When no plan at the one micro-batch profiled fits, the next is
   profiled under the guard rather than refusing.
2. Scale: stats at a length (or micro-batch) whose profile would not fit are the line through the
   two longest profiles made (:func:`memfit.fitting.candidates.interpolate_stats`, per field: bytes
   affine in the tokens, as the activations, their gradients and the chunked head's chunk are;
   seconds too). Where auto-fit could profile one micro-batch only (the next one's keep-all step is
   over the budget, while a larger micro-batch may fit with recompute: a DDP rank of a 4-layer demo
   at 11 MiB), the line runs through that profile and the stats of 0 samples, the model states alone
   (:func:`states_point`: every fixed part taken at most as large as it is, so the line errs high).
   :func:`memfit.fitting.budget.plan_for_budget`, given a predictor of its profile, profiles the
   batch asked for only where predicted within the free memory, else two halvings of it, scaled.
   Plans come from those stats, and the chosen plan's window, predicted within the budget, is
   measured to confirm it.
3. Guard: every real step runs under :func:`guarded`. On CPU it lowers the process's address-space
   limit (``RLIMIT_AS``) to what the process maps now plus the budget plus a margin
   (:func:`guard_headroom_bytes`), so that an allocation past it fails inside torch instead of
   growing the process; on CUDA the allocator's out-of-memory error is caught. Either way the
   measurement stops with :class:`MeasurementGuardError` (the model is restored by the snapshot
   around it), and the search goes on with a smaller candidate.
4. Nothing held: a search keeps only Stats (numbers) between probes; each probe's tensors, tracker
   events and autograd graphs go with its frame, and :func:`guarded` collects the cycles a failed
   measurement's traceback leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import resource
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from memfit.capture.stats import BlockStats, HeadOptionStats, OptionStats, Stats
from memfit.capture.step import StepSpec
from memfit.capture.tracker import BudgetExceededError
from memfit.errors import BudgetInfeasibleError, MemfitError
from memfit.fitting.candidates import interpolate_stats
from memfit.units import format_bytes
from memfit.workload import Workload, batch_signature, cast_batch

__all__ = [
    "MeasurementGuardError",
    "bounded_profile",
    "available_bytes",
    "guard_headroom_bytes",
    "guarded",
    "longest_within",
    "predict_peak_bytes",
    "profile_peak_bytes",
    "scaled_stats",
    "states_point",
    "with_bytes_of",
]

GUARD_MIN_MARGIN_BYTES = 512 * 2**20
"""The guard's margin over the budget is at least this (the process's own allocations: snapshot of
the model, allocator slack, libraries mapping their buffers on first use)."""

_ALLOC_FAILURES = ("can't allocate memory", "not enough memory", "Cannot allocate memory")


class MeasurementGuardError(MemfitError):
    """A measured step grew past the budget plus the guard's margin and was stopped (NOTE [ Bounded measurement ])."""


def guard_headroom_bytes(budget_bytes: int) -> int:
    """What a guarded measurement may add to the process: the budget plus a margin (the larger of
    the budget and :data:`GUARD_MIN_MARGIN_BYTES`)."""
    return budget_bytes + max(budget_bytes, GUARD_MIN_MARGIN_BYTES)


def available_bytes(device: torch.device | str = "cpu") -> int | None:
    """Memory a measurement may still take: the host's ``MemAvailable`` on CPU, the device's free
    memory on CUDA; None when unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _mapped_bytes() -> int | None:
    """The process's address space now (``VmSize``), or None off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        return None


def _is_alloc_failure(err: BaseException) -> bool:
    if isinstance(err, MemoryError | torch.OutOfMemoryError | BudgetExceededError):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _ALLOC_FAILURES)


@contextlib.contextmanager
def guarded(budget_bytes: int, what: str, *, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run a measurement that may add at most :func:`guard_headroom_bytes` to the process (NOTE
    [ Bounded measurement ], step 3).

    On CPU the soft ``RLIMIT_AS`` is lowered to the address space mapped now plus the headroom (never
    above the limits already set; restored afterwards), and also to the host's available memory. On
    CUDA the allocator's out-of-memory error stops it.

    Raises:
        MeasurementGuardError: an allocation failed under the guard (``what`` names the measurement).
    """
    dev = torch.device(device)
    headroom = guard_headroom_bytes(budget_bytes)
    old = resource.getrlimit(resource.RLIMIT_AS)
    mapped = _mapped_bytes() if dev.type == "cpu" else None
    if mapped is not None:
        avail = available_bytes("cpu")
        limit = mapped + (headroom if avail is None else min(headroom, avail))
        for cap in old:
            if cap != resource.RLIM_INFINITY:
                limit = min(limit, cap)
        resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
    try:
        yield
    except BaseException as err:
        if not _is_alloc_failure(err):
            raise
        raise MeasurementGuardError(
            f"memfit.fit: {what} grew past the budget of {format_bytes(budget_bytes)} plus the guard's margin "
            f"(at most {format_bytes(headroom)} more than before it) and was stopped; the search goes on with "
            "a smaller candidate."
        ) from None
    finally:
        if mapped is not None:
            resource.setrlimit(resource.RLIMIT_AS, old)
        gc.collect()  # a stopped measurement's traceback holds its frames and their tensors
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def profile_peak_bytes(st: Stats) -> int:
    """The largest tracker peak of the steps a profile ran (its set-ups and head options)."""
    peaks = [st.peak_bytes, *st.measured_peak_bytes_by_option.values()]
    for h in st.head_options.values():
        peaks += [h.measured_peak_bytes, *h.measured_peak_bytes_by_option.values()]
    return max(peaks)


def states_bytes(st: Stats) -> int:
    """A step's bytes that do not grow with the tokens: parameters, gradients, optimizer state."""
    return st.params_bytes + st.grads_bytes + st.optimizer_bytes


def _line(points: Mapping[int, int], floor_bytes: int) -> tuple[float, float] | None:
    """``(slope, intercept)`` through the two longest points, or through ``(0, floor_bytes)`` and the
    one point; None with no point."""
    xs = sorted(points)
    if not xs:
        return None
    if len(xs) == 1:
        (x1,) = xs
        x0, y0 = 0, floor_bytes
    else:
        x0, x1 = xs[-2:]
        y0 = points[x0]
    slope = max(0.0, (points[x1] - y0) / (x1 - x0))
    return slope, points[x1] - slope * x1


def predict_peak_bytes(points: Mapping[int, int], x: int, *, floor_bytes: int = 0) -> int | None:
    """A profile's peak at ``x`` tokens from the peaks measured at ``points`` (NOTE [ Bounded
    measurement ], step 1); None with no point."""
    line = _line(points, floor_bytes)
    if line is None:
        return None
    slope, icpt = line
    longest = max(points)
    return int(max(icpt + slope * x, points[longest] if x >= longest else 0))


def longest_within(points: Mapping[int, int], limit_bytes: int, *, floor_bytes: int = 0) -> float | None:
    """The most tokens whose predicted profile peak is within ``limit_bytes`` (inf when the peak does
    not grow; None with no point)."""
    line = _line(points, floor_bytes)
    if line is None:
        return None
    slope, icpt = line
    return float("inf") if slope <= 0 else (limit_bytes - icpt) / slope


def scaled_stats(profiles: Mapping[int, Stats], x: int, *, batch_size: int) -> Stats:
    """Stats at ``x`` tokens per row from profiles at other lengths (keyed by length, all at
    ``batch_size``): the line through the two longest (NOTE [ Bounded measurement ], step 2)."""
    xs = sorted(profiles)[-2:]
    if len(xs) < 2:
        raise MemfitError("memfit.fit: scaling stats to another length needs profiles at two lengths.")
    lo, hi = (replace(profiles[t], batch_size=t) for t in xs)
    return replace(interpolate_stats(lo, hi, x), batch_size=batch_size)


def with_bytes_of(st: Stats, est: Stats) -> Stats:
    """``st`` (scaled stats) with every byte count that ``est`` (a fake-tensor step's stats at the same
    length and micro-batch, made as the profile was) also holds taken from ``est``; seconds, and what
    ``est`` lacks (an option it did not calibrate), stay as in ``st`` (NOTE [ Longest sequence ] in
    :mod:`memfit.fitting.seq_len`, step 4). On this machine's kernels a fake step's bytes are a
    profile's (the tracker sees the same ops' outputs), so the stats' bytes become those of their
    own length, where the line through two short profiles misses a working set whose peak moves
    (a tiled block's backward: its weights' gradients at short lengths, its attention at long ones)."""
    return _take_bytes(st, est, "")


def _take_bytes(a: Any, b: Any, name: str) -> Any:
    if (
        ("bytes" in name or name == "freed_inputs")
        and isinstance(a, int)
        and not isinstance(a, bool)
        and isinstance(b, int)
    ):
        return b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return {k: _take_bytes(v, b[k], name) if k in b else v for k, v in a.items()}
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_take_bytes(x, y, name) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a) and type(a) is type(b) and not isinstance(a, type):
        if name == "calibration":
            return a
        return replace(
            a, **{f.name: _take_bytes(getattr(a, f.name), getattr(b, f.name), f.name) for f in dataclasses.fields(a)}
        )  # type: ignore[arg-type]
    return a


def states_point(st: Stats, later_grads_bytes: Sequence[int]) -> Stats:
    """One process's stats at a micro-batch of 0 samples, from its stats ``st`` at another: what does
    not grow with the micro-batch (NOTE [ Bounded measurement ], step 2). With ``st`` it makes the
    line auto-fit scales larger micro-batches on where only one could be profiled.

    Kept, as the fixed bytes they are: every live-bytes level at most the parameters and optimizer
    state (alive through the whole step; the gradients are not alive at its start), the peak after
    the first block's backward at most those and the gradients of the other blocks, or the optimizer
    step's peak less what the step started with beyond them (the batch: the optimizer step holds no
    activation), a block's
    backward base at most the gradients of the blocks after it (``later_grads_bytes``,
    :func:`memfit.fitting.candidates.gradient_bytes`), and the optimizer step's seconds. Everything
    else, every activation, its gradient and the gradients a block's backward makes, is 0. Each fixed
    part is at most the bytes it stands in for, so a line through this point and ``st`` grows at least
    as fast as the step: scaled peaks err high, never low (the measured window confirms the plan).
    """
    fixed = st.params_bytes + st.optimizer_bytes
    after_blocks = fixed + (later_grads_bytes[0] if later_grads_bytes else 0)
    # the optimizer step's peak holds no activation: all of it but what the step started with beyond
    # the model states (the batch, the embeddings' output) is fixed
    opt_step = st.peak_bytes_by_phase.get("optimizer", 0) - max(0, st.start_bytes - fixed)
    opt_s = max(0.0, st.step_s - st.fwd_s - st.bwd_s)  # the optimizer step's: no activation in it

    def option(o: OptionStats, i: int) -> OptionStats:
        return replace(
            o, retained_bytes=0, fwd_peak_bytes=0, bwd_peak_bytes=0, bwd_s=0.0, fwd_s=0.0, rerun_s=0.0,
            bwd_base_bytes=min(o.bwd_base_bytes, later_grads_bytes[i]),
            fwd_only_bytes={k: 0 for k in o.fwd_only_bytes},
        )  # fmt: skip

    def block(b: BlockStats, i: int) -> BlockStats:
        return replace(
            b, fwd_s=0.0, bwd_s=0.0, saved_bytes=0, output_bytes=0, input_bytes=0, fwd_temp_bytes=0, bwd_temp_bytes=0,
            options={m: option(o, i) for m, o in b.options.items()}, freed_inputs={k: 0 for k in b.freed_inputs},
        )  # fmt: skip

    def head(h: HeadOptionStats) -> HeadOptionStats:
        return replace(
            h, head_peak_bytes=0, step_s=opt_s, measured_peak_bytes=min(h.measured_peak_bytes, fixed),
            measured_peak_bytes_by_option={k: min(v, fixed) for k, v in h.measured_peak_bytes_by_option.items()},
            head_peak_bytes_by_option={k: 0 for k in h.head_peak_bytes_by_option},
        )  # fmt: skip

    return replace(
        st,
        batch_size=0,
        blocks=tuple(block(b, i) for i, b in enumerate(st.blocks)),
        peak_bytes=min(st.peak_bytes, fixed),
        step_s=opt_s,
        fwd_s=0.0,
        bwd_s=0.0,
        activations_peak_bytes=0,
        peak_bytes_by_phase={k: min(v, fixed) for k, v in st.peak_bytes_by_phase.items()},
        start_bytes=min(st.start_bytes, fixed),
        pre_peak_bytes=min(st.pre_peak_bytes, fixed),
        post_peak_bytes=min(st.post_peak_bytes, max(after_blocks, opt_step)),
        head_peak_bytes=0,
        head_model_peak_bytes=None if st.head_model_peak_bytes is None else 0,
        head_backward_peak_bytes=None if st.head_backward_peak_bytes is None else 0,
        head_peak_bytes_by_option={k: 0 for k in st.head_peak_bytes_by_option},
        head_model_peak_bytes_by_option={k: 0 for k in st.head_model_peak_bytes_by_option},
        head_backward_peak_bytes_by_option={k: 0 for k in st.head_backward_peak_bytes_by_option},
        step_s_by_option={k: opt_s for k in st.step_s_by_option},
        measured_peak_bytes_by_option={k: min(v, fixed) for k, v in st.measured_peak_bytes_by_option.items()},
        head_options={k: head(h) for k, h in st.head_options.items()},
    )


def bounded_profile(
    workload: Workload,
    step: StepSpec,
    budget_bytes: int,
    predict: Callable[[int], int | None] | None,
    *,
    run: Callable[[StepSpec], Stats],
    progress: Callable[[str], None] | None,
) -> Stats:
    """The profile at the step's batch, under the guard, where its largest step is predicted (by
    ``predict``; None, or a prediction of None: not predicted) within the memory free here and the guard lets it finish; else
    the line through profiles at the two largest halvings of the batch that are, at the batch (NOTE
    [ Bounded measurement ] in :mod:`memfit.fitting.bounded`). Without a prediction the guard allows
    what is free here: a profile that would take more is stopped, not killed by the kernel.

    Raises:
        BudgetInfeasibleError: not even two smaller batches are predicted within the free memory and
            finish under the guard.
    """
    batch = step.batch_size or workload.default_batch_size
    dev = step.device or next((p.device for p in workload.model.parameters()), "cpu")
    free = available_bytes(dev)

    def attempt(b: int) -> Stats | None:
        peak = predict(b) if predict is not None else None
        if peak is not None and free is not None and peak > free:
            return None
        allowance = max(budget_bytes, peak if peak is not None else free or 0)
        try:
            with guarded(allowance, f"the profile at batch {b}", device=dev):
                return run(replace(step, batch_size=b))
        except MeasurementGuardError as err:
            if progress:
                progress(str(err))
            return None

    whole = attempt(batch)
    if whole is not None:
        return whole
    made: list[Stats] = []
    b = batch
    while b > 1 and len(made) < 2:
        b //= 2
        if (st := attempt(b)) is not None:
            made.append(st)
    if len(made) < 2:
        raise BudgetInfeasibleError(
            f"memfit.plan: the profile at batch {batch} would need more than the "
            f"{format_bytes(free) if free is not None else 'memory'} free here (predicted, or stopped by the guard), "
            "and no two smaller batches fit it. Lower --batch-size (or --seq-len), or plan with --estimate."
        )
    hi, lo = made
    if progress:
        progress(f"batch {batch}: its profile does not fit; scaled from batches {lo.batch_size} and {hi.batch_size}")
    st = interpolate_stats(lo, hi, batch)
    probe = cast_batch(workload.make_batch(batch), dtype=step.dtype, device=dev)
    return replace(st, fingerprint={**st.fingerprint, "batch": batch_signature(probe)})
