"""``--device`` on the measuring commands and ``--target`` for estimates (memfit.cli.device), and
workloads built on a device (``load_workload(device=)``). No GPU here: the CUDA paths run on the
meta device where the code allows, and the default choice with ``torch.cuda.is_available`` patched."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from memfit.capture.step import StepSpec
from memfit.cli import device as cli_device
from memfit.cli.common import Output, step_from_args
from memfit.cli.main import main
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.workload import iter_tensors

TINY = "demo?n_layer=2&n_embd=32&n_head=2"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


@pytest.mark.parametrize("spec", [TINY, "examples/convnet.py:build"])
def test_a_workload_built_on_a_device_has_its_model_and_batches_there(spec: str) -> None:
    wl = load_workload(spec, device="meta")
    assert {p.device.type for p in wl.model.parameters()} == {"meta"}
    assert {t.device.type for t in iter_tensors(wl.make_batch(2))} == {"meta"}
    if wl.make_batch_at is not None:
        assert {t.device.type for t in iter_tensors(wl.make_batch_at(2, 8))} == {"meta"}


def test_the_same_weights_and_batches_on_any_device() -> None:
    plain, on_cpu = load_workload(TINY, seed=3), load_workload(TINY, seed=3, device="cpu")
    for a, b in zip(plain.model.parameters(), on_cpu.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.manual_seed(0)
    x = iter_tensors(plain.make_batch(2))
    torch.manual_seed(0)
    y = iter_tensors(on_cpu.make_batch(2))
    for a, b in zip(x, y, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("available, expected", [(False, "cpu"), (True, "cuda")])
def test_the_default_device_is_cuda_when_available(monkeypatch, available: bool, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert cli_device.default_device().type == expected


def test_the_default_device_is_said_and_set_on_the_step(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    args = argparse.Namespace(device=None, batch_size=2, seed=0)
    got = cli_device.resolve_device(args, Output(json_mode=False), command="profile")
    assert got == {"device": "cuda"} and args.device == "cuda"
    assert "device: cuda (NVIDIA H100 80GB HBM3) (the default: CUDA is available)" in capsys.readouterr().out
    assert step_from_args(args).device == "cuda"


@pytest.mark.slow
def test_plan_on_the_cpu_is_the_plan_of_a_model_built_without_a_device(capsys) -> None:
    # at the least budget the plan does not hang on timing noise: memory alone decides it
    wl, step = load_workload(TINY, seq_len=16), StepSpec(batch_size=2, repeats=1)
    first = plan_for_budget(wl, 1 << 40, step=step)
    ref = plan_for_budget(wl, first.min_budget_bytes, stats=first.stats)
    code, d, _ = run_json(
        capsys, "plan", "--model", TINY, "--seq-len", "16", "--batch-size", "2", "--budget", str(first.min_budget_bytes),
        "--repeats", "1", "--device", "cpu",
    )  # fmt: skip
    assert code == 0 and d["device"] == "cpu" and "measured_choice" not in d
    want = ref.to_dict()
    for key in (
        "blocks",
        "segments",
        "head",
        "activations",
        "predicted_peak_bytes",
        "min_budget_bytes",
        "baseline_peak_bytes",
    ):
        assert d[key] == json.loads(json.dumps(want[key])), key


def test_the_old_device_spelling_moves_to_target_with_a_note(capsys) -> None:
    args = argparse.Namespace(device="h100-sxm", target=None, estimate=True)
    got = cli_device.resolve_device(args, Output(json_mode=True), command="plan")
    assert args.target == "h100-sxm" and args.device == "cpu"
    assert got["warnings"] == [
        "--device h100-sxm names the GPU to estimate for: that is --target h100-sxm now (--device is where the model "
        "runs: cpu, cuda or cuda:N); the old spelling still works for now."
    ]
    assert "--target h100-sxm now" in capsys.readouterr().err
    kept = argparse.Namespace(device="cpu", target=None, estimate=False)  # --device cpu runs here: no note
    assert cli_device.resolve_device(kept, Output(json_mode=True), command="plan") == {"device": "cpu"}


@pytest.mark.slow
def test_the_old_device_spelling_names_the_estimate_target_with_a_note(capsys) -> None:
    argv = ["plan", "--model", "hf:gpt2?n_layer=2&n_embd=64&n_head=2", "--budget", "2GiB", "--estimate"]
    code_new, new, err_new = run_json(capsys, *argv, "--target", "h100-sxm")
    code_old, old, err_old = run_json(capsys, *argv, "--device", "h100-sxm")
    assert code_new == code_old == 0
    assert old["estimated"]["device"] == new["estimated"]["device"] == "h100-sxm"
    assert old["predicted_peak_bytes"] == new["predicted_peak_bytes"]
    assert "warnings" not in new and "--target h100-sxm now" in old["warnings"][0]
    assert "--target h100-sxm now" in err_old and "--target" not in err_new.replace("warning", "")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["plan", "--budget", "1GiB", "--device", "cuda"], "CUDA is not available here"),
        (["profile", "--device", "tpu"], "unknown device 'tpu'"),
        (["plan", "--budget", "1GiB", "--target", "h100-sxm"], "add --estimate, or leave out --target"),
        (["plan", "--budget", "1GiB", "--estimate", "--device", "h200", "--target", "h100-sxm"], "give --target h100-sxm alone"),
        (["plan", "--budget", "1GiB", "--estimate"], "--estimate needs --target NAME"),
    ],
)  # fmt: skip
def test_device_refusals(capsys, argv: list[str], fragment: str) -> None:
    code, d, _ = run_json(capsys, *argv)
    assert code == 2 and d["ok"] is False and fragment in d["error"], d


@pytest.mark.slow
def test_the_suggested_estimate_call_is_accepted(capsys) -> None:
    code, d, _ = run_json(capsys, "plan", "--budget", "1GiB", "--target", "h100-sxm")
    suggested = d["error"].split("; add ")[1].split(", or leave out")[0].split()
    code, d, _ = run_json(
        capsys, "plan", "--model", "hf:gpt2?n_layer=2&n_embd=64&n_head=2", "--budget", "2GiB", "--target", "h100-sxm",
        *suggested,
    )  # fmt: skip
    assert code == 0 and d["estimated"]["device"] == "h100-sxm"


@pytest.mark.parametrize(
    "command", [["profile", "--repeats", "1"], ["verify", "--policy", "all"], ["explain", "--policy", "all"]]
)
def test_measuring_commands_take_device_cpu(capsys, command: list[str]) -> None:
    code, d, err = run_json(capsys, command[0], "--model", TINY, "--seq-len", "8", "--device", "cpu", *command[1:])
    assert code in (0, 1) and d["device"] == "cpu", (code, d.get("error"), err)


def test_estimate_names_its_gpu_with_target_as_plan_and_fit_do(capsys) -> None:
    # `memfit estimate` has no device it runs on: --device and --target both name the GPU estimated for.
    argv = ["estimate", "--model", "demo?n_layer=2&n_embd=32&seq_len=32", "--batch-size", "2"]
    code, by_target, _ = run_json(capsys, *argv, "--target", "h100-sxm")
    assert code == 0 and by_target["device"] == "h100-sxm"
    code, by_device, _ = run_json(capsys, *argv, "--device", "h100-sxm")
    keys = ("device", "peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "fits", "states", "step_s")
    assert code == 0 and {k: by_device[k] for k in keys} == {k: by_target[k] for k in keys}
