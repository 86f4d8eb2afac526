"""`memfit train` watching its run: out-of-memory replans with a redo, drift of measured peak and
step time from the fit's predictions, and the counts in the summary and ``--json``.

The auto-fit is replaced by a fast stand-in (monkeypatched, test-only) that answers with policy
plans and chosen predictions; the stand-in also trains on the model and draws random numbers, as
the real auto-fit's profiling does, so a leak of its state into the run would show.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import memfit.fitting
from memfit.accumulate import Accumulator
from memfit.apply import apply_plan
from memfit.capture.tracker import MemoryTracker
from memfit.cli.main import main
from memfit.fitting import FitResult
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.training.guard import tighter_budget

DEMO_SMALL = "demo?n_layer=4&n_embd=32&seq_len=32"  # dropout 0.1: the redo must replay the masks
G = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


class FakeFit:
    """Stands in for memfit.fitting.autofit: answers from a queue of (policy, predicted peak,
    predicted samples/s) with the whole share as micro-batch, and records the budgets asked for."""

    def __init__(self, answers: list[tuple[str, int, float]]) -> None:
        self.answers = list(answers)
        self.budgets: list[int] = []

    def __call__(self, workload: Any, budget_bytes: int, global_batch: int, **kw: Any) -> FitResult:
        self.budgets.append(budget_bytes)
        policy, peak, sps = self.answers.pop(0)
        model = workload.model
        with torch.no_grad():  # what profiling does to the model: steps and random draws
            for p in model.parameters():
                p.add_(0.5)
        torch.rand(1000)
        plan = policy_plan(model, policy)
        return FitResult(
            budget_bytes=budget_bytes,
            global_batch=global_batch,
            micro_batch=global_batch,
            accumulation_steps=1,
            predicted_peak_bytes=peak,
            predicted_samples_per_s=sps,
            measured_peak_bytes=None,
            measured_samples_per_s=None,
            plan=plan,
            candidates=(),
        )


@pytest.fixture
def fake_fit(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def install(answers: list[tuple[str, int, float]]) -> FakeFit:
        fake = FakeFit(answers)
        monkeypatch.setattr(memfit.fitting, "autofit", fake)
        return fake

    yield install


def window_peaks(policy: str) -> tuple[int, int]:
    """Tracker peaks of the first and the second training window of the demo under a policy."""
    wl = load_workload(DEMO_SMALL)
    model = copy.deepcopy(wl.model)
    apply_plan(model, policy_plan(model, policy))
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=3e-4), micro_batch=G)
    batch = wl.make_batch(G)
    peaks = []
    for _ in range(2):
        tracker = MemoryTracker(device="cpu").track(model, acc.optimizer, batch)
        with tracker:
            acc.step(batch, wl.loss_fn, wl.count_fn)
        peaks.append(tracker.peak_bytes)
    return peaks[0], peaks[1]


@pytest.mark.slow
def test_guard_replans_and_the_run_ends_where_an_uninterrupted_one_does(capsys, fake_fit, tmp_path: Path) -> None:
    none_first, _ = window_peaks("none")
    all_first, all_steady = window_peaks("all")
    assert max(all_first, all_steady) < none_first
    limit = (max(all_first, all_steady) + none_first) // 2
    common = [
        "train",
        "--model",
        DEMO_SMALL,
        "--global-batch",
        str(G),
        "--budget",
        str(limit),
        "--guard",
        "--steps",
        "3",
    ]

    fake = fake_fit([("none", none_first, 100.0), ("all", all_steady, 100.0)])
    code, got = run_json(capsys, *common, "--save", str(tmp_path / "replanned.pt"))
    assert code == 0
    assert got["replans"] == 1 and got["optimizer_steps"] == 3 and got["skipped_steps"] == 0
    (event,) = got["replan_events"]
    assert event["error_type"] == "BudgetExceededError" and event["window"] == 0
    assert event["limit_bytes"] == limit and event["overflow_bytes"] == event["live_bytes"] - limit > 0
    assert fake.budgets == [limit, tighter_budget(limit, event["overflow_bytes"])] == [limit, event["budget_bytes"]]
    assert (event["recomputed_before"], event["recomputed"]) == (0, 4)
    assert got["policy"] == "all" and got["guard"] is True
    assert got["measured_peak_bytes"] <= limit and got["guard_ops_per_step"] > 100
    assert any("out of memory in window 0" in w for w in got["warnings"])

    fake_fit([("all", all_steady, 100.0)])
    code, want = run_json(capsys, *common, "--save", str(tmp_path / "direct.pt"))
    assert code == 0 and want["replans"] == 0
    a = torch.load(tmp_path / "replanned.pt", weights_only=True)
    b = torch.load(tmp_path / "direct.pt", weights_only=True)
    torch.testing.assert_close(a["model"], b["model"], rtol=0, atol=0)  # dropout masks replayed
    torch.testing.assert_close(a["optimizer"]["state"], b["optimizer"]["state"], rtol=0, atol=0)
    assert (
        a["counters"]
        == b["counters"]
        == {"optimizer_steps": 3, "skipped_steps": 0, "consecutive_skips": 0, "windows": 3, "samples_seen": 3 * G}
    )
    assert got["losses"] == want["losses"]


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_replan_re_solves_the_fits_profiles(capsys, fake_fit, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the start's fit at hand, a replan is FitResult.resolve (the solver only): the auto-fit
    is not run again, and the resolve is asked for the tighter budget and at most the current
    micro-batch."""
    none_first, _ = window_peaks("none")
    all_first, all_steady = window_peaks("all")
    limit = (max(all_first, all_steady) + none_first) // 2
    fake = fake_fit([("none", none_first, 100.0)])
    real_call = fake.__call__
    resolved: list[tuple[int, int | None]] = []

    def with_profiles(*a: Any, **kw: Any) -> FitResult:
        return dataclasses.replace(real_call(*a, **kw), profiles={1: None, G: None}, profiled_batch_sizes=(1, G))

    def resolve(self: FitResult, budget_bytes: int, *, max_micro_batch: int | None = None) -> FitResult:
        resolved.append((budget_bytes, max_micro_batch))
        return dataclasses.replace(
            self,
            budget_bytes=budget_bytes,
            plan=policy_plan(load_workload(DEMO_SMALL).model, "all"),
            predicted_peak_bytes=all_steady,
        )

    monkeypatch.setattr(memfit.fitting, "autofit", with_profiles)
    monkeypatch.setattr(FitResult, "resolve", resolve)
    code, got = run_json(
        capsys,
        "train",
        "--model",
        DEMO_SMALL,
        "--global-batch",
        str(G),
        "--budget",
        str(limit),
        "--guard",
        "--steps",
        "2",
    )
    assert code == 0 and got["replans"] == 1 and got["policy"] == "all"
    assert fake.budgets == [limit]  # the auto-fit ran once, at the start
    assert resolved == [(got["replan_events"][0]["budget_bytes"], G)]


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_drift_is_warned_and_reported(capsys, fake_fit) -> None:
    common = ["train", "--model", DEMO_SMALL, "--global-batch", str(G), "--budget", "64MiB", "--steps", "5"]
    fake_fit([("all", 10**9, 1e6)])  # a peak far too high, a time far too short
    code, off = run_json(capsys, *common)
    assert code == 0
    assert off["predicted_peak_bytes"] == 10**9 and off["measured_peak_bytes"] > 0
    assert off["peak_drift"] == pytest.approx(off["measured_peak_bytes"] / 10**9 - 1)
    assert off["predicted_step_s"] == pytest.approx(G / 1e6) and off["time_drift"] > 10
    assert any("measured peak" in w for w in off["warnings"]) and any(
        "measured step time" in w for w in off["warnings"]
    )
    assert off["peak_measured_by"] == "MemoryTracker, first two steps"

    # The measured peak is deterministic: predicting it exactly silences the peak warning.
    fake_fit([("all", off["measured_peak_bytes"], 1e6)])
    code, exact = run_json(capsys, *common)
    assert exact["peak_drift"] == 0.0
    assert not any("measured peak" in w for w in exact["warnings"])


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_one_step_reports_no_peak_drift(capsys, fake_fit) -> None:
    # The first step creates AdamW's state, so its peak is below the steady one the fit predicts:
    # `--steps 1` warned of a drift (-24 %) that was not there.
    common = ["train", "--model", DEMO_SMALL, "--global-batch", str(G), "--budget", "64MiB"]
    fake_fit([("all", 10**9, 1e6)])
    code, steady = run_json(capsys, *common, "--steps", "2")
    assert code == 0
    fake_fit([("all", steady["measured_peak_bytes"], 1e6)])  # the steady peak, predicted exactly
    code, one = run_json(capsys, *common, "--steps", "1")
    assert code == 0 and one["measured_peak_bytes"] < steady["measured_peak_bytes"]
    assert one["peak_drift"] is None and not any("measured peak" in w for w in one["warnings"])


