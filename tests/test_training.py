"""memfit.training from Python, without the CLI: ``train()`` on a user's Workload against plain
big-batch training, and the auto-fit replanner driving an :class:`OutOfMemoryGuard` against a run
that used the replanned choice from the start."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit.fitting
from memfit import StepSpec
from memfit.accumulate import Accumulator
from memfit.apply import apply_plan
from memfit.capture.tracker import MemoryTracker
from memfit.errors import SpecError
from memfit.fitting import autofit
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.training import (
    LoopEnded,
    RunStarted,
    StepDone,
    TrainConfig,
    TrainEvent,
    autofit_replanner,
    train,
)
from memfit.training.guard import OutOfMemoryGuard
from memfit.workload import Workload

pytestmark = pytest.mark.usefixtures("one_thread")

G = 8
STEPS = 3


def _mlp_workload() -> tuple[Workload, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A float64 MLP whose ``make_batch`` hands out fixed batches in order (no RNG involved)."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    batches = [
        (torch.randn(G, 6, generator=gen, dtype=torch.float64), torch.randn(G, 1, generator=gen, dtype=torch.float64))
        for _ in range(STEPS)
    ]
    served = iter(batches)

    def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert batch_size == G
        return next(served)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ((m(batch[0]) - batch[1]) ** 2).mean()

    return Workload(name="mlp", model=model, make_batch=make_batch, loss_fn=loss_fn, default_batch_size=G), batches


def test_train_from_python_equals_plain_big_batch_training() -> None:
    wl, batches = _mlp_workload()
    reference = copy.deepcopy(wl.model)  # the unmodified model, trained on whole batches below
    events: list[TrainEvent] = []
    config = TrainConfig(global_batch=G, micro_batch=3, steps=STEPS, optimizer="sgd", lr=0.1, device="cpu",
                         plan=lambda model: policy_plan(model, "all"))  # fmt: skip
    res = train(wl, config, progress=events.append)

    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    want_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = ((reference(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
    for (name, got), want in zip(wl.model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=name)
    assert res.losses == pytest.approx(want_losses, rel=1e-12)
    assert (res.ok, res.optimizer_steps, res.micro_batch, res.accumulation_steps) == (True, STEPS, 3, 3)
    assert res.policy == "all" and res.recomputed_blocks == 5
    kinds = [type(e) for e in events]
    assert kinds == [RunStarted, *[StepDone] * STEPS, LoopEnded]
    assert [e.result.loss for e in events if isinstance(e, StepDone)] == list(res.losses)


def test_a_config_that_cannot_run_is_refused_before_any_work() -> None:
    wl, _ = _mlp_workload()
    before = copy.deepcopy(wl.model.state_dict())
    for config, words in [
        (TrainConfig(global_batch=G, steps=1, guard=True), "--guard enforces --budget"),
        (TrainConfig(global_batch=G, steps=1, micro_batch=G + 1), "--micro-batch"),
        (TrainConfig(global_batch=G, steps=1, save_every=2), "--save PATH"),
        (TrainConfig(global_batch=G, steps=1, budget_bytes=2**20, plan=policy_plan(wl.model, "all")), "not both"),
    ]:
        with pytest.raises(SpecError, match=words):
            train(wl, config)
    for k, v in wl.model.state_dict().items():
        assert torch.equal(v, before[k])


def _steady_peak(wl: Workload, policy: str, micro_batch: int) -> int:
    """Tracker peak of the second window (optimizer state allocated) of a copy under a policy plan."""
    model = copy.deepcopy(wl.model)
    apply_plan(model, policy_plan(model, policy))
    acc = Accumulator(model, torch.optim.AdamW(model.parameters()), micro_batch=micro_batch)
    batch = wl.make_batch(G)
    peak = 0
    for _ in range(2):
        tracker = MemoryTracker(device="cpu").track(model, acc.optimizer, batch)
        with tracker:
            acc.step(batch, wl.loss_fn, wl.count_fn)
        peak = tracker.peak_bytes
    return peak


@pytest.mark.parametrize(
    "with_fit", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["re-solve-the-fit", "fit-again"]
)
@pytest.mark.slow  # about 9 s on 2 cores: the fast tier keeps to about 4 minutes
def test_autofit_replanner_with_the_guard_from_python(with_fit: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    wl = load_workload("demo?n_layer=4&n_embd=32&seq_len=32&dropout=0", dtype=torch.float64)
    torch.manual_seed(0)
    batches = [wl.make_batch(G) for _ in range(STEPS)]
    initial = copy.deepcopy(wl.model)
    # The run starts with the whole batch and no recompute, which goes over the limit; recompute
    # at half the micro-batch fits under it.
    whole = _steady_peak(wl, "none", G)
    limit = (whole + _steady_peak(wl, "all", G // 2)) // 2
    fit = autofit(wl, whole, G, step=StepSpec(repeats=1)) if with_fit else None
    if with_fit:  # the fit's profiles are re-solved: no new auto-fit
        monkeypatch.setattr(memfit.fitting, "autofit", lambda *a, **k: pytest.fail("re-ran the auto-fit"))
    acc = Accumulator(wl.model, torch.optim.AdamW(wl.model.parameters()), micro_batch=G)
    guard = OutOfMemoryGuard(
        acc, model=wl.model, budget_bytes=whole, limit_bytes=limit, max_replans=8,
        replan=autofit_replanner(wl, acc, window_samples=G, fit=fit),
    )  # fmt: skip
    for batch in batches:
        guard.step(batch, wl.loss_fn, count_fn=wl.count_fn)
    assert guard.replans and guard.replans[0].window == 0  # the first window went over the limit
    assert all(r.budget_bytes < r.failed_budget_bytes for r in guard.replans)
    assert acc.optimizer_steps == STEPS and acc.windows == STEPS
    final = guard.last_choice
    assert final.micro_batch < G or final.plan is not None and not final.plan.is_plain

    # Reference: the unmodified start, run with the final choice from the first window on (a replan
    # in a later window changes earlier windows' micro-batch, so their rounding: float64 tolerance).
    ref = initial
    if final.plan is not None:
        apply_plan(ref, final.plan)
    ref_acc = Accumulator(ref, torch.optim.AdamW(ref.parameters()), micro_batch=final.micro_batch)
    for batch in batches:
        ref_acc.step(batch, wl.loss_fn, wl.count_fn)
    for (name, got), want in zip(wl.model.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=name)
