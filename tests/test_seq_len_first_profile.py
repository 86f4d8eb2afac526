"""The first profile of the longest-sequence search is predicted before it runs (NOTE [ Longest
sequence ] in memfit.fitting.seq_len): by the fake-tensor estimate of its keep-all step, as ``memfit fit
--seq-len auto`` gives it, and run at a shorter length where that is over the budget.

Reference: the profiles the search then made (their measured largest step, bytes), on a Llama-shaped
model with a real vocabulary whose keep-all step at the workload's own length (1,024 tokens: 384 KiB
of logits, their softmax and gradient per token) is about twice the budget."""

from __future__ import annotations

import argparse

import pytest
import torch

from memfit.capture.step import StepSpec
from memfit.cli.estimated import profile_peak_fn
from memfit.fitting.seq_len import fit_seq_len
from memfit.models.registry import load_workload

MiB = 2**20
LLAMA32K = (
    "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=2"
    "&num_key_value_heads=2&vocab_size=32000&max_position_embeddings=131072&padding=false&seq_len=1024"
)


@pytest.mark.slow
def test_the_first_profile_runs_at_a_length_estimated_within_the_budget() -> None:
    torch.set_num_threads(1)
    wl = load_workload(LLAMA32K)
    budget = 192 * MiB
    args = argparse.Namespace(optimizer="adamw", seed=0)

    def predict(w, b: int) -> int:  # as memfit fit --seq-len auto predicts it
        return profile_peak_fn(args, w)(b)

    assert predict(wl, 1) > budget  # the workload's own length: its keep-all step is over the budget
    lines: list[str] = []
    res = fit_seq_len(
        wl, budget, step=StepSpec(optimizer="adamw", repeats=1), multiple=64, max_seq_len=2048, max_tries=3,
        measure=False, predict_profile_peak=predict, progress=lines.append,
    )  # fmt: skip
    first = res.tries[0]
    assert first.seq_len == 1024 and first.stats == "scaled"  # estimated over the budget: not profiled
    assert first.predicted_profile_peak_bytes is not None and first.predicted_profile_peak_bytes > budget
    assert any("seq_len 1024: a profile is estimated at" in s for s in lines)
    profiled = sorted({t for tr in res.tries for t in tr.scaled_from})
    assert profiled and max(profiled) < 1024
    # the profiles made: their largest step measured within the budget
    for tr in res.tries:
        if tr.stats == "profiled":
            assert tr.profile_peak_bytes is not None and tr.profile_peak_bytes <= budget
