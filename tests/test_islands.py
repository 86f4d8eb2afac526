"""float32 islands inside a float64 check (NOTE [ float32 islands ] in memfit.verification.islands).

A token model whose norm computes in float32 whatever the model's dtype, as transformers' Gemma
RMSNorm does (``x.float()``, ``1 + weight.float()``): the norm weight's gradient is then a float32
sum over the tokens of each micro-batch, and a correct accumulation over micro-batches differs from
the big batch by float32 rounding. The check must pass it at float64's tolerance (the islands run in
float64 and it says so), and must still fail a wrong accumulation: a micro-batch missing, a token
count off by one, a loss scaled by the number of micro-steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import token_batch, token_count, wrong_accumulator
from torch import nn

import memfit.verification.accumulation as accumulation
from memfit import StepSpec, policy_plan
from memfit.verification import verify_accumulation
from memfit.verification.islands import Float32Islands, LowPrecisionOps
from memfit.verification.plans import verify
from memfit.workload import Workload

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, D = 37, 16


class Float32Norm(nn.Module):
    """Gemma's RMSNorm: normalises ``x.float()`` and scales by ``1 + weight.float()``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.float())).type_as(x)


class IslandBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = Float32Norm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        h = F.softmax(h, dim=-1, dtype=torch.float32).to(x.dtype)  # an attention-style upcast
        return x + self.fc2(h)


class IslandLM(nn.Module):
    def __init__(self, n_layer: int = 3, buffer_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(IslandBlock(D) for _ in range(n_layer))
        self.head = nn.Linear(D, VOCAB)
        self.buffer_dtype = buffer_dtype
        self.register_buffer("scale", torch.ones(D))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        if self.buffer_dtype is not None:  # a buffer the model keeps in float32 whatever its dtype
            x = x * self.scale.to(self.buffer_dtype).to(x.dtype)
        return self.head(x)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["idx"])[:, :-1]
    target = batch["idx"][:, 1:].masked_fill(~batch["mask"][:, 1:], -100)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, (target != -100).sum()


def workload(**kw: object) -> Workload:
    torch.manual_seed(0)
    return Workload(
        name="island-lm",
        model=IslandLM(**kw),  # type: ignore[arg-type]
        make_batch=lambda b: token_batch(b, seq_len=24, vocab=VOCAB),
        loss_fn=loss_fn,
        count_fn=token_count,
        default_batch_size=8,
    )


# -- the mode ---------------------------------------------------------------------------------------


def test_float32_requests_become_float64_and_are_named_by_the_model_code() -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    f32 = torch.zeros(1)
    with Float32Islands() as islands:
        got = {
            "float": x.float(),
            "to": x.to(torch.float32),
            "to_kw": x.to(dtype=torch.float32),
            "to_tensor": x.to(f32),
            "type": x.type(torch.float32),
            "type_as": x.type_as(f32),
            "softmax": F.softmax(x, -1, dtype=torch.float32),
            "sum": x.sum(-1, dtype=torch.float32),
            "factory": torch.ones(3, dtype=torch.float32),
            "int": torch.arange(4).float(),
        }
        bits = x.view(torch.int64)  # a view of the bits as another dtype is not a conversion
        half = x.half()
    assert {k: v.dtype for k, v in got.items()} == dict.fromkeys(got, torch.float64)
    assert bits.dtype is torch.int64 and half.dtype is torch.float16
    torch.testing.assert_close(got["softmax"], F.softmax(x, -1), rtol=0, atol=0)
    assert {where for where, _ in islands.sites} == {
        "test_islands.py:test_float32_requests_become_float64_and_are_named_by_the_model_code"
    }
    assert sum(islands.sites.values()) == len(got)


def test_low_precision_ops_are_found_where_the_model_runs_them() -> None:
    model = IslandLM(buffer_dtype=torch.float16).double()
    with Float32Islands(), LowPrecisionOps() as narrow:
        model(torch.randint(0, VOCAB, (2, 5))).sum().backward()
    assert {w for w, _ in narrow.sites} == {"test_islands.py:IslandLM.forward"}
    assert all(op.endswith("float16") for _, op in narrow.sites)


