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


def test_estimate_runs_the_step_it_is_given() -> None:
    one = memfit.estimate(SPEC, step=StepSpec(batch_size=1))
    two = memfit.estimate(SPEC, step=StepSpec(batch_size=2, optimizer="sgd", dtype=torch.float64))
    assert (one.batch_size, two.batch_size) == (1, 2)
    assert two.activations_bytes > one.activations_bytes
    assert (one.optimizer, one.dtype, two.optimizer, two.dtype) == ("adamw", "float32", "sgd", "float64")
    assert two.optimizer_bytes == two.params_bytes  # sgd with momentum: one state per parameter


@pytest.mark.parametrize("changes", [{"device": "cpu"}, {"repeats": 1}])
def test_estimate_refuses_a_step_device_or_repeats(changes: dict) -> None:
    with pytest.raises(SpecError, match="the target device is device= .* without device and repeats"):
        memfit.estimate(SPEC, device="h100-sxm", step=StepSpec(**changes))


def test_verify_accumulation_runs_the_dtype_and_seed_it_is_given() -> None:
    wl = memfit.load_workload(SPEC)
    sharp = memfit.verify_accumulation(wl, 4, 2, measure_memory=False)  # step=None: float64
    single = memfit.verify_accumulation(wl, 4, 2, step=StepSpec(dtype=torch.float32), measure_memory=False)
    assert (sharp["dtype"], single["dtype"]) == ("float64", "float32")
    assert sharp["ok"] and single["ok"] and sharp["grad_rtol"] < single["grad_rtol"]
    reseeded = memfit.verify_accumulation(wl, 4, 2, step=StepSpec(dtype=torch.float64, seed=1), measure_memory=False)
    assert reseeded["dtype"] == "float64" and reseeded["ref_loss"] != sharp["ref_loss"]  # another batch
    as_it_is = memfit.verify_accumulation(wl, 4, 2, step=StepSpec(), measure_memory=False)
    assert as_it_is["dtype"] == "float32"  # a StepSpec without dtype keeps the model's
    assert next(wl.model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"batch_size": 4}, "batch_size=4"),
        ({"optimizer": "sgd"}, "optimizer='sgd'"),
        ({"repeats": 1}, "repeats=1"),
        ({"device": "cpu"}, "device='cpu'"),
    ],
)
def test_verify_accumulation_refuses_what_it_would_ignore(changes: dict, field: str) -> None:
    wl = memfit.load_workload(SPEC)
    with pytest.raises(SpecError, match=f"give a StepSpec with dtype and seed only .*{field}"):
        memfit.verify_accumulation(wl, 4, 2, step=StepSpec(**changes))


@pytest.mark.slow  # about 10 s on 2 cores: the fast tier keeps to about 4 minutes
def test_estimated_stats_run_the_step_they_are_given() -> None:
    from memfit.estimation import estimate_stats, stats_fn

    one = estimate_stats(SPEC, device="h100-sxm", step=StepSpec(batch_size=1))
    two = estimate_stats(SPEC, device="h100-sxm", step=StepSpec(batch_size=2, optimizer="sgd", dtype=torch.bfloat16))
    assert (one.batch_size, one.optimizer, one.dtype) == (1, "adamw", "float32")
    assert (two.batch_size, two.optimizer, two.dtype) == (2, "sgd", "bfloat16")
    made = stats_fn(memfit.estimation.load_fake_workload(SPEC), device="h100-sxm", step=StepSpec(optimizer="sgd"))(3)
    assert (made.batch_size, made.optimizer) == (3, "sgd")
    with pytest.raises(SpecError, match="without device and repeats"):
        estimate_stats(SPEC, device="h100-sxm", step=StepSpec(repeats=1))
    with pytest.raises(SpecError, match="without batch_size"):
        stats_fn(memfit.estimation.load_fake_workload(SPEC), device="h100-sxm", step=StepSpec(batch_size=2))
