"""memfit.integrations.lightning: a plan fitted on a copy, and ExactAccumulation under automatic optimisation.

Reference: one big-batch SGD step per window computed by hand (``loss_sum / count`` of the window,
one backward, the same StepLR schedule) from the same weights. Control: the same Trainer with
``accumulate_grad_batches`` and without the callback, which must miss it.
"""

from __future__ import annotations

import copy
import threading
import warnings
from typing import TYPE_CHECKING

import pytest
import torch
from tiny_models import TinyTokenLM, token_batch, token_count, token_loss, token_samples  # noqa: E402

from memfit.apply.engine import applied_plan, is_applied  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.plan.policies import policy_plan  # noqa: E402

if TYPE_CHECKING:
    import lightning as L
    from lightning_modules import LitLM

F64 = torch.float64
SEQ_LEN = 256  # long sequences: activations outweigh the parameters, so recompute pays
GLOBAL_BATCH = 6
SAMPLES = 16  # windows of 6, 6 and a short last one of 4 (the end of the epoch)
BUDGET_BYTES = 1_450_000  # below a plain step at micro-batch 1 (1.6 MB), above the smallest plan (1.24 MB)
LR, GAMMA = 0.5, 0.5


def make_model() -> TinyTokenLM:
    torch.manual_seed(0)
    return TinyTokenLM(n_layer=4, d=32).to(F64)


def make_batch(b: int) -> dict[str, torch.Tensor]:
    return token_batch(b, seq_len=SEQ_LEN)


def dataset() -> list[dict[str, torch.Tensor]]:
    return token_samples(SAMPLES, SEQ_LEN)


def optimizer_and_scheduler(params):
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)


# memfit.integrations.lightning imports Lightning (4 s), and so do the LightningModule and Callback of
# tests/lightning_modules.py: the tests import them when they run, so that collecting this file
# (every `pytest` run, whichever tests it selects) does not.


def train(module: LitLM, k: int, micro_batch: int, *, callbacks=(), max_steps: int = -1, tmp=None) -> L.Trainer:
    import lightning as L

    loader = torch.utils.data.DataLoader(dataset(), batch_size=micro_batch, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, accumulate_grad_batches=k,
        precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=tmp is not None, default_root_dir=tmp, callbacks=list(callbacks),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "does not have many workers", "GPU available" ...
        trainer.fit(module, loader)
    return trainer


def reference_weights(base: torch.nn.Module, steps: int | None = None) -> list[torch.Tensor]:
    """One big-batch step per window by hand, with the same optimizer and schedule."""
    model = copy.deepcopy(base)
    opt, sched = optimizer_and_scheduler(model.parameters())
    for i, window in enumerate(torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH)):
        if steps is not None and i == steps:
            break
        s, c = token_loss(model, window)
        (s / c).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def rel_err(got, want, start) -> float:
    """Largest weight difference relative to the largest change training made (per tensor)."""
    return max(
        float((g - w).abs().max() / (w - s).abs().max().clamp_min(1e-30))
        for g, w, s in zip(got, want, start, strict=True)
    )


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.fixture(scope="module")
def fitted():
    from memfit.integrations import lightning as memfit_lightning

    model = make_model()
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(2)
    fit = memfit_lightning.fit(
        model, BUDGET_BYTES, global_batch=GLOBAL_BATCH, make_batch=make_batch, loss_fn=token_loss,
        count_fn=token_count, optimizer="sgd",
    )  # fmt: skip
    assert GLOBAL_BATCH % fit.micro_batch == 0  # Lightning's window: micro_batch * k samples
    return model, before, fit


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_fit_measures_a_copy_and_applies_a_plan_that_recomputes(fitted) -> None:
    model, before, fit = fitted
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert is_applied(model) and not fit.plan.is_plain  # recompute, selective or segments, as timing picks
    assert fit.micro_batch < GLOBAL_BATCH and fit.measured_peak_bytes <= BUDGET_BYTES


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_fit_measures_the_model_itself_so_a_model_that_cannot_be_copied_fits() -> None:
    """Auto-fit leaves the model bitwise as it was, so fit() measures it in place: no second copy
    of the model (on a GPU, beside a large model, there is no room for one), and a model holding
    something deepcopy refuses (a lock, an open handle) fits too."""
    from memfit.integrations import lightning as memfit_lightning

    model = make_model()
    model.lock = threading.Lock()  # copy.deepcopy(model): TypeError: cannot pickle '_thread.lock'
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    fit = memfit_lightning.fit(
        model, "1GiB", global_batch=2, make_batch=lambda b: token_batch(b, seq_len=16),
        loss_fn=token_loss, count_fn=token_count, optimizer="sgd",
    )  # fmt: skip
    assert is_applied(model) and fit.micro_batch * fit.accumulation_steps >= 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_fit_with_a_policy_keeps_its_plan() -> None:
    """fit(..., policy="every:2"): the applied plan is the policy's (text parsed once, at the
    edge) and the fit's measured window fits the budget."""
    from memfit.integrations import lightning as memfit_lightning

    model = make_model()
    fit = memfit_lightning.fit(
        model, BUDGET_BYTES, global_batch=GLOBAL_BATCH, make_batch=make_batch, loss_fn=token_loss,
        count_fn=token_count, optimizer="sgd", policy="every:2",
    )  # fmt: skip
    assert str(fit.policy) == "every:2" and applied_plan(model).blocks == policy_plan(make_model(), "every:2").blocks
    assert fit.measured_peak_bytes is not None and fit.measured_peak_bytes <= BUDGET_BYTES


