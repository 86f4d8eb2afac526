"""Estimate-fed planning : Stats from fake-tensor steps.

References, each independent of the code under test:
- a measured profile of the same model on this machine (per-block bytes, CPU kernels);
- the real step of the estimate-fed plan under the live-tensor tracker (its peak);
- :func:`memfit.estimation.estimate`, the fake step without the per-block hooks (whole-step peaks);
- a block's FLOPs counted by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from memfit import StepSpec
from memfit.capture.stats import Stats
from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.estimation import (
    estimate,
    estimate_stats,
    get_device,
    load_fake_workload,
    stats_fn,
)
from memfit.estimation.devices import published_mfu
from memfit.fitting import autofit
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.policies import policy_plan
from memfit.plan.solve import min_budget
from memfit.profiling.blocks import profile
from memfit.profiling.side_by_side import measure_setups, plan_setup

SRC = str(Path(__file__).resolve().parents[1] / "src")

MODELS = {
    "demo": ("demo?n_layer=3&n_embd=64&n_head=4", 64),
    "gpt2": ("hf:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256", 32),
    "llama": (
        "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
        "&num_key_value_heads=2&vocab_size=256",
        32,
    ),
}
BYTE_FIELDS = ("retained_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "bwd_base_bytes")
# This machine's kernels, so that the estimate compares with a profile measured here; the
# roofline's device only sets the seconds.
DEVICE = "h100-sxm"


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request: pytest.FixtureRequest) -> tuple[str, object, Stats, Stats]:
    torch.set_num_threads(1)
    spec, seq_len = MODELS[request.param]
    wl = load_workload(spec, seq_len=seq_len, seed=0)
    # sgd: its state is one momentum buffer per parameter on both paths (AdamW's 4-byte `step`
    # counters are CPU tensors that only the measured CPU step counts; see test below)
    measured = profile(
        wl, step=StepSpec(batch_size=2, optimizer="sgd", repeats=1), options=BASE_OPTIONS, heads=False, tiling=False
    )
    est = estimate_stats(
        wl,
        device=DEVICE,
        gpu_kernels=False,
        step=StepSpec(batch_size=2, optimizer="sgd"),
        heads=False,
        tiling=False,
        host_inputs=False,
    )  # the long-sequence options are compared in tests/test_estimate_long.py
    return request.param, wl, measured, est


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_per_block_bytes_equal_measured(pair: tuple) -> None:
    _name, _wl, measured, est = pair
    assert [b.name for b in est.blocks] == [b.name for b in measured.blocks]
    for e, m in zip(est.blocks, measured.blocks, strict=True):
        for f in ("saved_bytes", "output_bytes", "input_bytes", "fwd_temp_bytes", "bwd_temp_bytes", "input_saved"):
            assert getattr(e, f) == getattr(m, f), (e.name, f)
        for mode in BASE_OPTIONS:
            for f in BYTE_FIELDS:
                assert getattr(e.options[mode], f) == getattr(m.options[mode], f), (e.name, mode, f)
    for f in (
        "start_bytes",
        "pre_peak_bytes",
        "head_peak_bytes",
        "post_peak_bytes",
        "peak_bytes",
        "params_bytes",
        "grads_bytes",
        "optimizer_bytes",
    ):
        assert getattr(est, f) == getattr(measured, f), f
    for f in ("head_peak_bytes_by_option", "head_model_peak_bytes_by_option", "head_backward_peak_bytes_by_option"):
        assert getattr(est, f) == getattr(measured, f) and set(getattr(est, f)) == set(BASE_OPTIONS), f
    assert est.measured_peak_bytes_by_option == measured.measured_peak_bytes_by_option
    assert est.activations == measured.activations
    assert (est.sequential, est.segment_spans) == (measured.sequential, measured.segment_spans)
    assert est.calibration.estimated is not None and est.calibration.estimated.device == DEVICE
    assert measured.calibration.estimated is None


def test_each_calibration_plan_is_predicted_as_its_step_measured(pair: tuple) -> None:
    """Every block in one option: the cost model gives that calibration step's own peak, measured
    or estimated (the head's peak is the step's own: NOTE [ The head's peak per option ])."""
    _name, wl, measured, est = pair
    for stats in (measured, est):
        costs = ChainCosts.from_stats(stats, margin=0.0)
        for mode, action in (("keep", "none"), ("recompute", "all")):
            plan = policy_plan(wl.model, action).with_(segments=())
            assert predict(costs, plan).peak_bytes == stats.measured_peak_bytes_by_option[mode], (
                mode,
                stats.calibration.estimated,
            )


def _with_times_of(measured: Stats, est: Stats) -> Stats:
    """The measured stats with the estimate's seconds: plans then differ only by bytes."""
    blocks = tuple(
        dataclasses.replace(
            m,
            fwd_s=e.fwd_s,
            bwd_s=e.bwd_s,
            options={
                k: dataclasses.replace(c, fwd_s=e.options[k].fwd_s, bwd_s=e.options[k].bwd_s)
                for k, c in m.options.items()
            },
        )
        for m, e in zip(measured.blocks, est.blocks, strict=True)
    )
    return dataclasses.replace(
        measured,
        blocks=blocks,
        step_s=est.step_s,
        fwd_s=est.fwd_s,
        bwd_s=est.bwd_s,
        step_s_by_option=dict(est.step_s_by_option),
    )


def test_plans_match_measured_and_predict_the_real_peak(pair: tuple) -> None:
    name, wl, measured, est = pair
    reference = _with_times_of(measured, est)
    costs = ChainCosts.from_stats(est, margin=0.0)
    need, _ = min_budget(costs)
    budgets = [int(need + f * (est.peak_bytes - need)) for f in (0.05, 0.5)]
    recomputed_somewhere = False
    for budget in budgets:
        got = plan_for_budget(wl, budget, stats=est, margin=0.0).plan
        want = plan_for_budget(wl, budget, stats=reference, margin=0.0).plan
        assert [b.option for b in got.blocks] == [b.option for b in want.blocks], (name, budget)
        assert got.segments == want.segments
        assert got.predicted_peak_bytes == want.predicted_peak_bytes
        recomputed_somewhere |= bool(got.recomputed)
    assert recomputed_somewhere, "the budgets should make the planner recompute"
    # The plan at the tightest budget, run for real: its peak within 2 % of the prediction.
    plan = plan_for_budget(wl, budgets[0], stats=est, margin=0.0).plan
    (row,) = measure_setups(wl, {"memfit": plan_setup(plan)}, batch_size=2, optimizer="sgd", repeats=1)
    assert abs(row.peak_bytes - plan.predicted_peak_bytes) <= 0.02 * row.peak_bytes, (
        name,
        row.peak_bytes,
        plan.predicted_peak_bytes,
    )


def test_adamw_step_counters_are_the_only_difference() -> None:
    spec, seq_len = MODELS["demo"]
    wl = load_workload(spec, seq_len=seq_len)
    measured = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep",), heads=False)
    est = estimate_stats(wl, device=DEVICE, options=("keep",), gpu_kernels=False, step=StepSpec(batch_size=2))
    for e, m in zip(est.blocks, measured.blocks, strict=True):
        assert e.options["keep"] == dataclasses.replace(m.options["keep"], fwd_s=e.fwd_s, bwd_s=e.bwd_s)
    # AdamW keeps a 0-dim float32 `step` per parameter; on a GPU it stays on the host, so the
    # estimate leaves it out and the measured CPU step counts it.
    counters = 4 * sum(1 for p in wl.model.parameters() if p.requires_grad)
    assert measured.start_bytes - est.start_bytes == counters
    assert measured.peak_bytes - est.peak_bytes == counters


@pytest.mark.slow  # about 6 s on 2 cores: the fast tier keeps to about 4 minutes
def test_step_peaks_match_the_fake_step_without_hooks() -> None:
    """The per-block hooks change nothing: each option's peak is :func:`estimate`'s for it."""
    spec, seq_len = MODELS["gpt2"]
    wl = load_workload(spec, seq_len=seq_len)
    est = estimate_stats(wl, device=DEVICE, activations=False, step=StepSpec(batch_size=2, dtype=torch.bfloat16))
    for mode, policy in (("keep", "none"), ("recompute", "all")):
        ref = estimate(wl, device=DEVICE, policy=policy, step=StepSpec(batch_size=2, dtype=torch.bfloat16))
        assert est.measured_peak_bytes_by_option[mode] == ref.peak_bytes, mode
        assert est.calibration.estimated.flops_by_option[mode] == ref.flops, mode
    assert est.dtype == "bfloat16" and est.calibration.estimated.kernels == "cuda"


@pytest.mark.slow  # about 5 s on 2 cores: the fast tier keeps to about 4 minutes
def test_block_seconds_are_its_flops_at_the_roofline() -> None:
    spec, seq_len = MODELS["demo"]
    wl = load_workload(spec, seq_len=seq_len)
    dev = get_device(DEVICE)
    est = estimate_stats(wl, device=dev, mfu=0.5, gpu_kernels=False, step=StepSpec(batch_size=2))
    # by hand: the block's four linears (3C, C, 4C, C outputs) and attention's two matmuls
    B, T, C = 2, seq_len, 64
    linear = 2 * B * T * (3 * C * C + C * C + 4 * C * C + 4 * C * C)
    attention = 2 * 2 * B * T * T * C  # q k^T and p v, the full T x T as torch counts it
    rate = dev.peak_flops_per_s(torch.float32) * 0.5
    b = est.blocks[1]
    assert b.fwd_s == pytest.approx((linear + attention) / rate, rel=1e-9)
    # backward: two matmuls per linear; attention's backward recomputes q k^T and has four
    # more (torch's sdpa_backward_flop_count): 2.5 times its forward
    assert b.bwd_s == pytest.approx((2 * linear + 2.5 * attention) / rate, rel=1e-9)
    assert b.options["recompute"].bwd_s == pytest.approx(b.bwd_s + b.fwd_s, rel=1e-9)  # one more forward
    assert ChainCosts.from_stats(est).time_scales.recompute_time_scale_measured == pytest.approx(1.0, rel=1e-6)


@pytest.mark.slow  # about 12 s on 2 cores: the fast tier keeps to about 4 minutes
def test_autofit_with_estimated_stats_measures_nothing() -> None:
    wl = load_fake_workload(MODELS["demo"][0], seq_len=MODELS["demo"][1])
    fn = stats_fn(wl, device="a100-80gb", step=StepSpec(optimizer="sgd"))
    small = fn(1)
    res = autofit(wl, small.peak_bytes * 3, 8, step=StepSpec(optimizer="sgd"), measure=False, stats_fn=fn)
    assert res.measured_peak_bytes is None and res.measurements == ()
    assert res.estimated is not None and res.estimated.device == "a100-80gb"
    # the utilisation fitted to a published A100 run (the default where the device class has one)
    a100_mfu = published_mfu(get_device("a100-80gb")).mfu
    assert res.to_dict()["estimated"] == {"device": "a100-80gb", "mfu": a100_mfu, "kernels": "cuda"}
    assert res.predicted_peak_bytes <= small.peak_bytes * 3
    assert all(
        st.calibration.estimated is not None and st.calibration.estimated.device == "a100-80gb"
        for st in res.profiles.values()
    )


def test_unknown_options_and_devices_raise() -> None:
    wl = load_fake_workload("demo?n_layer=2")
    with pytest.raises(SpecError, match="h100-sxm"):
        estimate_stats(wl, device="h1000")
    with pytest.raises(SpecError, match="no published"):
        estimate_stats(wl, device="cpu")
    with pytest.raises(SpecError, match="cannot be estimated"):
        estimate_stats(wl, device=DEVICE, options=("keep", "offload"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "memfit.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        (["--estimate", "--target", "h1000"], "unknown --target 'h1000'. Use one of: a100-40gb"),
        (["--estimate"], "--estimate needs --target NAME"),
        (["--target", "h100"], "add --estimate"),
        (["--estimate", "--target", "h100", "--measure"], "--measure"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "fit"])
def test_cli_errors_are_one_line(command: str, extra: list[str], want: str, capsys: pytest.CaptureFixture[str]) -> None:
    if command == "fit":
        if "--measure" in extra:
            extra = [*extra[:-1], "--report", "x.png"]
            want = "--report"
        extra = [*extra, "--global-batch", "4"]
    code = main([command, "--model", "demo?n_layer=2", "--budget", "30MiB", *extra])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0
    assert len(lines) == 1 and want in lines[0] and lines[0].startswith(f"memfit {command}:"), err


@pytest.mark.slow
def test_cli_fit_estimate_json() -> None:
    r = _cli(
        "fit",
        "--model",
        "demo?n_layer=2",
        "--budget",
        "40MiB",
        "--global-batch",
        "8",
        "--estimate",
        "--target",
        "a100",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["measured_peak_bytes"] is None and d["measured_samples_per_s"] is None
    assert d["estimated"]["device"] == "a100-80gb"


@pytest.mark.slow
def test_llama_7b_layers_plan_without_allocating() -> None:
    """Two Llama-7B layers (with its 32k-token embedding and head) at 4096 tokens in bf16: a step
    of about 6.8 GiB (more reserved), planned for an H100 while this process stays far below that."""
    spec = (
        "hf:llama?hidden_size=4096&intermediate_size=11008&num_attention_heads=32&num_key_value_heads=32"
        "&num_hidden_layers=2&vocab_size=32000&max_position_embeddings=4096"
    )
    args = [
        "plan",
        "--model",
        spec,
        "--seq-len",
        "4096",
        "--batch-size",
        "1",
        "--dtype",
        "bfloat16",
        "--budget",
        "7GiB",
        "--estimate",
        "--target",
        "h100-sxm",
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memfit.cli.main", *args], stdout=out, stderr=err, text=True, env=env
        )
        # this child's own peak resident set (RUSAGE_CHILDREN would be the largest of every child
        # the test session waited for, earlier tests' included)
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    rss_bytes = usage.ru_maxrss * 1024
    assert proc.returncode == 0, stderr
    d = json.loads(stdout)
    assert d["baseline_peak_bytes"] > 6 * 2**30
    # on a GPU the budget is reserved memory: the plan's replayed step reserves at most 7 GiB
    assert d["budget_means"] == "reserved" and d["predicted_reserved_bytes"] <= 7 * 2**30
    assert d["predicted_peak_bytes"] < 7 * 2**30 and d["recomputed_blocks"] >= 1
    assert d["estimated"]["device"] == "h100-sxm"
    assert rss_bytes < 1.5 * 2**30, rss_bytes
