"""``plan_for_budget(..., predict_profile_peak=)``: a profile whose keep-all step is predicted over the
memory free here is not run; the stats are scaled from profiles at smaller batches predicted within it
(NOTE [ Bounded measurement ] in memfit.fitting.bounded).

References: a profile made at the batch itself (the scaled stats' predictions of the keep-all and
every-block-recomputed steps within a few percent of its), and the plan's fingerprint (it applies to
the batch planned for)."""

from __future__ import annotations

import argparse

import pytest
import torch

from memfit.apply import apply_plan, remove_plan
from memfit.capture.step import StepSpec
from memfit.cli.estimated import profile_peak_fn
from memfit.errors import BudgetInfeasibleError
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.policies import policy_plan

SPEC = "demo?n_layer=3&n_embd=48&n_head=2&dropout=0&seq_len=32"


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_a_profile_predicted_over_the_free_memory_is_scaled_from_smaller_batches() -> None:
    torch.set_num_threads(1)
    wl = load_workload(SPEC)
    estimate = profile_peak_fn(argparse.Namespace(optimizer="adamw", seed=0), wl)
    asked: list[int] = []

    def predict_peak(b: int) -> int:  # batch 8 predicted past any memory free here; the smaller, estimated
        asked.append(b)
        return 2**60 if b == 8 else estimate(b)

    step = StepSpec(batch_size=8, repeats=1)
    real = plan_for_budget(wl, 1 << 40, step=step, heads=False, activations=False, tiling=False)
    budget = (real.min_budget_bytes + real.stats.peak_bytes) // 2
    lines: list[str] = []
    res = plan_for_budget(
        wl, budget, step=step, heads=False, activations=False, tiling=False, predict_profile_peak=predict_peak,
        progress=lines.append,
    )  # fmt: skip
    assert asked == [8, 4, 2] and any("scaled from batches 2 and 4" in s for s in lines)
    assert res.stats.batch_size == 8
    for pol in ("none", "all"):  # the line through batches 2 and 4 predicts batch 8's steps
        plan = policy_plan(wl.model, pol)
        got = predict(ChainCosts.from_stats(res.stats), plan).peak_bytes
        want = predict(ChainCosts.from_stats(real.stats), plan).peak_bytes
        assert got == pytest.approx(want, rel=0.03), pol
    assert res.plan.fingerprint == real.plan.fingerprint  # the batch planned for, not the profiled ones
    apply_plan(wl.model, res.plan, batch=wl.make_batch(8))
    remove_plan(wl.model)


def test_no_two_smaller_batches_within_the_free_memory_is_refused() -> None:
    wl = load_workload(SPEC)
    with pytest.raises(
        BudgetInfeasibleError, match=r"profile at batch 4 would need more than .* free here .* Lower --batch-size"
    ):
        plan_for_budget(wl, 1 << 30, step=StepSpec(batch_size=4, repeats=1), predict_profile_peak=lambda b: 2**60)


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_without_a_prediction_a_profile_the_guard_stops_is_scaled_from_smaller_batches(monkeypatch) -> None:
    """``bounded=True`` (``memfit plan``): the guard alone bounds the profile; one it stops (here the
    guard is made to stop batch 8's, as it stops a step past the memory free here) is taken at batches
    4 and 2 and scaled, as with a prediction."""
    import contextlib

    import memfit.fitting.bounded as bounded

    real_guarded = bounded.guarded
    allowances: list[int] = []

    @contextlib.contextmanager
    def guard(budget_bytes: int, what: str, *, device="cpu"):
        allowances.append(budget_bytes)
        if what.endswith("batch 8"):
            raise bounded.MeasurementGuardError(f"memfit.fit: {what} grew past the budget (test)")
        with real_guarded(budget_bytes, what, device=device):
            yield

    monkeypatch.setattr(bounded, "guarded", guard)
    torch.set_num_threads(1)
    wl = load_workload(SPEC)
    step = StepSpec(batch_size=8, repeats=1)
    lines: list[str] = []
    res = plan_for_budget(wl, 1 << 30, step=step, heads=False, activations=False, tiling=False, bounded=True,
                          progress=lines.append)  # fmt: skip
    assert res.stats.batch_size == 8 and any("scaled from batches 2 and 4" in s for s in lines)
    # without a prediction each profile may take what is free here (at least the budget)
    assert len(allowances) == 3 and all(a >= 1 << 30 for a in allowances)


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_memfit_plan_predicts_its_profile_on_fake_tensors_first(monkeypatch, tmp_path, capsys) -> None:
    """``memfit plan`` bounds its profile as ``fit --seq-len auto`` does: the keep-all step is estimated on
    fake tensors before it runs, and a batch predicted past the memory free here is profiled at two
    halvings and scaled (the plan file is still for the batch asked)."""
    import json

    import memfit.cli.plan as cli_plan
    from memfit.cli.main import main
    from memfit.plan.types import Plan

    asked: list[int] = []
    real_fn = cli_plan.profile_peak_fn

    def spy(args, wl):  # batch 8 predicted past any memory free here; the smaller ones estimated
        estimate = real_fn(args, wl)

        def peak(b: int) -> int:
            asked.append(b)
            return 2**60 if b == 8 else estimate(b)

        return peak

    monkeypatch.setattr(cli_plan, "profile_peak_fn", spy)
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", SPEC, "--budget", "1GiB", "--batch-size", "8", "--repeats", "1", "--no-tiling",
                 "--keep-head", "--keep-activations", "--out", str(out), "--json"])  # fmt: skip
    assert code == 0, capsys.readouterr()
    assert asked == [8, 4, 2]
    assert json.loads(capsys.readouterr().out)["budget_bytes"] == 1 << 30
    wl = load_workload(SPEC)
    apply_plan(wl.model, Plan.load(str(out)), batch=wl.make_batch(8))  # fingerprinted for batch 8
    remove_plan(wl.model)
