"""Model zoo, audio: Wav2Vec2 as transformers builds it, trained as its users train it (CTC).

``Wav2Vec2ForCTC`` from a tiny ``Wav2Vec2Config`` with the library's defaults, in training mode:
SpecAugment masks time steps drawn from NumPy's global generator (``mask_time_prob`` 0.05), and
LayerDrop skips encoder layers at random (``layerdrop`` 0.1, a torch draw in the encoder's loop).
Before memfit seeded NumPy's generator beside torch's, ``verify`` failed every plan (``none``
included: 0.77 relative on ``masked_spec_embed``), and ``profile`` refused the model whenever a layer
was skipped, with a fix that did not apply.

Checks, as tests/zoo/test_zoo.py makes them: a profile (LayerDrop switched off while measuring,
no segments offered), a plan at the budget halfway between the least peak any plan reaches and
store-all, ``verify`` of it and of the trivial plans (gradients and buffers equal the unmodified
model's, peak within the budget and near its prediction), and ``verify_accumulation`` in float64.

Run alone with ``pytest -m zoo tests/zoo/test_zoo_audio.py``.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import StepSpec, Workload
from memfit.capture.chain import discover_chain
from memfit.errors import BudgetInfeasibleError
from memfit.plan.options import BASE_OPTIONS
from memfit.verification import verify_accumulation
from memfit.verification.plans import verify

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures("one_thread")]

SAMPLES, LABEL_LEN, VOCAB = 1600, 8, 32  # 0.1 s of 16 kHz audio: 159 frames after the feature encoder
PREDICTION_RTOL = 0.06  # as tests/zoo/test_zoo.py


def _wav2vec2(**overrides: object) -> Workload:
    cfg = transformers.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(cfg).train()

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        audio = torch.randn(b, SAMPLES)
        labels = torch.randint(1, VOCAB, (b, LABEL_LEN))  # 0 is CTC's blank (pad_token_id)
        return {"input_values": audio, "labels": labels}

    return Workload(
        name="wav2vec2",
        model=model,
        make_batch=make_batch,
        loss_fn=lambda m, batch: m(**batch).loss,
        default_batch_size=4,
    )


def test_library_defaults_draw_from_numpy_and_skip_layers() -> None:
    cfg = _wav2vec2().model.config
    assert cfg.mask_time_prob > 0 and cfg.layerdrop > 0  # what the checks below are about


@pytest.mark.parametrize("policy", ["none", "all"])
def test_trivial_plans_verify(policy: str) -> None:
    wl = _wav2vec2()
    r = verify(wl, memfit.policy_plan(wl.model, policy), step=StepSpec(repeats=0))
    assert r.ok, r.to_dict()


def test_plan_within_budget_and_verified() -> None:
    wl = _wav2vec2()
    assert discover_chain(wl.model).path == "wav2vec2.encoder.layers"
    stats = memfit.profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
    assert wl.model.config.layerdrop == 0.1  # switched off while measuring only
    assert stats.segment_spans == () and "LayerDrop (Wav2Vec2Config.layerdrop 0.1)" in stats.calibration.segments
    store_all = stats.peak_bytes
    try:
        memfit.plan_for_budget(wl, 1, stats=stats)
    except BudgetInfeasibleError as err:
        min_bytes = err.min_budget_bytes
    assert min_bytes is not None and min_bytes < store_all, (min_bytes, store_all)
    budget = (min_bytes + store_all) // 2
    plan = memfit.plan_for_budget(wl, budget, stats=stats).plan
    assert plan.recomputed and not plan.segments
    for seed in (0, 1):  # two seeds: LayerDrop skips different layers
        result = verify(wl, plan, budget_bytes=budget, step=StepSpec(repeats=0, seed=seed))
        assert result.ok, result.to_dict()
        assert result.measured_peak_bytes <= budget
        # The prediction is of the step where every layer runs: a step that skips one is below it.
        assert result.measured_peak_bytes <= (1 + PREDICTION_RTOL) * plan.predicted_peak_bytes


def test_accumulation_float64() -> None:
    """SpecAugment draws its masks per batch (6 rows, or 4 and 2): no accumulation scheme can equal
    the big batch with it on, as with dropout, which verify_accumulation turns off. Checked with the
    masks and LayerDrop off, and CTC's loss averaged over the batch as transformers' fine-tuning
    example sets it (``ctc_loss_reduction="mean"``; the default, a sum over the batch, is no mean to
    accumulate: 0.49 relative)."""
    wl = _wav2vec2(mask_time_prob=0.0, layerdrop=0.0, ctc_loss_reduction="mean")
    out = verify_accumulation(wl, 6, 4, plan="all", measure_memory=False)
    assert out["micro_steps"] == 2 and not out["missing_grads"], out
    assert out["ok"] and out["buffers_equal"], out
