"""The time model calibrated on the steps the measured choice timed (NOTE [ The time model learns ]).

NOTE [ The time model learns ]
The cost model predicts a plan's step as the profile's keep-all step (``base_step_s``) plus what the
plan changes (``extra_s`` per option: a recomputed block's forward again, the chunked head's cost, a
selective block's re-run ops), each calibrated on one profile. The measured choice
(:mod:`memfit.fitting.choice`) then times several plans in interleaved rounds, which says how far
that was off on this machine now: on the 2-core test machine under load the ratios of measured to
predicted ran from 0.03x to 5.3x, on an H200 recompute cost 1.4x to 1.8x of what the model expected.
From the timed candidates ``i`` (each with its base ``b_i``, its predicted step ``p_i``, its measured
median ``m_i`` and the profile ``r(i)`` it was predicted on) :func:`fit_time_model` fits

    m_i  ~  keep_scale[r(i)] * b_i  +  change_scale * (p_i - b_i)  [ +  step_overhead_s ]

by least squares on the relative error (rows weighted by ``1 / m_i``): ``keep_scale[r]`` is how the
keep-all step of profile ``r`` measures now (the solver's plans are predicted on one profile, the fixed
policies on another of the model's own activations, made at another time: on a loaded machine under
another load), ``change_scale`` how a plan's changes (recompute above all) measure against their
calibration, and on CUDA only ``step_overhead_s`` a per-step term (kernel launches and synchronisation
that do not scale with a block's seconds), kept where the bases of one profile differ enough to tell it
from its ``keep_scale`` (else it is part of that scale). Where the
candidates cannot tell the terms apart (their changes alike, or one candidate) or contradict one (a
negative scale), one scale is fitted for the whole step (``keep_scale == change_scale``, no overhead),
and the fit says so (``fitted``: ``("keep",)``). :func:`calibrated_costs` applies the fit
to a cost model, so that a later solve on the same stats (``plan_for_budget(..., time_model=)``)
predicts the calibrated times; ``time_model_ratio`` before and after say how close each is.

Known limitations:
    - One scale for every change a plan makes: a selective block's re-run and a recompute are
      corrected alike, and a chunked head's cost with them.
    - The fit is of this machine at the time of the rounds; on a loaded machine the next rounds can
      measure otherwise (the paired ratios the choice reads are what stays meaningful).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memfit.errors import SpecError
from memfit.plan.costmodel import ChainCosts

__all__ = ["TimedStep", "TimeModelFit", "calibrated_costs", "fit_time_model"]

_MIN_SPREAD = 0.05
"""A term is fitted only where its column varies by this fraction of the steps' seconds at least."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimedStep:
    """One timed plan: its predicted keep-all base, its predicted step and its measured step (seconds),
    and the profile it was predicted on (``solver``: the stats the plan was solved on; ``policy``: the
    fixed policies' profile)."""

    base_s: float
    predicted_s: float
    measured_s: float
    profile: str = "solver"


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeModelFit:
    """The time model's correction (NOTE [ The time model learns ]).

    Attributes:
        keep_scale: the keep-all step's measured over predicted seconds, for the profile of the first
            step fitted (the solver's: the stats a later solve uses).
        keep_scales: the same per profile.
        change_scale: a plan's changes (recompute, head, selective) measured over predicted seconds.
        step_overhead_s: seconds per step besides the scaled terms (CUDA only; 0 where not fitted).
        fitted: the terms fitted (``keep``, ``change``, ``overhead``); the others kept at 1 (0).
        steps: how many timed plans it was fitted on.
        ratio_before: median over them of measured over predicted step time.
        ratio_after: the same with the calibrated prediction.
    """

    keep_scale: float = 1.0
    keep_scales: dict[str, float] = field(default_factory=dict)
    change_scale: float = 1.0
    step_overhead_s: float = 0.0
    fitted: tuple[str, ...] = ()
    steps: int = 0
    ratio_before: float = float("nan")
    ratio_after: float = float("nan")

    def predict_step_s(self, base_s: float, predicted_s: float, profile: str | None = None) -> float:
        """The calibrated prediction of a step the cost model predicted at ``predicted_s`` on a base of
        ``base_s`` (of ``profile``; None: the first one's)."""
        keep = self.keep_scales.get(profile, self.keep_scale) if profile is not None else self.keep_scale
        return self.step_overhead_s + keep * base_s + self.change_scale * (predicted_s - base_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "keep_scale": self.keep_scale,
            "keep_scales": dict(self.keep_scales),
            "change_scale": self.change_scale,
            "step_overhead_s": self.step_overhead_s,
            "fitted": list(self.fitted),
            "steps": self.steps,
            "ratio_before": self.ratio_before,
            "ratio_after": self.ratio_after,
        }


