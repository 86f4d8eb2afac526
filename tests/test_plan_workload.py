"""A plan file names the workload it was made for: a command given the file and no --model builds that one
(it built the demo model and reported a mismatch)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.errors import PlanFileError
from memfit.plan.types import Plan

SPEC = "demo?n_layer=2&n_embd=32&seq_len=32"


def run_json(*argv: str) -> tuple[int, dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main([*argv, "--json"])
    return code, json.loads(buf.getvalue())


def test_verify_with_a_plan_file_and_no_model_builds_the_plans_workload(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    code, _ = run_json("plan", "--model", SPEC, "--batch-size", "4", "--policy", "all", "--out", str(out))
    assert code == 0
    assert json.loads(out.read_text())["workload"] == SPEC
    code, res = run_json("verify", "--plan", str(out), "--batch-size", "4", "--repeats", "0")
    assert code == 0 and res["ok"], res  # the demo model would be refused: made for another model


def test_an_explicit_model_wins_and_a_file_without_one_means_demo(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert run_json("plan", "--model", SPEC, "--batch-size", "4", "--policy", "all", "--out", str(out))[0] == 0
    data = json.loads(out.read_text())
    del data["workload"]
    out.write_text(json.dumps(data))
    code, res = run_json("verify", "--plan", str(out), "--batch-size", "4", "--repeats", "0")
    assert code == 2 and "made for another model" in res["error"]  # the demo model, as before
    code, res = run_json("verify", "--model", SPEC, "--plan", str(out), "--batch-size", "4", "--repeats", "0")
    assert code == 0 and res["ok"]


@pytest.mark.parametrize("value", [5, "", "  ", ["demo"]])
def test_a_workload_that_is_not_a_spec_is_refused(value: object) -> None:
    plan = Plan.from_dict(json.loads(json.dumps(_minimal())))
    data = {**plan.to_dict(), "workload": value}
    with pytest.raises(PlanFileError, match='"workload"'):
        Plan.from_dict(data)


def _minimal() -> dict:
    return {"format": "memfit.plan", "version": Plan.from_dict.__globals__["PLAN_FORMAT_VERSION"], "policy": "none",
            "chain_path": "", "blocks": [{"name": "b.0", "option": "keep"}]}  # fmt: skip