def test_exact_accumulation_equals_one_big_batch_step_per_window(fitted, tmp_path) -> None:
    from lightning_modules import LitLM

    from memfit.integrations import lightning as memfit_lightning

    model, _, fit = fitted
    base = make_model()
    start, want = weights(base), reference_weights(base)
    k = fit.accumulation_steps
    memfit_run = LitLM(copy.deepcopy(model))
    cb = memfit_lightning.ExactAccumulation(count_fn=token_count)
    trainer = train(memfit_run, k, fit.micro_batch, callbacks=[cb], tmp=str(tmp_path))
    assert rel_err(weights(memfit_run.model), want, start) < 1e-10  # float64: rounding only
    # Lightning's own bookkeeping as without memfit: 3 windows -> 3 steps, the schedule stepped 3 times
    assert trainer.global_step == 3
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * GAMMA**3)
    assert cb.last_count == token_count(dataset_batch(SAMPLES - 4, SAMPLES))  # the short last window
    # the control: Lightning's accumulate_grad_batches alone
    plain = LitLM(copy.deepcopy(base))
    train(plain, k, fit.micro_batch)
    assert rel_err(weights(plain.model), want, start) > 0.05
    # the loss Lightning logs is the training_step's, untouched by the rescaling: the first window
    # runs from the same weights in both runs, so its logged losses are equal
    assert memfit_run.logged[:k] == pytest.approx(plain.logged[:k], rel=1e-12)
    assert "train_loss" in trainer.callback_metrics
    # the checkpoint Lightning saved (with the plan applied) loads into a plain model
    ckpt_path = trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
    ckpt = torch.load(ckpt_path, weights_only=False)
    assert ckpt["global_step"] == 3
    fresh = LitLM(TinyTokenLM(n_layer=4, d=32).to(F64))
    fresh.load_state_dict(ckpt["state_dict"])  # strict: the same keys
    assert not is_applied(fresh.model)
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh.model), weights(memfit_run.model), strict=True))


def dataset_batch(lo: int, hi: int) -> dict[str, torch.Tensor]:
    items = dataset()[lo:hi]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def test_max_steps_is_honoured_and_stops_at_a_window_boundary(fitted) -> None:
    from lightning_modules import LitLM

    from memfit.integrations import lightning as memfit_lightning

    model, _, fit = fitted
    base = make_model()
    start, want = weights(base), reference_weights(base, steps=2)
    run = LitLM(copy.deepcopy(model))
    trainer = train(run, fit.accumulation_steps, fit.micro_batch, max_steps=2,
                    callbacks=[memfit_lightning.ExactAccumulation(count_fn=token_count)])  # fmt: skip
    assert trainer.global_step == 2
    assert rel_err(weights(run.model), want, start) < 1e-10


