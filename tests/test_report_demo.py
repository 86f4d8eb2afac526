"""``memfit demo``'s report profiles the options its fit chose from: the frontier is made of plans the
fit could choose, and the options it did not use (selective, calibrated by an op-level capture) are not
profiled again for the page."""

from __future__ import annotations

from tiny_models import token_workload

from memfit.fitting import FitResult
from memfit.fitting.report_inputs import gather_fit_report
from memfit.plan import policy_plan
from memfit.plan.options import BASE_OPTIONS


def _calibrated(inputs) -> set[str]:
    return {name for per_block in inputs.costs.options for name in per_block}


def test_fit_report_profiles_only_the_options_given() -> None:
    wl = token_workload()
    plan = policy_plan(wl.model, "all")
    res = FitResult(
        budget_bytes=10**6, global_batch=8, micro_batch=4, accumulation_steps=2, predicted_peak_bytes=10**5,
        predicted_samples_per_s=400.0, measured_peak_bytes=None, measured_samples_per_s=None, plan=plan, candidates=(),
    )  # fmt: skip
    base = _calibrated(gather_fit_report(wl, res, options=BASE_OPTIONS))
    assert {"keep", "recompute"} <= base and not any(o.startswith("selective") for o in base)
