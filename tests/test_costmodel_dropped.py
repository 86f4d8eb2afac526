"""Tensors a block's forward leaves alive that the model's forward drops before the backward
(NOTE [ Tensors the forward drops ] in memfit.plan.costmodel).

The model is written as BLOOM's transformers code is, in plain torch: a bias made before the blocks
from the attention mask and passed to every block (ALiBi), attention scores from ``baddbmm`` on
that bias, a float32 softmax, and a block that returns its attention probabilities beside its
output, which the model's loop holds (``outputs = block(...)``) until the next block returns. A
kept block saves the probabilities for its backward; a recomputed one leaves them alive only
until the next block's forward ends. Counted as retained bytes, every plan mixing kept and
recomputed blocks was off by one block's probabilities (BLOOM: 3.5 % over, 3.4 % under).
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import StepSpec, policy_plan, profile
from memfit.errors import BudgetInfeasibleError
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.types import Segment
from memfit.verification.plans import verify

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, D, HEADS, LAYERS, VOCAB = 4, 16, 16, 4, 4, 64
PROBS_BYTES = B * HEADS * T * T * 4  # one block's attention probabilities, float32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4).flatten(1, 2)
        scores = bias.baddbmm(q, k.transpose(1, 2), alpha=(D // HEADS) ** -0.5)  # (B * nh, T, T)
        probs = F.softmax(scores.view(b, HEADS, t, t) + mask, dim=-1, dtype=torch.float32)  # (B, nh, T, T)
        ctx = torch.bmm(probs.view(b * HEADS, t, t), v).view(b, HEADS, t, -1).transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(ctx)
        return x + self.mlp(self.ln2(x)), probs  # as BLOOM's block: its probabilities beside its output


class AlibiLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, HEADS + 1, dtype=torch.float32), persistent=False)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.emb(ids)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask  # (B, T)
        bias = (self.slopes[None, :, None] * positions[:, None, :]).reshape(b * HEADS, 1, t)  # made before the blocks
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = torch.zeros(b, 1, t, t).masked_fill(~(causal & attention_mask[:, None, None, :].bool()), -1e4)
        for block in self.h:
            outputs = block(h, bias, mask)
            h = outputs[0]
        return self.head(self.ln_f(h))


def _workload() -> memfit.Workload:
    def make_batch(b: int) -> dict[str, torch.Tensor]:
        lengths = torch.randint(T // 2, T + 1, (b,))
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # right-padded rows
        return {"ids": torch.randint(0, VOCAB, (b, T)), "attention_mask": mask}

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = m(batch["ids"], batch["attention_mask"])[:, :-1]
        labels = batch["ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return loss, (labels != -100).sum()

    torch.manual_seed(0)
    return memfit.Workload(
        name="alibi", model=AlibiLM().train(), make_batch=make_batch, loss_fn=loss_fn, default_batch_size=B
    )


@pytest.fixture(scope="module")
def alibi() -> tuple[memfit.Workload, memfit.Stats]:
    wl = _workload()
    return wl, profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)


def test_profile_records_what_the_forward_drops(alibi) -> None:
    """A recomputed block's probabilities are dropped in the next block's window (the last two
    blocks': after the last block); a kept block saves them (none dropped); retained bytes hold
    none of them, so every block retains alike under recompute."""
    _, stats = alibi
    n = len(stats.blocks)
    rec = [b.options["recompute"] for b in stats.blocks]
    assert [o.fwd_only_bytes for o in rec] == [{i + 1 if i < n - 2 else n: PROBS_BYTES} for i in range(n)]
    assert all(not b.options["keep"].fwd_only_bytes for b in stats.blocks)
    assert len({o.retained_bytes for o in rec}) == 1  # block 0 no longer carries them, the last block neither
    assert stats.blocks[1].freed_inputs  # the bias and mask: NOTE [ Inputs a recompute holds ]'s, not these


def test_stats_json_keeps_them(alibi) -> None:
    _, stats = alibi
    back = memfit.Stats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert back == stats
    plain = dataclasses.replace(stats.blocks[0].options["keep"])
    assert "fwd_only_bytes" not in plain.to_dict()  # JSON as before where there are none


def _measured(wl: memfit.Workload, plan: memfit.Plan) -> int:
    """The plan's measured step peak (the tracker, over the step profile calibrates with), verified
    against the unmodified model."""
    result = verify(wl, plan, step=StepSpec(repeats=0))
    assert result.ok, result.to_dict()
    return result.measured_peak_bytes


FAST = {"krrk", "rkkk", "kkkr"}  # BLOOM's mid-budget plan; over and under before, in the fast tier
MIXED = ["".join(p) for p in itertools.product("kr", repeat=LAYERS) if "k" in p and "r" in p]


@pytest.mark.parametrize("actions", [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in MIXED])
def test_every_mixed_plan_is_predicted_to_the_byte(alibi, actions: str) -> None:
    wl, stats = alibi
    costs = ChainCosts.from_stats(stats)
    assert not costs.additive
    plan = policy_plan(wl.model, "none").with_(
        blocks=tuple(costs.decision(i, "keep" if a == "k" else "recompute") for i, a in enumerate(actions))
    )
    predicted = predict(costs, plan).peak_bytes
    assert _measured(wl, plan.with_(predicted_peak_bytes=predicted)) == predicted


@pytest.mark.parametrize("spans", [((0, 2),), ((1, 4),), ((0, 2), (2, 4))], ids=str)
def test_segment_plans_are_predicted_on_the_safe_side(alibi, spans: tuple[tuple[int, int], ...]) -> None:
    """A segment's blocks leave their probabilities for the next one as recomputed blocks do. The
    recompute inside a segment's backward is not calibrated: measured up to 3,136 B (0.6 %) below
    its prediction here (before, 2.6 % below and 1.2 % above)."""
    wl, stats = alibi
    costs = ChainCosts.from_stats(stats)
    plan = policy_plan(wl.model, "none").with_(segments=tuple(Segment(start=a, stop=b) for a, b in spans))
    predicted = predict(costs, plan).peak_bytes
    measured = _measured(wl, plan.with_(predicted_peak_bytes=predicted))
    assert predicted - 0.01 * predicted <= measured <= predicted, (measured, predicted)


def test_the_planned_answer_verifies(alibi) -> None:
    """At the middle of the budget range the solver's answer (checked with predict: the costs are not
    additive) fits its budget and its prediction holds, whichever plan the measured times make it."""
    wl, stats = alibi
    with pytest.raises(BudgetInfeasibleError) as err:
        memfit.plan_for_budget(wl, 1, stats=stats)
    least = err.value.min_budget_bytes
    assert least is not None and least < stats.peak_bytes
    budget = (least + stats.peak_bytes) // 2
    plan = memfit.plan_for_budget(wl, budget, stats=stats).plan
    assert not plan.is_plain  # which plan it is depends on the measured times; that it fits does not
    result = verify(wl, plan, budget_bytes=budget, step=StepSpec(repeats=0))
    assert result.ok, result.to_dict()
    predicted = plan.predicted_peak_bytes
    # exact for kept and recomputed blocks, up to 1 % below for a segment (the test above)
    assert predicted - 0.01 * predicted <= result.measured_peak_bytes <= predicted