def test_plain_run_reports_no_prediction_and_a_steady_peak(capsys) -> None:
    code, res = run_json(
        capsys, "train", "--model", DEMO_SMALL, "--global-batch", str(G), "--micro-batch", "4", "--steps", "3"
    )
    assert code == 0
    assert res["replans"] == 0 and res["replan_events"] == [] and res["warnings"] == []
    assert res["predicted_peak_bytes"] is None and res["peak_drift"] is None and res["time_drift"] is None
    # The second step holds AdamW's state (2 x parameters) from its start: the steady peak.
    params = sum(p.numel() * p.element_size() for p in load_workload(DEMO_SMALL).model.parameters())
    assert res["measured_peak_bytes"] > 4 * params  # parameters, gradients and two moments
    assert res["step_s"] is not None and res["accumulation_steps"] == 2


def test_guard_needs_a_budget(capsys) -> None:
    code = main(["train", "--model", DEMO_SMALL, "--global-batch", "4", "--steps", "1", "--guard", "--json"])
    assert code == 2
    assert "--guard enforces --budget" in json.loads(capsys.readouterr().out)["error"]


@pytest.mark.slow
def test_budget_run_on_gpt2_fuses_its_activations_unless_kept(capsys) -> None:
    """A real auto-fit on a tiny GPT-2: the plan fuses gelu_new (reported), and the measured peak
    stays within the budget; --keep-activations leaves the model's own activation."""
    tiny = "hf:gpt2?num_hidden_layers=2&hidden_size=32&n_inner=128&num_attention_heads=2&vocab_size=256"
    common = ["train", "--model", tiny, "--seq-len", "32", "--global-batch", "4", "--budget", "64MiB", "--steps", "2"]
    code, res = run_json(capsys, *common)
    assert code == 0 and res["activations"] == "fused" and res["measured_peak_bytes"] <= res["budget_bytes"]
    code, kept = run_json(capsys, *common, "--keep-activations")
    assert code == 0 and kept["activations"] is None
