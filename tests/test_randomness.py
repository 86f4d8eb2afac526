"""Randomness a forward draws outside torch is held equal wherever memfit replays a step.

A model may draw from NumPy's global generator (Wav2Vec2's SpecAugment masks) or Python's
``random`` in its forward, and skip layers at random (LayerDrop). ``verify`` compares a planned step
with the unmodified model's from the same weights: both must see the same draws, else the check
fails for reasons that are not memfit's. A profile of a model with LayerDrop measures with every
layer running (NOTE [ LayerDrop is measured with every layer running ]).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import memfit
from memfit import StepSpec, Workload
from memfit.capture.snapshot import every_layer_runs, seed_generators
from memfit.errors import UnsupportedModelError
from memfit.verification.plans import verify

D, T = 16, 24


class _MaskedBlock(nn.Module):
    """A block that masks time steps from NumPy's generator and scales by Python's (SpecAugment-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.masked = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        mask = torch.from_numpy(np.random.rand(x.shape[0], x.shape[1]) < 0.3)  # (B, T)
        x = torch.where(mask[..., None], self.masked.to(x.dtype), x)
        return x + torch.tanh(self.fc(x)) * (1.0 + random.random())


class _Encoder(nn.Module):
    """A stack of blocks that draws masks from NumPy before the blocks and, with ``layerdrop``, skips
    blocks at random as transformers' encoders do (a torch draw in the loop, outside the block)."""

    def __init__(self, n: int = 4, layerdrop: float = 0.0) -> None:
        super().__init__()
        self.masked_spec_embed = nn.Parameter(torch.randn(D))
        self.layers = nn.ModuleList(_MaskedBlock() for _ in range(n))
        self.layerdrop = layerdrop
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.from_numpy(np.random.rand(x.shape[0], x.shape[1]) < 0.2)
        x = torch.where(mask[..., None], self.masked_spec_embed.to(x.dtype), x)
        for layer in self.layers:
            if self.training and self.layerdrop > 0.0 and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return self.out(x).mean()


def _workload(layerdrop: float = 0.0) -> Workload:
    torch.manual_seed(0)
    model = _Encoder(layerdrop=layerdrop).train()
    return Workload(
        name="masked-encoder",
        model=model,
        make_batch=lambda b: torch.randn(b, T, D, generator=torch.Generator().manual_seed(b)),
        loss_fn=lambda m, x: m(x),
        default_batch_size=4,
    )


def test_seed_generators_seeds_torch_numpy_and_python() -> None:
    seed_generators(3)
    a = (torch.rand(2), np.random.rand(2), random.random())
    seed_generators(3)
    b = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.parametrize("policy", ["none", "all"])
def test_verify_holds_numpy_and_python_draws_equal(policy: str) -> None:
    # Before the generators were seeded beside torch's, every plan failed here (`none` included):
    # the reference and the planned step drew different NumPy masks.
    wl = _workload()
    np_before, py_before = np.random.get_state(), random.getstate()
    r = verify(wl, memfit.policy_plan(wl.model, policy), step=StepSpec(repeats=0))
    assert r.ok, r.reason
    assert r.max_grad_rel_err < 1e-6
    # ... and the user's generators are where they were.
    assert np.array_equal(np.random.get_state()[1], np_before[1]) and random.getstate() == py_before


def test_every_layer_runs_switches_layerdrop_off_and_back() -> None:
    wl = _workload(layerdrop=0.5)

    class Config:
        encoder_layerdrop = 0.2
        hidden_dropout = 0.1

    cfg = Config()
    wl.model.config = cfg  # transformers keeps its LayerDrop probabilities on the config
    cfg.encoder_layerdrop = 0.2  # an instance attribute, as PretrainedConfig holds them
    with every_layer_runs(wl.model) as where:
        assert wl.model.layerdrop == 0.0 and cfg.encoder_layerdrop == 0.0
        assert sorted(where) == ["Config.encoder_layerdrop 0.2", "_Encoder.layerdrop 0.5"]
    assert wl.model.layerdrop == 0.5 and cfg.encoder_layerdrop == 0.2


def test_layerdrop_is_profiled_with_every_layer_and_planned_exactly() -> None:
    wl = _workload(layerdrop=0.5)
    stats = memfit.profile(wl, step=StepSpec(repeats=1))
    assert wl.model.layerdrop == 0.5  # put back
    assert stats.segment_spans == () and not stats.sequential
    assert stats.calibration.segments is not None and "LayerDrop (_Encoder.layerdrop 0.5)" in stats.calibration.segments
    plan = memfit.plan_for_policy(wl, "every:2", stats=stats).plan  # kept and recomputed blocks, no segment
    assert not plan.segments and plan.predicted_peak_bytes is not None
    # Seeds where different blocks are skipped: the planned step equals the plain one. (verify's
    # gradient step seeds the generators with seed + 2; the loop's draws are the first torch draws.)
    skipped = set()
    for seed in range(4):
        torch.manual_seed(seed + 2)
        skipped.add(tuple(bool(torch.rand([]) < 0.5) for _ in range(4)))
        r = verify(wl, plan, step=StepSpec(repeats=0, seed=seed))
        assert r.ok, r.reason
        assert r.measured_peak_bytes <= plan.predicted_peak_bytes  # every layer running: the largest step
    assert len(skipped) > 1


def test_layerdrop_not_named_so_is_refused_with_a_fix_that_names_it() -> None:
    wl = _workload(layerdrop=0.5)
    wl.model.skip_p = wl.model.__dict__.pop("layerdrop")  # a name memfit does not know
    type(wl.model).layerdrop = property(lambda self: self.skip_p)
    try:
        with pytest.raises(UnsupportedModelError, match="LayerDrop.*set that probability to 0"):
            memfit.profile(wl, step=StepSpec(repeats=1))
    finally:
        del type(wl.model).layerdrop
