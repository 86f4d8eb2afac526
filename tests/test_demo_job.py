"""memfit.demo_job: the demo's training run against plain training of the unmodified model."""

from __future__ import annotations

import pytest
import torch

from memfit.apply import is_applied
from memfit.capture.step import make_optimizer
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.training.demo import baseline_peak_bytes, train_fitted
from memfit.workload import mean_loss

SPEC = "demo?n_layer=2&n_embd=16&n_head=2&seq_len=16&dropout=0"

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_losses(spec: str, *, global_batch: int, steps: int, lr: float, seed: int) -> list[float]:
    """The reference: the unmodified model, one backward over the whole batch per step."""
    wl = load_workload(spec, seed=seed)
    opt = make_optimizer(wl.model, "adamw", lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    torch.manual_seed(seed + 100)
    out = []
    for _ in range(steps):
        batch = wl.make_batch(global_batch)
        loss = mean_loss(wl.loss_fn(wl.model, batch))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def test_train_fitted_trains_as_the_unmodified_model() -> None:
    """Every block recomputed, 2 micro-batches of 3: the same losses as plain steps over 6 samples."""
    plan = policy_plan(load_workload(SPEC).model, "all")
    run = train_fitted(SPEC, plan, micro_batch=3, global_batch=6, steps=4, lr=3e-3, seed=1)
    ref = plain_losses(SPEC, global_batch=6, steps=4, lr=3e-3, seed=1)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert ref[-1] < ref[0]  # it trained, so equal losses say the optimizer steps were equal too
    assert len(run.step_s) == 3 and run.measured_peak_bytes is not None and run.measured_peak_bytes > 0
    k, first, last = run.loss_means()
    assert (k, first, last) == (1, run.losses[0], run.losses[-1])


def test_baseline_peak_leaves_the_model_as_built() -> None:
    wl = load_workload(SPEC, seed=2)
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    rng = torch.get_rng_state()
    peak = baseline_peak_bytes(wl, 4, seed=2)
    torch.testing.assert_close(wl.model.state_dict(), before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert not is_applied(wl.model)
    params_bytes = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    assert peak > 4 * params_bytes  # parameters, gradients and AdamW's two moments at least
