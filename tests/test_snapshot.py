"""capture/snapshot: what is installed on a model is lifted for a measurement and put back.

capture does not import apply (NOTE [ Lifting what is installed ] in memfit.capture.snapshot): it
calls the object apply_plan leaves under INSTALLED_ATTR. These tests check the protocol with a
stand-in written here (independent of memfit.apply) and with a real plan.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.apply import applied_plan, apply_plan, remove_plan
from memfit.capture.snapshot import INSTALLED_ATTR, leave_unchanged
from memfit.plan import policy_plan


class _Doubler:
    """A stand-in for an applied plan: while installed, the model's forward doubles its output."""

    def __init__(self) -> None:
        self.removed = 0
        self.reinstalled = 0

    def install(self, model: nn.Module) -> None:
        plain = type(model).forward
        model.__dict__["forward"] = lambda x: 2 * plain(model, x)
        model.__dict__[INSTALLED_ATTR] = self

    def remove(self, model: nn.Module) -> None:
        self.removed += 1
        model.__dict__.pop("forward", None)
        model.__dict__.pop(INSTALLED_ATTR, None)

    def reinstall(self, model: nn.Module) -> None:
        self.reinstalled += 1
        self.install(model)


def test_an_installed_object_is_lifted_during_the_measurement_and_put_back() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    plain_out = model(x).detach()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    d = _Doubler()
    d.install(model)
    assert torch.equal(model(x), 2 * plain_out)
    with leave_unchanged(model) as m:
        assert m is model and INSTALLED_ATTR not in model.__dict__
        assert torch.equal(m(x), plain_out)  # the plain model runs
        m(x).sum().backward()
        torch.optim.SGD(m.parameters(), lr=1.0).step()
    assert (d.removed, d.reinstalled) == (1, 1)
    assert model.__dict__[INSTALLED_ATTR] is d and torch.equal(model(x), 2 * plain_out)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_user_plan_comes_back_and_a_measurement_plan_left_behind_goes() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    user = policy_plan(model, "all")
    apply_plan(model, user)
    with pytest.raises(RuntimeError, match="measurement failed"), leave_unchanged(model) as m:
        assert applied_plan(m) is None
        apply_plan(m, policy_plan(m, "every:2"))  # the measurement's own plan, left applied by the error
        raise RuntimeError("measurement failed")
    assert applied_plan(model) == user
    assert all("forward" in blk.__dict__ for blk in model)  # 'all' wraps every block ('every:2' would not)
    remove_plan(model)
    assert applied_plan(model) is None and all("forward" not in blk.__dict__ for blk in model)
