"""The command line as users run it: JSON contracts, exit codes, errors with the fix."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.models.registry import load_workload
from memfit.plan import policy_plan

ROOT = Path(__file__).resolve().parents[1]
CONVNET = str(ROOT / "examples" / "convnet.py") + ":build"
SETS = str(ROOT / "examples" / "custom_mlp.py") + ":build"
DEMO_SMALL = "demo?n_layer=4&n_embd=32&seq_len=32"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.mark.slow
def test_verify_hf_gpt2_policy_all_entry_point() -> None:
    """The foundation issue's done-when command, through the installed entry point."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit.cli.main",
            "verify",
            "--model",
            "hf:gpt2",
            "--policy",
            "all",
            "--json",
            "--repeats",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["ok"] is True
    assert res["max_grad_rel_err"] <= 1e-5
    assert res["buffers_equal"] is True
    assert res["measured_peak_bytes"] < res["baseline_peak_bytes"]


def test_verify_file_workload_with_batchnorm_and_dropout(capsys) -> None:
    for policy in ("all", "sqrt", "every:2"):
        code, res = run_json(capsys, "verify", "--model", CONVNET, "--policy", policy, "--repeats", "0")
        assert code == 0 and res["ok"] and res["buffers_equal"], (policy, res)
        assert res["max_grad_rel_err"] <= 1e-5
        assert res["measured_peak_bytes"] < res["baseline_peak_bytes"]


@pytest.mark.slow
def test_verify_named_selective_and_offload_plans_and_a_fused_budget_plan(capsys) -> None:
    """`--policy` takes what `memfit explain` takes (selective presets, op lists, offload); a
    `--budget` plan with `--options all` on GPT-2 fuses its gelu_new and still verifies."""
    tiny = "hf:gpt2?num_hidden_layers=2&hidden_size=32&n_inner=64&num_attention_heads=2&vocab_size=256"
    for policy in ("selective:save_matmuls", "selective:save:aten.addmm.default@1", "offload"):
        code, res = run_json(
            capsys,
            "verify",
            "--model",
            tiny,
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--policy",
            policy,
            "--repeats",
            "0",
        )
        assert code == 0 and res["ok"] and res["buffers_equal"], (policy, res)
    code, res = run_json(
        capsys,
        "verify",
        "--model",
        tiny,
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--budget",
        "1GiB",
        "--options",
        "all",
        "--repeats",
        "0",
    )
    assert code == 0 and res["ok"], res
    code, plan = run_json(
        capsys, "plan", "--model", tiny, "--seq-len", "16", "--batch-size", "2", "--budget", "1GiB", "--repeats", "1"
    )
    assert code == 0 and plan["activations"] == "fused", plan


def test_profile_json_contract(capsys) -> None:
    code, res = run_json(capsys, "profile", "--model", DEMO_SMALL, "--batch-size", "2", "--repeats", "1")
    assert code == 0
    assert len(res["blocks"]) == 4
    for b in res["blocks"]:
        assert {"name", "fwd_s", "bwd_s", "saved_bytes", "output_bytes"} <= b.keys()
        assert b["saved_bytes"] > 0 and b["output_bytes"] > 0
    assert res["peak_bytes"] > 0 and res["step_s"] > 0


@pytest.mark.slow  # about 7 s on 2 cores: the fast tier keeps to about 4 minutes
def test_plan_out_measure_then_verify_the_plan_file(capsys, tmp_path: Path) -> None:
    code, prof = run_json(capsys, "profile", "--model", SETS, "--repeats", "1")
    budget = int(prof["peak_bytes"] * 0.85)
    plan_file = tmp_path / "plan.json"
    code, res = run_json(
        capsys, "plan", "--model", SETS, "--budget", str(budget), "--out", str(plan_file), "--measure", "--repeats", "1"
    )
    assert code == 0
    for key in (
        "budget_bytes",
        "predicted_peak_bytes",
        "predicted_step_s",
        "baseline_peak_bytes",
        "baseline_step_s",
        "blocks",
        "measured_peak_bytes",
        "measured_step_s",
    ):
        assert key in res, key
    assert res["budget_bytes"] == budget
    assert res["measured_peak_bytes"] <= budget
    assert abs(res["measured_peak_bytes"] - res["predicted_peak_bytes"]) <= 0.1 * res["measured_peak_bytes"]
    assert all(b["option"] in ("keep", "recompute", "selective", "offload") for b in res["blocks"])
    code, ver = run_json(capsys, "verify", "--model", SETS, "--plan", str(plan_file), "--repeats", "0")
    assert code == 0 and ver["ok"]
    code, ver = run_json(capsys, "verify", "--model", SETS, "--budget", str(budget), "--repeats", "0")
    assert code == 0 and ver["ok"] and ver["measured_peak_bytes"] <= budget


