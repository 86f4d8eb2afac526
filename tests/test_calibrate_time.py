"""``calibrate_mfu``: the roofline's utilisation fitted to measured steps (memfit.estimation.calibrate_time).

The reference is a second, independent measurement of the same step (a fresh median of repeats,
not the one the fit used); the only timing comparison is between two measurements of one thing.
"""

from __future__ import annotations

import json

import pytest
import torch

import memfit.estimation.calibrate_time as ct
from memfit.capture.step import StepSpec
from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.estimation import estimate_stats
from memfit.estimation.calibrate_time import _same_gpu, calibrate_mfu, host_device
from memfit.estimation.devices import DEVICES
from memfit.models.registry import load_workload

SPEC = "demo?n_layer=2&n_embd=192"


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_calibrated_step_predicts_the_measured_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fitted mfu makes the roofline predict the step measured at the calibrated batch. The
    measurement is replaced by a fixed time (wall-clock comparisons live in benchmarks/: on a shared
    2-core machine a fresh measurement moves by more than any tolerance a test could hold). The fixed
    time is long, so that the fitted mfu stays below 1 however slow this machine's measured matmul
    rate (the host's peak) is at the moment: a fit clamped at 1 cannot predict the step."""
    wl = load_workload(SPEC)
    before = [t.detach().clone() for t in wl.model.state_dict().values()]
    measured = []

    def fixed_step_s(*args: object, **kwargs: object) -> float:
        measured.append(kwargs.get("batch_size", args[1] if len(args) > 1 else None))
        return 10.0

    monkeypatch.setattr(ct, "measure_step_s", fixed_step_s)
    cal = calibrate_mfu(wl, "cpu", batch_size=4, repeats=7)
    after = list(wl.model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # measuring left the model as it was
    assert measured == [4]
    assert 0 < cal.mfu <= 1 and cal.mfu_before == 0.4
    assert cal.device.fp32_flops_per_s and cal.device.memory_bandwidth_bytes_per_s
    stats = estimate_stats(wl, device=cal.device, mfu=cal.mfu, step=StepSpec(batch_size=4))
    assert stats.calibration.estimated.mfu == cal.mfu
    assert stats.step_s == pytest.approx(10.0, rel=0.01), (stats.step_s, cal)
    # the uncalibrated roofline is reported, not required to be close
    assert cal.predicted_step_s_before > 0


def test_calibration_measures_a_real_step() -> None:
    """Without the stand-in, the calibration's measured step is a real one: positive, and the fitted
    mfu within (0, 1]."""
    cal = calibrate_mfu(load_workload(SPEC), "cpu", batch_size=2, repeats=2)
    assert cal.measured_step_s > 0 and 0 < cal.mfu <= 1


def test_refuses_a_device_that_is_not_here():
    here = host_device().name
    other = "h100-sxm" if here != "h100-sxm" else "l4"
    with pytest.raises(SpecError, match=r"memfit.estimate: cannot calibrate .*--mfu"):
        calibrate_mfu(SPEC, other)


@pytest.mark.parametrize("command", ["plan", "estimate"])
@pytest.mark.slow  # about 7 s on 2 cores: the fast tier keeps to about 4 minutes
def test_cli_calibrate_json(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--budget", "40MiB", "--estimate"] if command == "plan" else []
    code = main([command, "--model", SPEC, "--batch-size", "2", *extra, "--device", "cpu", "--calibrate", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0
    cal = d["calibrated"]
    assert cal["measured_step_s"] > 0 and cal["predicted_step_s_before"] > 0
    assert cal["predicted_step_s_after"] == pytest.approx(
        cal["measured_step_s"], rel=1e-6
    )  # the fit reproduces its own measurement
    mfu = d["estimated"]["mfu"] if command == "plan" else d["mfu"]
    assert mfu == cal["mfu"]


def test_cli_calibrate_refuses_another_device(capsys: pytest.CaptureFixture[str]) -> None:
    other = "l4" if host_device().name != "l4" else "h100"
    code = main(["plan", "--model", SPEC, "--budget", "40MiB", "--estimate", "--target", other, "--calibrate"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and "cannot calibrate" in lines[0] and "--mfu" in lines[0], lines


@pytest.mark.parametrize(
    ("cuda_name", "want"),
    [  # names torch.cuda.get_device_name reports on these GPUs
        ("NVIDIA H200", ["h200"]),
        ("NVIDIA H100 80GB HBM3", ["h100-sxm"]),
        ("NVIDIA H100 PCIe", ["h100-pcie"]),
        ("NVIDIA A100-SXM4-40GB", ["a100-40gb"]),
        ("NVIDIA A100-SXM4-80GB", ["a100-80gb"]),
        ("NVIDIA A100 80GB PCIe", []),  # not in the table (lower bandwidth than the SXM4 entry)
        ("NVIDIA GeForce RTX 4090", ["rtx4090"]),
        ("NVIDIA L4", ["l4"]),
        ("NVIDIA L40S", ["l40s"]),
        ("Tesla V100-SXM2-32GB", ["v100-32gb"]),
    ],
)
def test_cuda_names_match_one_table_entry(cuda_name: str, want: list[str]) -> None:
    assert [d.name for d in DEVICES.values() if d.name != "cpu" and _same_gpu(cuda_name, d)] == want
