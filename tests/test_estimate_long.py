"""Estimated long-sequence options: tiled blocks, the chunked head and host-held inputs on fake tensors.

References, each independent of the code under test:
- a measured CPU profile of the same model with tiling and the chunked head (per-block bytes of every
  tiled option, the chunked head's peak per block option);
- the real CPU step of the host-held plan under the live-tensor tracker (the CPU path runs it, its host
  copy uncounted), and the arithmetic of the kept inputs: layers x batch x tokens x hidden x 4 bytes;
- the device table's datasheet link rate, by hand.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfit import StepSpec
from memfit.apply.engine import plan_applied
from memfit.capture.step import make_optimizer, measure_step, warm_up
from memfit.errors import SpecError
from memfit.estimation import estimate_stats, get_device, stats_fn
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan.policies import policy_plan
from memfit.plan.types import Option
from memfit.profiling.blocks import profile

# Each test runs fake-tensor steps per option (and the comparisons a real profile): 10-70 s on 2 shared cores.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

LLAMA = (
    "hf:llama?num_hidden_layers=4&hidden_size=64&intermediate_size=256&num_attention_heads=4"
    "&num_key_value_heads=2&vocab_size=512"
)
SEQ, BATCH = 256, 2
BYTE_FIELDS = ("retained_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "bwd_base_bytes")


@pytest.fixture(scope="module")
def pair() -> tuple:
    torch.set_num_threads(1)
    wl = load_workload(LLAMA, seq_len=SEQ, seed=0)
    measured = profile(wl, step=StepSpec(batch_size=BATCH, optimizer="sgd", repeats=1), heads=True, tiling=True)
    est = estimate_stats(
        wl, device="h100-sxm", gpu_kernels=False, step=StepSpec(batch_size=BATCH, optimizer="sgd"), host_inputs=False
    )
    return wl, measured, est


def test_tiled_options_bytes_equal_the_measured_profile(pair: tuple) -> None:
    """Every tiled option the profile measured is estimated, at the same tile counts, with the same
    per-block bytes (CPU kernels on both sides) and the same submodules tiled."""
    _wl, measured, est = pair
    tiled = [m for m in measured.blocks[0].options if ":tiles-" in m]
    assert tiled and measured.calibration.tiling is not None
    assert est.calibration.tiling.tile_counts == measured.calibration.tiling.tile_counts
    assert set(tiled) <= set(est.blocks[0].options)
    for e, m in zip(est.blocks, measured.blocks, strict=True):
        for opt in tiled:
            eo, mo = e.options[opt], m.options[opt]
            assert eo.tiled == mo.tiled == ("mlp",)
            for f in BYTE_FIELDS:
                assert getattr(eo, f) == getattr(mo, f), (e.name, opt, f)
    # tiling lowers the recompute's backward peak: one tile's MLP intermediates instead of all
    n = max(measured.calibration.tiling.tile_counts)
    b = est.blocks[1].options
    assert b[f"recompute:tiles-{n}"].bwd_peak_bytes < b["recompute"].bwd_peak_bytes
    # and costs one more forward of the MLP: more FLOPs in backward
    assert b[f"recompute:tiles-{n}"].bwd_s > b["recompute"].bwd_s


def test_chunked_head_peak_equals_the_measured_profile(pair: tuple) -> None:
    _wl, measured, est = pair
    assert "chunked" in measured.head_options and "chunked" in est.head_options
    m, e = measured.head_options["chunked"], est.head_options["chunked"]
    assert e.head_peak_bytes_by_option == m.head_peak_bytes_by_option
    assert e.measured_peak_bytes_by_option == m.measured_peak_bytes_by_option
    assert e.head_peak_bytes < est.head_peak_bytes  # the logits of one chunk instead of all


def test_host_held_estimate_against_the_cpu_step_and_the_kept_inputs() -> None:
    """recompute:host for a CUDA device: the estimate's whole-step forward peak equals the real CPU
    step of the same plan (the CPU path runs it with the host copy uncounted), and it is below
    recompute's by the kept inputs of the two middle layers (the first layer's input is the
    embedding's output, which the model holds anyway; the last one's is freed after the forward's peak)."""
    wl = load_workload(LLAMA, seq_len=SEQ, seed=0)
    est = estimate_stats(
        wl, device="h100-sxm", gpu_kernels=False, step=StepSpec(batch_size=BATCH, optimizer="sgd"), tiling=False
    )
    assert "recompute:host" in est.blocks[0].options
    assert est.calibration.offload_h2d_bytes_per_s == 64e9  # PCIe 5.0 x16, per direction
    batch = wl.make_batch(BATCH)

    def forward_peak(held: bool) -> int:
        plan = policy_plan(wl.model, "all")
        plan = plan.with_(
            blocks=tuple(dataclasses.replace(b, host_input=held and b.option is Option.RECOMPUTE) for b in plan.blocks)
        )
        with plan_applied(wl.model, plan):
            opt = make_optimizer(wl.model, "sgd")
            warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
            return measure_step(wl.model, batch, wl.loss_fn, opt, seed=2).peak_bytes_by_phase["forward"]

    measured = forward_peak(False) - forward_peak(True)
    est_drop = est.measured_peak_bytes_by_option["recompute"] - est.measured_peak_bytes_by_option["recompute:host"]
    kept = BATCH * SEQ * 64 * 4  # one layer's input, float32
    assert measured >= 2 * kept
    retained = sum(
        b.options["recompute"].retained_bytes - b.options["recompute:host"].retained_bytes for b in est.blocks
    )
    assert retained == 2 * kept
    assert est_drop <= measured  # the whole step's peak is in backward: it moves less than the forward's
    # seconds: the copies at the host link beyond the block's compute (none here: tiny copies)
    assert est.step_s_by_option["recompute:host"] == pytest.approx(est.step_s_by_option["recompute"])


