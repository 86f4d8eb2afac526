"""Out-of-memory guard: replan, redo the window, and end where an uninterrupted run ends.

Failures are injected test-side only: a loss_fn that raises ``torch.cuda.OutOfMemoryError`` on a
chosen micro-step of a chosen window, an optimizer whose ``step`` raises, and the tracker's real
budget guard (``BudgetExceededError``). References are the same training without any failure,
in float64 (NOTE [ Redo after out-of-memory ] in memfit.training.guard).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny_models import (
    TinyRegressor,
    TinyTokenLM,
    mse_mean,
    regression_batch,
    token_batch,
    token_count,
    token_loss,
)
from torch import nn

from memfit.accumulate import Accumulator
from memfit.apply import applied_plan, apply_plan, remove_plan
from memfit.capture.snapshot import preserved_state
from memfit.capture.tracker import BudgetExceededError, MemoryTracker
from memfit.errors import BudgetInfeasibleError, MemfitError
from memfit.plan import policy_plan
from memfit.training.guard import Choice, OutOfMemoryGuard, tighter_budget

G = 12  # samples per window
STEPS = 3


pytestmark = pytest.mark.usefixtures("one_thread")


def token_model(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return TinyTokenLM(d=16, n_layer=3, dropout=dropout).double()


def token_batches(n: int = STEPS) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(1)  # data drawn up front: independent of the training RNG
    return [token_batch(G) for _ in range(n)]


class InjectedOOM:
    """A loss_fn raising ``torch.cuda.OutOfMemoryError`` once, on micro-step ``micro`` (0-based) of
    window ``window``; counts the samples it was called with."""

    def __init__(self, acc: Accumulator, loss_fn: Callable[..., Any], *, window: int, micro: int) -> None:
        self.acc, self.loss_fn, self.window, self.micro = acc, loss_fn, window, micro
        self.fired = False
        self._calls: dict[int, int] = {}

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        w = self.acc.windows
        i = self._calls.get(w, 0)
        self._calls[w] = i + 1
        if not self.fired and w == self.window and i == self.micro:
            self.fired = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected by the test)")
        return self.loss_fn(model, batch)


def train(
    *,
    dropout: float = 0.0,
    micro: int = 4,
    plan: str | None = None,
    replan: Callable[[int], Choice] | None = None,
    inject: tuple[int, int] | None = None,
    optimizer: str = "adamw",
    limit_bytes: int | None = None,
    budget_bytes: int | None = 10**9,
    model: nn.Module | None = None,
) -> tuple[nn.Module, Accumulator, OutOfMemoryGuard]:
    model = model if model is not None else token_model(dropout)
    if plan is not None:
        apply_plan(model, policy_plan(model, plan))
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    acc = Accumulator(model, opt, micro_batch=micro)
    guard = OutOfMemoryGuard(acc, budget_bytes=budget_bytes, replan=replan, limit_bytes=limit_bytes)
    loss_fn: Callable[..., Any] = token_loss
    if inject is not None:
        loss_fn = InjectedOOM(acc, token_loss, window=inject[0], micro=inject[1])
    torch.manual_seed(123)  # training RNG (dropout)
    for batch in token_batches():
        guard.step(batch, loss_fn, count_fn=token_count)
    return model, acc, guard


def assert_same_training(
    got: tuple[nn.Module, Accumulator, Any], want: tuple[nn.Module, Accumulator, Any], **tol: Any
) -> None:
    (m1, acc1, _), (m2, acc2, _) = got, want
    torch.testing.assert_close(dict(m1.named_parameters()), dict(m2.named_parameters()), **tol)
    s1, s2 = acc1.optimizer.state_dict()["state"], acc2.optimizer.state_dict()["state"]
    torch.testing.assert_close(s1, s2, **tol)
    assert (
        (acc1.windows, acc1.optimizer_steps, acc1.samples_seen)
        == (acc2.windows, acc2.optimizer_steps, acc2.samples_seen)
        == (STEPS, STEPS, STEPS * G)
    )


def recompute_all(model: nn.Module, micro: int) -> Callable[[int], Choice]:
    return lambda budget: Choice(micro_batch=micro, plan=policy_plan(model, "all"))


def test_tighter_budget_rule() -> None:
    assert tighter_budget(1000) == 900  # no overflow known (CUDA): 90 %
    assert tighter_budget(1000, 50) == 900  # a small overflow: still 90 %
    assert tighter_budget(1000, 300) == 700  # a large one is subtracted
    assert tighter_budget(10, 20) == 0


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("at", [(0, 0), (1, 2)])
@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_redo_after_oom_equals_uninterrupted_run(dropout: float, at: tuple[int, int]) -> None:
    """Same micro-batch, new plan (every block recomputed): the run ends where it would have,
    dropout masks included (RNG restored; checkpoint replays them)."""
    ref = train(dropout=dropout)
    model = token_model(dropout)
    got = train(dropout=dropout, model=model, replan=recompute_all(model, 4), inject=at)
    assert_same_training(got, ref)
    # bitwise, in fact: the redo runs the same arithmetic
    assert all(torch.equal(a, b) for a, b in zip(got[0].parameters(), ref[0].parameters(), strict=True))
    (event,) = got[2].replans
    assert event.window == at[0] and event.failed_at == f"micro-step {at[1] + 1} of 3"
    assert event.error_type == "OutOfMemoryError" and event.overflow_bytes is None
    assert event.budget_bytes == tighter_budget(10**9) == 9 * 10**8
    assert (event.micro_batch_before, event.micro_batch, event.recomputed_before, event.recomputed) == (4, 4, None, 3)
    assert applied_plan(model) is not None and applied_plan(model).policy == "all"


def test_redo_with_a_smaller_micro_batch_matches_up_to_rounding() -> None:
    ref = train(micro=4)
    got = train(micro=4, replan=lambda b: Choice(micro_batch=2, plan=None), inject=(1, 1))
    assert_same_training(got, ref, rtol=1e-12, atol=1e-14)
    assert got[1].micro_batch == 2 and got[2].replans[0].micro_batch == 2


def window_peak(model: nn.Module, plan: str, micro: int, batch: Any) -> int:
    m = copy.deepcopy(model)
    remove_plan(m)
    apply_plan(m, policy_plan(m, plan))
    acc = Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), micro_batch=micro)
    tracker = MemoryTracker(device="cpu").track(m, batch)
    with tracker:
        acc.step(batch, token_loss, token_count)
    return tracker.peak_bytes


def test_budget_guard_replans_until_the_window_fits() -> None:
    """The tracker's real guard (CPU stand-in for CUDA OOM): plan 'none' goes over the limit,
    the replan to 'all' fits, and the run equals one that used 'all' from the start."""
    model = token_model(0.1)
    batch = token_batches()[0]
    p_none, p_all = window_peak(model, "none", 12, batch), window_peak(model, "all", 12, batch)
    assert p_all < p_none
    limit = (p_none + p_all) // 2
    ref = train(dropout=0.1, micro=12, plan="all", optimizer="sgd")
    got = train(
        dropout=0.1,
        model=model,
        micro=12,
        optimizer="sgd",
        limit_bytes=limit,
        budget_bytes=limit,
        replan=recompute_all(model, 12),
    )
    assert_same_training(got, ref)
    (event,) = got[2].replans
    assert event.error_type == "BudgetExceededError" and event.window == 0
    assert event.limit_bytes == limit and event.live_bytes > limit and event.overflow_bytes == event.live_bytes - limit
    assert event.budget_bytes == tighter_budget(limit, event.overflow_bytes)
    assert got[2].last_peak_bytes is not None and got[2].last_peak_bytes <= limit


def test_failure_in_the_optimizer_step_before_any_update_is_redone() -> None:
    """First step of AdamW: state created lazily, then out of memory before any update."""
    ref = train()
    model = token_model(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    real_step = opt.step
    fired = []

    def step(*a: Any, **k: Any) -> Any:
        if not fired:
            fired.append(1)
            p = next(iter(model.parameters()))
            opt.state[p]["exp_avg"] = torch.zeros_like(p)  # half-initialised state, as a lazy init leaves it
            raise torch.cuda.OutOfMemoryError("injected in optimizer.step")
        return real_step(*a, **k)

    opt.step = step  # type: ignore[method-assign]
    acc = Accumulator(model, opt, micro_batch=4)
    guard = OutOfMemoryGuard(acc, budget_bytes=10**6, replan=lambda b: Choice(micro_batch=4, plan=None))
    torch.manual_seed(123)
    for batch in token_batches():
        guard.step(batch, token_loss, count_fn=token_count)
    assert_same_training((model, acc, guard), ref)
    assert guard.replans[0].failed_at == "optimizer step"


def test_failure_after_the_optimizer_updated_something_is_refused() -> None:
    model = token_model(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real_step = opt.step

    def step(*a: Any, **k: Any) -> Any:
        real_step(*a, **k)
        raise torch.cuda.OutOfMemoryError("injected after the update")

    opt.step = step  # type: ignore[method-assign]
    guard = OutOfMemoryGuard(
        Accumulator(model, opt, micro_batch=4), budget_bytes=10**6, replan=lambda b: Choice(micro_batch=4, plan=None)
    )
    with pytest.raises(MemfitError, match="inside the optimizer step"):
        guard.step(token_batches(1)[0], token_loss, count_fn=token_count)


def test_batchnorm_running_statistics_are_restored() -> None:
    def run(inject: bool) -> tuple[nn.Module, Accumulator]:
        torch.manual_seed(0)
        model = TinyRegressor(bn=True).double()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=4, bn="ghost")
        guard = OutOfMemoryGuard(acc, budget_bytes=10**6, replan=lambda b: Choice(micro_batch=4, plan=None))
        loss: Callable[..., Any] = InjectedOOM(acc, mse_mean, window=1, micro=2) if inject else mse_mean
        torch.manual_seed(1)
        batches = [tuple(t.double() for t in regression_batch(G)) for _ in range(STEPS)]
        for b in batches:
            guard.step(b, loss)
        return model, acc

    got, ref = run(True), run(False)
    torch.testing.assert_close(dict(got[0].named_buffers()), dict(ref[0].named_buffers()))
    torch.testing.assert_close(dict(got[0].named_parameters()), dict(ref[0].named_parameters()))
    assert int(got[0].bn.num_batches_tracked) == STEPS * 3  # 3 micro-steps a window, none twice


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_gives_up_with_the_facts() -> None:
    model = token_model(0.0)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=4)
    batch = token_batches(1)[0]

    def always(m: nn.Module, b: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("always")

    guard = OutOfMemoryGuard(acc, budget_bytes=1000, replan=lambda b: Choice(micro_batch=4, plan=None), max_replans=2)
    with pytest.raises(MemfitError, match="2 replans already"):
        guard.step(batch, always)
    assert [r.budget_bytes for r in guard.replans] == [900, 810]
    assert (acc.windows, acc.samples_seen) == (0, 0) and all(p.grad is None for p in model.parameters())

    def infeasible(budget: int) -> Choice:
        raise BudgetInfeasibleError("memfit.plan: too small", min_budget_bytes=10**6)

    with pytest.raises(MemfitError, match="no micro-batch and plan fit the tighter budget"):
        OutOfMemoryGuard(acc, budget_bytes=1000, replan=infeasible).step(batch, always)
    with pytest.raises(MemfitError, match="no replanner"):
        OutOfMemoryGuard(acc, budget_bytes=1000).step(batch, always)


def test_other_errors_pass_through_untouched() -> None:
    model = token_model(0.0)
    guard = OutOfMemoryGuard(Accumulator(model, None, micro_batch=4), replan=lambda b: Choice(micro_batch=4, plan=None))

    def broken(m: nn.Module, b: Any) -> Any:
        raise ValueError("a bug in the loss")

    with pytest.raises(ValueError, match="a bug in the loss"):
        guard.step(token_batches(1)[0], broken)
    assert guard.replans == []


def test_preserved_state_puts_weights_rng_and_plan_back() -> None:
    model = token_model(0.1)
    apply_plan(model, policy_plan(model, "all"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with preserved_state(model):
        remove_plan(model)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        token_loss(model, token_batch(4))[0].backward()
        opt.step()
        torch.rand(10)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert applied_plan(model).policy == "all" and all(p.grad is None for p in model.parameters())


def test_budget_exceeded_error_is_what_the_tracker_raises_in_backward() -> None:
    """The guard relies on the tracker's error surviving autograd's engine with its type."""
    model = token_model(0.0)
    out = token_loss(model, token_batch(8))[0]
    with pytest.raises(BudgetExceededError), MemoryTracker(device="cpu", budget_bytes=1):
        out.backward()


def test_failure_before_the_first_micro_step_is_window_set_up() -> None:
    """An out-of-memory in the window's set-up (here: counting tokens), after a window that
    finished: reported as the set-up of the new window, not the last one's optimizer step, and
    redone to the uninterrupted run."""
    ref = train()
    model = token_model(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, opt, micro_batch=4)
    guard = OutOfMemoryGuard(acc, budget_bytes=10**6, replan=lambda b: Choice(micro_batch=4, plan=None))
    fired = []

    def count_fn(batch: Any) -> int:
        if acc.windows == 1 and not fired:
            fired.append(1)
            raise torch.cuda.OutOfMemoryError("injected while counting tokens")
        return token_count(batch)

    torch.manual_seed(123)
    for batch in token_batches():
        guard.step(batch, token_loss, count_fn=count_fn)
    assert_same_training((model, acc, guard), ref)
    assert [(r.window, r.failed_at) for r in guard.replans] == [(1, "window set-up")]


def test_replan_event_renders_as_before() -> None:
    """The JSON fields and the sentence ``memfit train`` prints for a replan (the failure record
    became a typed value; what is printed did not change)."""
    model = token_model(0.0)
    got = train(model=model, replan=recompute_all(model, 2), inject=(1, 1))
    (event,) = got[2].replans
    assert list(event.to_dict()) == [
        "window", "error_type", "failed_at", "live_bytes", "limit_bytes", "overflow_bytes", "failed_budget_bytes",
        "budget_bytes", "micro_batch_before", "micro_batch", "recomputed_before", "recomputed", "replan_s", "changed_buffers",
    ]  # fmt: skip
    text = event.describe().replace(f"{event.replan_s:.1f} s", "T s")
    assert text == (
        "out of memory in window 1 at micro-step 2 of 3 (OutOfMemoryError); replanned for 858.31 MiB "
        "(was 953.67 MiB) in T s: micro-batch 4 -> 2, blocks not kept - -> 3; the window is redone"
    )
