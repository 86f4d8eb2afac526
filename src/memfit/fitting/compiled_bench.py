"""The compiled planning mode's measuring parts: candidates, the fraction search, the bench.

:func:`memfit.fitting.compiled.plan_compiled` chooses; this module measures for it.
:class:`CandidateBench` compiles each candidate on its own copy of the model, measures its peak
with the profiler, keeps the copies that fit and times them in interleaved rounds against the
compiler's own candidate; :func:`largest_fitting_fraction` is the bisection over
``activation_memory_budget`` (NOTE [ Fractions from bytes ] in :mod:`memfit.fitting.compiled`);
:func:`choose` picks among the timed candidates.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.apply.compiled import MemoryBudgetBackend, compile_plan
from memfit.capture.compiled import profiled_step_peak_bytes
from memfit.capture.step import make_optimizer, training_step, warm_up
from memfit.plan import Plan
from memfit.plan.details import CompileSettings
from memfit.profiling.side_by_side import paired_ratio
from memfit.workload import Workload, cast_batch


@dataclass(frozen=True, kw_only=True, slots=True)
class CompiledCandidate:
    """One compiled set-up measured by :func:`memfit.fitting.compiled.plan_compiled`.

    Attributes:
        name: e.g. ``"compiler f=0.5"``, ``"memfit@120.00 MiB"``.
        kind: one of :data:`memfit.fitting.compiled.KINDS`.
        plan: the plan applied before compiling (keep-all for ``compiler``).
        activation_memory_budget: the partitioner's fraction (1.0: its default).
        eager_budget_bytes: the budget memfit's plan was solved for (None for ``compiler``).
        peak_bytes: the compiled step's peak, by the profiler (None when it failed to compile).
        compile_s: seconds of the first step, which compiles.
        step_s: median step time (None when not timed: over the budget or failed).
        time_vs_compiler: the median over timed rounds of this candidate's step time over the
            compiler's own candidate's in the same round (None without a fitting compiler candidate).
        digest: a hash of the compiled forward and backward graphs (inductor only; see
            :class:`memfit.apply.compiled.MemoryBudgetBackend`).
        same_as: the candidate measured before that compiles to the same graphs from the same plan
            (the same program: timed once, its time reported for both).
        error: why it failed, if it did.
    """

    name: str
    kind: str
    plan: Plan
    activation_memory_budget: float
    eager_budget_bytes: int | None = None
    peak_bytes: int | None = None
    compile_s: float | None = None
    step_s: float | None = None
    time_vs_compiler: float | None = None
    digest: str | None = None
    same_as: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "activation_memory_budget": self.activation_memory_budget,
            "eager_budget_bytes": self.eager_budget_bytes,
            "recomputed_blocks": len(self.plan.recomputed),
            "peak_bytes": self.peak_bytes,
            "compile_s": self.compile_s,
            "step_s": self.step_s,
            "time_vs_compiler": self.time_vs_compiler,
            "digest": self.digest,
            "same_as": self.same_as,
            "error": self.error,
        }


def largest_fitting_fraction(
    peak_bytes_at: Callable[[float], int | None], budget_bytes: int, *, steps: int, slack: float = 0.0
) -> float | None:
    """The largest fraction whose peak fits, by bisection over measured peaks (NOTE [ Fractions from bytes ]).

    Args:
        peak_bytes_at: measures the peak at a fraction (None: it could not be measured, which
            counts as not fitting). Called once per fraction tried: at most ``2 * steps + 1``
            times (``steps + 1`` when a fraction on the bisection grid fits).
        budget_bytes: the budget.
        steps: bisection steps after 1.0 (grid k / 2**steps), and the most halvings below the
            grid when nothing on it fits.
        slack: when the largest fitting fraction on the grid leaves more than this share of the
            budget unused, bisect on (up to ``steps`` more compiles, a grid k / 2**(2 * steps)) until
            the fitting peak is within it: a higher fraction that fits recomputes less
            (24-layer GPT-2 at 241 MiB: 0.25 measured 212 MiB, 0.375 243 MiB; 0 stops at the grid).

    Returns:
        1.0 when it fits; else the largest fraction measured to fit; None when none did.
    """
    peak = peak_bytes_at(1.0)
    if peak is not None and peak <= budget_bytes:
        return 1.0
    lo, hi, best, best_peak = 0.0, 1.0, None, 0
    for i in range(2 * steps):
        if i >= steps and (slack <= 0.0 or best is None or best_peak >= (1.0 - slack) * budget_bytes):
            break  # the grid's answer, or none on it (the descent below), or the budget used to within slack
        mid = (lo + hi) / 2
        peak = peak_bytes_at(mid)
        if peak is not None and peak <= budget_bytes:
            best, best_peak, lo = mid, peak, mid
        else:
            hi = mid
    f = hi  # when nothing on the grid fitted, hi is its smallest fraction
    for _ in range(steps if best is None else 0):
        f /= 2
        peak = peak_bytes_at(f)
        if peak is not None and peak <= budget_bytes:
            return f
    return best


def choose(timed: list[CompiledCandidate], min_gain: float) -> tuple[CompiledCandidate, str | None]:
    """The fastest candidate, judged round by round against the compiler's own (when one fits);
    the compiler's own unless another is at least ``min_gain`` faster (and a note saying so)."""
    ref = compilers_own(timed)
    if ref is None:
        return min(timed, key=lambda c: (c.step_s or 0.0, c.peak_bytes or 0)), None
    fastest = min(
        timed, key=lambda c: (c.time_vs_compiler if c.time_vs_compiler is not None else 1.0, c.peak_bytes or 0)
    )
    gain = 1.0 - (fastest.time_vs_compiler or 1.0)
    if fastest is ref or gain >= min_gain:
        return fastest, None
    if gain <= 0.0:  # a twin of the compiler's own, or no faster
        return ref, None
    return ref, (
        f"{fastest.name} measured {gain:.1%} faster than {ref.name} round by round, under min_gain {min_gain:.0%}: "
        f"the compiler's own set-up is chosen (the same speed within what the rounds resolve, with nothing of memfit's applied)"
    )