def fit_time_model(steps: Sequence[TimedStep], *, overhead: bool = False) -> TimeModelFit:
    """Fit the time model's correction to timed steps (NOTE [ The time model learns ]).

    Args:
        steps: the timed plans (a step without a positive measured time is left out).
        overhead: also fit a per-step term (on CUDA).

    Returns:
        The fit; scale 1 (overhead 0) for a term the steps cannot tell apart.

    Raises:
        SpecError: no step to fit on.
    """
    pts = [s for s in steps if s.measured_s > 0 and s.predicted_s > 0]
    if not pts:
        raise SpecError("memfit.fitting: the time model needs at least one timed step with a positive time.")
    scale = statistics.median(s.measured_s for s in pts)
    profiles = list(dict.fromkeys(s.profile for s in pts))  # the first step's profile first
    extra = [s.predicted_s - s.base_s for s in pts]
    cols: dict[str, list[float]] = {
        _keep(r, profiles): [s.base_s if s.profile == r else 0.0 for s in pts] for r in profiles
    }
    # the changes vary between the plans (else they cannot be told from the base), with a step to spare
    if len(pts) > len(cols) and max(extra) - min(extra) > _MIN_SPREAD * scale:
        cols["change"] = extra
        if overhead and len(pts) > len(cols):
            cols["overhead"] = [1.0] * len(pts)
    fit = _least_squares(pts, cols) if "change" in cols else None
    if fit is None and "overhead" in cols:  # the bases of each profile alike: the overhead is in their scale
        del cols["overhead"]
        fit = _least_squares(pts, cols)
    if fit is None or min(v for k, v in fit.items() if k != "overhead") <= 0 or fit.get("overhead", 0.0) < 0:
        # one scale for the whole step (the terms cannot be told apart, or the steps contradict one)
        (r,) = _least_squares(pts, {"step": [s.predicted_s for s in pts]}).values()  # type: ignore[union-attr]
        fit = {"keep": r, "change": r}
        cols = {"keep": []}
    keeps = {r: fit.get(_keep(r, profiles), fit["keep"]) for r in profiles}
    out = TimeModelFit(
        keep_scale=keeps[profiles[0]],
        keep_scales=keeps,
        change_scale=fit["change"],
        step_overhead_s=fit.get("overhead", 0.0),
        fitted=tuple(cols),
        steps=len(pts),
    )
    before = statistics.median(s.measured_s / s.predicted_s for s in pts)
    after = statistics.median(
        s.measured_s / max(1e-12, out.predict_step_s(s.base_s, s.predicted_s, s.profile)) for s in pts
    )
    return replace(out, ratio_before=before, ratio_after=after)


def _keep(profile: str, profiles: list[str]) -> str:
    """The name of a profile's keep scale among the fitted terms: ``keep`` for the first, ``keep:<profile>``."""
    return "keep" if profile == profiles[0] else f"keep:{profile}"


def _least_squares(pts: Sequence[TimedStep], cols: dict[str, list[float]]) -> dict[str, float] | None:
    """Least squares of ``measured`` on ``cols``, rows weighted by ``1 / measured`` (relative error);
    None where the columns are dependent."""
    w = torch.tensor([1.0 / s.measured_s for s in pts], dtype=torch.float64)
    a = torch.tensor(list(zip(*cols.values(), strict=True)), dtype=torch.float64) * w[:, None]
    y = torch.tensor([s.measured_s for s in pts], dtype=torch.float64) * w
    if int(torch.linalg.matrix_rank(a)) < a.shape[1]:
        return None
    sol = torch.linalg.lstsq(a, y[:, None]).solution[:, 0]
    return {name: float(v) for name, v in zip(cols, sol.tolist(), strict=True)}


def calibrated_costs(costs: ChainCosts, fit: TimeModelFit) -> ChainCosts:
    """``costs`` whose predicted step times are ``fit``'s: the base scaled by ``keep_scale`` plus the
    per-step overhead, every option's and head option's added seconds by ``change_scale``."""
    s = fit.change_scale
    return replace(
        costs,
        base_step_s=fit.step_overhead_s + fit.keep_scale * costs.base_step_s,
        options=tuple({name: replace(c, extra_s=s * c.extra_s) for name, c in opts.items()} for opts in costs.options),
        head_options={name: replace(h, extra_s=s * h.extra_s) for name, h in costs.head_options.items()},
    )
