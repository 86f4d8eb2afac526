"""Plan files: one schema (memfit.plan.schema, checked by Plan.from_dict) for every reader.

A file is either a plan this version writes, read with every field as written, or refused with
one line (PlanFileError, exit 2 on the command line). Fuzzed: valid plans mutated (keys dropped or
added, values replaced by other types and out-of-range numbers) are loaded or refused, never
another exception and never a field silently dropped or changed.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.cli.main import main
from memfit.errors import MemfitError, PlanFileError
from memfit.plan.types import BlockDecision, Option, Plan, Segment

ROOT = Path(__file__).resolve().parents[1]


def valid_plan() -> dict[str, Any]:
    """A plan with every kind of field this version writes."""
    plan = Plan(
        policy="memfit",
        chain_path="h",
        blocks=(
            BlockDecision(name="h.0", option=Option.KEEP, tiles=2, tiled=("mlp",)),
            BlockDecision(name="h.1", option=Option.RECOMPUTE, host_input=True),
            BlockDecision(name="h.2", option=Option.SELECTIVE, policy="save_matmuls"),
            BlockDecision(name="h.3", option=Option.KEEP),
            BlockDecision(name="h.4", option=Option.RECOMPUTE),
        ),
        segments=(Segment(start=3, stop=5),),
        fingerprint={
            "model": {"class": "GPT", "chain_path": "h", "n_blocks": 5, "block_types": ["Block"] * 5,
                      "n_params": 1000, "dtype": "float32", "params_digest": "abc"},
            "batch": [{"shape": [2, 16], "dtype": "int64"}],
        },
        budget_bytes=2**20, predicted_peak_bytes=2**19, predicted_step_s=0.01, states="step-in-backward",
        workload="demo?n_layer=4", margin=0.02, min_budget_bytes=2**18, micro_batch=2, accumulation_steps=2,
    )  # fmt: skip
    return plan.to_dict()


@functools.cache
def repo_plans() -> list[dict[str, Any]]:
    """The plan files kept in the repository (benchmarks' results), which must stay valid."""
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if x.get("format") == "memfit.plan":
                found.append(x)
            else:
                for v in x.values():
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for path in sorted([*ROOT.glob("benchmarks/**/*.json"), *ROOT.glob("tests/**/*.json")]):
        try:
            walk(json.loads(path.read_text()))
        except (ValueError, UnicodeDecodeError):
            continue
    return found


def load(data: Any) -> Plan:
    return Plan.from_dict(data, source="'p.json'")


def test_every_plan_kept_in_the_repository_loads() -> None:
    plans = repo_plans()
    assert len(plans) >= 20
    for data in plans:
        assert load(data).to_dict()["blocks"] == [
            {("option" if k == "action" else k): v for k, v in b.items()} for b in data["blocks"]
        ]


def refused(data: Any, fragment: str) -> None:
    with pytest.raises(PlanFileError) as info:
        load(data)
    line = str(info.value)
    assert "\n" not in line and fragment in line, line


def mutated(**changes: Any) -> dict[str, Any]:
    d = valid_plan()
    for path, value in changes.items():
        *parents, key = path.split("__")
        obj: Any = d
        for p in parents:
            obj = obj[int(p)] if p.isdigit() else obj[p]
        obj[int(key) if key.isdigit() else key] = value
    return d


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (mutated(extra_key=1), "unknown key(s) 'extra_key'"),
        (mutated(blocks__0__tile=4), "block 0 has unknown key(s) 'tile'"),
        (mutated(segments__0__end=3), "unknown key(s) 'end'"),
        (mutated(fingerprint__model__dtypes="float32"), "unknown key(s) 'dtypes'"),
        (mutated(version=True), '"version" is True'),
        (mutated(version=1.0), '"version" is 1.0'),
        (mutated(budget_bytes=0), '"budget_bytes" is 0'),
        (mutated(budget_bytes=1.5), "whole number of bytes"),
        (mutated(extra__min_budget_bytes=-1), '"extra.min_budget_bytes" is -1'),
        (mutated(extra__margin=-5), '"extra.margin" is -5'),
        (mutated(extra__margin=1.5), '"extra.margin" is 1.5'),
        (mutated(extra__micro_batch=0), '"extra.micro_batch" is 0'),
        (mutated(fingerprint=None), '"fingerprint" is None'),
        (mutated(fingerprint=[]), '"fingerprint" is []'),
        (mutated(fingerprint__batch="x"), '"fingerprint.batch"'),
        (mutated(fingerprint__batch__0__shape=[2, "16"]), "shape"),
        (mutated(fingerprint__model__n_blocks=True), "n_blocks"),
        (mutated(blocks__0__tiles=10**9), "1000000000 tiles and a row of its batch has 16 tokens"),
        (mutated(blocks__0__tiles=17), "at most 16 tiles"),
        (mutated(segments__0__start=True), "integer start and stop"),
    ],
    ids=str,
)
def test_a_field_no_plan_has_is_refused(data: dict[str, Any], fragment: str) -> None:
    refused(data, fragment)


def test_tiles_up_to_the_tokens_of_a_row_load() -> None:
    assert load(mutated(blocks__0__tiles=16)).blocks[0].tiles == 16


