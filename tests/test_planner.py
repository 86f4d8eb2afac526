"""The planner end to end: measured peaks against predictions, budgets, plan files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engine import conv_workload, kw_workload

from memfit import BudgetInfeasibleError, PlanFileError, PlanMismatchError, StepSpec
from memfit.apply import apply_plan, is_applied
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan import Plan, policy_plan
from memfit.plan.costmodel import ChainCosts, predict
from memfit.profiling.blocks import profile
from memfit.verification.plans import verify

HF_SMALL = "num_hidden_layers=4&hidden_size=64&intermediate_size=128&num_attention_heads=4&vocab_size=512"
ACCURACY_WORKLOADS = [
    ("conv-bn", conv_workload, 16),
    ("kw-model", kw_workload, 8),
    ("demo", lambda: load_workload("demo?n_layer=6&n_embd=64&seq_len=64"), 4),
    ("hf:gpt2", lambda: load_workload(f"hf:gpt2?{HF_SMALL.replace('intermediate_size', 'n_inner')}", seq_len=64), 4),
    ("hf:llama", lambda: load_workload(f"hf:llama?{HF_SMALL}&num_key_value_heads=2", seq_len=64), 4),
    ("hf:bert", lambda: load_workload(f"hf:bert?{HF_SMALL}", seq_len=64), 4),
]


# The fast tier checks the two hand-written models (1 s each); demo and HF (3-5 s each) run in the full tier.
@pytest.mark.parametrize(
    ("name", "make", "batch_size"),
    [
        pytest.param(*w, id=w[0], marks=[pytest.mark.slow] if w[0] == "demo" or w[0].startswith("hf:") else [])
        for w in ACCURACY_WORKLOADS
    ],
)
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_measured_peak_within_10_percent_of_prediction_and_never_over_budget(name, make, batch_size) -> None:
    wl = make()
    stats = profile(wl, step=StepSpec(batch_size=batch_size, repeats=1))
    costs = ChainCosts.from_stats(stats)
    need = predict(costs, policy_plan(wl.model, "all")).peak_bytes
    full = stats.peak_bytes
    checked = 0
    for frac in (0.0, 0.3, 0.6, 1.0):
        budget = int(min(need, full) + frac * abs(full - need) * 1.02) + 1
        try:
            res = plan_for_budget(wl, budget, stats=stats)
        except BudgetInfeasibleError:
            continue
        plan = res.plan
        out = verify(wl, plan, step=StepSpec(batch_size=batch_size, repeats=0))
        assert out.ok, (name, budget, out)
        err = abs(out.measured_peak_bytes - plan.predicted_peak_bytes) / out.measured_peak_bytes
        assert err <= 0.10, (name, budget, out.measured_peak_bytes, plan.predicted_peak_bytes)
        assert out.measured_peak_bytes <= budget, (name, budget, out.measured_peak_bytes)
        checked += 1
    assert checked >= 2


def test_budget_below_minimum_says_the_minimum_and_breakdown() -> None:
    wl = kw_workload()
    stats = profile(wl, step=StepSpec(batch_size=8, repeats=1))
    with pytest.raises(BudgetInfeasibleError, match=r"below the minimum .* parameters .* Raise the budget") as err:
        plan_for_budget(wl, 1000, stats=stats)
    need = err.value.min_budget_bytes
    assert need > 1000
    res = plan_for_budget(wl, need, stats=stats)
    assert res.plan.predicted_peak_bytes <= need


def test_budget_above_store_all_keeps_everything() -> None:
    wl = conv_workload()
    stats = profile(wl, step=StepSpec(batch_size=8, repeats=1))
    res = plan_for_budget(wl, 10 * stats.peak_bytes, stats=stats)
    assert not res.plan.recomputed and not res.plan.segments
    assert res.plan.predicted_step_s == pytest.approx(stats.step_s)


def test_plan_file_roundtrip_and_fingerprint(tmp_path: Path) -> None:
    wl = kw_workload()
    stats = profile(wl, step=StepSpec(batch_size=8, repeats=1))
    res = plan_for_budget(wl, int(stats.peak_bytes * 0.8), stats=stats)
    path = tmp_path / "plan.json"
    res.plan.save(path)
    loaded = Plan.load(path)
    assert loaded == res.plan
    torch.manual_seed(0)
    apply_plan(kw_workload().model, loaded, batch=wl.make_batch(8))
    with pytest.raises(PlanMismatchError, match="batch"):
        apply_plan(kw_workload().model, loaded, batch=wl.make_batch(3))
    with pytest.raises(PlanMismatchError, match="made for KwModel"):
        apply_plan(conv_workload().model, loaded)
    from test_engine import KwModel

    with pytest.raises(PlanMismatchError, match="number of blocks: plan 5, model 3"):
        apply_plan(KwModel(n=3), loaded)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "something else"}', "not a valid memfit plan"),
        (None, "option 'sometimes'"),
        (None, "overlap without nesting"),
    ],
)
def test_corrupt_or_hand_edited_plan_files_are_refused_clearly(tmp_path: Path, text, message) -> None:
    good = policy_plan(conv_workload().model, "none").to_dict()
    if text is None and "option" in message:
        good["blocks"][1]["option"] = "sometimes"
        text = json.dumps(good)
    elif text is None:
        good["segments"] = [{"start": 0, "stop": 3}, {"start": 2, "stop": 5}]
        text = json.dumps(good)
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanFileError, match=message):
        Plan.load(path)
    with pytest.raises(PlanFileError, match="cannot read"):
        Plan.load(tmp_path / "missing.json")


def test_plan_files_with_the_old_action_key_load_the_same() -> None:
    """Files written before a block's option was named "option" carry "action"; they load alike."""
    data = policy_plan(conv_workload().model, "all").to_dict()
    assert all(set(b) == {"name", "option"} for b in data["blocks"])
    old = {**data, "blocks": [{"name": b["name"], "action": b["option"]} for b in data["blocks"]]}
    assert Plan.from_dict(old) == Plan.from_dict(data)


