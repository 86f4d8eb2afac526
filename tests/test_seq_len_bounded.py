"""Searches that stay within their budget (NOTE [ Bounded measurement ] in memfit.fitting.bounded).

The searches (the longest sequence, auto-fit's micro-batch, an integration's fit) run in a child
process under an address-space limit (``RLIMIT_AS``) a few times the budget above what the child
maps after its imports, on a Llama-shaped model with a real vocabulary (32000: the keep-all step's
logits and their gradients are 384 KiB per token), and must finish with a plan within the budget.
Before the bound, the longest-sequence search profiled lengths whose keep-all step needed many times
the budget (a 32000-token vocabulary at 4,096 tokens: 1.5 GiB of logits alone), and auto-fit
profiled micro-batches likewise: under the limit those allocations fail and the child exits non-zero.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap

import pytest
import torch

from memfit.fitting.bounded import (
    MeasurementGuardError,
    guard_headroom_bytes,
    guarded,
    longest_within,
    predict_peak_bytes,
)

MiB = 2**20
LLAMA32K = (
    "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=2"
    "&num_key_value_heads=2&vocab_size=32000&max_position_embeddings=131072&padding=false"
)

# --- the guard and the predictions, in this process -----------------------------------------------


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_guard_stops_an_allocation_past_the_budget_and_restores_the_limit() -> None:
    before = resource.getrlimit(resource.RLIMIT_AS)
    big = guard_headroom_bytes(64 * MiB) + 2**30
    with pytest.raises(MeasurementGuardError, match="the test's step grew past the budget of 64.00 MiB"):
        with guarded(64 * MiB, "the test's step"):
            torch.empty(big, dtype=torch.uint8).fill_(1)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    with guarded(64 * MiB, "a step within"):  # what fits runs, and other errors pass through
        torch.ones(8 * MiB, dtype=torch.uint8).sum()
    with pytest.raises(ValueError, match="not memory"), guarded(64 * MiB, "x"):
        raise ValueError("not memory")
    assert torch.empty(big, dtype=torch.uint8).numel() == big  # the limit is lifted again


def test_profile_peaks_are_predicted_affine_in_the_tokens() -> None:
    # one point: the line through the model's states (no tokens) and that point
    assert predict_peak_bytes({100: 300}, 200, floor_bytes=100) == 500
    assert longest_within({100: 300}, 700, floor_bytes=100) == 300
    # two points or more: the line through the two longest (not the first)
    pts = {50: 1000, 100: 200, 200: 400}
    assert predict_peak_bytes(pts, 400) == 800
    assert longest_within(pts, 1000) == 500
    assert predict_peak_bytes({}, 10) is None and longest_within({}, 10) is None
    assert longest_within({1: 5, 2: 5}, 10) == float("inf")


# --- searches in a child process under RLIMIT_AS ---------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    torch.set_num_threads(1)
    from memfit.capture.step import StepSpec
    from memfit.fitting.search import autofit
    from memfit.fitting.seq_len import fit_seq_len
    from memfit.models.registry import load_workload

    kind, spec, budget, factor = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    wl = load_workload(spec)
    if kind == "transformers":
        import transformers
        from memfit.integrations import transformers as mt
    def mapped():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped() + int(factor * budget)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    step = StepSpec(optimizer="adamw", repeats=1)
    lines = []
    if kind == "seq_len":
        res = fit_seq_len(wl, budget, step=step, multiple=64, max_seq_len=8192, progress=lines.append)
        out = res.to_dict()
    elif kind == "autofit":
        res = autofit(wl, budget, 16, step=step, max_tries=1, tiling=False, progress=lines.append)
        out = res.to_dict()
    else:
        rows = [{"input_ids": wl.make_batch(1)["input_ids"][0].tolist()} for _ in range(16)]
        def collate(rs):
            ids = torch.tensor([r["input_ids"] for r in rs])
            return {"input_ids": ids, "labels": ids.clone()}
        args = transformers.TrainingArguments(
            output_dir=sys.argv[5], per_device_train_batch_size=16, report_to=[], use_cpu=True, max_steps=1,
            save_strategy="no", disable_tqdm=True, optim="adamw_torch",
        )
        trainer = transformers.Trainer(model=wl.model, args=args, train_dataset=rows, data_collator=collate)
        fitted = mt.fit(trainer, budget=budget, repeats=1, progress=lines.append)
        out = {"micro_batch": fitted.micro_batch, "measured_peak_bytes": fitted.fit.measured_peak_bytes}
    print(json.dumps({"result": out, "lines": lines, "limit": limit}))
    """
)


def _run_child(kind: str, spec: str, budget: int, factor: float, tmp_path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, kind, spec, str(budget), str(factor), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_seq_len_search_stays_within_an_address_space_limit(tmp_path) -> None:
    budget = 176 * MiB  # the keep-all step fits up to about 340 tokens
    d = _run_child("seq_len", f"{LLAMA32K}&seq_len=256", budget, 6, tmp_path)
    res = d["result"]
    tries = res["seq_len_search"]["tries"]
    assert res["measured_peak_bytes"] is not None and res["measured_peak_bytes"] <= budget
    # a chunked head and tiling keep the need nearly flat: scaled from two profiles of at most 340 tokens,
    # the search still reaches its cap (a line through a profile of fewer than 256 tokens, where the
    # chunked head's two chunks still grow, stopped it at 560)
    assert res["seq_len"] == 8192 and res["seq_len_search"]["limited_by"] == "max_seq_len"
    # every profile ran where predicted within the budget (the first: nothing to predict from)
    profiled = [t for t in tries if t["stats"] == "profiled"]
    assert all(t["predicted_profile_peak_bytes"] <= budget for t in profiled if t["predicted_profile_peak_bytes"])
    # the lengths whose profile would not fit were scaled, with the profile's prediction given
    scaled = [t for t in tries if t["stats"] == "scaled"]
    assert scaled and all(t["predicted_profile_peak_bytes"] > budget for t in scaled)
    assert all(len(t["scaled_from"]) == 2 for t in scaled)
    # one progress line per length tried
    per_length = [s for s in d["lines"] if "a plan needs" in s]
    assert len(per_length) == len(tries)


@pytest.mark.slow
def test_autofit_micro_batch_search_stays_within_an_address_space_limit(tmp_path) -> None:
    budget = 288 * MiB
    d = _run_child("autofit", f"{LLAMA32K}&seq_len=256", budget, 3, tmp_path)
    res = d["result"]
    assert res["measured_peak_bytes"] is not None and res["measured_peak_bytes"] <= budget
    assert any("a profile would need" in s for s in d["lines"])  # a micro-batch predicted, not profiled
    assert 4 not in res["profiled_batch_sizes"]


@pytest.mark.slow
def test_transformers_fit_stays_within_an_address_space_limit(tmp_path) -> None:
    budget = 288 * MiB
    d = _run_child("transformers", f"{LLAMA32K}&seq_len=256", budget, 3, tmp_path)
    assert d["result"]["measured_peak_bytes"] <= budget
    assert any("a profile would need" in s for s in d["lines"])
