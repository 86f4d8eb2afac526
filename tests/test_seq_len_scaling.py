"""Stats at a length 16 times the profiled ones (NOTE [ Longest sequence ] in memfit.fitting.seq_len,
step 4): the line through two short profiles, its bytes taken from a fake-tensor step at the length.

Reference: the measured window of the plan solved on them, at that length (the tracker's peak, bytes,
deterministic on CPU), on a Llama-shaped model with a real vocabulary. The plan is the one a search
would measure there (the least budget's: blocks recomputed or tiled, the chunked head), so the test
checks what decides whether the first window measured fits: its peak within the planner's margin.
"""

from __future__ import annotations

import pytest
import torch

from memfit.capture.step import StepSpec
from memfit.estimation import estimate_stats
from memfit.estimation.calibrate_time import host_device
from memfit.fitting.bounded import scaled_stats, with_bytes_of
from memfit.fitting.candidates import Candidate
from memfit.fitting.window import measure_window
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.solve import min_budget, plan_from_solution, solve
from memfit.profiling.blocks import profile
from memfit.workload import with_seq_len

LLAMA32K = (
    "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=256&num_attention_heads=2"
    "&num_key_value_heads=2&vocab_size=32000&max_position_embeddings=131072&padding=false"
)
PROFILE = {"options": BASE_OPTIONS, "heads": True, "activations": True, "tiling": True, "host_inputs": True}


@pytest.mark.slow
def test_bytes_of_a_fake_step_predict_the_window_16_times_past_the_profiles() -> None:
    torch.set_num_threads(1)
    wl = load_workload(LLAMA32K)
    step = StepSpec(batch_size=1, optimizer="adamw", repeats=1)
    profs = {t: profile(with_seq_len(wl, t), step=step, **PROFILE) for t in (256, 384)}
    T = 16 * 256
    est = estimate_stats(with_seq_len(wl, T), device=host_device(), step=StepSpec(batch_size=1), **PROFILE)
    st = with_bytes_of(scaled_stats(profs, T, batch_size=1), est)
    assert st.blocks[0].options["recompute"].bwd_peak_bytes == est.blocks[0].options["recompute"].bwd_peak_bytes
    costs = ChainCosts.from_stats(st, margin=0.02)
    need, _ = min_budget(costs)
    plan = plan_from_solution(solve(costs, need), costs, chain_path=st.chain_path, fingerprint=st.fingerprint,
                              budget_bytes=need, min_budget_bytes=need, baseline_peak_bytes=st.peak_bytes,
                              baseline_step_s=st.step_s)  # fmt: skip
    assert plan.head == "chunked" and any(b.option.value != "keep" for b in plan.blocks)
    pred = predict(costs, plan)
    cand = Candidate(micro_batch=1, accumulation_steps=1, sizes=(1,), feasible=True, plan=plan)
    measured = measure_window(with_seq_len(wl, T), cand, 1, repeats=1).peak_bytes
    # within the planner's margin above the prediction, and no more than 3 % below it
    assert 0.97 * pred.peak_bytes <= measured <= pred.peak_with_margin_bytes, (measured, pred)