def test_plan_files_extra_loads_as_typed_fields_and_writes_back_the_same(tmp_path: Path) -> None:
    """A file's ``"extra"`` (as memfit wrote it before the typed fields) becomes typed fields and is
    written back key for key; an unknown key is named with the fix."""
    data = policy_plan(conv_workload().model, "all").to_dict()
    data["extra"] = {
        "margin": 0.02,
        "predicted_peak_with_margin_bytes": 1020,
        "peak_event": "backward of layer2",
        "search": "per-block options",
        "recompute_time_scale": 0.5,
        "recompute_time_scale_measured": 0.31,
        "head_extra_s_measured[chunked]": 0.001,
        "time_scale[selective:save_matmuls]": 1.5,
        "time_scale_measured[selective:save_matmuls]": 1.5,
        "min_budget_bytes": 900,
        "baseline_peak_bytes": 2000,
        "baseline_step_s": 0.25,
        "parallel": {"kind": "ddp", "world_size": 2},
        "accumulation": {"steps": 3, "predicted_peak_bytes": 1100},
        "compile": {"mode": "model", "backend": "inductor", "activation_memory_budget": 0.5},
    }
    plan = Plan.from_dict(data)
    assert plan.margin == 0.02 and plan.min_budget_bytes == 900 and plan.parallel == {"kind": "ddp", "world_size": 2}
    assert plan.time_scales is not None and plan.time_scales.recompute_time_scale_measured == 0.31
    assert plan.time_scales.time_scale_by_option == {"selective:save_matmuls": 1.5}
    assert plan.accumulation_window is not None and plan.accumulation_window.predicted_peak_bytes == 1100
    assert plan.compile_settings is not None and plan.compile_settings.activation_memory_budget == 0.5
    assert json.dumps(plan.to_dict()) == json.dumps(data)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    data["extra"]["solver_note"] = "hand-written"
    with pytest.raises(PlanFileError, match="unknown field 'solver_note'.*remove it"):
        Plan.from_dict(data)
    data["extra"] = {"margin": "2%"}
    with pytest.raises(PlanFileError, match="'margin' must be int or float"):
        Plan.from_dict(data)


def test_failed_apply_leaves_model_unchanged() -> None:
    wl = conv_workload()
    plan = policy_plan(wl.model, "all")
    other = kw_workload().model
    with pytest.raises(PlanMismatchError):
        apply_plan(other, plan)
    assert not is_applied(other)
