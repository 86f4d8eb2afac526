"""memfit.verification.plans.verify against a hand-written comparison: two copies of the model, one with the
plan applied, one backward each on the same batch, gradients compared parameter by parameter. A
block that computes something else when it is recomputed (a wrong wrapper, in effect) must fail
verify by the error the hand-written comparison finds; a correct plan must pass it."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import MLPBlock, mlp_chain_workload
from torch import nn

from memfit import StepSpec, apply_plan, policy_plan
from memfit.plan.types import Plan
from memfit.verification.plans import verify
from memfit.workload import Workload

pytestmark = pytest.mark.usefixtures("one_thread")

B = 16


class RecomputedDifferently(MLPBlock):
    """An MLP block whose forward scales its hidden layer by 1.01 when it runs inside backward:
    a recompute that does not repeat the forward, as a wrapper that replays the wrong thing would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if torch._C._current_graph_task_id() != -1:  # running inside backward: the recompute
            h = h * 1.01
        return x + self.fc2(h)


def broken_workload() -> Workload:
    wl = mlp_chain_workload(("relu", "gelu", "tanh"))
    wrong = RecomputedDifferently(16, "gelu")
    wrong.load_state_dict(wl.model.blocks[1].state_dict())
    wl.model.blocks[1] = wrong
    return wl


def hand_compare(model: nn.Module, plan: Plan, batch, loss_fn) -> float:
    """Largest relative gradient error of the planned model against the unmodified one: per
    parameter max|g - g_ref| over max|g_ref|, with max|g_ref| floored at 1e-3 of the largest
    reference gradient (NOTE [ Gradient floor ])."""
    ref, planned = copy.deepcopy(model), copy.deepcopy(model)
    apply_plan(planned, plan)
    for m in (ref, planned):
        loss_fn(m, batch).backward()
    ref_grads = dict(ref.named_parameters())
    floor = 1e-3 * max(p.grad.abs().max().item() for p in ref_grads.values())
    errs = []
    for name, p in planned.named_parameters():
        want = ref_grads[name].grad
        errs.append((p.grad - want).abs().max().item() / max(want.abs().max().item(), floor))
    return max(errs)


@pytest.mark.parametrize("policy", ["none", "all", "every:2"])
def test_a_correct_plan_passes_and_agrees_with_the_hand_comparison(policy: str) -> None:
    wl = mlp_chain_workload(("relu", "gelu", "tanh"))
    plan = policy_plan(wl.model, policy)
    res = verify(wl, plan, step=StepSpec(batch_size=B, repeats=0))
    hand = hand_compare(wl.model, plan, wl.make_batch(B), wl.loss_fn)
    assert res.ok and res.buffers_equal, res
    assert res.max_grad_rel_err == pytest.approx(hand, abs=1e-7) and hand <= 1e-6


def test_a_block_recomputed_differently_fails_by_the_hand_compared_error() -> None:
    wl = broken_workload()
    plan = policy_plan(wl.model, "all")
    res = verify(wl, plan, step=StepSpec(batch_size=B, repeats=0))
    hand = hand_compare(wl.model, plan, wl.make_batch(B), wl.loss_fn)
    assert hand > 1e-3  # the 1 % change reaches the gradients
    assert not res.ok and res.max_grad_rel_err == pytest.approx(hand, rel=1e-5), res
    assert res.worst_param is not None and res.worst_param.startswith("blocks.")
    assert res.reason


def test_the_broken_block_is_harmless_where_it_is_not_recomputed() -> None:
    """The same model with the broken block kept (every other block recomputed): nothing runs it
    inside backward, verify passes, and the hand comparison agrees."""
    wl = broken_workload()
    plan = policy_plan(wl.model, "all")
    plan = plan.with_(
        blocks=tuple(b if i != 1 else policy_plan(wl.model, "none").blocks[1] for i, b in enumerate(plan.blocks))
    )
    res = verify(wl, plan, step=StepSpec(batch_size=B, repeats=0))
    hand = hand_compare(wl.model, plan, wl.make_batch(B), wl.loss_fn)
    assert res.ok and hand <= 1e-6, res
