"""fit_seq_len: the longest sequence that trains within a budget, at a given micro-batch, with its plan.

size: the search and how it makes each length's stats within the budget, read together.

NOTE [ Longest sequence ]
Each length needs its own stats (a profile here, or a fake-tensor estimate for another device), and
at long sequences one profile is the expensive part, in time and in memory: a profile runs the
keep-all step (every activation and the model's own head's logits alive), which at the lengths a
chunked head, tiling and recomputation reach needs many times the budget. The cause of a search
killed at 24 GB within 400 and 512 MiB (a 4-layer, 256-wide Llama with a 32000-token vocabulary,
AdamW) was one oversized measured step, not memory held across lengths: the search went 256, 512,
4,096, 32,768 tokens, profiling each, and a profile's keep-all step grows 384 KiB per token (the
logits, their softmax and their gradient): 1.3 GiB of live tensors at 4,096 tokens, 8.6 GiB at
32,768, plus the profile's own copies and the allocator's slack. Between lengths the search holds
only stats (a tiny Llama's search: resident memory 534, 520, 620 MiB after its three profiles, the
allocator keeping freed pages, and 620 MiB over the seven lengths after them). So the search
profiles few, short lengths and predicts the rest from what scales (NOTE [ Bounded measurement ]
in :mod:`memfit.fitting.bounded`):

0. Stats at a length: profiled where the profile's largest step is predicted within the budget
   (and the host's available memory; the device's on CUDA), else scaled from the profiles made:
   the line through the two longest, profiled at the longest length predicted within the budget
   and one within 40 % below it, and at 256 tokens or more where the budget allows (the chunked
   head's peak holds two chunks of up to 128 rows: below 256 rows it still grows with the rows, 128
   KiB per row for a 32000-token vocabulary, so a line from a shorter profile over-predicted every
   longer length: 560 tokens where 15,000 fit).
   Where the caller gives ``predict_profile_peak`` (the CLI: the fake-tensor estimate of the
   keep-all step, :mod:`memfit.estimation`, which ``fitting`` does not import), every profile is
   predicted by it before it runs, and not run (a shorter one is) while it is over the limit: the
   first profile (the workload's own length) has no profile to be predicted from, and the line
   through the model's states and one profile reads low where that profile's largest step is the
   optimizer step's, which holds no tokens (256 tokens: 376.54 MiB; the line said 439.05 MiB at
   512 tokens, where the keep-all backward measured and the estimate said 476.83 MiB). Without it
   the guard bounds the profiles, and halves the length when it stops one. Every real step runs
   under the guard.
1. Bracket (geometric): the workload's own length (halving while it does not fit), then twice it,
   and from then on predict before trying.
2. Predict: at each length tried the least budget any plan needs, ``need(T)`` (the solver's
   minimum, margin included; for a fixed policy its plan's peak), is one number. Activations,
   their gradients, a block's working set and the chunked head grow with the tokens, so
   ``need(T)`` is affine in ``T`` with fused attention; with quadratic attention (the math path,
   eager attention, an explicit mask: NOTE [ Attention memory at long sequences ] in
   :mod:`memfit.capture.attention`) it has a ``T^2`` term. The next length to try is where the
   line through the two lengths around the answer (a parabola through three when the attention
   is quadratic) meets the budget, rounded down to the multiple.
3. Bisect: a prediction that falls outside the bracket, or next to one end, is replaced by the
   middle of the bracket. The search stops when the bracket is within ``tolerance`` (or one
   multiple) or after ``max_tries`` lengths.
4. Confirm, then verify. The line through two short profiles is exact for what is affine in the
   tokens, but a working set whose peak is the larger of two events is not where the events cross
   between or past the profiles: a block's backward in ``recompute:tiles-4`` (the 256-wide Llama
   with a 32000-token vocabulary, AdamW) grows 13,326 B per token between 307 and 512 tokens (its
   peak at an event with an 8.6 MiB constant part) and 16,664 B per token from 512 to 2,048 (its
   peak at another event: 15.87, 24.40, 41.47 MB at 512, 1,024, 2,048 tokens). Four such blocks,
   scaled on the line through 307 and 512 tokens, read the chosen plan's window 4 % low at 8,192
   tokens and 7.6 % low at 12,491 within 512 MiB (measured 539.86 MiB against 501.72 MiB: the
   missing 3.3 KB per token, extrapolated; ``keep:tiles-4`` bends the same way, 4,086 then 7,424 B
   per token, while ``keep`` and ``recompute`` keep one slope from 307 to 2,048 tokens). A measured
   window costs minutes at these lengths, so the first one measured must fit: before the longest
   length that fits is fitted, where its stats were scaled and the
   caller gives ``estimate_bytes`` (the CLI: fake-tensor steps of the profile's set-ups on this
   machine's kernels, whose bytes are a profile's: the same ops' outputs, tracked the same way;
   512 tokens: 476.83 MiB estimated and measured), every byte count of its stats is taken from
   those steps at its own length, the seconds staying the line's. A need over the budget on them
   moves the bracket below it, to where the line corrected by that error meets the budget (as
   below), and that length is confirmed the same way (at most :attr:`_Search.max_confirms`).
   Then the length is fitted for real (:func:`memfit.fitting.autofit` on its stats, which runs one
   measured window of the chosen plan, predicted within the budget, under the guard). A window
   over the budget, or stopped by the guard, makes that length the upper end and the search goes
   on below it: the next length is where the line through the longest length still predicted to
   fit and the measured point meets the budget, the error taken to grow from nothing at the
   longest profile to the measured one at that length (a measured or confirmed length counts its
   own need). Without it the search fell back to the longest length predicted to fit below, 4,096
   tokens within 512 MiB where 5,823 had fit within 400 MiB.

Only ``need(T)`` and scaled stats are extrapolated, never a plan: every plan returned comes from
stats of its own length (measured, scaled to it, or estimated for the device), and the returned
plan's window is measured. With quadratic attention the scaled stats are the line through two
profiles, which under-predicts the ``T^2`` term: the fake-tensor step's bytes at the length fitted
count it (step 4), and the measured window, under the guard, catches what is left.

Positions: a model with learned positions (GPT-2's ``wpe``, the demo's) takes no longer rows than
its table; rotary positions compute at any length, but quality past the trained length needs rope
scaling. So the search stops at the position limit unless the config scales rope (``llama3``,
``yarn``, ...), where it goes on and warns past the limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memfit.apply.head import MIN_CHUNK_ROWS
from memfit.capture.attention import AttentionReport, inspect_attention
from memfit.capture.chain import discover_chain
from memfit.capture.stats import Stats
from memfit.capture.step import StepSpec
from memfit.errors import BudgetInfeasibleError, MemfitError, SpecError
from memfit.fitting.bounded import (
    MeasurementGuardError,
    available_bytes,
    guarded,
    longest_within,
    predict_peak_bytes,
    profile_peak_bytes,
    scaled_stats,
    states_bytes,
    with_bytes_of,
)
from memfit.fitting.budget import check_policy_stats, policy_options
from memfit.fitting.candidates import accumulation_costs, gradient_bytes
from memfit.fitting.result import FitResult
from memfit.fitting.search import WindowOverBudgetError, autofit
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import Parallel, rank_param_table, rank_stats
from memfit.plan.policies import Policy, parse_policy, policy_plan
from memfit.plan.solve import min_budget
from memfit.plan.window import window_costs
from memfit.profiling.blocks import profile
from memfit.units import format_bytes
from memfit.workload import PositionLimit, Workload, with_seq_len

__all__ = ["SeqLenFit", "SeqLenTry", "fit_seq_len"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SeqLenTry:
    """One length the search tried.

    Attributes:
        seq_len: tokens per row.
        need_bytes: the least budget any plan needs at this length (margin included); for a fixed
            policy, its plan's peak with the margin: the predicted peak of the best plan.
        fits: ``need_bytes`` within the budget.
        predicted_seq_len: where the extrapolation of ``need`` put the longest length before this
            try; None for the bracketing tries.
        seconds: wall time of its stats (profile, scaling or estimate).
        measured_peak_bytes: the measured window's peak, for the verified length.
        stats: where its stats came from: ``"profiled"`` (measured at this length), ``"scaled"``
            (from the profiles at ``scaled_from``: its profile was predicted over the measurement
            limit, NOTE [ Bounded measurement ] in :mod:`memfit.fitting.bounded`) or ``"estimated"``.
        predicted_profile_peak_bytes: the largest step of a profile at this length, predicted
            before deciding to profile it (None for the first profile: nothing to predict from).
        profile_peak_bytes: the largest step its profile measured (profiled lengths).
        scaled_from: the profiled lengths its stats were scaled from.
        guard: what the guard stopped at this length (a measurement past the budget plus the margin).
        scaled_need_bytes: for scaled stats whose bytes were then taken from a fake-tensor step
            (NOTE [ Longest sequence ], step 4): the need the line alone predicted; ``need_bytes`` is
            the one from the step's bytes.
    """

    seq_len: int
    need_bytes: int
    fits: bool
    predicted_seq_len: int | None = None
    seconds: float = 0.0
    measured_peak_bytes: int | None = None
    stats: str = "profiled"
    predicted_profile_peak_bytes: int | None = None
    profile_peak_bytes: int | None = None
    scaled_from: tuple[int, ...] = ()
    guard: str | None = None
    scaled_need_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["scaled_from"] = list(self.scaled_from)
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class SeqLenFit:
    """The longest sequence that trains within the budget (NOTE [ Longest sequence ]).

    Attributes:
        seq_len: the length found (a multiple of ``multiple``).
        fit: the auto-fit at that length (plan, micro-batch, accumulation, measured window).
        tries: the lengths measured, in order.
        limited_by: ``"budget"`` (one multiple longer does not fit, or the bracket closed within
            the tolerance), ``"positions"`` (the model's position limit) or ``"max_seq_len"``.
        upper_seq_len: the shortest length found not to fit (None when the search never reached one).
        multiple: the length is a multiple of this.
        positions: the model's position limit, if known.
        attention: the attention kernels at the workload's own length (measured runs only).
        warnings: e.g. a length past the trained positions of a rope-scaled model.
        estimated: the stats were estimated for another device (nothing ran).
    """

    seq_len: int
    fit: FitResult
    tries: tuple[SeqLenTry, ...]
    limited_by: str
    upper_seq_len: int | None
    multiple: int
    positions: PositionLimit | None = None
    attention: AttentionReport | None = None
    warnings: tuple[str, ...] = ()
    estimated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The fit's JSON with ``seq_len`` and the search (``seq_len_search``) added."""
        return self.fit.to_dict() | {
            "seq_len": self.seq_len,
            "seq_len_search": {
                "limited_by": self.limited_by,
                "upper_seq_len": self.upper_seq_len,
                "multiple": self.multiple,
                "tries": [t.to_dict() for t in self.tries],
                "positions": None if self.positions is None else self.positions.to_dict(),
                "warnings": list(self.warnings),
                "extrapolated": "need(T), the least budget a plan needs at T: affine in T "
                + ("plus T^2 (quadratic attention)" if self.quadratic else "(linear attention)")
                + "; every plan comes from stats of its own length",
            },
            "attention": None if self.attention is None else self.attention.to_dict(),
        }

    @property
    def quadratic(self) -> bool:
        return self.attention is not None and self.attention.memory == "quadratic"


def fit_seq_len(
    workload: Workload,
    budget_bytes: int,
    *,
    micro_batch: int = 1,
    global_batch: int | None = None,
    step: StepSpec | None = None,
    margin: float = 0.02,
    multiple: int = 1,
    max_seq_len: int | None = None,
    tolerance: float = 0.02,
    max_tries: int = 8,
    measure: bool = True,
    options: tuple[str, ...] | None = None,
    heads: bool = True,
    activations: bool = True,
    policy: Policy | None = None,
    tiling: bool = True,
    tile_modules: tuple[str, ...] | None = None,
    estimate: Callable[[Workload], Callable[[int], Stats]] | None = None,
    progress: Callable[[str], None] | None = None,
    predict_profile_peak: Callable[[Workload, int], int] | None = None,
    parallel: Parallel | None = None,
    estimate_bytes: Callable[..., Stats] | None = None,
) -> SeqLenFit:
    """Find the longest sequence that trains within ``budget_bytes`` at ``micro_batch`` (NOTE [ Longest sequence ]).

    Measuring never changes the model (profiles and the measured window leave it as it was).

    Args:
        workload: a workload that makes batches of any length (``make_batch_at``: the ``hf:`` and
            ``demo`` workloads, or your own :class:`~memfit.workload.Workload`).
        budget_bytes: peak live bytes allowed for a whole training step.
        micro_batch: rows per micro-step.
        global_batch: rows per optimizer step (default ``micro_batch``; more adds accumulation,
            whose later micro-steps hold the gradients).
        step: optimizer, seed and timed repeats (no batch size, dtype or device: as :func:`autofit`).
        margin: the planner's safety margin on predicted peaks.
        multiple: the length is rounded down to a multiple of this (``--seq-multiple``).
        max_seq_len: search no further than this.
        tolerance: stop when the bracket is within this fraction of its lower end.
        max_tries: lengths to measure at most (the verification not counted).
        measure: verify the final length with a measured window (with ``estimate``: never).
        options, heads, activations: as :func:`autofit` (the planner's options at each length).
        policy: keep this checkpoint policy's plan at every length (``--policy``).
        tiling, tile_modules: consider sequence-tiled blocks and host-held inputs (as
            :func:`autofit`; ``tiling=False`` is ``--no-tiling``).
        estimate: ``workload -> (batch_size -> Stats)``, estimated stats for another device
            (:func:`memfit.estimation.stats_fn` bound to the device) instead of profiling.
        progress: called with a short text as the search advances.
        predict_profile_peak: ``(workload at a length, micro-batch) -> bytes``, the largest step of a
            profile predicted without running it (e.g. a fake-tensor estimate of the keep-all step):
            each profile runs only where it predicts it within the budget (NOTE [ Longest sequence ]).
        parallel: search for rank 0 of a DDP or FSDP2 job: ``budget_bytes`` is per rank and
            ``global_batch`` the rank's share; each length's stats (profiled, scaled or estimated: one
            process's) are the rank's (:func:`memfit.plan.parallel.rank_stats`) and a window of several
            micro-steps is the rank's (:func:`memfit.plan.window.window_costs`), as :func:`autofit` fits
            a rank. The verified length is predicted, not measured (one process measures no rank).
        estimate_bytes: ``(workload at a length, step, **the profile's options) -> Stats`` of fake-tensor
            steps on this machine's kernels, made as the profile is (the CLI:
            :func:`memfit.estimation.estimate_stats` for the host device); before a length whose stats were scaled is fitted, their bytes are taken
            from it (NOTE [ Longest sequence ], step 4), so the measured window is predicted from the
            bytes of its own length.

    Returns:
        The :class:`SeqLenFit`.

    Raises:
        SpecError: the workload has one length only, bad arguments, or a length beyond the
            learned positions was asked for.
        BudgetInfeasibleError: not even ``multiple`` tokens fit.

    Example:
        >>> from memfit.models.registry import load_workload
        >>> wl = load_workload("demo?n_layer=2&n_embd=32&seq_len=256")
        >>> res = fit_seq_len(wl, 40 * 2**20, multiple=16, measure=False)  # doctest: +SKIP
    """
    step = step or StepSpec()
    global_batch = _check_args(step, micro_batch, global_batch, multiple, max_tries, tolerance, options, policy)
    policy = parse_policy(policy) if policy is not None else None
    say = progress or (lambda _s: None)
    with_seq_len(workload, multiple)  # refuses a workload of one length before any work
    cap, cap_kind = _cap(workload.positions, max_seq_len)
    search = _Search(
        workload=workload, budget_bytes=budget_bytes, micro_batch=micro_batch, global_batch=global_batch,
        step=step, margin=margin, options=options, heads=heads, activations=activations, policy=policy,
        tiling=tiling and policy is None, tile_modules=tile_modules, estimate=estimate, say=say,
        multiple=multiple, predict_profile_peak=predict_profile_peak, parallel=parallel,
        estimate_bytes=estimate_bytes,
    )  # fmt: skip
    attention = _attention(search, seed=step.seed)
    # 1. bracket, 2. predict and 3. bisect (NOTE [ Longest sequence ])
    start = _round(min(int(workload.info.get("seq_len") or 256), cap or math.inf), multiple)
    lo, hi = search.bracket(start, multiple, cap)
    quadratic = attention is not None and attention.memory == "quadratic"
    lo, hi = search.narrow(lo, hi, multiple, cap, tolerance, max_tries, quadratic=quadratic)
    # 4. verify
    fit, lo, hi = search.verify(lo, hi, multiple, measure=measure and estimate is None and parallel is None)
    return SeqLenFit(
        seq_len=lo, fit=fit, tries=tuple(search.tries), limited_by="budget" if hi is not None else (cap_kind or "budget"),
        upper_seq_len=hi, multiple=multiple, positions=workload.positions, attention=attention,
        warnings=_position_warnings(workload.positions, lo), estimated=estimate is not None,
    )  # fmt: skip


def _attention(search: _Search, *, seed: int) -> AttentionReport | None:
    """The attention kernels at the workload's own length (one guarded forward); None when the
    stats are estimated (nothing runs)."""
    if search.estimate is not None:
        search.say("estimating")
        return None
    search.say("attention: one forward at the workload's own length")
    with guarded(search.budget_bytes, "the attention check's forward", device=search.device):
        return inspect_attention(search.workload, batch_size=search.micro_batch, seed=seed)


def _check_args(
    step: StepSpec,
    micro_batch: int,
    global_batch: int | None,
    multiple: int,
    max_tries: int,
    tolerance: float,
    options: tuple[str, ...] | None,
    policy: Policy | None,
) -> int:
    """Refuse arguments the search cannot take, before any work; the global batch (default the micro-batch)."""
    if step.batch_size is not None or step.dtype is not None or step.device is not None:
        raise SpecError(
            "memfit.fit: the sequence search runs the model as it is at micro_batch=; give a StepSpec without "
            "batch_size, dtype and device."
        )
    if micro_batch < 1 or multiple < 1 or max_tries < 2 or not 0 < tolerance < 1:
        raise SpecError(
            f"memfit.fit: micro_batch {micro_batch} and multiple {multiple} must be at least 1, max_tries {max_tries} "
            f"at least 2 and tolerance {tolerance} between 0 and 1."
        )
    global_batch = global_batch or micro_batch
    if global_batch < micro_batch:
        raise SpecError(f"memfit.fit: global batch {global_batch} is below the micro-batch {micro_batch}.")
    if policy is not None:
        parse_policy(policy)
        if options is not None:
            raise SpecError("memfit.fit: pass options= or policy=, not both (--options all or --policy).")
    return global_batch


def _position_warnings(positions: PositionLimit | None, seq_len: int) -> tuple[str, ...]:
    """A length past a rope-scaled model's trained positions (the cap stops the others)."""
    if positions is None or seq_len <= positions.max_positions:
        return ()
    return (
        f"{seq_len} tokens is past the model's {positions.max_positions} trained positions; its rope scaling "
        f"({positions.rope_scaling}) extends them, so check quality at this length.",
    )


def _round(n: float, multiple: int) -> int:
    return max(multiple, int(n) // multiple * multiple)


def _cap(positions: PositionLimit | None, max_seq_len: int | None) -> tuple[int | None, str | None]:
    """The longest length the search may try, and what sets it."""
    caps: list[tuple[int, str]] = []
    if max_seq_len is not None:
        caps.append((max_seq_len, "max_seq_len"))
    if positions is not None and (positions.kind == "learned" or positions.rope_scaling is None):
        caps.append((positions.max_positions, "positions"))
    if not caps:
        return None, None
    return min(caps)


@dataclass(kw_only=True)
class _Search:
    workload: Workload
    budget_bytes: int
    micro_batch: int
    global_batch: int
    step: StepSpec
    margin: float
    options: tuple[str, ...] | None
    heads: bool
    activations: bool
    policy: Policy | None
    tiling: bool
    tile_modules: tuple[str, ...] | None
    estimate: Callable[[Workload], Callable[[int], Stats]] | None
    say: Callable[[str], None]
    tries: list[SeqLenTry] = field(default_factory=list)
    stats: dict[tuple[int, int], Stats] = field(default_factory=dict)
    multiple: int = 1
    predict_profile_peak: Callable[[Workload, int], int] | None = None
    parallel: Parallel | None = None
    estimate_bytes: Callable[..., Stats] | None = None
    max_profiles: int = 3  # the first at the workload's length, then at most two to scale from
    max_confirms: int = 3  # lengths whose scaled bytes a fake-tensor step replaces before fitting

    def __post_init__(self) -> None:
        model = self.workload.model
        self.grads_bytes, self.later = gradient_bytes(model, self.workload.blocks)
        self.fixed = None
        if self.policy is not None:
            self.fixed = policy_plan(model, self.policy, chain=discover_chain(model, self.workload.blocks))
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        avail = available_bytes(self.device)
        # NOTE [ Bounded measurement ]: a profile runs only where its largest step is predicted within this
        self.limit_bytes = self.budget_bytes if avail is None else min(self.budget_bytes, avail)
        self.profiles: dict[int, dict[int, Stats]] = {}  # micro-batch -> length -> measured stats
        self.too_long: dict[int, int] = {}  # micro-batch -> shortest length whose profile the guard stopped
        self.notes: dict[int, dict[str, Any]] = {}  # length -> how its stats were made, for its try
        self.confirmed: set[int] = set()  # lengths whose scaled bytes a fake-tensor step replaced

    # --- one length ------------------------------------------------------------------------------

    def stats_at(self, seq_len: int, batch_size: int) -> Stats:
        """Stats at one length: profiled where the profile is predicted within the measurement
        limit, else scaled from the profiles made (NOTE [ Bounded measurement ])."""
        key = (seq_len, batch_size)
        if key not in self.stats:
            if self.estimate is not None:
                st = self.estimate(with_seq_len(self.workload, seq_len))(batch_size)
                self.notes[seq_len] = {"stats": "estimated"}
            else:
                profs = self.profiles.setdefault(batch_size, {})
                pred = self._predicted_profile_peak(seq_len, batch_size)
                note: dict[str, Any] = {"predicted_profile_peak_bytes": pred}
                if (pred is None and not profs) or (pred is not None and pred <= self.limit_bytes):
                    self._profile(seq_len, batch_size, note)
                if seq_len in profs:
                    st = profs[seq_len]
                    note |= {"stats": "profiled", "profile_peak_bytes": profile_peak_bytes(st)}
                else:
                    self._profiles_for_scaling(seq_len, batch_size)
                    st = scaled_stats(profs, seq_len, batch_size=batch_size)
                    note |= {"stats": "scaled", "scaled_from": tuple(sorted(profs)[-2:])}
                self.notes[seq_len] = note
            if self.policy is not None:
                check_policy_stats(st, self.policy, subsystem="memfit.fit")
            self.stats[key] = st
        return self.stats[key]

    def _predicted_profile_peak(self, seq_len: int, batch_size: int) -> int | None:
        profs = self.profiles.get(batch_size, {})
        pts = {t: profile_peak_bytes(st) for t, st in profs.items()}
        floor = states_bytes(next(iter(profs.values()))) if profs else 0
        return predict_peak_bytes(pts, seq_len, floor_bytes=floor)

    def _profile(self, seq_len: int, batch_size: int, note: dict[str, Any] | None = None) -> None:
        """One guarded profile at ``seq_len``; the guard stopping it marks the length too long to profile."""
        if seq_len >= self.too_long.get(batch_size, math.inf):
            return
        wl = with_seq_len(self.workload, seq_len)
        if self.predict_profile_peak is not None:
            # predicted by the caller's estimate (NOTE [ Longest sequence ], step 0): the first has no
            # profile to be predicted from, and the line through the profiles reads low where their
            # largest step is the optimizer step's (no tokens) and the keep-all backward's past them
            est = self.predict_profile_peak(wl, batch_size)
            if note is not None:
                note["predicted_profile_peak_bytes"] = est
            if est > self.limit_bytes:
                self.too_long[batch_size] = min(seq_len, self.too_long.get(batch_size, seq_len))
                self.say(
                    f"seq_len {seq_len}: a profile is estimated at {format_bytes(est)}, over "
                    f"{format_bytes(self.limit_bytes)}: profiling shorter"
                )
                return
        kw = self._profile_options()
        try:
            with guarded(self.budget_bytes, f"the profile at {seq_len} tokens", device=self.device):
                st = profile(wl, step=self._step(batch_size), **kw)
        except MeasurementGuardError as err:
            self.too_long[batch_size] = min(seq_len, self.too_long.get(batch_size, seq_len))
            self.say(f"seq_len {seq_len}: {err}")
            if note is not None:
                note["guard"] = str(err)
            return
        self.profiles.setdefault(batch_size, {})[seq_len] = st

    def _profiles_for_scaling(self, seq_len: int, batch_size: int) -> None:
        """Profiles at two lengths at least, as long as predicted within the limit (up to ``seq_len``)."""
        profs = self.profiles.setdefault(batch_size, {})
        for _ in range(2 * self.max_profiles):
            t = self._next_profile_length(seq_len, batch_size)
            if t is None:
                break
            self.say(f"seq_len {t}: profiling to scale from (predicted within {format_bytes(self.limit_bytes)})")
            self._profile(t, batch_size)
        if len(profs) < 2:
            raise BudgetInfeasibleError(
                f"memfit.fit: no two lengths could be profiled within {format_bytes(self.limit_bytes)} at micro-batch "
                f"{batch_size} (profiled: {sorted(profs) or 'none'}). Raise the budget or lower the micro-batch.",
                min_budget_bytes=None,
            )

    def _next_profile_length(self, seq_len: int, batch_size: int) -> int | None:
        """The longest length predicted within the limit, when well past the profiles made (their
        line then extrapolates less); else a second, shorter one; None when there is nothing to add."""
        profs = self.profiles[batch_size]
        cap = min(seq_len, self.too_long.get(batch_size, math.inf) - self.multiple)
        if not profs:  # the guard stopped the first profile: halve
            top = min(seq_len, self.too_long.get(batch_size, seq_len))
            t = _round(top // 2, self.multiple)
            return t if t < top else None
        pts = {x: profile_peak_bytes(st) for x, st in profs.items()}
        reach = longest_within(pts, self.limit_bytes, floor_bytes=states_bytes(next(iter(profs.values()))))
        t = _round(min(reach or 0.0, cap), self.multiple)
        longest = max(profs)
        if t >= 1.25 * longest and t not in profs and len(profs) < self.max_profiles:
            return t
        # The line's other point within 40 % of the longest: a short profile can sit where a piece
        # does not scale yet (the chunked head's chunk grows with the rows up to 128 rows).
        second = sorted(profs)[-2] if len(profs) >= 2 else 0
        low = max(0.6 * longest, 2 * MIN_CHUNK_ROWS)  # the head's peak holds two chunks of 128 rows
        if second < low and (len(profs) < 2 or len(profs) < self.max_profiles):
            t = -(-int(low) // self.multiple) * self.multiple  # rounded up
            if not second < t < longest:
                t = _round(0.6 * longest, self.multiple)
            return t if second < t < longest else None
        return None

    def _profile_options(self) -> dict[str, Any]:
        """The options a profile here calibrates (and a fake-tensor step of it estimates)."""
        if self.policy is not None:
            return {"options": policy_options(self.policy), "heads": False, "activations": False}
        return {
            "options": self.options or BASE_OPTIONS,
            "heads": self.heads,
            "activations": self.activations,
            "tiling": self.tiling,
            "tile_modules": self.tile_modules,
            "host_inputs": self.tiling,
        }

    def _step(self, batch_size: int) -> StepSpec:
        return replace(self.step, batch_size=batch_size, repeats=self.step.repeats_or(2))

    def need(self, seq_len: int, predicted: int | None = None) -> SeqLenTry:
        """Stats at one length (profiled, scaled or estimated): the least budget a plan needs there."""
        t0 = time.perf_counter()
        need = self.need_bytes(seq_len)
        tr = SeqLenTry(
            seq_len=seq_len,
            need_bytes=need,
            fits=need <= self.budget_bytes,
            predicted_seq_len=predicted,
            seconds=time.perf_counter() - t0,
            **self.notes.get(seq_len, {}),
        )
        self.tries.append(tr)
        self.say(_progress_line(tr, self.budget_bytes))
        return tr

    def need_bytes(self, seq_len: int) -> int:
        """The least budget a plan needs at ``seq_len`` (for a fixed policy its plan's peak), margin
        included, on the stats there (a rank's, a window's with accumulation)."""
        st = self.stats_at(seq_len, self.micro_batch)
        if self.parallel is not None:  # one rank's (NOTE [ Per-rank accounting ] in memfit.plan.parallel)
            st = rank_stats(st, rank_param_table(self.workload.model, st, self.parallel), self.parallel)
        costs = ChainCosts.from_stats(st, margin=self.margin)
        k = -(-self.global_batch // self.micro_batch)
        if k > 1 and self.parallel is not None:  # a rank's window (memfit.plan.window)
            costs = window_costs(st, k, costs)
        elif k > 1:  # later micro-steps start with the gradients alive
            costs = accumulation_costs(costs, grads_bytes=self.grads_bytes, later_grads_bytes=self.later)
        if self.fixed is not None:
            return int(predict(costs, self.fixed).peak_with_margin_bytes)
        return int(min_budget(costs)[0])

    # --- the search ------------------------------------------------------------------------------

    def bracket(self, start: int, multiple: int, cap: int | None) -> tuple[int, int | None]:
        """A length that fits and, where reached, one that does not (geometric steps)."""
        t = start
        tr = self.need(t)
        while not tr.fits:
            if t <= multiple:
                raise BudgetInfeasibleError(
                    f"memfit.fit: not even {t} tokens per row fit {format_bytes(self.budget_bytes)} at micro-batch "
                    f"{self.micro_batch} (a plan needs {format_bytes(tr.need_bytes)}). Raise the budget or lower the micro-batch.",
                    min_budget_bytes=tr.need_bytes,
                )
            t = _round(t // 2, multiple)
            tr = self.need(t)
        lo = t
        hi = next((x.seq_len for x in self.tries if not x.fits), None)
        if hi is None and (cap is None or lo < cap):
            t = min(2 * lo, cap) if cap is not None else 2 * lo
            t = _round(t, multiple)
            if t > lo:
                tr = self.need(t)
                lo, hi = (t, None) if tr.fits else (lo, t)
        return lo, hi

    def narrow(
        self,
        lo: int,
        hi: int | None,
        multiple: int,
        cap: int | None,
        tolerance: float,
        max_tries: int,
        *,
        quadratic: bool,
    ) -> tuple[int, int | None]:
        """Predict, measure, bisect until the bracket closes (NOTE [ Longest sequence ])."""
        while len(self.tries) < max_tries:
            if hi is not None and hi - lo <= max(multiple, tolerance * lo):
                break
            if hi is None and cap is not None and lo >= cap:
                break
            pred = self.predict(quadratic=quadratic)
            if pred is None:  # need does not grow: nothing to extrapolate
                pred = 2 * lo
            upper = hi if hi is not None else (cap + multiple if cap is not None else None)
            t = _round(pred, multiple)
            if hi is None:
                t = min(max(t, lo + multiple), 8 * lo)  # geometric at most x8 past a measured length
                if cap is not None:
                    t = min(t, cap)
            if (
                t <= lo
                or (upper is not None and t >= upper)
                or (hi is not None and (t - lo < 0.1 * (hi - lo) or hi - t < 0.1 * (hi - lo)))
            ):
                # outside the bracket or hugging one end: bisect (a hugging prediction of a
                # slightly curved need would creep towards the answer one multiple at a time)
                t = _round((lo + hi) / 2, multiple) if hi is not None else t
            if t <= lo or (hi is not None and t >= hi):
                break
            tr = self.need(t, predicted=_round(pred, multiple))
            lo, hi = (t, hi) if tr.fits else (lo, t)
        return lo, hi

    def predict(self, *, quadratic: bool) -> float | None:
        """Where ``need(T)`` meets the budget: the line through the two measured lengths nearest
        the answer (a parabola through three with quadratic attention)."""
        pts = sorted({(t.seq_len, t.need_bytes) for t in self.tries})
        if len(pts) < 2:
            return None
        fits = [p for p in pts if p[1] <= self.budget_bytes]
        over = [p for p in pts if p[1] > self.budget_bytes]
        near = (fits[-2:] + over[:1])[-3:] if over else fits[-3:]
        if quadratic and len(near) >= 3:
            (x0, y0), (x1, y1), (x2, y2) = near[-3:]
            # y = a x^2 + b x + c through the three points
            d = (x0 - x1) * (x0 - x2) * (x1 - x2)
            a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / d
            b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / d
            c = y0 - a * x0 * x0 - b * x0
            if a > 0:
                disc = b * b - 4 * a * (c - self.budget_bytes)
                if disc >= 0:
                    return (-b + math.sqrt(disc)) / (2 * a)
        (x0, y0), (x1, y1) = near[-2:]
        slope = (y1 - y0) / (x1 - x0)
        if slope <= 0:
            return None
        return x1 + (self.budget_bytes - y1) / slope

    def verify(self, lo: int, hi: int | None, multiple: int, *, measure: bool) -> tuple[FitResult, int, int | None]:
        """Fit the longest length that fits for real; a measured window over the budget moves the
        bracket below it."""
        while True:
            lo, hi = self.confirm(lo, hi, multiple)
            self.say(f"seq_len {lo}: fitting {'and measuring one window' if measure else ''}".rstrip())
            wl = with_seq_len(self.workload, lo)
            T = lo
            try:
                with guarded(self.budget_bytes, f"the measured window at {lo} tokens", device=self.device):
                    fit = autofit(
                        wl,
                        self.budget_bytes,
                        self.global_batch,
                        step=replace(self.step, repeats=self.step.repeats_or(2)),
                        margin=self.margin,
                        measure=measure,
                        max_tries=1,
                        max_micro_batch=self.micro_batch,
                        options=None if self.policy is not None else self.options,
                        heads=self.heads,
                        activations=self.activations,
                        stats_fn=lambda b, T=T: self.stats_at(T, b),
                        policy=self.policy,
                        parallel=self.parallel,
                        **(
                            {}
                            if self.policy is not None
                            else {"tiling": self.tiling, "tile_modules": self.tile_modules}
                        ),
                    )
            except MemfitError as err:
                if isinstance(err, BudgetInfeasibleError) or not measure:
                    raise
                self.say(f"seq_len {lo}: the measured window is over the budget ({err}); searching below")
                measured = err.measured_peak_bytes if isinstance(err, WindowOverBudgetError) else None
                hi, lo = lo, self.below(lo, measured, multiple)
                if lo >= hi:
                    raise
                continue
            if fit.measured_peak_bytes is not None:
                i = max(i for i, t in enumerate(self.tries) if t.seq_len == lo)
                self.tries[i] = replace(self.tries[i], measured_peak_bytes=fit.measured_peak_bytes)
            return fit, lo, hi

    def confirm(self, lo: int, hi: int | None, multiple: int) -> tuple[int, int | None]:
        """The length to fit, its scaled stats' bytes taken from a fake-tensor step of its own length
        (NOTE [ Longest sequence ], step 4): while the need on them is over the budget, the bracket
        moves below it (as after a measured window over the budget)."""
        for _ in range(self.max_confirms):
            note = self.notes.get(lo, {})
            if self.estimate_bytes is None or note.get("stats") != "scaled" or lo in self.confirmed:
                break
            self.confirmed.add(lo)
            key = (lo, self.micro_batch)
            step = replace(self.step, batch_size=self.micro_batch, repeats=None)
            est = self.estimate_bytes(with_seq_len(self.workload, lo), step, **self._profile_options())
            self.stats[key] = with_bytes_of(self.stats[key], est)
            i = max(i for i, t in enumerate(self.tries) if t.seq_len == lo)
            line = self.tries[i].need_bytes
            need = self.need_bytes(lo)
            self.tries[i] = replace(
                self.tries[i], need_bytes=need, fits=need <= self.budget_bytes, scaled_need_bytes=line
            )
            self.say(
                f"seq_len {lo}: its bytes from a fake-tensor step at this length put the least budget at "
                f"{format_bytes(need)} (the line through the profiles: {format_bytes(line)}; "
                f"{'fits' if need <= self.budget_bytes else 'over'} {format_bytes(self.budget_bytes)})"
            )
            if need <= self.budget_bytes:
                break
            hi, lo = lo, self._below(lo, need, multiple)
            if lo >= hi:
                raise BudgetInfeasibleError(
                    f"memfit.fit: no length fits {format_bytes(self.budget_bytes)} at micro-batch {self.micro_batch} "
                    f"once the bytes of a fake-tensor step at {hi} tokens are counted ({format_bytes(need)}). "
                    "Raise the budget or lower the micro-batch.",
                    min_budget_bytes=need,
                )
        return lo, hi

    def below(self, over: int, measured_peak_bytes: int | None, multiple: int) -> int:
        """The next length to fit after the measured window at ``over`` tokens came out over the
        budget (NOTE [ Longest sequence ], step 4); without a measured peak (the guard stopped the
        window): the longest length predicted to fit."""
        i = max(i for i, t in enumerate(self.tries) if t.seq_len == over)
        self.tries[i] = replace(self.tries[i], measured_peak_bytes=measured_peak_bytes)
        if measured_peak_bytes is None:
            fits = [t.seq_len for t in self.tries if t.fits and t.seq_len < over and t.measured_peak_bytes is None]
            return max(fits) if fits else self._tried(_round(over // 2, multiple))
        return self._below(over, int(measured_peak_bytes * (1.0 + self.margin)), multiple)

    def _below(self, over: int, true_need_bytes: int, multiple: int) -> int:
        """The next length to fit below ``over``, where a plan needs ``true_need_bytes`` (a measured
        peak with the margin, or the need on a fake-tensor step's bytes): every length's need on the
        line corrected by the line's error at ``over`` (growing from nothing at the longest profile to
        that error at ``over``; a measured length's own peak, a confirmed length's own need), the next
        length is where the line through the longest corrected length within the budget and the next
        one above it meets the budget."""
        scale = 1.0 + self.margin
        tr_over = next(t for t in reversed(self.tries) if t.seq_len == over)
        x0 = max((x for p in self.profiles.values() for x in p if x < over), default=0)
        error = max(0.0, true_need_bytes / (tr_over.scaled_need_bytes or tr_over.need_bytes) - 1.0)
        points: dict[int, float] = {over: float(true_need_bytes)}
        for tr in self.tries:
            if tr.seq_len >= over:
                continue
            if tr.measured_peak_bytes is not None:
                points[tr.seq_len] = tr.measured_peak_bytes * scale
            elif tr.scaled_need_bytes is not None or tr.stats != "scaled":  # its own length's bytes
                points.setdefault(tr.seq_len, float(tr.need_bytes))
            elif tr.seq_len not in points:
                points[tr.seq_len] = tr.need_bytes * (1.0 + error * max(0, tr.seq_len - x0) / max(1, over - x0))
        xs = sorted(points)
        within = [x for x in xs if points[x] <= self.budget_bytes]
        if not within:
            return self._tried(_round(over // 2, multiple))
        a = within[-1]
        b = next(x for x in xs if x > a)  # ``over`` at the latest: it is over the budget
        t = _round(a + (self.budget_bytes - points[a]) * (b - a) / (points[b] - points[a]), multiple)
        if t <= a or t >= b:
            return self._tried(a)
        self.say(
            f"seq_len {over}: {format_bytes(true_need_bytes)} needed, {error:.1%} above the line; "
            f"corrected, {t} tokens are predicted within {format_bytes(self.budget_bytes)}"
        )
        return self._tried(t)

    def _tried(self, seq_len: int) -> int:
        """``seq_len``, with a try recorded for it (the search's JSON lists every length it fits)."""
        if all(t.seq_len != seq_len for t in self.tries):
            self.need(seq_len)
        return seq_len


def _progress_line(tr: SeqLenTry, budget_bytes: int) -> str:
    """One line per length tried: how its stats were made and what a plan needs there."""
    how = {
        "profiled": f"profiled (largest step {format_bytes(tr.profile_peak_bytes or 0)}"
        + (
            f", predicted {format_bytes(tr.predicted_profile_peak_bytes)})"
            if tr.predicted_profile_peak_bytes is not None
            else ")"
        ),
        "scaled": f"scaled from the profiles at {', '.join(map(str, tr.scaled_from))} tokens"
        + (
            f" (a profile here: {format_bytes(tr.predicted_profile_peak_bytes)} predicted)"
            if tr.predicted_profile_peak_bytes is not None
            else ""
        ),
        "estimated": "estimated",
    }[tr.stats]
    fits = "fits" if tr.fits else "over"
    return (
        f"seq_len {tr.seq_len}: {how}; a plan needs {format_bytes(tr.need_bytes)} ({fits} {format_bytes(budget_bytes)})"
    )
