"""Choosing by measurement (memfit.fitting.choice, ``plan``/``fit --measure-choice``): the next-best
plans against brute force, the pick against the JSON's own measured numbers, every timed candidate
within the budget, and ``--no-measure-choice`` leaving the solver's plan as it was. No assert on a
measured time: only on the consistency of what was measured with what was chosen."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from memfit.capture.step import StepSpec
from memfit.cli.choice import wants_choice
from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.fitting.budget import plan_for_budget
from memfit.fitting.choice import MeasuredCandidate, pick_fastest
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.solve import ranked_solutions, solve
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile

TINY = "demo?n_layer=3&n_embd=32&n_head=2"


@pytest.fixture(scope="module")
def tiny_stats():
    wl = load_workload(TINY, seq_len=16)
    return profile(
        wl,
        step=StepSpec(batch_size=2, repeats=1),
        options=("keep", "recompute"),
        heads=False,
        activations=False,
        tiling=False,
        host_inputs=False,
    )


def test_ranked_solutions_are_the_fastest_fitting_plans_by_brute_force(tiny_stats) -> None:
    costs = ChainCosts.from_stats(tiny_stats)
    options = sorted({o for b in tiny_stats.blocks for o in b.options})
    assert options == ["keep", "recompute"]
    every = []
    for opts in itertools.product(options, repeat=len(costs)):
        plan = Plan(policy="t", chain_path="", blocks=tuple(costs.decision(i, o) for i, o in enumerate(opts)))
        every.append((opts, predict(costs, plan)))
    least = min(p.peak_with_margin_bytes for _, p in every)
    most = max(p.peak_with_margin_bytes for _, p in every)
    budget = (least + most) // 2
    fits = {opts: p for opts, p in every if p.peak_with_margin_bytes <= budget}
    got = ranked_solutions(costs, budget, segments=False, limit=3)
    assert len(got) == 3 and len({s.options for s in got}) == 3
    # the first is the fastest fitting plan of all 2^n; the next-best are fitting plans, in order of time
    assert got[0].prediction.step_s == pytest.approx(min(p.step_s for p in fits.values()), rel=1e-9)
    assert got[0].options == solve(costs, budget, segments=False).options
    for s in got:
        assert s.options in fits and s.prediction.step_s == pytest.approx(fits[s.options].step_s, rel=1e-9)
    assert [s.prediction.step_s for s in got] == sorted(s.prediction.step_s for s in got)
    assert all(s.prediction.peak_with_margin_bytes <= budget for s in got)


def _candidate(label: str, *, vs: float, step_s: float, fits: bool, kind: str = "policy") -> MeasuredCandidate:
    return MeasuredCandidate(
        label=label, kind=kind, plan=Plan(policy=label, chain_path="", blocks=()), predicted_peak_bytes=1,
        predicted_step_s=1.0, measured_peak_bytes=1, measured_step_s=step_s, step_s_samples=(step_s,), vs_solver=vs,
        time_model_ratio=step_s, fits_budget=fits,
    )  # fmt: skip


def test_the_pick_is_the_fastest_measured_within_the_budget() -> None:
    solver = _candidate("memfit", vs=1.0, step_s=1.0, fits=True, kind="solver")
    over = _candidate("none", vs=0.5, step_s=0.5, fits=False)  # fastest, but over the budget
    every2 = _candidate("every:2", vs=0.9, step_s=0.95, fits=True)
    assert pick_fastest((solver, over, every2))[0] == "every:2"
    assert pick_fastest((solver, over, _candidate("all", vs=1.3, step_s=1.3, fits=True)))[0] == "memfit"
    assert pick_fastest((_candidate("memfit", vs=1.0, step_s=1.0, fits=False, kind="solver"), over))[0] == "memfit"


def _args(**kw) -> argparse.Namespace:
    base = {"measure_choice": None, "budget": 1 << 20, "device": "cpu", "choice_rounds": 3}
    return argparse.Namespace(**(base | kw))


def test_on_by_default_on_cuda_only_when_asked_on_the_cpu() -> None:
    assert not wants_choice(_args(), command="plan")
    assert wants_choice(_args(device="cuda:0"), command="plan")
    assert wants_choice(_args(measure_choice=True), command="plan")
    assert not wants_choice(_args(device="cuda", measure_choice=False), command="plan")
    assert not wants_choice(_args(device="cuda", estimate=True), command="plan")  # nothing runs: off
    assert not wants_choice(_args(device="cuda", policy="all"), command="fit")
    with pytest.raises(SpecError, match="leave out --estimate"):
        wants_choice(_args(measure_choice=True, estimate=True), command="plan")


def test_measure_choice_with_estimate_is_refused_with_the_fix(capsys) -> None:
    code = main(["plan", "--model", TINY, "--budget", "1GiB", "--estimate", "--target", "h100-sxm", "--measure-choice", "--json"])  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 2 and "--measure-choice times plans for a --budget on this machine" in d["error"]


@pytest.mark.slow
def test_plan_measure_choice_keeps_the_fastest_measured_candidate_within_the_budget(capsys, tmp_path: Path) -> None:
    wl, step = load_workload(TINY, seq_len=16), StepSpec(batch_size=2, repeats=1)
    first = plan_for_budget(wl, 1 << 40, step=step)
    budget = (first.min_budget_bytes + first.stats.peak_bytes) // 2
    out = tmp_path / "plan.json"
    code = main(
        ["plan", "--model", TINY, "--seq-len", "16", "--batch-size", "2", "--budget", str(budget), "--repeats", "1",
         "--measure-choice", "--choice-rounds", "2", "--out", str(out), "--json"]
    )  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 0, d
    timed = d["measured_choice"]
    assert timed[0]["label"] == "memfit" and {c["kind"] for c in timed} == {"solver", "policy"}
    for c in timed:  # what was timed is within the budget, measured (the tracker's peak)
        assert c["measured_peak_bytes"] <= budget and c["fits_budget"], c
        assert c["time_model_ratio"] == pytest.approx(c["measured_step_s"] / c["predicted_step_s"])
    # the time model calibrated on every timed candidate, its median ratio before as the candidates' own
    assert d["time_model"]["steps"] == len(timed) and d["time_model_ratio_after"] == d["time_model"]["ratio_after"]
    assert d["time_model"]["ratio_before"] == pytest.approx(d["time_model_ratio"])
    chosen = next(c for c in timed if c["label"] == d["measured_choice_chosen"])
    assert chosen["vs_solver"] == min(c["vs_solver"] for c in timed if c["fits_budget"])
    saved = json.loads(out.read_text())
    assert d["recomputed_blocks"] == chosen["recomputed_blocks"]
    assert sum(b["option"] != "keep" for b in saved["blocks"]) == chosen["recomputed_blocks"]


@pytest.mark.slow
def test_no_measure_choice_gives_the_solvers_plan_unchanged(capsys) -> None:
    wl, step = load_workload(TINY, seq_len=16), StepSpec(batch_size=2, repeats=1)
    first = plan_for_budget(wl, 1 << 40, step=step)
    ref = plan_for_budget(wl, first.min_budget_bytes, stats=first.stats).to_dict()  # memory alone decides it
    code = main(
        ["plan", "--model", TINY, "--seq-len", "16", "--batch-size", "2", "--budget", str(first.min_budget_bytes),
         "--repeats", "1", "--no-measure-choice", "--json"]
    )  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and "measured_choice" not in d
    for key in ("blocks", "segments", "head", "activations", "predicted_peak_bytes"):
        assert d[key] == json.loads(json.dumps(ref[key])), key


@pytest.mark.slow
def test_fit_measure_choice_lists_the_candidates(capsys) -> None:
    wl = load_workload(TINY, seq_len=16)
    first = plan_for_budget(wl, 1 << 40, step=StepSpec(batch_size=2, repeats=1))
    budget = (first.min_budget_bytes + first.stats.peak_bytes) // 2
    code = main(
        ["fit", "--model", TINY, "--seq-len", "16", "--global-batch", "2", "--max-micro-batch", "2", "--budget",
         str(budget), "--repeats", "1", "--measure-choice", "--choice-rounds", "1", "--json"]
    )  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 0, d
    fits = [c for c in d["measured_choice"] if c["fits_budget"]]
    assert all(c["measured_peak_bytes"] <= budget for c in fits)
    assert d["measured_choice_chosen"] == min(fits, key=lambda c: c["vs_solver"])["label"]