def test_measured_peak_is_within_the_budget(fitted) -> None:
    from lightning_modules import LitLM, Peak

    from memfit.integrations import lightning as memfit_lightning

    model, _, fit = fitted
    peak = Peak()
    cb = memfit_lightning.ExactAccumulation(count_fn=token_count)
    train(LitLM(copy.deepcopy(model)), fit.accumulation_steps, fit.micro_batch, callbacks=[cb, peak])
    assert 0 < peak.tracker.peak_bytes <= BUDGET_BYTES
    # without the plan, a micro-batch of one needs more than the budget
    plain_peak = Peak()
    train(LitLM(make_model()), fit.accumulation_steps, fit.micro_batch, callbacks=[plain_peak])
    assert plain_peak.tracker.peak_bytes > BUDGET_BYTES


def test_refuses_manual_optimisation_and_a_bad_loss_kind() -> None:
    from lightning_modules import LitLM

    from memfit.integrations import lightning as memfit_lightning

    with pytest.raises(MemfitError, match="'mean' or 'sum'"):
        memfit_lightning.ExactAccumulation(count_fn=token_count, loss="avg")

    class Manual(LitLM):
        def __init__(self, model) -> None:
            super().__init__(model)
            self.automatic_optimization = False

    with pytest.raises(MemfitError, match="automatic optimisation"):
        train(Manual(make_model()), 1, 2, callbacks=[memfit_lightning.ExactAccumulation(count_fn=token_count)])


def test_without_lightning_the_import_names_the_extra(monkeypatch) -> None:
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "lightning", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "memfit.integrations.lightning", raising=False)
    with pytest.raises(MemfitError, match=r"pip install memfit\[lightning\]"):
        importlib.import_module("memfit.integrations.lightning")


def _torchrun(tmp_path, *extra: str) -> dict:
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent / "src"), str(here), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={port}", str(here / "integration_lightning_worker.py"), str(tmp_path), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "rank0.json").read_text())


@pytest.mark.distributed
@pytest.mark.slow
def test_fit_in_the_process_group_plans_a_ddp_rank_within_the_budget(tmp_path) -> None:
    """fit() where torch.distributed is initialised: rank 0 plans one DDP rank (its gradient buckets,
    the trainable parameters' bytes, on top of the step); the rank's peak over an epoch under
    Lightning's DDP, plus its buckets, is within the budget."""
    facts = _torchrun(tmp_path, str(BUDGET_BYTES))
    assert facts["world_size"] == 2
    assert facts["buckets_bytes"] == sum(p.numel() * p.element_size() for p in make_model().parameters())
    assert facts["rank_peak_bytes"] <= BUDGET_BYTES, facts
    assert facts["predicted_peak_bytes"] >= facts["rank_peak_bytes"] - 0.03 * BUDGET_BYTES, facts


@pytest.mark.distributed
def test_ddp_on_two_processes_under_torchrun_equals_one_process(fitted, tmp_path) -> None:
    model, _, fit = fitted
    k = GLOBAL_BATCH // (2 * fit.micro_batch)  # per process: 2 processes share each window
    torch.save({"plan": fit.plan.to_dict(), "micro_batch": fit.micro_batch, "k": k}, tmp_path / "fit.pt")
    facts = _torchrun(tmp_path)
    assert facts == {"world_size": 2, "global_step": 3}
    got = torch.load(tmp_path / "weights.pt")
    base = make_model()
    start, want = weights(base), reference_weights(base)
    assert rel_err(got, want, start) < 1e-10


@pytest.mark.slow  # a fresh process importing Lightning: ~5 s
def test_importing_the_integration_leaves_pythons_random_as_it_was() -> None:
    # Lightning's import draws from `random`: a user's seeded sequence moved on when memfit's
    # integration was imported. In a fresh process, so that Lightning is imported for the first time.
    import subprocess
    import sys

    code = (
        "import random; random.seed(7); want = random.Random(7).random(); "
        "import memfit.integrations.lightning; print(random.random() == want)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True", proc.stdout
