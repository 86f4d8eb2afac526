"""``calibrate_mfu`` (``memfit plan --estimate --calibrate``) measures within its budget (NOTE [ Bounded
measurement ] in memfit.fitting.bounded): its step is predicted by the fake-tensor estimate first and
run at a micro-batch predicted within the budget and the free memory, under the guard.

References: the estimate's own peak at each micro-batch (bytes), and a child process under an
address-space limit (``RLIMIT_AS``) a few times the budget, where a step of the micro-batch asked for
(several GiB of logits) cannot be allocated."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import memfit.estimation.calibrate_time as ct
from memfit.capture.step import StepSpec
from memfit.errors import SpecError
from memfit.estimation import estimate_stats
from memfit.models.registry import load_workload

SPEC = "demo?n_layer=2&n_embd=192"
MiB = 2**20


def _peak(wl, b: int) -> int:
    host = ct._measured_cpu()
    return estimate_stats(wl, device=host, options=("keep",), heads=False, step=StepSpec(batch_size=b)).peak_bytes


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_the_micro_batch_is_halved_until_its_step_is_predicted_within_the_budget(monkeypatch) -> None:
    torch.set_num_threads(1)
    wl = load_workload(SPEC)
    p2, p4 = _peak(wl, 2), _peak(wl, 4)
    assert p2 < p4
    measured: list[int] = []
    monkeypatch.setattr(ct, "measure_step_s", lambda *a, **k: measured.append(k["batch_size"]) or 10.0)
    cal = ct.calibrate_mfu(wl, "cpu", batch_size=8, repeats=1, budget_bytes=(p2 + p4) // 2)
    assert measured == [2] and cal.batch_size == 2 and cal.asked_batch_size == 8
    assert cal.predicted_peak_bytes == p2 <= (p2 + p4) // 2
    # without a budget, only the free memory bounds it: the micro-batch asked for is measured
    cal = ct.calibrate_mfu(wl, "cpu", batch_size=4, repeats=1)
    assert measured[-1] == 4 and cal.asked_batch_size is None and cal.predicted_peak_bytes == p4


def test_a_step_predicted_over_the_free_memory_is_not_run(monkeypatch) -> None:
    wl = load_workload(SPEC)
    measured: list[int] = []
    monkeypatch.setattr(ct, "measure_step_s", lambda *a, **k: measured.append(k["batch_size"]) or 10.0)
    monkeypatch.setattr(ct, "available_bytes", lambda device: 1 * MiB)
    with pytest.raises(SpecError, match=r"micro-batch 1 is predicted at .* over the 1.00 MiB free on cpu.*--mfu 0.4"):
        ct.calibrate_mfu(wl, "cpu", batch_size=4, repeats=1)
    assert measured == []


CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    torch.set_num_threads(1)
    from memfit.estimation.calibrate_time import calibrate_mfu
    from memfit.models.registry import load_workload

    spec, budget, factor = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    wl = load_workload(spec)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + int(factor * budget)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    cal = calibrate_mfu(wl, "cpu", batch_size=64, repeats=1, warmup=1, budget_bytes=budget)
    print(json.dumps({"batch_size": cal.batch_size, "asked": cal.asked_batch_size, "peak": cal.predicted_peak_bytes}))
    """
)


@pytest.mark.slow
def test_calibration_stays_within_an_address_space_limit() -> None:
    spec = (
        "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=2"
        "&num_key_value_heads=2&vocab_size=32000&max_position_embeddings=131072&padding=false&seq_len=256"
    )
    budget = 288 * MiB  # micro-batch 64 at 256 tokens: about 6 GiB of logits and their gradients alone
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, spec, str(budget), "3"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    assert d["asked"] == 64 and d["batch_size"] < 64 and d["peak"] <= budget


@pytest.mark.slow
def test_plan_calibrate_measures_within_the_budget(capsys, monkeypatch) -> None:
    """``memfit plan --estimate --target cpu --calibrate`` hands its budget to the calibration."""
    from memfit.cli.main import main

    wl = load_workload(SPEC)
    p2, p4 = _peak(wl, 2), _peak(wl, 4)
    budget = int(0.9 * p4)  # the plan at 4 recomputes; the calibration's plain step at 4 is over
    assert p2 <= budget
    monkeypatch.setattr(ct, "measure_step_s", lambda *a, **k: 10.0)  # the time is not what is checked
    code = main(
        ["plan", "--model", SPEC, "--estimate", "--target", "cpu", "--calibrate", "--batch-size", "4",
         "--budget", str(budget), "--json"]
    )  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 0, d
    assert d["calibrated"]["batch_size"] == 2 and d["calibrated"]["asked_batch_size"] == 4
    assert d["calibrated"]["predicted_peak_bytes"] == p2