def test_a_device_without_a_host_link_drops_it_with_the_reason() -> None:
    wl = load_workload(LLAMA, seq_len=64, seed=0)
    dev = dataclasses.replace(get_device("h100-sxm"), name="no-link", host_bytes_per_s=None)
    st = estimate_stats(wl, device=dev, step=StepSpec(batch_size=1, optimizer="sgd"), tiling=False, heads=False)
    assert "recompute:host" not in st.blocks[0].options
    assert "no host link rate" in st.calibration.dropped_options["recompute:host"]
    # the datasheets' PCIe figures per direction: gen5 x16 for H100 SXM, gen4 x16 for A100 SXM
    assert get_device("h100-sxm").host_bytes_per_s == 64e9 and get_device("a100-80gb").host_bytes_per_s == 32e9


def test_the_planner_chooses_tiles_and_the_chunked_head_from_estimates() -> None:
    """At a budget below what untiled plans need, the estimate-fed planner tiles and chunks the head;
    with tiling off (--no-tiling) the same budget is infeasible."""
    wl = load_workload(LLAMA, seq_len=SEQ, seed=0)
    step = StepSpec(batch_size=BATCH, optimizer="sgd")
    full = stats_fn(wl, device="h100-sxm", gpu_kernels=False, step=dataclasses.replace(step, batch_size=None))
    plain = stats_fn(
        wl, device="h100-sxm", gpu_kernels=False, step=dataclasses.replace(step, batch_size=None), tiling=False
    )
    a = plan_for_budget(wl, 1 << 40, step=step, stats_fn=full)
    b = plan_for_budget(wl, 1 << 40, step=step, stats_fn=plain)
    assert a.min_budget_bytes < b.min_budget_bytes
    res = plan_for_budget(wl, a.min_budget_bytes, step=step, stats_fn=full)
    assert any(d.tiles for d in res.plan.blocks) or res.plan.head == "chunked"


def test_named_options_are_estimated_and_unknown_ones_refused() -> None:
    wl = load_workload(LLAMA, seq_len=64, seed=0)
    st = estimate_stats(
        wl, device="h100-sxm", gpu_kernels=False, step=StepSpec(batch_size=1), options=("keep", "recompute", "recompute:tiles-3"),
        tiling=False, heads=False, host_inputs=False,
    )  # fmt: skip
    assert set(st.blocks[0].options) == {"keep", "recompute", "recompute:tiles-3"}
    with pytest.raises(SpecError, match="cannot be estimated"):
        estimate_stats(wl, device="h100-sxm", step=StepSpec(batch_size=1), options=("keep", "offload"))
