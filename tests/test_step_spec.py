"""memfit.StepSpec: the one step specification the measuring verbs share; what it refuses, and that
a verb runs the step it describes."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import SpecError, StepSpec
from memfit.fitting.compiled import plan_compiled
from memfit.profiling.side_by_side import measure_plan

SPEC = "demo?n_layer=2&n_embd=16&n_head=2&seq_len=8"


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"optimizer": "lamb"}, "unknown optimizer 'lamb'. Use one of: adamw, adam, sgd"),
        ({"batch_size": 0}, "batch_size must be an integer of at least 1"),
        ({"repeats": -1}, "repeats must be an integer of at least 0"),
        ({"batch_size": True}, "batch_size must be an integer"),
    ],
)
def test_a_bad_step_is_refused_with_the_fix(changes: dict, fragment: str) -> None:
    with pytest.raises(SpecError, match=fragment):
        StepSpec(**changes)


def test_the_default_step_takes_each_verbs_repeats() -> None:
    assert StepSpec().repeats_or(3) == 3 and StepSpec(repeats=0).repeats_or(3) == 0
    assert memfit.StepSpec is StepSpec and "StepSpec" in memfit.__all__


def test_profile_runs_the_step_it_is_given() -> None:
    wl = memfit.load_workload(SPEC)
    stats = memfit.profile(wl, step=StepSpec(batch_size=3, optimizer="sgd", repeats=1), options=("keep",))
    assert (stats.batch_size, stats.optimizer) == (3, "sgd")
    assert stats.dtype == "float32"
    cast = memfit.profile(wl, step=StepSpec(batch_size=2, dtype=torch.float64, repeats=1), options=("keep",))
    assert cast.dtype == "float64" and next(wl.model.parameters()).dtype == torch.float32  # a cast copy


def test_verbs_that_run_the_model_as_it_is_refuse_a_dtype_device_or_batch() -> None:
    wl = memfit.load_workload(SPEC)
    with pytest.raises(SpecError, match="without batch_size, dtype and device"):
        memfit.autofit(wl, 1 << 30, 4, step=StepSpec(batch_size=2))
    with pytest.raises(SpecError, match="without dtype and device"):
        plan_compiled(wl, 1 << 30, step=StepSpec(dtype=torch.float64))
    with pytest.raises(SpecError, match="without device"):
        measure_plan(wl, memfit.policy_plan(wl.model, "all"), step=StepSpec(device="cpu"))