@pytest.mark.parametrize(
    "policy", [pytest.param("all", marks=pytest.mark.slow), "sqrt", pytest.param("every:2", marks=pytest.mark.slow)]
)
def test_plan_policy_predicts_what_a_run_of_that_policy_measures(capsys, tmp_path: Path, policy: str) -> None:
    """`memfit plan --policy P` (DESIGN: --policy wherever --budget is): the policy's plan predicted from
    the keep/recompute profile, against the same plan run and tracked in --measure; the plan file is
    the policy's and verifies."""
    plan_file = tmp_path / "plan.json"
    code, res = run_json(
        capsys, "plan", "--model", CONVNET, "--policy", policy, "--measure", "--repeats", "1", "--out", str(plan_file)
    )
    assert code == 0, res
    assert res["budget_bytes"] is None and res["within_budget"] is None
    assert res["measured_peak_bytes"] < res["baseline_peak_bytes"]  # the policy saves memory here
    assert abs(res["measured_peak_bytes"] - res["predicted_peak_bytes"]) <= 0.02 * res["measured_peak_bytes"]
    want = policy_plan(load_workload(CONVNET).model, policy)
    assert [b["option"] for b in res["blocks"]] == [b.option.value for b in want.blocks]
    assert [(s["start"], s["stop"]) for s in res["segments"]] == [(s.start, s.stop) for s in want.segments]
    expected = run_json(capsys, "verify", "--model", CONVNET, "--policy", policy, "--repeats", "0")[1]
    code, ver = run_json(capsys, "verify", "--model", CONVNET, "--plan", str(plan_file), "--repeats", "0")
    assert code == 0 and ver["ok"]
    assert ver["measured_peak_bytes"] == expected["measured_peak_bytes"]  # the file holds the policy's plan


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--policy", "offload"], "memfit verify --policy offload"),
        (["--policy", "all", "--budget", "1GiB"], "not allowed with"),
        (
            ["--policy", "all", "--options", "all"],
            "--policy all fixes the plan; give one of them",
        ),  # --estimate works: tests/test_fit_policy.py
        ([], "one of the arguments --budget --policy is required"),
    ],
)
def test_plan_policy_refusals(capsys, argv: list[str], fragment: str) -> None:
    code, res = run_json(capsys, "plan", "--model", CONVNET, *argv)
    assert code == 2 and fragment in res["error"], res


def test_plan_file_for_another_model_is_refused(capsys, tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    code, _ = run_json(capsys, "plan", "--model", SETS, "--budget", "1GiB", "--out", str(plan_file), "--repeats", "1")
    assert code == 0
    code, res = run_json(capsys, "verify", "--model", CONVNET, "--plan", str(plan_file))
    assert code == 2 and res["error_type"] == "PlanMismatchError"
    assert "memfit plan" in res["error"]


def test_infeasible_budget_exit_2_with_minimum(capsys) -> None:
    code, res = run_json(capsys, "plan", "--model", SETS, "--budget", "10KiB", "--repeats", "1")
    assert code == 2 and res["error_type"] == "BudgetInfeasibleError"
    # every placement of the model states is named with why it does not fit, and the least budget found
    assert "Raise the budget to at least" in res["error"]
    assert all(f"{m}: " in res["error"] for m in ("device", "step-in-backward", "host-optimizer", "host-params"))


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["verify", "--model", "nonsense"], "hf:TYPE"),
        (["verify", "--model", "hf:llama?num_hidden_layerz=2"], "num_hidden_layers"),
        (["verify", "--model", "missing.py:build"], "no file"),
        (["verify", "--model", DEMO_SMALL, "--policy", "half"], "every:K"),
        (["verify", "--model", DEMO_SMALL, "--global-batch", "8"], "--micro-batch"),
    ],
)
def test_bad_input_gives_an_error_with_the_fix(capsys, argv, fragment) -> None:
    code, res = run_json(capsys, *argv)
    assert code == 2 and res["ok"] is False
    assert fragment in res["error"]


def test_verify_accumulation_fp64(capsys) -> None:
    code, res = run_json(
        capsys,
        "verify",
        "--model",
        DEMO_SMALL,
        "--global-batch",
        "8",
        "--micro-batch",
        "3",
        "--dtype",
        "float64",
        "--policy",
        "all",
    )
    assert code == 0 and res["ok"]
    assert res["max_grad_rel_err"] <= 1e-10


@pytest.mark.slow  # about 6 s on 2 cores: the fast tier keeps to about 4 minutes
def test_demo_smoke(capsys, tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    code, res = run_json(capsys, "demo", "--model", DEMO_SMALL, "--steps", "4", "--report", str(png))
    assert code == 0
    assert res["measured_peak_bytes"] < res["baseline_peak_bytes"]
    assert res["verify"]["ok"] and len(res["losses"]) == 4
    assert png.stat().st_size > 1000
    html = png.with_suffix(".html")  # the HTML report beside the plot; its JSON is the demo's
    assert res["report_html"] == str(html)
    blob = json.loads(re.search(r'id="memfit-data">(.*?)</script>', html.read_text(), re.S).group(1))
    assert {k: v for k, v in blob.items() if k != "report_data"} == res
    assert blob["report_data"]["command"] == "demo" and len(blob["report_data"]["timelines"]) == 2


def test_help_lists_the_commands() -> None:
    proc = subprocess.run([sys.executable, "-m", "memfit.cli.main", "--help"], capture_output=True, text=True, cwd=ROOT)
    for cmd in ("demo", "profile", "plan", "verify", "train"):
        assert cmd in proc.stdout
