"""The adapters choose the model states' placement as memfit's commands do, with the framework's loop as the
context (NOTE [ Model states in a framework's loop ] in memfit.integrations._fit): accelerate steps the
user's optimizer on the device gradients, so ``device`` is the one placement it can use; below the device
floor the refusal names every placement and why, before anything is measured."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from tiny_models import TinyTokenLM, token_batch, token_count, token_loss

import memfit.fitting.search
from memfit.errors import BudgetInfeasibleError, SpecError
from memfit.integrations import accelerate as memfit_accelerate


def _model() -> TinyTokenLM:
    torch.manual_seed(0)
    return TinyTokenLM()


def _fit(model: TinyTokenLM, budget: int, **kw: object) -> object:
    return memfit_accelerate.fit(
        Accelerator(cpu=True), model, budget, global_batch=2, make_batch=lambda b: token_batch(b),
        loss_fn=token_loss, count_fn=token_count, optimizer="sgd", **kw,
    )  # fmt: skip


def test_below_every_placements_states_the_refusal_comes_before_any_profile(monkeypatch) -> None:
    def no_profile(*_a: object, **_k: object) -> None:
        pytest.fail("profiled a model whose states cannot fit")

    monkeypatch.setattr(memfit.fitting.search, "profile", no_profile)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BudgetInfeasibleError) as err:
        _fit(model, 1000)
    text = str(err.value)
    assert text.startswith("memfit.integrations.accelerate: no placement of the model states fits")
    assert "device: model states alone need" in text
    for m in ("step-in-backward", "host-optimizer", "host-params"):
        assert f"{m}: the loop steps your optimizer after the backward" in text
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_a_placement_the_loop_cannot_use_is_refused_and_device_opts_out() -> None:
    with pytest.raises(SpecError, match="states='step-in-backward' is not used here: the loop steps your optimizer"):
        _fit(_model(), 10**9, states="step-in-backward")
    with pytest.raises(BudgetInfeasibleError) as err:  # the opt-out: the fit's own refusal, no choice
        _fit(_model(), 1000, states="device")
    assert "no placement of the model states" not in str(err.value)


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_auto_keeps_the_device_where_it_fits() -> None:
    fit = _fit(_model(), 10**9, states="auto")
    assert fit.plan.states == "device"


def test_trainer_refuses_states_without_a_budget() -> None:
    from memfit.integrations import transformers as memfit_transformers

    with pytest.raises(SpecError, match="states='device' places the model states for a budget; add budget="):
        memfit_transformers.fit(object(), policy="all", states="device")
