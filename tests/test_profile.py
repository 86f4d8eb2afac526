"""memfit.profile against references it does not compute: per-block saved and output bytes counted
by hand and by saved-tensor hooks on the unmodified model, the step's peak by the torch profiler."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import (
    SAVED_WIDTH,
    mlp_chain_workload,
    saved_tensor_counts,
    step_peaks_bytes,
    token_workload,
)

from memfit import StepSpec, profile

pytestmark = pytest.mark.usefixtures("one_thread")

ACTS = ("relu", "gelu", "tanh", "gelu")
B, D = 64, 16
F32 = 4  # bytes


@pytest.fixture(scope="module")
def mlp():
    wl = mlp_chain_workload(ACTS, d=D)
    return wl, profile(wl, step=StepSpec(batch_size=B, repeats=1), options=("keep",), heads=False, activations=False)


def test_saved_and_output_bytes_are_those_counted_by_hand(mlp) -> None:
    """fc1 saves its input; ReLU and Tanh their output (fc2's input too), GELU its input and fc2
    its output: 5 or 9 (B, d) float tensors per block; every block outputs one."""
    _, stats = mlp
    assert stats.chain_path == "blocks" and [b.name for b in stats.blocks] == [f"blocks.{i}" for i in range(4)]
    assert [b.saved_bytes for b in stats.blocks] == [SAVED_WIDTH[a] * B * D * F32 for a in ACTS]
    assert [b.output_bytes for b in stats.blocks] == [B * D * F32] * 4
    assert [b.input_bytes for b in stats.blocks] == [B * D * F32] * 4
    assert all(b.input_saved for b in stats.blocks)


def test_saved_and_output_bytes_match_saved_tensor_hooks() -> None:
    """A model with residual blocks, an embedding and a causal mixing step (where bytes are not
    easy to count by hand): memfit's per-block numbers equal the hooks' on the unmodified model."""
    wl = token_workload()
    stats = profile(wl, step=StepSpec(batch_size=6, repeats=1), options=("keep",), heads=False, activations=False)
    model = copy.deepcopy(wl.model)
    torch.manual_seed(0)
    want = saved_tensor_counts(model, list(model.blocks), wl.make_batch(6), wl.loss_fn)
    assert [(b.saved_bytes, b.output_bytes) for b in stats.blocks] == want
    assert all(s > 0 for s, _ in want)


def test_peak_is_the_profilers(mlp) -> None:
    """The step's peak (parameters, gradients, AdamW state, activations) equals the torch
    profiler's allocation events over the same step of an unmodified copy."""
    wl, stats = mlp
    tracker_bytes, profiler_bytes = step_peaks_bytes(copy.deepcopy(wl.model), wl.make_batch(B), wl.loss_fn)
    assert stats.peak_bytes == profiler_bytes == tracker_bytes
    params_bytes = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    assert stats.params_bytes == params_bytes and stats.optimizer_bytes == 2 * params_bytes + 4 * len(
        list(wl.model.parameters())
    )


def test_peak_grows_with_the_batch_by_the_saved_bytes() -> None:
    """Doubling the batch adds at least the activations counted by hand (every block's saved bytes
    at the larger batch), and the profiler agrees at both sizes."""
    wl = mlp_chain_workload(ACTS, d=D)
    peaks = {}
    for b in (32, 64):
        stats = profile(wl, step=StepSpec(batch_size=b, repeats=1), options=("keep",), heads=False, activations=False)
        _, profiler_bytes = step_peaks_bytes(copy.deepcopy(wl.model), wl.make_batch(b), wl.loss_fn)
        assert stats.peak_bytes == profiler_bytes
        peaks[b] = stats.peak_bytes
    assert peaks[64] - peaks[32] >= sum(SAVED_WIDTH[a] for a in ACTS) * 32 * D * F32
