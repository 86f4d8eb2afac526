"""float32 islands on the HF decoders of the zoo (NOTE [ float32 islands ] in memfit.verification.islands).

Every current decoder computes parts of its forward in float32 whatever the model's dtype (RMSNorm,
rotary tables, Gemma's ``1 + weight.float()``, routers). A float64 check must pass a correct
accumulation at float64's tolerance, with and without a plan, name where the model computes in
float32, and still fail a wrong accumulation (a micro-batch missing, a token count off by one, a loss
scaled by the number of micro-steps).
"""

from __future__ import annotations

import pytest
import torch
from test_zoo import MOE, _build, _exact_accumulation
from tiny_models import wrong_accumulator

import memfit.verification.accumulation as accumulation
from memfit import StepSpec, policy_plan
from memfit.verification import verify_accumulation
from memfit.verification.plans import verify

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]

DECODERS = ("llama", "qwen2", "gemma2", "mixtral", "deepseek_v3")


def _workload(family: str):  # type: ignore[no-untyped-def]
    wl = _build(family)
    if family in MOE:
        _exact_accumulation(wl.model)
    return wl


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("plan", ["none", "all"])
def test_a_correct_accumulation_passes_in_float64_and_names_the_islands(family: str, plan: str) -> None:
    out = verify_accumulation(_workload(family), 10, 4, plan=plan, measure_memory=False)
    assert out["ok"] and out["grad_rtol"] == 1e-10, out
    assert any("RMSNorm" in site["where"] or "Norm" in site["where"] for site in out["float32_islands"]), out
    assert out["notes"] and "float32" in out["notes"][0]


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("kind", ["missing", "count", "scaled"])
def test_a_wrong_accumulation_fails(monkeypatch: pytest.MonkeyPatch, family: str, kind: str) -> None:
    monkeypatch.setattr(accumulation, "Accumulator", wrong_accumulator(kind))
    out = verify_accumulation(_workload(family), 10, 4, plan="all", measure_memory=False)
    assert not out["ok"] and out["max_grad_rel_err"] > 1e-4, out


@pytest.mark.parametrize("family", DECODERS)
def test_a_float64_plan_check_passes_with_the_islands_promoted(family: str) -> None:
    wl = _workload(family)
    res = verify(wl, policy_plan(wl.model, "all"), step=StepSpec(dtype=torch.float64, repeats=0))
    assert res.ok and res.grad_rtol == 1e-10 and res.float32_islands, res