# -- accumulation ------------------------------------------------------------------------------------


def test_the_trap_is_real_without_promotion(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the islands left in float32, a correct accumulation differs from the big batch by far more
    than float64's tolerance: what a float64 check would wrongly call a failure."""

    class Off(Float32Islands):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(accumulation, "Float32Islands", Off)
    monkeypatch.setattr(accumulation, "LowPrecisionOps", Off)
    out = verify_accumulation(workload(), 10, 4, plan="none", measure_memory=False)
    assert not out["ok"] and 1e-10 < out["max_grad_rel_err"] < 1e-5, out


@pytest.mark.parametrize("plan", ["none", "all"])
def test_a_correct_accumulation_passes_at_float64s_tolerance_and_says_why(plan: str) -> None:
    out = verify_accumulation(workload(), 10, 4, plan=plan, measure_memory=False)
    assert out["ok"] and out["grad_rtol"] == 1e-10 and out["max_grad_rel_err"] < 1e-13, out
    wheres = {site["where"] for site in out["float32_islands"]}
    assert wheres == {"test_islands.py:Float32Norm.forward", "test_islands.py:IslandBlock.forward"}, out
    assert not out["float32_kept"] and "in float64 in both runs" in out["notes"][0]


@pytest.mark.parametrize("kind", ["missing", "count", "scaled"])
@pytest.mark.parametrize("buffer_dtype", [None, torch.float16], ids=["promoted", "kept"])
def test_a_wrong_accumulation_still_fails(
    monkeypatch: pytest.MonkeyPatch, kind: str, buffer_dtype: torch.dtype | None
) -> None:
    monkeypatch.setattr(accumulation, "Accumulator", wrong_accumulator(kind))
    out = verify_accumulation(workload(buffer_dtype=buffer_dtype), 10, 4, plan="all", measure_memory=False)
    assert not out["ok"] and out["max_grad_rel_err"] > 1e-3, out
    assert bool(out["float32_kept"]) == (buffer_dtype is not None)


def test_what_cannot_be_promoted_is_judged_at_float32s_tolerance_with_the_reason() -> None:
    out = verify_accumulation(workload(buffer_dtype=torch.float16), 10, 4, plan="none", measure_memory=False)
    assert out["ok"] and out["grad_rtol"] == 1e-4, out
    assert out["float32_kept"][0]["where"] == "test_islands.py:IslandLM.forward"
    assert "float32" in out["grad_rtol_reason"] and "judged at float32's tolerance" in out["notes"][0]


def test_a_float32_check_is_left_as_it_is() -> None:
    out = verify_accumulation(workload(), 10, 4, step=StepSpec(dtype=torch.float32), measure_memory=False)
    assert out["ok"] and out["float32_islands"] == [] and out["notes"] == [], out


# -- plans ------------------------------------------------------------------------------------------


def test_a_float64_plan_check_promotes_in_both_runs_and_recompute_replays_it() -> None:
    wl = workload()
    res = verify(wl, policy_plan(wl.model, "all"), step=StepSpec(dtype=torch.float64, repeats=0))
    assert res.ok and res.grad_rtol == 1e-10 and res.max_grad_rel_err == 0.0, res
    assert {s["where"] for s in res.float32_islands} >= {"test_islands.py:Float32Norm.forward"}
    assert any("in float64 in both runs" in n for n in res.notes)


def test_a_float64_plan_check_still_fails_a_block_that_recomputes_differently() -> None:
    wl = workload()

    class Different(IslandBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(self.norm(x))
            if torch._C._current_graph_task_id() != -1:  # the recompute, inside backward
                h = h * 1.001
            return x + self.fc2(F.softmax(h, dim=-1, dtype=torch.float32).to(x.dtype))

    wrong = Different(D)
    wrong.load_state_dict(wl.model.blocks[1].state_dict())
    wl.model.blocks[1] = wrong
    res = verify(wl, policy_plan(wl.model, "all"), step=StepSpec(dtype=torch.float64, repeats=0))
    assert not res.ok and res.max_grad_rel_err > 1e-4, res
