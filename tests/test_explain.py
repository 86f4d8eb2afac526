"""`memfit explain`: the listed saved tensors add up to the profile's saved bytes; decisions follow
the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_engine import BUILTIN, conv_workload, kw_workload

from memfit import PlanMismatchError, StepSpec
from memfit.capture.ops import capture_ops
from memfit.cli.main import main
from memfit.models.registry import load_workload
from memfit.plan import Offload, Segment, Selective, policy_plan
from memfit.profiling.blocks import profile
from memfit.profiling.residuals import explain

WORKLOADS = {
    "conv-bn": (conv_workload, 8),
    "kw-model": (kw_workload, 4),
    "hf:gpt2": (lambda: load_workload(BUILTIN["hf:gpt2"], seq_len=32), 3),
    "hf:llama": (lambda: load_workload(BUILTIN["hf:llama"], seq_len=32), 3),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_listed_tensors_add_up_to_the_profiles_saved_bytes(name: str) -> None:
    make, bs = WORKLOADS[name]
    wl = make()
    stats = profile(wl, step=StepSpec(batch_size=bs, repeats=1), options=("keep",), activations=False)
    ops = capture_ops(wl, batch_size=bs, repeats=1)
    cases = [
        (p, ops, stats)
        for p in (
            policy_plan(wl.model, "none"),
            policy_plan(wl.model, "all"),
            policy_plan(wl.model, Selective(preset="save_matmuls")),
            policy_plan(wl.model, Offload()),
        )
    ]
    fused = profile(wl, step=StepSpec(batch_size=bs, repeats=1), options=("keep",))
    if fused.activations:  # hf:gpt2's gelu_new: explain captures the fused model the plan runs
        cases.append((policy_plan(wl.model, "none").with_(activations=fused.activations), None, fused))
    for plan, o, st in cases:
        ex = explain(wl, plan, step=StepSpec(batch_size=bs), ops=o)
        for b, s in zip(ex.blocks, st.blocks, strict=True):
            assert b.name == s.name
            assert sum(t.bytes for t in b.tensors) == s.saved_bytes, (name, plan.policy, b.name)
            assert b.saved_bytes == b.kept_bytes + b.recomputed_bytes + b.offloaded_bytes == s.saved_bytes
    assert (fused.activations is not None) == (name == "hf:gpt2")
    if fused.activations:
        assert fused.blocks[0].saved_bytes < stats.blocks[0].saved_bytes


def test_decisions_follow_the_plan() -> None:
    wl = load_workload(BUILTIN["hf:gpt2"], seq_len=32)
    ops = capture_ops(wl, batch_size=3, repeats=1)
    keep = explain(wl, policy_plan(wl.model, "none"), step=StepSpec(batch_size=3), ops=ops).blocks[1]
    assert {t.decision for t in keep.tensors} == {"saved"} and keep.seconds_added == 0
    rec = explain(wl, policy_plan(wl.model, "all"), step=StepSpec(batch_size=3), ops=ops).blocks[1]
    assert [t.decision for t in rec.tensors if t.op == "input"] == ["saved"]
    assert {t.decision for t in rec.tensors if t.op != "input"} == {"recomputed"}
    assert rec.kept_bytes == ops.blocks[1].saved[0].bytes and rec.seconds_added == pytest.approx(ops.blocks[1].fwd_s)
    sel = explain(
        wl, policy_plan(wl.model, Selective(preset="save_matmuls")), step=StepSpec(batch_size=3), ops=ops
    ).blocks[1]
    kept_ops = {t.op for t in sel.tensors if t.decision == "saved"}
    assert kept_ops == {"input", "aten.addmm.default"}  # the MLP's c_fc output is saved (GELU input)
    # outputs backward does not need: the attention projection's, the MLP's last, and q @ k^T
    assert {t.op for t in sel.cached} == {"aten.addmm.default", "aten.bmm.default"}
    assert 0 < sel.seconds_added < rec.seconds_added
    off = explain(wl, policy_plan(wl.model, Offload()), step=StepSpec(batch_size=3), ops=ops).blocks[1]
    assert {t.decision for t in off.tensors} <= {"saved", "offloaded"}
    assert all(t.decision == "saved" for t in off.tensors if t.op == "input")


def test_segments_keep_only_the_segment_input() -> None:
    wl = conv_workload()
    plan = policy_plan(wl.model, "none").with_(segments=(Segment(start=1, stop=4), Segment(start=2, stop=4)))
    ex = explain(wl, plan, step=StepSpec(batch_size=8, repeats=1))
    first, inner = ex.blocks[1], ex.blocks[2]
    assert [t.decision for t in first.tensors if t.op == "input"] == ["saved"]
    assert {t.decision for t in inner.tensors} == {"recomputed"}  # its input exists only during the recompute
    assert {t.decision for t in ex.blocks[0].tensors} == {"saved"}


def test_plan_for_another_model_is_refused() -> None:
    with pytest.raises(PlanMismatchError, match="Make a plan for this model"):
        explain(kw_workload(), policy_plan(conv_workload().model, "all"), step=StepSpec(batch_size=2))


def test_cli_json_with_policy_and_plan_file(tmp_path: Path, capsys) -> None:
    spec = "demo?n_layer=3&n_embd=32&seq_len=16"
    assert (
        main(
            [
                "explain",
                "--model",
                spec,
                "--policy",
                "selective:save_matmuls",
                "--batch-size",
                "2",
                "--repeats",
                "1",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["plan_policy"] == "selective:save_matmuls" and len(data["blocks"]) == 3
    for b in data["blocks"]:
        assert sum(t["bytes"] for t in b["tensors"]) == b["saved_bytes"]
        assert {"op", "shape", "dtype", "bytes", "decision", "why", "bytes_saved", "seconds_added"} <= set(
            b["tensors"][0]
        )
    stats = profile(load_workload(spec), step=StepSpec(batch_size=2, repeats=1), options=("keep",))
    assert [b["saved_bytes"] for b in data["blocks"]] == [b.saved_bytes for b in stats.blocks]
    path = tmp_path / "plan.json"
    policy_plan(load_workload(spec).model, "every:2").save(path)
    assert main(["explain", "--model", spec, "--plan", str(path), "--batch-size", "2", "--repeats", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["option"] for b in data["blocks"]] == ["recompute", "keep", "recompute"]
    assert (
        main(
            ["explain", "--model", spec, "--policy", "offload", "--batch-size", "2", "--repeats", "1", "--blocks", "9"]
        )
        == 2
    )
    assert "out of range" in capsys.readouterr().err


def test_cli_budget_explains_the_planned_plan(capsys) -> None:
    spec = "demo?n_layer=3&n_embd=32&seq_len=32"
    stats = profile(load_workload(spec), step=StepSpec(batch_size=8, repeats=1), options=("keep",))
    budget = stats.peak_bytes - stats.activations_peak_bytes // 3
    assert (
        main(["explain", "--model", spec, "--budget", str(budget), "--batch-size", "8", "--repeats", "1", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["plan_policy"] == "memfit"
    # The budget forces something out of memory: a recomputed or offloaded block, or a segment
    # (whose blocks read "keep" but whose tensors are recomputed rows).
    assert data["recomputed_bytes"] + data["offloaded_bytes"] > 0
    assert [b["saved_bytes"] for b in data["blocks"]] == [b.saved_bytes for b in stats.blocks]


def test_explain_reports_the_batch_size_it_measured() -> None:
    """The batch explain builds is the one it reports (not the workload's default)."""
    wl = kw_workload()
    bs = wl.default_batch_size + 1
    ex = explain(wl, policy_plan(wl.model, "all"), step=StepSpec(batch_size=bs, repeats=1))
    assert ex.batch_size == bs == capture_ops(wl, batch_size=bs, repeats=1).batch_size