# Values a mutation puts anywhere: other types, out-of-range and absurd numbers.
HOSTILE = st.sampled_from(
    [None, True, False, 0, -1, -5, 1, 2, 1.5, 1e9, 10**30, "", "x", "float64", [], [1], {}, {"a": 1}, "save_matmuls"]
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutants(draw: Any) -> dict[str, Any]:
    d = copy.deepcopy(draw(st.sampled_from([valid_plan(), *repo_plans()[:6]])))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(d)
        path = draw(st.sampled_from(paths))
        *parents, key = path
        obj = d
        for p in parents:
            obj = obj[p]
        how = draw(st.sampled_from(["replace", "drop", "add"]))
        if how == "replace":
            obj[key] = copy.deepcopy(draw(HOSTILE))
        elif how == "drop" and isinstance(obj, dict):
            del obj[key]
        elif isinstance(obj, dict):
            obj[draw(st.sampled_from(["x", "tiles", "extra", "option", "bogus"]))] = copy.deepcopy(draw(HOSTILE))
    return d


def _same_fields(data: dict[str, Any], plan: Plan) -> None:
    """Every field of an accepted file reads back as written (nothing dropped or coerced)."""
    out = plan.to_dict()
    for key in ("format", "version", "policy", "chain_path", "head", "activations", "workload", "fingerprint",
                "budget_bytes", "predicted_peak_bytes", "predicted_step_s"):  # fmt: skip
        if key in data and data[key] is not None:
            same_kind = key == "predicted_step_s" or type(out.get(key)) is type(data[key])  # seconds: int or float
            assert out.get(key) == data[key] and same_kind, (key, data[key], out.get(key))
    for given_block, read in zip(data["blocks"], out["blocks"], strict=True):
        for key, value in given_block.items():
            key = "option" if key == "action" else key
            if value not in (None, False, [], ()):
                assert read.get(key) == value, (key, value, read)
    assert load(out) == plan  # what it writes, it reads


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutants())
def test_a_mutated_plan_is_read_as_written_or_refused_in_one_line(data: dict[str, Any]) -> None:
    try:
        plan = load(data)
    except MemfitError as err:
        assert "\n" not in str(err) and str(err).startswith("memfit.plan: 'p.json' is not a valid memfit plan: ")
        return
    _same_fields(data, plan)


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--device", "h100-sxm"],
        ["train", "--global-batch", "2", "--steps", "1"],
        ["verify", "--batch-size", "2"],
        ["explain", "--batch-size", "2", "--repeats", "0"],
    ],
    ids=lambda a: a[0],
)
def test_every_reader_refuses_an_unknown_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(mutated(blocks__0__tile=4)))
    code = main(
        [argv[0], "--model", "demo?n_layer=4&n_embd=16&n_head=2&seq_len=16", *argv[1:], "--plan", str(path), "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and "unknown key(s) 'tile'" in out["error"] and out["error_type"] == "PlanFileError", out


def test_train_refuses_a_batch_of_other_tensors_as_verify_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan whose batch fingerprint is of another dtype: verify and train refuse it alike (train's
    micro-batch may differ from the plan's, so only the first dimension is not compared)."""
    from memfit.models.registry import load_workload
    from memfit.plan.policies import policy_plan

    spec = "demo?n_layer=2&n_embd=16&n_head=2&seq_len=8"
    wl = load_workload(spec)
    data = policy_plan(wl.model, "all", batch=wl.make_batch(2)).to_dict()
    assert data["fingerprint"]["batch"][0]["dtype"] == "int64"
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(data))
    data["fingerprint"]["batch"][0]["dtype"] = "float64"
    bad.write_text(json.dumps(data))
    lines = {}
    for command, extra in (
        ("verify", ["--batch-size", "2", "--repeats", "0"]),
        ("train", ["--global-batch", "2", "--steps", "1"]),
    ):
        code = main([command, "--model", spec, *extra, "--plan", str(bad), "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 2 and out["error_type"] == "PlanMismatchError", out
        lines[command] = out["error"]
    assert all("batch: plan float64[2, 8]" in line for line in lines.values()), lines
    # another micro-batch of the same tensors trains
    code = main(
        [
            "train",
            "--model",
            spec,
            "--global-batch",
            "4",
            "--micro-batch",
            "4",
            "--steps",
            "1",
            "--plan",
            str(good),
            "--json",
        ]
    )
    assert code == 0, capsys.readouterr().out


def test_train_refuses_a_plan_predicted_for_parameters_of_another_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A float32 plan's predicted peak does not hold for a float64 model: train refuses it before any
    step, and the fix it names (train in the plan's dtype) trains. Verify still applies it to its
    float64 reference, which is how gradients are compared."""
    spec = "demo?n_layer=2&n_embd=16&n_head=2&seq_len=8"
    plan = tmp_path / "p.json"
    assert main(["plan", "--model", spec, "--policy", "all", "--batch-size", "2", "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    data = json.loads(plan.read_text())
    assert data["fingerprint"]["model"]["dtype"] == "float32" and data["predicted_peak_bytes"] > 0
    base = ["train", "--model", spec, "--global-batch", "2", "--steps", "1", "--plan", str(plan), "--json"]
    code = main([*base, "--dtype", "float64"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["error_type"] == "PlanMismatchError", out
    assert "predicted for float32 parameters and the model's are float64" in out["error"]
    assert "(--dtype float32)" in out["error"]
    code = main([*base, "--dtype", "float32"])
    assert code == 0, capsys.readouterr().out