def compilers_own(cands: list[CompiledCandidate]) -> CompiledCandidate | None:
    """The compiler's own candidate among ``cands``: the largest fraction, nothing of memfit's
    applied (not a twin of another candidate); None when there is none."""
    return max(
        (c for c in cands if c.kind == "compiler" and c.same_as is None),
        key=lambda c: c.activation_memory_budget,
        default=None,
    )


def plan_key(plan: Plan) -> tuple[Any, ...]:
    """What makes two plans run alike: per-block options and policies, segments, head, activations."""
    return (tuple((b.option, b.policy) for b in plan.blocks), plan.segments, plan.head, plan.activations)


class CandidateBench:
    """Compiles candidates on copies of the model, measures their peaks, then times those that fit.

    A fitting candidate's copy is kept (compiled once, never recompiled in the timed rounds), and
    every fitting candidate is timed; a copy over the budget is dropped at once.
    """

    def __init__(
        self,
        workload: Workload,
        batch_size: int,
        budget_bytes: int,
        *,
        mode: str,
        backend: str,
        optimizer: str,
        seed: int,
    ) -> None:
        self.wl, self.budget_bytes, self.mode, self.backend, self.optimizer, self.seed = (
            workload,
            budget_bytes,
            mode,
            backend,
            optimizer,
            seed,
        )
        dev = next((p.device for p in workload.model.parameters()), torch.device("cpu"))
        torch.manual_seed(seed)
        self.batch = cast_batch(workload.make_batch(batch_size), device=dev)
        self.measured: list[CompiledCandidate] = []
        self.kept: dict[str, tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]] = {}

    def measure(
        self, name: str, kind: str, plan: Plan, fraction: float, *, eager_budget_bytes: int | None
    ) -> CompiledCandidate:
        model = copy.deepcopy(self.wl.model)
        opt = make_optimizer(model, self.optimizer, lr=1e-6)
        loss_fn = self.wl.loss_fn
        try:
            warm_up(model, self.batch, loss_fn, opt, seed=self.seed)
            compiler = MemoryBudgetBackend(fraction, self.backend)
            undo = compile_plan(
                model,
                plan.with_(
                    compile_settings=CompileSettings(
                        mode=self.mode, backend=self.backend, activation_memory_budget=fraction
                    )
                ),
                compiler=compiler,
            )
            t0 = time.perf_counter()
            training_step(model, self.batch, loss_fn, opt, seed=self.seed)  # compiles
            compile_s = time.perf_counter() - t0
            peak = profiled_step_peak_bytes(model, self.batch, loss_fn, opt, seed=self.seed)
            opt.zero_grad(set_to_none=True)
        except Exception as err:  # a candidate that does not compile is reported, not fatal
            c = CompiledCandidate(
                name=name,
                kind=kind,
                plan=plan,
                activation_memory_budget=fraction,
                eager_budget_bytes=eager_budget_bytes,
                error=f"{type(err).__name__}: {err}"[:300],
            )
            self.measured.append(c)
            return c
        # The same plan compiled to the same graphs (another fraction, same partition): the same program.
        digest = compiler.digest
        twin = next(
            (
                k
                for k in self.measured
                if digest is not None
                and k.digest == digest
                and k.same_as is None
                and plan_key(k.plan) == plan_key(plan)
            ),
            None,
        )
        c = CompiledCandidate(
            name=name, kind=kind, plan=plan, activation_memory_budget=fraction, eager_budget_bytes=eager_budget_bytes, peak_bytes=peak, compile_s=compile_s,
            digest=digest, same_as=twin.name if twin else None,
        )  # fmt: skip
        self.measured.append(c)
        if peak <= self.budget_bytes and twin is None:
            self.kept[name] = (model, opt, undo)
        else:
            undo()
        return c

    def time_fitting(self, repeats: int, say: Callable[[str], None]) -> tuple[list[CompiledCandidate], float | None]:
        """Interleaved timed rounds of the fitting candidates (round 0 warms up); medians, each one's
        time against the compiler's own candidate round by round (the one with the largest fraction
        that fits), and the largest relative spread (max - min over the median) of any candidate's
        samples. A candidate that is the same program as one timed gets its time."""
        fitting = [c for c in self.measured if c.name in self.kept]
        samples: dict[str, list[float]] = {c.name: [] for c in fitting}
        for r in range(max(repeats, 1) + 1):
            for c in fitting:
                say(f"timing: round {r}/{max(repeats, 1)}, {c.name}")
                model, opt, _ = self.kept[c.name]
                t0 = time.perf_counter()
                training_step(model, self.batch, self.wl.loss_fn, opt, seed=self.seed)
                opt.zero_grad(set_to_none=True)
                if r > 0:
                    samples[c.name].append(time.perf_counter() - t0)
        ref = compilers_own(fitting)
        timed = [
            dataclasses.replace(
                c,
                step_s=statistics.median(samples[c.name]),
                time_vs_compiler=None if ref is None else paired_ratio(samples[c.name], samples[ref.name]),
            )
            for c in fitting
        ]
        by_name = {c.name: c for c in timed}
        twins = [
            dataclasses.replace(
                c, step_s=by_name[c.same_as].step_s, time_vs_compiler=by_name[c.same_as].time_vs_compiler
            )
            for c in self.measured
            if c.same_as in by_name and c.peak_bytes is not None and c.peak_bytes <= self.budget_bytes
        ]
        spreads = [(max(s) - min(s)) / statistics.median(s) for s in samples.values() if s]
        return timed + twins, (max(spreads) if spreads else None)

    def _drop(self, name: str) -> None:
        _model, _opt, undo = self.kept.pop(name)
        undo()

    def release(self) -> None:
        for name in list(self.kept):
            self._drop(name)
